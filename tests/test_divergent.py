"""Ranks that route through different parameters in one step (MoE routing, data-dependent branches).

Each rank picks its experts (which, in which order, how often) from its own
batch, and skips a module on some steps; routes change every step. The run
must not hang, and must equal one process that averages the ranks' losses:
a parameter unused on a rank contributes zero there, and a parameter no rank
used is not stepped at all (torch skips parameters without a gradient).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero3
from tests import models
from tests.distributed import run_ranks

LR, WD, CLIP, MICRO, STEPS = 3e-3, 0.01, 1.0, 4, 6


def config(**zero: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


def reference(world: int, sync: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole global batch: the mean of the ranks' losses, AdamW, clipping. `sync`:
    `RoutedSync`, its statistic summed over every rank's rows, as its all-reduce does."""
    torch.manual_seed(0)
    model = models.RoutedSync() if sync else models.Routed()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for x, y in models.batches("x8", STEPS, MICRO * world):
        if sync:
            hidden = [model.hidden(xs) for xs in x.chunk(world)]
            scale = sum(h.detach().abs().mean() for h in hidden).reshape(1)
            loss = sum(model.head_loss(h, ys, scale) for h, ys in zip(hidden, y.chunk(world))) / world
        else:
            loss = sum(model(xs, ys) for xs, ys in zip(x.chunk(world), y.chunk(world))) / world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def train_routed(rank: int, world: int, zero: dict) -> dict:
    torch.manual_seed(0)
    model = models.Routed()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=config(**zero))
    live = engine.coordinator.live
    count, peak = live.observe, [0]

    def observe_and_track_peak(unit, old, new):  # type: ignore[no-untyped-def]
        count(unit, old, new)
        peak[0] = max(peak[0], live.numel)

    live.observe = observe_and_track_peak  # type: ignore[method-assign]
    losses, codes = [], []
    for x, y in models.batches("x8", STEPS, MICRO * world):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        codes.append(models.Routed.code(xs))
        loss = engine(xs, ys)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().reshape(1).clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    params = {name: zero3.safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()}
    statuses = {zero3.param_status(p) for p in model.parameters()}
    result = {"losses": losses, "params": params, "codes": codes, "statuses": statuses, "peak": peak[0],
              "live_after": engine.coordinator.live_numel()}
    engine.destroy()
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "zero",
    [{}, {"stage3_prefetch_bucket_size": 1500, "stage3_max_live_parameters": 2200, "reduce_bucket_size": 2000}],
    ids=["defaults", "small-buckets"],
)
def test_ranks_on_different_routes_train_like_one_process(world: int, zero: dict) -> None:
    ref_losses, ref_params = reference(world)
    results = run_ranks(world, train_routed, zero)
    codes = [r["codes"] for r in results]
    # The routes really differ between ranks (in most steps) and from step to step.
    assert sum(len({c[step] for c in codes}) > 1 for step in range(STEPS)) >= STEPS // 2
    assert len({c for rank_codes in codes for c in rank_codes}) >= 4
    for result in results:
        for ours, ref in zip(result["losses"], ref_losses):
            assert abs(ours - ref) <= 1e-5 * max(1.0, abs(ref)), (result["losses"], ref_losses)
        for name, ref in ref_params.items():
            assert torch.allclose(result["params"][name], ref, rtol=1e-4, atol=1e-6), name
        # Never used by any rank: never stepped (weight decay would have moved it).
        assert torch.equal(result["params"]["experts.3.weight"], ref_params["experts.3.weight"])
        assert result["statuses"] == {zero3.ParamStatus.NOT_AVAILABLE}
        assert result["live_after"] == 0
        if zero:
            # stage3_max_live_parameters bounds every gather: at most one layer in use plus what fits.
            assert result["peak"] <= zero["stage3_max_live_parameters"], result["peak"]


def train_routed_sync(rank: int, world: int, zero: dict) -> dict:
    torch.manual_seed(0)
    model = models.RoutedSync()
    engine, *_ = zero3.initialize(model=model, config=config(**zero))
    losses = models.mean_losses(engine, rank, world, models.batches("x8", STEPS, MICRO * world))
    walks = (engine.coordinator.forward_walk, engine.coordinator.backward_walk)
    result = {"losses": losses, "keeper_gathers": sum(walk.keeper_gathers for walk in walks),
              "params": {name: zero3.safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()}}
    engine.destroy()
    return result


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("world", "zero"), [
    (3, {"stage3_prefetch_bucket_size": 1500, "reduce_bucket_size": 2000}),
], ids=["3-small-prefetch"])
def test_a_model_running_its_own_all_reduce_on_different_routes_trains_like_one_process(world: int, zero: dict) -> None:
    """Without the walk's keeper a rank blocks in the model's all-reduce while a peer waits on a gather that
    only the blocked rank can pair: both hang (see gather_walk's [Note: the walk's keeper]). The keeper
    holds no more than stage3_max_live_parameters, so that budget must cover what the routes need."""
    ref_losses, ref_params = reference(world, sync=True)
    results = run_ranks(world, train_routed_sync, zero)
    assert any(result["keeper_gathers"] > 0 for result in results)  # the keeper had to act
    for result in results:
        for ours, ref in zip(result["losses"], ref_losses):
            assert abs(ours - ref) <= 1e-5 * max(1.0, abs(ref)), (result["losses"], ref_losses)
        for name, ref in ref_params.items():
            assert torch.allclose(result["params"][name], ref, rtol=1e-4, atol=1e-6), name
