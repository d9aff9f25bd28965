"""Lean memory mode (`zero_optimization.lean_memory`): the trained parameters keep no 16-bit
shards; each gather casts them from the fp32 masters. Against the default layout, in bf16 at 1 and 2 ranks:
training is bit-identical with every optimizer class the suite covers (losses and masters), and so are the
16-bit values every reader sees (the accessors, `ds_tensor`, `iter_full_params`, GatheredParameters' edits),
ZeRO-Offload's host masters, `offload_states`/`reload_states`, and checkpoints (saved in one mode, loaded in
the other); the model state report loses exactly the trained parameters' 16-bit bytes, frozen parameters
keep theirs, and a forward is refused while the masters are parked. The default layout here keeps its
gradient shards in one flat buffer (`tests.models.flat_gradients`), as it does on a device; at several CPU ranks the engine
makes them on demand as lean mode does (zero3.step.grad_shards), checked against the flat buffer too."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import zero3
from tests import models
from tests.devices import worlds_on_devices
from tests.distributed import run_ranks
from zero3.config import ConfigError, load_config
from zero3.step import grad_shards

STEPS = 3
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "AdamW": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "SGD": {"type": "sgd", "params": {"lr": 0.05, "momentum": 0.9}},
    "Adagrad": {"type": "Adagrad", "params": {"lr": 0.05, "initial_accumulator_value": 0.1}},
    "RMSprop": {"type": "RMSprop", "params": {"lr": 1e-3, "alpha": 0.9}},
    "NAdam": {"type": "NAdam", "params": {"lr": 3e-3}},
    "Lion": {"type": "Lion", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}},
    "Muon": {"type": "Muon", "params": {"lr": 0.02, "muon_lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9}},
}


class FrozenEmbeddingLM(nn.Module):
    """A tied transformer behind a frozen extra embedding: frozen and trained units side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Embedding(48, 32)
        self.extra.requires_grad_(False)
        self.lm = models.TiedTransformer(vocab=48)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.lm(idx, targets) + 1e-3 * self.extra(idx).float().pow(2).mean()


def config(optimizer: dict[str, Any], lean: bool, **zero: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": optimizer,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100, "sub_group_size": 2000,
                              "lean_memory": lean, **zero},
    }


def build(optimizer: dict[str, Any], lean: bool, **zero: Any) -> tuple[Any, nn.Module]:
    torch.manual_seed(0)
    model = FrozenEmbeddingLM()
    with models.flat_gradients():
        return zero3.initialize(model=model, config=config(optimizer, lean, **zero))[0], model


def masters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: models.full_value(p).clone() for name, p in model.named_parameters()}


def sixteen_bit(engine: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every 16-bit value a reader outside a pass sees: local shards (accessor and ds_tensor), and whole."""
    seen = {}
    for name, p in model.named_parameters():
        seen[f"local/{name}"] = zero3.safe_get_local_lp_param(p).clone()
        seen[f"ds_tensor/{name}"] = p.ds_tensor.clone()
    for dtype in (torch.bfloat16, torch.float32):
        for name, full in engine.iter_full_params(dtype=dtype):
            seen[f"whole/{dtype}/{name}"] = full.clone()
    with zero3.GatheredParameters(list(model.parameters())):
        seen.update({f"gathered/{name}": p.detach().clone() for name, p in model.named_parameters()})
    return seen


def optimizers_alike(rank: int, world: int) -> dict[str, Any]:
    """Each optimizer trained in both modes on the same data: losses, masters and 16-bit values."""
    data = models.batches("tokens", STEPS, 2 * world)
    out: dict[str, Any] = {}
    for name, optimizer in OPTIMIZERS.items():
        runs = []
        for lean in (False, True):
            engine, model = build(optimizer, lean)
            losses = models.mean_losses(engine, rank, world, data)
            runs.append((losses, masters(model), sixteen_bit(engine, model), engine.model_state_bytes()))
            engine.destroy()
        (losses, full, seen, state), (lean_losses, lean_full, lean_seen, lean_state) = runs
        out[name] = {
            "losses": losses == lean_losses,
            "masters": all(torch.equal(full[k], lean_full[k]) for k in full),
            "sixteen_bit": sorted(k for k in seen if not torch.equal(seen[k], lean_seen[k])),
            "lp_bytes": (state["lp_params"], lean_state["lp_params"]),
            # Everything else than the 16-bit shards and the persistent unit's gathered copy (at world 1 the
            # default layout's persistent parameters view their shards; lean ones are cast into a copy).
            "rest": [(s["total"] - s["lp_params"] - s["persistent_params"], s["lp_grads"]) for s in (state, lean_state)],
        }
    # The frozen embedding's 16-bit shard is all lean mode keeps (bf16: 2 bytes an element).
    out["frozen_shard_bytes"] = 2 * -(-48 * 32 // world)
    return out


@worlds_on_devices(1, 2)
def test_lean_memory_trains_bit_identically_with_every_optimizer(world: int, device: str) -> None:
    for out in run_ranks(world, optimizers_alike):
        frozen = out.pop("frozen_shard_bytes")
        for name, found in out.items():
            assert found["losses"] and found["masters"], (name, found)
            assert found["sixteen_bit"] == [], (name, found["sixteen_bit"])
            default_lp, lean_lp = found["lp_bytes"]
            assert lean_lp == frozen < default_lp, (name, found["lp_bytes"])
            # Between steps lean mode holds no gradient shards either (they live from a backward to its step).
            (default_rest, default_grads), (lean_rest, lean_grads) = found["rest"]
            assert lean_grads == 0 < default_grads and lean_rest == default_rest - default_grads, (name, found["rest"])


class TwoHeads(nn.Module):
    """A body and two heads; the second head is used only where asked (so some steps give it no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 64)
        self.a = nn.Linear(64, 8)
        self.b = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        hidden = torch.tanh(self.body(x))
        out = self.a(hidden)
        if use_b:
            out = out + self.b(hidden)
        return out.float().pow(2).mean()


# Per step, which micro-steps use the second head: in the second step it gets no gradient at all.
MICRO_STEPS = [(False, True), (False, False), (True, False)]


def gradients_from_backward_to_step(rank: int, world: int, root: str, accum: str) -> dict[str, Any]:
    """Both modes with 2 micro-steps a step, clipped: the gradient shards each reader sees after every
    micro-step, the bytes held, the masters after every step; in the last step the gradients are parked on
    disk between the micro-steps. The clipping norm's windows are made small here, so that some lie inside
    one shard, some across several, some over the unused head's missing shards."""
    grad_shards.NORM_CHUNK = 256  # (this rank's process only)
    g = torch.Generator().manual_seed(7)
    data = [[torch.randn(2 * world, 16, generator=g) for _ in micro] for micro in MICRO_STEPS]
    runs = {}
    # The default layout with a flat buffer, lean mode, and (at 2 CPU ranks) the default as the engine builds it.
    variants = [("default", False, True), ("lean", True, True)] + [("on_demand", False, False)] * (world > 1)
    for name, lean, flat in variants:
        torch.manual_seed(0)
        model = TwoHeads()
        cfg = config(OPTIMIZERS["AdamW"], lean)
        cfg["gradient_accumulation_steps"] = 2
        cfg["gradient_clipping"] = 1e-3  # every step clipped: its masters follow the norm's every bit
        cfg["data_types"] = {"grad_accum_dtype": accum}  # fp32: the step runs on the shards themselves
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        with models.flat_gradients(flat):
            engine = zero3.initialize(model=model, config=cfg)[0]
        seen: dict[str, Any] = {"grads": [], "held": [], "masters": []}
        for step, (uses, batches) in enumerate(zip(MICRO_STEPS, data)):
            for micro, (use_b, x) in enumerate(zip(uses, batches)):
                engine.backward(engine(x.chunk(world)[rank], use_b))
                seen["grads"].append({name: zero3.safe_get_local_grad(p).clone() for name, p in model.named_parameters()})
                seen["held"].append(engine.model_state_bytes()["lp_grads"])
                if step == len(MICRO_STEPS) - 1 and micro == 0:
                    engine.offload_states(include=["lp_grads"], device="nvme", nvme_path=root)
                    seen["parked"] = engine.state_report()["lp_grads"]
                    engine.reload_states()
                engine.step()
            seen["masters"].append(masters(model))
            seen["held"].append(engine.model_state_bytes()["lp_grads"])
        runs[name] = seen
        engine.destroy()
    default = runs["default"]
    shard_bytes = {name: 2 * -(-p.numel() // world) for name, p in TwoHeads().named_parameters()}  # bf16

    def differ(key: str) -> list[list[str]]:
        """Per record, the entries where some on-demand variant differs from the flat default."""
        return [sorted(k for run in runs.values() for k in d if not torch.equal(d[k], run[key][i][k]))
                for i, d in enumerate(default[key])]

    return {
        "grads": differ("grads"), "masters": differ("masters"),
        "default_held": default["held"], "lean_held": runs["lean"]["held"], "lean_parked": runs["lean"]["parked"],
        "on_demand": {key: runs["on_demand"][key] for key in ("held", "parked")} if "on_demand" in runs else None,
        "all_shards": sum(shard_bytes.values()), "head_b": shard_bytes["b.weight"] + shard_bytes["b.bias"],
    }


def test_lean_gradient_shards_live_from_the_backward_to_the_step(tmp_path: Any) -> None:
    """Lean mode's gradient shards are made as the backward reaches them and dropped at the step, and
    everything reads as in the default layout: the accessors between micro-steps, the clipped step's masters
    (the norm sums the same pieces), a head without gradients in a whole step, the shards parked on disk
    between micro-steps. A world of one makes a unit's shards at its first gradient; at 2 ranks every landed
    reduction makes its parameters' (a head unused everywhere lands zeros). With fp32 accumulation the step
    runs on the shards themselves, with bf16 on an fp32 copy of each sub-group's."""
    for world, accum in ((1, "bf16"), (2, "bf16"), (2, "fp32")):
        for out in run_ranks(world, gradients_from_backward_to_step, str(tmp_path / f"w{world}{accum}"), accum):
            assert all(diff == [] for diff in out["grads"]), out["grads"]
            assert all(diff == [] for diff in out["masters"]), out["masters"]
            full = out["default_held"][0]
            assert out["default_held"] == [full] * len(out["default_held"]), out["default_held"]
            # Per step: after each micro-step, then after the step (nothing held).
            held = out["lean_held"]
            assert held[2] == held[5] == held[8] == 0, held
            assert full >= out["all_shards"] and all(0 < held[i] for i in (0, 1, 3, 4, 6, 7)), held
            assert held[0] <= held[1] <= full + 64 * 6 and held[6] <= held[7], held  # alignment: < 64 B a shard
            if world == 1:  # the second head's shards exist only where it had a gradient
                assert held[3] == held[4] < held[1] and held[1] - held[0] >= out["head_b"], held
            assert sum(out["lean_parked"].values()) == held[6] and "nvme" in out["lean_parked"], out["lean_parked"]
            if world > 1:  # the default layout at 2 CPU ranks holds and parks its shards as lean mode does
                assert out["on_demand"] == {"held": held, "parked": out["lean_parked"]}, out["on_demand"]


def with_replicas(rank: int, world: int) -> dict[str, Any]:
    """MiCS with a shard group of 1: each rank a replica of the other, whose gradients are summed once a step
    (lean mode sums a flat copy of its shards, then writes every shard back)."""
    data = models.batches("tokens", STEPS, 2 * world)
    runs = []
    for lean in (False, True):
        engine, model = build(OPTIMIZERS["AdamW"], lean, mics_shard_size=1)
        runs.append((models.mean_losses(engine, rank, world, data), masters(model),
                     engine.model_state_bytes()["lp_grads"]))
        engine.destroy()
    (losses, full, _), (lean_losses, lean_full, lean_grads) = runs
    return {"losses": losses == lean_losses, "masters": all(torch.equal(full[k], lean_full[k]) for k in full),
            "lean_grads": lean_grads}


def test_lean_memory_sums_replicas_alike() -> None:
    for out in run_ranks(2, with_replicas):
        assert out == {"losses": True, "masters": True, "lean_grads": 0}, out


def states_and_checkpoints(rank: int, world: int, root: str) -> dict[str, Any]:
    """ZeRO-Offload's host masters, offload_states and reload_states, a checkpoint saved in one mode and
    loaded in the other, and a GatheredParameters edit: each in both modes, compared."""
    data = models.batches("tokens", 2 * STEPS, 2 * world)
    first, second = data[:STEPS], data[STEPS:]
    adamw = OPTIMIZERS["AdamW"]
    out: dict[str, Any] = {}
    runs: dict[bool, Any] = {}
    for lean in (False, True):
        engine, model = build(adamw, lean, offload_optimizer={"device": "cpu"})
        losses = models.mean_losses(engine, rank, world, first)
        engine.offload_states(device="nvme", nvme_path=root)  # parked for real (host memory is a CPU engine's own)
        if lean:
            try:
                engine(*[t.chunk(world)[rank] for t in second[0]])
            except zero3.StateOffloadedError as error:
                out["refused while parked"] = str(error)
        engine.reload_states()
        with zero3.GatheredParameters([model.lm.ln.weight], modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    model.lm.ln.weight.mul_(1.5)
        losses += models.mean_losses(engine, rank, world, second)
        engine.save_checkpoint(os.path.join(root, f"lean{int(lean)}"), tag="t")
        runs[lean] = (losses, masters(model), sixteen_bit(engine, model))
        engine.destroy()
    (losses, full, seen), (lean_losses, lean_full, lean_seen) = runs[False], runs[True]
    out["offload"] = (losses == lean_losses, all(torch.equal(full[k], lean_full[k]) for k in full),
                      sorted(k for k in seen if not torch.equal(seen[k], lean_seen[k])))
    # Each mode loads the other's checkpoint and trains on: the same losses either way.
    after = {}
    for lean in (False, True):
        engine, model = build(adamw, lean)
        engine.load_checkpoint(os.path.join(root, f"lean{int(not lean)}"), tag="t")
        after[lean] = (models.mean_losses(engine, rank, world, first), masters(model))
        engine.destroy()
    out["checkpoint"] = (after[False][0] == after[True][0],
                         all(torch.equal(after[False][1][k], after[True][1][k]) for k in after[False][1]))
    return out


def test_lean_memory_with_host_masters_parked_states_and_checkpoints(tmp_path: Any) -> None:
    for out in run_ranks(2, states_and_checkpoints, str(tmp_path)):
        assert out["offload"] == (True, True, []), out["offload"]
        assert out["checkpoint"] == (True, True), out["checkpoint"]
        assert "hp_params" in out["refused while parked"], out["refused while parked"]


@pytest.mark.parametrize("zero, bad", [
    ({"offload_param": {"device": "cpu"}}, "offload_param.device"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "offload_optimizer.device"),
])
def test_lean_memory_refuses_tiers_it_cannot_serve(zero: dict[str, Any], bad: str) -> None:
    with pytest.raises(ConfigError, match="lean_memory") as error:
        load_config(config(OPTIMIZERS["AdamW"], True, **zero))
    assert f"zero_optimization.{bad}" in str(error.value), str(error.value)
