"""A gather unit owns why it stays gathered: holds by reason, released by reason, refused when absent."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero3.partition.collectives import ParamGather
from zero3.shard_mesh import ShardMesh
from zero3.partition.sharded_param import ATTR, ShardedParam
from zero3.partition.unit import GatherUnit, Hold


@pytest.fixture
def unit() -> GatherUnit:
    mesh = ShardMesh.geometry(2, 1)
    params = [nn.Parameter(torch.zeros(3, 4)), nn.Parameter(torch.zeros(5))]
    sps = [ShardedParam(p, f"p{i}", mesh, torch.float32, torch.device("cpu")) for i, p in enumerate(params)]
    yield GatherUnit(sps, ParamGather(mesh, None), "block")
    for p in params:
        delattr(p, ATTR)


def test_holds_count_by_reason_and_backward_is_held_once(unit: GatherUnit) -> None:
    assert not unit.needed
    unit.acquire(Hold.FORWARD)
    unit.acquire(Hold.FORWARD)  # a nested frame, or a parameter returned to the caller
    unit.acquire(Hold.PIN)
    unit.acquire(Hold.BACKWARD)
    unit.acquire(Hold.BACKWARD)  # asked again by another saved tensor: still one hold
    assert (unit.holds(Hold.FORWARD), unit.holds(Hold.PIN), unit.holds(Hold.BACKWARD)) == (2, 1, 1)
    unit.release(Hold.FORWARD)
    unit.release(Hold.PIN)
    unit.release(Hold.BACKWARD)
    assert unit.needed  # one forward frame still holds it
    unit.release_all(Hold.FORWARD)
    assert not unit.needed


def test_releasing_a_hold_the_unit_does_not_have_is_an_error(unit: GatherUnit) -> None:
    unit.acquire(Hold.FORWARD)
    with pytest.raises(RuntimeError, match="unit block: released a pin hold it does not have"):
        unit.release(Hold.PIN)
    assert unit.holds(Hold.FORWARD) == 1  # nothing changed


def test_close_drops_every_hold_and_persistence(unit: GatherUnit) -> None:
    unit.persistent = True
    unit.acquire(Hold.PIN)
    unit.acquire(Hold.BACKWARD)
    unit.close()
    assert not unit.needed and unit.holds(Hold.PIN) == 0 and unit.holds(Hold.BACKWARD) == 0


def test_gathered_parameters_leaves_tensors_that_are_not_partitioned_alone() -> None:
    """DeepSpeed accepts plain tensors in GatheredParameters, a modifier rank too: nothing to gather or write."""
    import zero3

    plain = torch.ones(3)
    for modifier in (None, 0):
        with zero3.GatheredParameters([plain, None], modifier_rank=modifier):
            plain.add_(1.0)
    assert torch.equal(plain, torch.full((3,), 3.0))
