"""Engine behaviour beyond loss parity: precision, accounting, coalescing, status, teardown."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

import zero3
from tests import models
from tests.devices import ON_DEVICES, worlds_on_devices
from tests.distributed import run_ranks


def cfg(**extra: object) -> dict:
    zero = extra.pop("zero", {})
    base = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }
    base.update(extra)
    return base


# ---- fp16 with dynamic loss scaling --------------------------------------------------
def fp16_overflow(rank: int, world: int) -> dict:
    config = cfg(fp16={"enabled": True, "initial_scale_power": 12, "hysteresis": 1}, gradient_clipping=1.0,
                 optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}})
    torch.manual_seed(0)
    model = models.MLP()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=config)
    data = models.batches("x8", 1, 4 * world) * 6  # one batch, so the loss must fall
    losses, scales, snapshots = [], [], []
    for step, (x, y) in enumerate(data):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = engine(x, y)
        if step == 3 and rank == world - 1:
            loss = loss * float("inf")  # an overflow on one rank only
        scales.append(engine.loss_scale)
        before = zero3.safe_get_full_fp32_param(model.fc1.weight).clone()
        engine.backward(loss)
        engine.step()
        after = zero3.safe_get_full_fp32_param(model.fc1.weight)
        snapshots.append(torch.equal(before, after))
        losses.append(loss.item())
    result = {"losses": losses, "scales": scales, "unchanged": snapshots, "skipped": engine.skipped_steps,
              "dtype": zero3.safe_get_local_lp_param(model.fc1.weight).dtype}
    engine.destroy()
    return result


def scaled_and_clipped_step(rank: int, world: int, zero: dict, clip: float) -> dict:
    """One SGD step (lr 1, no momentum) of an fp16 engine under a fixed loss scale of 1024: each master moves
    by minus its gradient, unscaled and, with `clip`, clipped to that norm overall."""
    config = cfg(fp16={"enabled": True, "loss_scale": 1024.0}, gradient_clipping=clip, zero=zero,
                 optimizer={"type": "sgd", "params": {"lr": 1.0, "momentum": 0.0}})
    torch.manual_seed(0)
    model = models.MLP()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=config)
    (x, y), = models.batches("x8", 1, 4 * world)
    before = [zero3.safe_get_full_fp32_param(p).clone() for p in model.parameters()]
    engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
    grads = [zero3.safe_get_full_grad(p).float() / 1024.0 for p in model.parameters()]  # held scaled until the step
    engine.step()
    moved = [before[i] - zero3.safe_get_full_fp32_param(p) for i, p in enumerate(model.parameters())]
    reported = {"engine": engine.get_global_grad_norm(), "deepspeed": engine.optimizer._global_grad_norm}
    engine.destroy()
    return {"moved": torch.cat([m.flatten() for m in moved]).norm().item(),
            "grad_norm": torch.cat([g.flatten() for g in grads]).norm().item(), "reported": reported}


@pytest.mark.parametrize("zero, clip", [
    pytest.param({}, 0.01, id="clipped"),
    pytest.param({"offload_optimizer": {"device": "cpu", "super_offload": True}}, 0.01, id="clipped-overlapped"),
    pytest.param({"offload_optimizer": {"device": "cpu", "super_offload": True}}, 0.0, id="unclipped-overlapped"),
])
def test_an_fp16_step_unscales_and_clips_its_gradients(zero: dict, clip: float) -> None:
    for result in run_ranks(2, scaled_and_clipped_step, zero, clip):
        expected = clip if clip > 0 else result["grad_norm"]
        assert clip == 0 or result["grad_norm"] > 10 * clip, result  # the clipping acts
        assert result["moved"] == pytest.approx(expected, rel=1e-3), result
        # The norm the engine reports (and DeepSpeed's optimizer name for it) is unscaled, before clipping.
        assert result["reported"]["engine"] == result["reported"]["deepspeed"], result
        assert result["reported"]["engine"] == pytest.approx(result["grad_norm"], rel=1e-3), result


def test_fp16_dynamic_scaling_skips_an_injected_overflow_on_every_rank() -> None:
    for result in run_ranks(2, fp16_overflow):
        assert result["dtype"] == torch.float16
        assert result["skipped"] == 1
        assert result["unchanged"] == [False, False, False, True, False, False]
        assert result["scales"][3] == 2.0**12 and result["scales"][4] == 2.0**11
        finite = [l for i, l in enumerate(result["losses"]) if i != 3]
        assert all(torch.isfinite(torch.tensor(finite)))
        assert finite[-1] < finite[0]


# ---- accounting ---------------------------------------------------------------------
def state_bytes(rank: int, world: int, threshold: int) -> dict:
    config = cfg(bf16={"enabled": True}, zero={"stage3_param_persistence_threshold": threshold})
    torch.manual_seed(0)
    with zero3.Init(config=config):
        model = models.TiedTransformer(vocab=256, dim=64, heads=4, layers=2)
    numel = sum(p._zero3.numel for p in model.parameters())  # true sizes (the params are released)
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=config)
    x, y = models.batches("tokens", 1, 4)[0]
    engine.backward(engine(x.to(engine.device), y.to(engine.device)))
    engine.step()
    result = {"bytes": engine.model_state_bytes(), "numel": numel}
    engine.destroy()
    return result


@worlds_on_devices(1, 2)
def test_model_state_is_16P_over_N(world: int, device: str) -> None:
    # Between steps: 16 bytes per parameter / N, DeepSpeed's; 14 at several CPU ranks, where the gradient
    # shards are made by the backward and dropped at the step (zero3.step.grad_shards).
    grads_on_demand = device == "cpu" and world > 1
    for result in run_ranks(world, state_bytes, 0):
        expected = (14 if grads_on_demand else 16) * result["numel"] / world
        assert (result["bytes"]["lp_grads"] == 0) == grads_on_demand, result
        states = result["bytes"]
        model_state = states["lp_params"] + states["hp_params"] + states["lp_grads"] + states["optim_states"]
        assert abs(model_state - expected) / expected <= 0.05, (states, expected)
        assert states["lp_params"] == pytest.approx(2 * result["numel"] / world, rel=0.05)
        assert states["optim_states"] == pytest.approx(8 * result["numel"] / world, rel=0.05)
        assert states["persistent_params"] == 0


def test_persistent_params_stay_whole_and_are_counted() -> None:
    for result in run_ranks(2, state_bytes, 100):
        states = result["bytes"]
        assert states["persistent_params"] > 0  # LayerNorm weights and biases stay whole
        assert states["total"] == sum(v for k, v in states.items() if k not in ("total", "contiguous_grad_buffer"))


# ---- coalescing and status ---------------------------------------------------------
def count_collectives(rank: int, world: int) -> dict:
    import zero3.comm as comm

    calls = {"all_gather": 0, "reduce_scatter": 0, "marker": 0}
    real_ag, real_rs = comm._all_gather_flat, comm._reduce_scatter_flat
    control: list = []

    def all_gather(*a, **k):
        calls["marker" if control and k.get("group") is control[0] else "all_gather"] += 1
        return real_ag(*a, **k)

    def reduce_scatter(*a, **k):
        calls["reduce_scatter"] += 1
        return real_rs(*a, **k)

    comm._all_gather_flat, comm._reduce_scatter_flat = all_gather, reduce_scatter
    torch.manual_seed(0)
    model = models.MLP()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg())
    control.append(engine.comm.control_group)
    statuses: list[tuple[str, zero3.ParamStatus, zero3.ParamStatus]] = []

    params = dict(model.named_parameters())  # iteration does not gather; attribute reads would

    def watch(module: nn.Module, args: object) -> None:
        statuses.append(("fc2", zero3.param_status(params["fc2.weight"]), zero3.param_status(params["fc3.weight"])))

    model.fc2.register_forward_pre_hook(watch)  # runs after the engine's own pre-hook
    x, y = models.batches("x8", 1, 4)[0]
    calls.update(all_gather=0, reduce_scatter=0, marker=0)
    engine.backward(engine(x, y))
    first = dict(calls)
    engine.step()
    after_step = zero3.param_status(model.fc1.weight)
    buckets = [[sp.name for sp in bucket.params] for bucket in engine.parts.reducer.buckets]
    engine.destroy()
    return {"first": first, "statuses": statuses, "after_step": after_step, "buckets": buckets}


def test_one_all_gather_per_module_and_one_reduce_scatter_per_bucket() -> None:
    for result in run_ranks(2, count_collectives):
        # 3 Linear modules, each gathered as ONE flat all-gather (weight and bias together) in
        # forward, and again in backward; the 6 gradients travel in one reduce-scatter per bucket
        # (at most a MIN_BUCKETS-th of the model each, at least its largest parameter: here
        # [fc3, fc2.bias], [fc2.weight], [fc1]). Each pass ends with one small marker on the
        # control group (ranks agree the pass is over).
        assert len(result["buckets"]) == 3 and sum(map(len, result["buckets"])) == 6
        assert result["first"] == {"all_gather": 6, "reduce_scatter": 3, "marker": 2}
        name, fc2_status, fc3_status = result["statuses"][0]
        assert fc2_status is zero3.ParamStatus.AVAILABLE  # inside its own forward
        # Step 1 has no trace yet: the walk prefetches in registration order.
        assert fc3_status is zero3.ParamStatus.INFLIGHT
        assert result["after_step"] is zero3.ParamStatus.NOT_AVAILABLE


def prefetch_status(rank: int, world: int) -> list:
    torch.manual_seed(0)
    model = models.MLP()
    config = cfg(zero={"stage3_prefetch_bucket_size": 10_000})
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=config)
    fc2_weight = dict(model.named_parameters())["fc2.weight"]  # iteration does not gather
    seen: list[list[zero3.ParamStatus]] = []

    def record(*_: object) -> None:
        seen[-1].append(zero3.param_status(fc2_weight))

    # Each runs after the engine's own hook on the same module.
    model.fc1.register_forward_hook(record)  # fc1 done: fc2 is next
    model.fc2.register_forward_pre_hook(record)  # fc2 running
    model.fc2.register_forward_hook(record)  # fc2 done
    for x, y in models.batches("x8", 3, 4):
        seen.append([zero3.param_status(fc2_weight)])
        engine.backward(engine(x, y))
        engine.step()
    engine.destroy()
    return seen


def test_param_status_walks_not_available_inflight_available_and_back() -> None:
    na, inflight, available = (zero3.ParamStatus.NOT_AVAILABLE, zero3.ParamStatus.INFLIGHT,
                               zero3.ParamStatus.AVAILABLE)
    for seen in run_ranks(2, prefetch_status):
        # Step 1 prefetches in registration order; later steps along the previous forward's
        # order: fc2 is in flight while fc1 runs, whole inside its forward, released after.
        assert seen[0] == [na, inflight, available, na]
        assert seen[1] == [na, inflight, available, na]
        assert seen[2] == [na, inflight, available, na]


# ---- GatheredParameters after initialize ---------------------------------------------
def world_of_one(rank: int, world: int) -> dict:
    import zero3.comm as comm

    gathers = []
    real_ag = comm._all_gather_flat
    comm._all_gather_flat = lambda *a, **k: gathers.append(1) or real_ag(*a, **k)  # type: ignore[assignment]
    torch.manual_seed(0)
    model = models.MLP()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg())
    lp = engine.lp_buffers[0].tensor
    inside: list[bool] = []

    def watch(module: nn.Module, args: object) -> None:  # is fc2's weight a view of the shard buffer?
        data = module.weight.data
        start = lp.data_ptr()
        inside.append(start <= data.data_ptr() < start + lp.numel() * lp.element_size())

    model.fc2.register_forward_pre_hook(watch)
    for x, y in models.batches("x8", 2, 4):
        engine.backward(engine(x.to(engine.device), y.to(engine.device)))
        engine.step()
    with zero3.GatheredParameters([model.fc1.bias], modifier_rank=0):
        with torch.no_grad():
            model.fc1.bias.fill_(3.0)
    master = zero3.safe_get_full_fp32_param(model.fc1.bias).clone().cpu()
    engine.destroy()
    return {"gathers": len(gathers), "inside": inside, "master": master}


@ON_DEVICES
def test_a_world_of_one_gathers_nothing_its_parameters_view_the_shards(device: str) -> None:
    (result,) = run_ranks(1, world_of_one)
    assert result["gathers"] == 0
    assert result["inside"] == [True, True]
    assert result["master"].eq(3.0).all()  # an edit still reaches the fp32 master


def world_of_one_gradients(rank: int, world: int) -> dict:
    """Two micro-steps at a world of one: every gradient goes straight into lp_grads (nothing is
    reduced), and what accumulates there is plain torch's accumulated gradient, bit for bit."""
    from zero3.comm import Communicator

    reductions = []
    real = Communicator.reduce_scatter_flat

    def counted(self: Communicator, *args: object, **kwargs: object) -> object:
        reductions.append(1)
        return real(self, *args, **kwargs)

    Communicator.reduce_scatter_flat = counted  # type: ignore[method-assign]
    torch.manual_seed(0)
    reference = models.MLP()
    torch.manual_seed(0)
    model = models.MLP()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(),
                                  config=cfg(gradient_accumulation_steps=2))
    same = {}
    for micro, (x, y) in enumerate(models.batches("x8", 2, 4)):
        engine.backward(engine(x.to(engine.device), y.to(engine.device)))
        (reference(x, y) / 2).backward()
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            same[f"{name}@{micro}"] = torch.equal(zero3.safe_get_local_grad(p).cpu(), ref.grad.reshape(-1))
        engine.step()  # the first only accumulates; the second steps (and zeroes the gradients)
    engine.destroy()
    return {"reductions": len(reductions), "same": same}


@ON_DEVICES
def test_a_world_of_one_puts_gradients_straight_into_lp_grads(device: str) -> None:
    (result,) = run_ranks(1, world_of_one_gradients)
    assert result["reductions"] == 0  # no bucket was filled and sent
    if device == "cpu":  # the same kernels as plain torch: bit for bit (CUDA's backward may differ)
        assert all(result["same"].values()), result["same"]


def saved_tensors(rank: int, world: int) -> dict:
    """How forward saves what backward reads: through the coordinator's saved-tensor hooks where a
    released unit must be gathered again (world 2), by reference where every unit views its shard
    (world 1: gathered again in place when the backward begins). Either way a parameter is released
    after the forward that used it, as in DeepSpeed."""
    from zero3.passes.coordinator import ParamCoordinator

    packed = []
    real = ParamCoordinator._pack

    def counted(self: ParamCoordinator, tensor: torch.Tensor) -> object:
        packed.append(1)
        return real(self, tensor)

    ParamCoordinator._pack = counted  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = models.TiedTransformer()  # its LayerNorms save their weights: leaves, saved by reference
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg())
    after_forward, after_step = set(), set()
    for x, y in models.batches("tokens", 2, 4 * world):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = engine(x.to(engine.device), y.to(engine.device))
        after_forward |= {zero3.param_status(q) for q in model.parameters()}
        engine.backward(loss)
        engine.step()
        after_step |= {zero3.param_status(q) for q in model.parameters()}
    with torch.no_grad():  # records no graph: nothing is held for a backward
        engine(x.to(engine.device), y.to(engine.device))
    after_no_grad = {zero3.param_status(q) for q in model.parameters()}
    # A plain backward twice through one retained graph: each gathers what it reads again.
    loss = engine(x.to(engine.device), y.to(engine.device))
    loss.backward(retain_graph=True)
    engine.allreduce_gradients()
    once = [zero3.safe_get_local_grad(q).clone() for q in model.parameters()]
    loss.backward()
    engine.allreduce_gradients()
    twice = [zero3.safe_get_local_grad(q).clone() for q in model.parameters()]
    engine.zero_grad()
    engine.destroy()
    return {"packed": len(packed), "after_forward": after_forward, "after_step": after_step,
            "after_no_grad": after_no_grad, "doubled": all(torch.equal(2 * a, b) for a, b in zip(once, twice)),
            "nonzero": all(bool(a.abs().sum() > 0) for a in once)}


@pytest.mark.parametrize("world", [1, 2])
def test_a_world_of_one_saves_for_backward_by_reference(world: int) -> None:
    na = zero3.ParamStatus.NOT_AVAILABLE
    for result in run_ranks(world, saved_tensors):
        assert (result["packed"] == 0) == (world == 1)
        assert result["after_forward"] == {na}
        assert result["after_step"] == {na}  # released when the backward ended, at either size
        assert result["after_no_grad"] == {na}
        assert result["doubled"] and result["nonzero"]


def gradients_in_place(rank: int, world: int) -> dict:
    """A world of one lets autograd add each gradient into its lp_grads slot (zero3.passes.grad_hooks):
    the slots hold plain torch's gradients, `.grad` is None once the pass ends, and a backward that
    records a graph (accumulating out of place) still lands its gradients there."""
    torch.manual_seed(0)
    reference = models.MLP()
    torch.manual_seed(0)
    model = models.MLP()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg())
    (x, y), (x2, y2) = models.batches("x8", 2, 4)
    out: dict = {}
    for how, (xs, ys) in (("engine", (x, y)), ("create_graph", (x2, y2))):
        loss = engine(xs.to(engine.device), ys.to(engine.device))
        if how == "engine":
            engine.backward(loss)
        else:
            loss.backward(create_graph=True)
            engine.allreduce_gradients()
        reference(xs, ys).backward(create_graph=how == "create_graph")
        out[how] = all(torch.equal(zero3.safe_get_local_grad(p).cpu(), r.grad.reshape(-1))
                       for p, r in zip(model.parameters(), reference.parameters()))
        out[f"{how}_grads_none"] = all(p.grad is None for p in model.parameters())
        engine.zero_grad()
        reference.zero_grad()
    out["post_hooks"] = sum(1 for p in model.parameters() if getattr(p, "_post_accumulate_grad_hooks", None))
    engine.destroy()
    return out


@ON_DEVICES
def test_a_world_of_one_accumulates_gradients_in_place(device: str) -> None:
    (result,) = run_ranks(1, gradients_in_place)
    assert result["post_hooks"] == 0  # no hook runs after autograd's accumulation
    assert result["engine_grads_none"] and result["create_graph_grads_none"]
    if device == "cpu":  # the same kernels as plain torch: bit for bit (CUDA's backward may differ)
        assert result["engine"] and result["create_graph"]


def edit_after_initialize(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = models.MLP()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg())
    with zero3.GatheredParameters([model.fc1.bias], modifier_rank=0):
        assert model.fc1.bias.shape == (64,)
        with torch.no_grad():
            model.fc1.bias.fill_(3.0)
    master = zero3.safe_get_full_fp32_param(model.fc1.bias).clone()
    lp = zero3.safe_get_local_lp_param(model.fc1.bias).clone()
    released = model.fc1.bias.numel() == 0
    engine.destroy()
    return {"master": master, "lp": lp, "released": released}


def test_gathered_parameters_modifier_updates_shards_and_master() -> None:
    for result in run_ranks(2, edit_after_initialize):
        assert result["master"].eq(3.0).all()  # the fp32 master, not only the 16-bit copy
        assert result["lp"].eq(3.0).all()
        assert result["released"]


def edit_one_of_a_unit(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = models.MLP()
    engine, *_ = zero3.initialize(model=model, config=cfg(bf16={"enabled": True}))
    x, y = models.batches("x8", 1, 4 * world)[0]
    engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
    engine.step()  # masters now hold values a bf16 round trip would change
    before = {name: zero3.safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()}
    with zero3.GatheredParameters([model.fc1.weight], modifier_rank=0):  # fc1.bias is gathered with it
        with torch.no_grad():
            model.fc1.weight.mul_(2.0)
    after = {name: zero3.safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()}
    engine.destroy()
    return {"before": before, "after": after}


def test_modifier_edits_change_only_the_listed_masters() -> None:
    for result in run_ranks(2, edit_one_of_a_unit):
        before, after = result["before"], result["after"]
        for name in before:
            if name != "fc1.weight":
                assert torch.equal(before[name], after[name]), name  # fc1.bias above all: same unit
        # The edited master is the edited 16-bit value (2 x the bf16 copy), not 2 x the old master.
        assert torch.equal(after["fc1.weight"], (before["fc1.weight"].bfloat16() * 2).float())
        assert not torch.equal(after["fc1.weight"], before["fc1.weight"] * 2)


# ---- config keys zero3 accepts but does not act on, and the progress log ---------------------------
def logged(rank: int, world: int) -> list[str]:
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname} {record.getMessage()}")

    logger = logging.getLogger("zero3")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    config = cfg(
        steps_per_print=2, wall_clock_breakdown=True,
        zero={"stage3_max_reuse_distance": 1000, "contiguous_gradients": False,
              "stage3_gather_16bit_weights_on_model_save": True, "offload_optimizer": {"pin_memory": True}},
        optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    )
    torch.manual_seed(0)
    model = models.MLP()
    engine, *_ = zero3.initialize(model=model, config=config)
    for x, y in models.batches("x8", 4, 4):
        engine.backward(engine(x.to(engine.device), y.to(engine.device)))
        engine.step()
    engine.destroy()
    return records


@ON_DEVICES
def test_ignored_keys_warn_once_and_progress_is_logged(device: str) -> None:
    records = run_ranks(1, logged)[0]
    warnings = [r for r in records if r.startswith("WARNING")]
    for key in ("zero_optimization.stage3_max_reuse_distance=1000", "zero_optimization.contiguous_gradients=false",
                "zero_optimization.stage3_gather_16bit_weights_on_model_save=true",
                "zero_optimization.offload_optimizer.pin_memory=true", "optimizer.params.torch_adam=true"):
        assert sum(key in w and "has no effect" in w for w in warnings) == 1, (key, warnings)
    assert len(warnings) == 5
    progress = [r for r in records if r.startswith("INFO step ")]
    assert [r.split(":")[0] for r in progress] == ["INFO step 2", "INFO step 2 time", "INFO step 4", "INFO step 4 time"]
    assert "grad norm" in progress[0] and "forward" in progress[1] and "backward" in progress[1] and " ms" in progress[1]


def emulated_bf16_warnings(rank: int, world: int) -> list[str]:
    from zero3 import accelerator
    from tests.logs import zero3_messages

    accelerator.computes_bf16_natively = lambda device: False  # type: ignore[assignment]  # this rank's process
    messages = zero3_messages()
    for _ in range(2):
        engine, *_ = zero3.initialize(model=models.MLP(), config=cfg(bf16={"enabled": True}))
        engine.destroy()
    engine, *_ = zero3.initialize(model=models.MLP(), config=cfg())  # fp32: nothing to say
    engine.destroy()
    return [message for message in messages if "bf16" in message]


def test_a_bf16_engine_on_a_cpu_without_bf16_units_warns_once_naming_the_cost() -> None:
    (warnings,) = run_ranks(1, emulated_bf16_warnings)
    assert len(warnings) == 1, warnings
    assert "170x" in warnings[0] and "bf16.enabled" in warnings[0], warnings


# ---- teardown ---------------------------------------------------------------------
def destroy_and_collect(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = models.MLP()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg())
    x, y = (t.to(engine.device) for t in models.batches("x8", 1, 4)[0])
    engine.backward(engine(x, y))
    engine.step()
    engine.destroy()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(not hasattr(p, "_zero3") and p.numel() == 0 for p in model.parameters())
    assert all(type(m._parameters) is dict for m in model.modules())
    with pytest.raises(RuntimeError, match="destroyed"):
        engine(x, y)
    # A new engine over the released parameters would train on nothing: refused, before anything changes.
    with pytest.raises(ValueError, match=r"parameters \(fc1.weight, .*\) were released by an earlier engine's destroy"):
        zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg())
    assert all(not hasattr(p, "_zero3") and p.numel() == 0 for p in model.parameters())
    # Given values again, they make an engine that trains as one over a fresh model does.
    torch.manual_seed(0)
    fresh = models.MLP()
    for param, value in zip(model.parameters(), fresh.parameters()):
        param.data = value.data.clone()
    again, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg())
    reference, *_ = zero3.initialize(model=fresh, model_parameters=fresh.parameters(), config=cfg())
    assert again(x, y).item() == reference(x, y).item()
    again.destroy()
    reference.destroy()
    del again, reference, fresh
    engine_ref, model_ref = weakref.ref(engine), weakref.ref(model)
    del engine, model
    gc.collect()
    assert engine_ref() is None and model_ref() is None


@ON_DEVICES
def test_destroy_removes_hooks_and_frees_everything(device: str) -> None:
    # In a rank of its own, not in pytest's process: the engine would leave its default process group
    # there, and a gloo group makes a later CUDA engine pick the CPU (an nccl one, a later CPU engine fail).
    run_ranks(1, destroy_and_collect)


# ---- process group and errors -----------------------------------------------------------
@ON_DEVICES
def test_plain_process_without_launcher_is_a_world_of_one(device: str) -> None:
    script = (
        "import torch, zero3; from torch import nn\n"
        "m = nn.Linear(4, 2)\n"
        "e, o, _, s = zero3.initialize(model=m, model_parameters=m.parameters(), config={'optimizer': {'type': 'Adam'}})\n"
        "l = e(torch.randn(3, 4, device=e.device)).sum(); e.backward(l); e.step()\n"
        "print('world', e.world_size, e.global_rank, e.global_steps, e.device.type)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"world 1 0 1 {device}" in out.stdout  # on CUDA where the device is not pinned to the CPU


def errors(rank: int, world: int) -> dict:
    model = nn.Linear(4, 2)
    messages = []
    for call in (
        lambda: zero3.initialize(model=model, model_parameters=[torch.zeros(3, requires_grad=True)], config=cfg()),
        lambda: zero3.initialize(model=model, config={"zero_optimization": {"stage": 2}}),
    ):
        try:
            call()
        except (ValueError, TypeError) as err:
            messages.append(str(err))
    untouched = zero3.partition.sharded_param.sharded(model.weight) is None  # every refusal came before partitioning
    engine, *_ = zero3.initialize(model=nn.Linear(4, 2), config=cfg())
    try:
        engine.backward(engine(torch.randn(3, 4, device=engine.device)))
    except ValueError as err:
        messages.append(str(err))
    engine.destroy()
    return {"messages": messages, "untouched": untouched}


@ON_DEVICES
def test_misuse_gives_clear_errors(device: str) -> None:
    result = run_ranks(1, errors)[0]
    messages = result["messages"]
    assert len(messages) == 3, messages
    assert result["untouched"]
    assert "not a parameter of the model" in messages[0]
    assert "zero_optimization.stage" in messages[1]
    assert "scalar loss" in messages[2] and "(3, 2)" in messages[2]


def parameter_dicts(rank: int, world: int) -> dict:
    from zero3.partition.param_dict import ZeroParamDict

    torch.manual_seed(0)
    model = models.TiedTransformer(vocab=48)
    config = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}}
    engine = zero3.initialize(model=model, config=config)[0]
    reporting = sorted(name for name, module in model.named_modules() if isinstance(module._parameters, ZeroParamDict))
    x, y = models.batches("tokens", 1, 2 * world)[0]
    loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
    engine.backward(loss)
    engine.step()
    engine.destroy()
    return {"reporting": reporting, "loss": float(loss),
            "after destroy": [name for name, m in model.named_modules() if isinstance(m._parameters, ZeroParamDict)]}


def test_only_modules_whose_reads_can_gather_report_them() -> None:
    """A module whose parameters are all persistent (here the LayerNorms, 64 elements each, under a threshold of
    100) reads them through a plain dict: no Python call per read. The others (the tied head, the root's
    position table, the blocks' linears) still report each read, so a read outside the owner's forward
    gathers."""
    for out in run_ranks(2, parameter_dicts):
        assert "ln" not in out["reporting"] and "blocks.0.ln1" not in out["reporting"], out
        assert {"", "head", "embed", "blocks.0.qkv", "blocks.0.mlp.0"} <= set(out["reporting"]), out
        assert out["after destroy"] == [], out
