"""The CUDA side of offload_states: device memory drops, pinned host buffers are reused.

Runs where a CUDA device exists (skipped elsewhere, saying why); the CPU
behaviour of the same API is covered by tests/test_offload.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zero3
from tests.distributed import run_ranks
from tests.test_offload import STATES, build, micro_step, same, snapshot
from tests import models

pytestmark = pytest.mark.cuda  # skipped, saying why, where torch sees no CUDA device (tests/conftest.py)


def device_round_trips(rank: int, world: int, root: str) -> dict:
    engine, model = build(rank, world)
    device = torch.device("cuda", torch.cuda.current_device())
    data = models.batches("x8", 8, 4 * world)
    for batch in data[:2]:
        micro_step(engine, [t.to(device) for t in batch], rank, world)  # type: ignore[arg-type]
        engine.step()
    results: dict = {"pinned_ptrs": []}
    for index, (target, non_blocking) in enumerate([("cpu", False), ("cpu", True), ("nvme", False), ("nvme", True)]):
        micro_step(engine, [t.to(device) for t in data[2 + index]], rank, world)  # type: ignore[arg-type]
        torch.cuda.synchronize()
        before = snapshot(engine, model)
        allocated = torch.cuda.memory_allocated(device)
        engine.offload_states(device=target, non_blocking=non_blocking, nvme_path=root)
        where = {s.value: {str(d) for d in zero3.get_state_devices(engine, s)} for s in STATES}
        torch.cuda.synchronize()
        after_offload = torch.cuda.memory_allocated(device)
        if target == "cpu":
            results["pinned_ptrs"].append(
                sorted(t.data_ptr() for t in engine.offloader.host.pinned.values())
            )
            results["pinned"] = all(t.is_pinned() for t in engine.offloader.host.pinned.values())
        engine.reload_states(non_blocking=non_blocking)
        after = snapshot(engine, model)  # reads wait for the copies
        results[(target, non_blocking)] = {
            "where": where, "equal": same(before, after), "freed": allocated - after_offload,
            "state_bytes": sum(sum(p.values()) for p in engine.state_report().values()),
            "back": {s.value: {str(d) for d in zero3.get_state_devices(engine, s)} for s in STATES},
        }
        engine.step()
    engine.destroy()
    return results


def test_cuda_offload_frees_device_memory_and_reuses_pinned_buffers(tmp_path: Path) -> None:
    for result in run_ranks(1, device_round_trips, str(tmp_path)):
        for key in [("cpu", False), ("cpu", True), ("nvme", False), ("nvme", True)]:
            r = result[key]
            assert r["equal"], key
            assert r["freed"] >= 0.9 * r["state_bytes"], (key, r)
            expected = "cpu" if key[0] == "cpu" else "meta"
            assert r["where"]["hp_params"] == {expected} and r["where"]["contiguous_grad_buffer"] == set()
            assert all(d.startswith("cuda") for s, ds in r["back"].items() for d in ds)
        first, second = result["pinned_ptrs"]
        assert first and first == second, "pinned host buffers must be allocated once and reused"
        assert result["pinned"]


# ---- the offload tiers on a GPU (ZeRO-Offload / ZeRO-Infinity) -------------------------------------------
def tiers_on_cuda(rank: int, world: int, root: str) -> dict:
    from tests.test_tiers import build as build_tier
    from tests.test_tiers import tiers

    device = torch.device("cuda", torch.cuda.current_device())
    pinned = {"pin_memory": True}
    chosen = {
        "none": {},
        "optimizer_cpu": {"offload_optimizer": {"device": "cpu", **pinned}},
        "params_cpu": {"offload_param": {"device": "cpu", **pinned}},
        "both_nvme": tiers(root)["both_nvme"],
    }
    out: dict = {"losses": {}, "homes": {}, "side_stream": {}}
    for name, zero in chosen.items():
        engine, _ = build_tier(zero)
        losses = []
        for x, y in models.batches("tokens", 4, 4 * world):
            loss = models.loss_of(engine(x.to(device), y.to(device)), engine.module)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out["losses"][name] = losses
        out["homes"][name] = engine.state_report().homes
        out["side_stream"][name] = engine.parts.reducer._copy_stream is not None
        engine.destroy()
    return out


def test_cuda_tiers_train_like_the_device_engine_and_copy_gradients_on_a_side_stream(tmp_path: Path) -> None:
    result = run_ranks(1, tiers_on_cuda, str(tmp_path))[0]
    losses = result["losses"]
    assert losses["params_cpu"] == losses["none"]  # host shards copied in: the same values, the same kernels
    for name in ("optimizer_cpu", "both_nvme"):  # the host's fused Adam, not CUDA's: equal to rounding
        assert torch.allclose(torch.tensor(losses[name]), torch.tensor(losses["none"]), rtol=1e-4, atol=1e-5), name
    assert set(result["homes"]["optimizer_cpu"]["lp_grads"]) == {"cpu"}
    assert set(result["homes"]["optimizer_cpu"]["hp_params"]) == {"cpu"}
    assert result["side_stream"]["optimizer_cpu"] and not result["side_stream"]["none"]
