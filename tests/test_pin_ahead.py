"""engine.pin_offload_buffers: the page-locked host buffers of a first offload, made in the background.

The pool's background reservation is checked on the CPU with ordinary
buffers (the thread, the hand-over to `get`, a failure that falls back to
making buffers on demand); a CPU engine has nothing to pin. On a GPU the
first offload copies into exactly the buffers pinned ahead, bit-exact.
"""

from __future__ import annotations

import logging

import pytest
import torch

import zero3
from tests import models
from tests.distributed import run_ranks
from tests.test_offload import STATES, build, micro_step, same, snapshot
from zero3.offload.host import HostBufferPool


def test_a_reservation_made_in_the_background_is_what_get_hands_out() -> None:
    pool = HostBufferPool(torch.device("cpu"))
    window = pool.get("window", 8, torch.float32, pin=False)  # another user's buffer: kept as it is
    wanted = [("park:a", 1000, torch.bfloat16), ("park:b", 3000, torch.float32), ("window", 8, torch.float32)]
    assert pool.reserve(wanted, pin=False) == 2  # "window" fits already
    first = pool.get("park:b", 3000, torch.float32, pin=False)  # waits for the thread if it is still making it
    pool.settle()
    assert not pool.reserving
    assert set(pool.snapshot()) == {"park:a", "park:b", "window"}
    assert first.data_ptr() == pool.get("park:b", 3000, torch.float32, pin=False).data_ptr()
    assert pool.get("park:a", 1000, torch.bfloat16, pin=False).dtype == torch.bfloat16
    assert pool.get("window", 8, torch.float32, pin=False).data_ptr() == window.data_ptr()
    assert pool.reserve(wanted, pin=False) == 0  # all held: nothing to make
    assert pool.held_bytes == 1000 * 2 + 3000 * 4 + 8 * 4


def test_a_failed_reservation_is_logged_and_the_buffers_are_made_on_demand(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_empty = torch.empty

    def out_of_memory(*shape: object, **kwargs: object) -> torch.Tensor:
        if shape == (2000,):
            raise RuntimeError("CUDA error: out of memory (pinned host allocation)")
        return real_empty(*shape, **kwargs)  # type: ignore[arg-type]

    pool = HostBufferPool(torch.device("cpu"))
    monkeypatch.setattr(torch, "empty", out_of_memory)
    with caplog.at_level(logging.WARNING, logger="zero3"):
        pool.reserve([("park:a", 1000, torch.float32), ("park:b", 2000, torch.float32),
                      ("park:c", 3000, torch.float32)], pin=False)
        pool.settle()
    monkeypatch.setattr(torch, "empty", real_empty)
    assert "park:b" in caplog.text and "out of memory" in caplog.text
    assert set(pool.snapshot()) == {"park:a"}  # it stopped at the failure
    assert pool.get("park:c", 3000, torch.float32, pin=False).numel() == 3000  # made on demand


def cpu_engine_pins_nothing(rank: int, world: int) -> dict:
    engine, model = build(rank, world)
    data = models.batches("x8", 2, 4 * world)
    micro_step(engine, data[0], rank, world)
    engine.step()
    making = engine.pin_offload_buffers()
    before = snapshot(engine, model)
    engine.offload_states()
    engine.reload_states()
    result = {"making": making, "pool": sorted(engine.parts.host_pool.snapshot()), "equal": same(before, snapshot(engine, model))}
    engine.destroy()
    return result


def test_a_cpu_engine_has_nothing_to_pin() -> None:
    (result,) = run_ranks(1, cpu_engine_pins_nothing)
    assert result == {"making": 0, "pool": [], "equal": True}


def pinned_ahead_on_cuda(rank: int, world: int) -> dict:
    engine, model = build(rank, world)
    device = engine.device
    data = [tuple(t.to(device) for t in batch) for batch in models.batches("x8", 4, 4 * world)]
    micro_step(engine, data[0], rank, world)  # type: ignore[arg-type]
    engine.step()
    making = engine.pin_offload_buffers()
    micro_step(engine, data[1], rank, world)  # training goes on while the buffers are made
    engine.step()
    engine.parts.host_pool.settle()
    reserved = {key: t.data_ptr() for key, t in engine.offloader.host.pinned.items()}
    again = engine.pin_offload_buffers()
    before = snapshot(engine, model)
    engine.offload_states()
    used = {key: t.data_ptr() for key, t in engine.offloader.host.pinned.items()}
    where = {s.value: {str(d) for d in zero3.get_state_devices(engine, s)} for s in STATES}
    engine.reload_states()
    result = {"making": making, "again": again, "reserved": reserved, "used": used, "where": where,
              "equal": same(before, snapshot(engine, model))}
    micro_step(engine, data[2], rank, world)  # type: ignore[arg-type]
    engine.step()
    engine.destroy()
    return result


@pytest.mark.cuda
def test_the_first_offload_copies_into_the_buffers_pinned_ahead() -> None:
    (result,) = run_ranks(1, pinned_ahead_on_cuda)
    assert result["making"] == len(result["reserved"]) > 0
    assert result["again"] == 0  # held already
    assert result["used"] == result["reserved"]  # no new pinned allocation at the offload
    assert result["where"]["hp_params"] == {"cpu"} and result["where"]["optim_states"] == {"cpu"}
    assert result["equal"]
