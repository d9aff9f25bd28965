"""hpZ (`zero_optimization.zero_hpz_partition_size: K`): after a forward each rank keeps a secondary 16-bit
shard within its node, and the backward gathers from those on the node, at 4 ranks as 2 simulated nodes
of 2.

Judged against plain ZeRO-3 on the same batches, bit for bit (the backward gathers the same values by
another route), with no tier and with each tier; by the collectives each pass issued (the backward's
gathers on the secondary group, none on the shard group); by the 2P/K bytes computed from the model;
and across a checkpoint and an offload_states round trip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import zero3
from tests import models
from tests.distributed import run_ranks
from zero3.comm import Communicator
from zero3.config import load_config
from zero3.estimate import EstimateSettings, estimate
from zero3.topology import TopologyError

MICRO, STEPS = 4, 3


def config(precision: str = "fp32", **zero: object) -> dict:
    out: dict = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }
    if precision == "bf16":
        out["bf16"] = {"enabled": True}
    return out


class CountedGathers:
    """Counts this rank's parameter all-gathers by group (the shard group's and hpZ's secondary group's),
    per pass, at the engine's Communicator."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {"primary": 0, "secondary": 0}
        self._primary, self._secondary = Communicator.all_gather_flat, Communicator.all_gather_secondary
        counts = self.counts
        primary, secondary = self._primary, self._secondary

        def counted_primary(comm, output, shard, async_op=False):  # type: ignore[no-untyped-def]
            counts["primary"] += 1
            return primary(comm, output, shard, async_op)

        def counted_secondary(comm, output, shard, async_op=False):  # type: ignore[no-untyped-def]
            counts["secondary"] += 1
            return secondary(comm, output, shard, async_op)

        Communicator.all_gather_flat = counted_primary  # type: ignore[method-assign]
        Communicator.all_gather_secondary = counted_secondary  # type: ignore[method-assign]

    def take(self) -> dict[str, int]:
        taken = dict(self.counts)
        self.counts.update(primary=0, secondary=0)
        return taken


def _train(rank: int, world: int, zero: dict, precision: str, save_dir: str | None = None,
           park_dir: str | None = None, resume_dir: str | None = None) -> dict:
    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2))
    zero3.init_distributed()
    torch.manual_seed(0)
    model = models.MLP()
    numels = [p.numel() for p in model.parameters()]
    engine, *_ = zero3.initialize(model=model, config=config(precision, **zero))
    counted = CountedGathers()
    batches = models.batches("x8", STEPS + 2, MICRO * world)
    steps = range(STEPS + 2)  # uninterrupted; or the first STEPS, then a save; or a load, then the last 2
    if save_dir is not None:
        steps = range(STEPS)
    if resume_dir is not None:
        engine.load_checkpoint(resume_dir)
        steps = range(STEPS, STEPS + 2)
    losses, gathers, parked_exactly = [], [], None
    for step in steps:
        x, y = batches[step]
        if park_dir is not None and step == 1:  # every state to disk and back, between two steps
            before = {name: zero3.safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()}
            engine.offload_states(device="nvme", nvme_path=park_dir)
            parked_bytes = engine.model_state_bytes()["hpz_secondary"]
            engine.reload_states()
            parked_exactly = parked_bytes == 0 and all(
                torch.equal(zero3.safe_get_full_fp32_param(p), before[name]) for name, p in model.named_parameters())
        counted.take()
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        forward = counted.take()
        engine.backward(loss)
        backward = counted.take()
        engine.step()
        gathers.append({"forward": forward, "backward": backward})
        losses.append(loss.detach().float().clone())
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    params = {name: zero3.safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()}
    result = {"losses": losses, "params": params, "gathers": gathers, "bytes": engine.model_state_bytes(),
              "parked_exactly": parked_exactly, "numels": numels}
    engine.destroy()
    return result


def _run(zero: dict, precision: str = "fp32", *args: object) -> list[dict]:
    return run_ranks(4, _train, zero, precision, *args)


@pytest.fixture(scope="module")
def plain() -> dict[str, list[dict]]:
    return {precision: _run({}, precision) for precision in ("fp32", "bf16")}


def _identical(ours: list[dict], reference: list[dict]) -> None:
    for mine, theirs in zip(ours, reference):
        assert len(mine["losses"]) == len(theirs["losses"])
        for a, b in zip(mine["losses"], theirs["losses"]):
            assert torch.equal(a, b)
        for name, value in theirs["params"].items():
            assert torch.equal(mine["params"][name], value), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hpz_trains_bit_identically_to_plain_zero3_with_the_backward_gathering_on_the_node(
    plain: dict[str, list[dict]], precision: str,
) -> None:
    ours = _run({"zero_hpz_partition_size": 2}, precision)
    _identical(ours, plain[precision])
    for result, reference in zip(ours, plain[precision]):
        for step, (mine, theirs) in enumerate(zip(result["gathers"], reference["gathers"])):
            # every step: the forward gathers from the primary shards (refreshing the secondary ones),
            # the backward from the secondary shards only
            assert mine["forward"] == theirs["forward"], step
            assert mine["backward"] == {"primary": 0, "secondary": theirs["backward"]["primary"]}, step
            assert theirs["backward"]["primary"] > 0
        # 2P/K in 16-bit (fp32 here: 4 bytes): each rank keeps N/K = 2 of the 4 primary shards of every unit
        shards = sum(-(-numel // 4) for numel in result["numels"])
        element = 2 if precision == "bf16" else 4
        assert result["bytes"]["hpz_secondary"] == 2 * shards * element
        assert result["bytes"]["lp_params"] == reference["bytes"]["lp_params"]
        assert result["bytes"]["total"] == reference["bytes"]["total"] + result["bytes"]["hpz_secondary"]
        with torch.device("meta"):
            meta = models.MLP()
        settings = EstimateSettings.from_config(
            load_config(config(precision, zero_hpz_partition_size=2)), accelerator="cpu")
        assert result["bytes"] == estimate(model=meta, ranks_per_node=2, nodes=2, settings=settings).model_state_bytes()


# ZeRO-Offload (DeepSpeed #6926's case), and both tiers on disk (the parameters' shards come from the file,
# and the secondary shards never do).
TIERS = {
    "offload_optimizer cpu": lambda tmp: {"offload_optimizer": {"device": "cpu"}},
    "optimizer and params on nvme": lambda tmp: {
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp)},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp)},
    },
}


@pytest.mark.parametrize("tier", list(TIERS))
def test_hpz_with_each_tier_trains_bit_identically_and_parks_its_states(
    plain: dict[str, list[dict]], tier: str, tmp_path: Path,
) -> None:
    """DeepSpeed #6926: hpZ with CPU offload leaves grad_norm 0 and the loss stuck. Here every tier trains
    as plain ZeRO-3 without one does, and offload_states (which drops the secondary shards; the next
    forward makes them again) restores every state exactly."""
    (tmp_path / "park").mkdir()
    ours = _run({**TIERS[tier](tmp_path), "zero_hpz_partition_size": 2}, "bf16", None, str(tmp_path / "park"))
    _identical(ours, plain["bf16"])
    for result in ours:
        assert result["parked_exactly"] is True
        assert all(step["backward"]["primary"] == 0 for step in result["gathers"])


def test_an_hpz_checkpoint_resumes_with_the_uninterrupted_runs_losses(
    plain: dict[str, list[dict]], tmp_path: Path,
) -> None:
    """DeepSpeed #7606: the first step after loading an hpZ checkpoint has a high loss. Here the resumed
    steps equal the uninterrupted run's, bit for bit, and so do the masters."""
    zero = {"zero_hpz_partition_size": 2}
    uninterrupted = plain["bf16"]  # hpZ trains bit-identically to it (the test above)
    _run(zero, "bf16", str(tmp_path))
    resumed = _run(zero, "bf16", None, None, str(tmp_path))
    for mine, theirs in zip(resumed, uninterrupted):
        assert len(mine["losses"]) == 2
        for a, b in zip(mine["losses"], theirs["losses"][STEPS:]):
            assert torch.equal(a, b)
        for name, value in theirs["params"].items():
            assert torch.equal(mine["params"][name], value), name
        assert all(step["backward"]["primary"] == 0 for step in mine["gathers"])  # rebuilt by the first forward


def _bad_size(rank: int, world: int, zero: dict, local_world: int) -> str:
    os.environ.update(LOCAL_WORLD_SIZE=str(local_world), GROUP_RANK=str(rank // local_world))
    zero3.init_distributed()
    try:
        zero3.initialize(model=models.MLP(), config=config(**zero))
    except TopologyError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(("zero", "local_world", "message"), [
    ({"zero_hpz_partition_size": 3}, 4, "zero_hpz_partition_size=3 does not divide the shard group's 4 ranks"),
    ({"zero_hpz_partition_size": 4}, 2, "zero_hpz_partition_size=4 does not divide the 2 ranks per node"),
    ({"zero_hpz_partition_size": 4, "mics_shard_size": 2}, 4,
     "zero_hpz_partition_size=4 does not divide the shard group's 2 ranks"),
], ids=["not-dividing-the-shard-group", "spanning-two-nodes", "larger-than-the-mics-group"])
def test_a_secondary_group_that_does_not_fit_the_shard_group_and_the_node_is_refused_on_every_rank(
    zero: dict, local_world: int, message: str,
) -> None:
    results = run_ranks(4, _bad_size, zero, local_world)
    assert len(set(results)) == 1
    assert message in results[0]


def test_ranks_on_different_routes_under_hpz_train_like_one_process() -> None:
    """Each rank routes its batch through its own experts (tests/test_divergent.py's model): the units a
    forward gathered differ by rank, and the backward still gathers every unit from secondary shards only
    where every rank recorded one."""
    from tests.test_divergent import reference, train_routed

    ref_losses, ref_params = reference(4)
    for result in run_ranks(4, train_routed, {"zero_hpz_partition_size": 2}):
        for ours, ref in zip(result["losses"], ref_losses):
            assert abs(ours - ref) <= 1e-5 * max(1.0, abs(ref)), (result["losses"], ref_losses)
        for name, ref in ref_params.items():
            assert torch.allclose(result["params"][name], ref, rtol=1e-4, atol=1e-6), name
