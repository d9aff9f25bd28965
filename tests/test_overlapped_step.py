"""ZeRO-Offload's overlapped host step (`offload_optimizer.super_offload`): sub-groups step on a
host thread as their gradients land during the backward, and the step keeps or undoes that work so that
training is bit-identical to the step after the backward (zero3.step.early_step's Note). At 2 ranks, in
bf16 and fp32, against the same engine without it: losses, masters and moments equal after several steps
where the early steps are kept (unclipped, with gradient accumulation, with the 16-bit shards on disk), where
they are undone (every step clipped: once, as the backwards after a refused step speculate nothing; clipped,
then not: speculating again; an fp16 overflow; the learning rate changed between backward and step; an
accessor reading the masters there; offload_states and reload_states there), and where an early step fails
on one rank (every rank raises, the step lands nowhere)."""

from __future__ import annotations

import tempfile
import threading
from typing import Any, Callable

import pytest
import torch

import zero3
from tests import models
from tests.distributed import run_ranks
from zero3.config import ConfigError, load_config

STEPS = 4


def config(super_offload: bool, precision: str, clip: float, gas: int = 1, fp16_scale_power: int | None = None,
           optimizer: str = "AdamW", params_on_disk: str | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": optimizer, "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 100, "sub_group_size": 3000,
            "reduce_bucket_size": 4000, "offload_optimizer": {"device": "cpu", "super_offload": super_offload},
        },
    }
    if params_on_disk is not None:  # the 16-bit shards in files: written after the walk, early steps included
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": params_on_disk, "max_in_cpu": 0}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if fp16_scale_power is not None:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": fp16_scale_power, "loss_scale_window": 2}
    return cfg


def states(engine: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[f"master/{name}"] = zero3.safe_get_full_fp32_param(p).clone()
        for moment in ("exp_avg", "exp_avg_sq"):
            value = zero3.safe_get_full_optimizer_state(p, moment)
            if value is not None:
                out[f"{moment}/{name}"] = value.clone()
    return out


def train(rank: int, world: int, cfg: dict[str, Any], between: Callable[[Any, torch.nn.Module, int], None] | None,
          steps: int = STEPS) -> dict[str, Any]:
    """Train `steps` global batches; `between(engine, model, step)` runs after each boundary backward."""
    torch.manual_seed(0)
    model = models.TiedTransformer(vocab=48)
    engine = zero3.initialize(model=model, config=cfg)[0]
    if engine.optimizer.early is not None:
        engine.optimizer.early.after_computation = True  # every sub-group early, whenever its reduction lands
    gas = cfg["gradient_accumulation_steps"]
    losses = []
    for step, (x, y) in enumerate(models.batches("tokens", steps, 2 * world * gas)):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        for xs, ys in zip(x.chunk(gas), y.chunk(gas)):
            loss = models.loss_of(engine(xs, ys), model)
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary() and between is not None:
                between(engine, model, step)
            engine.step()
            losses.append(loss.item())
    early = engine.optimizer.early
    stats = None if early is None else {"kept": early.stats.kept, "undone": early.stats.undone,
                                        "reasons": dict(early.stats.undone_reasons),
                                        "skipped": early.stats.skipped,
                                        "skipped_reasons": dict(early.stats.skipped_reasons)}
    out = {"losses": losses, "states": states(engine, model), "stats": stats,
           "skipped": engine.skipped_steps}
    engine.destroy()
    return out


def compare(rank: int, world: int, case: str) -> dict[str, Any]:
    reads: list[torch.Tensor] = []

    def change_lr(engine: Any, model: Any, step: int) -> None:
        for group in engine.optimizer.param_groups:
            group["lr"] = 1e-2 / (step + 2)

    def park(engine: Any, model: Any, step: int) -> None:
        engine.offload_states()
        engine.reload_states()

    def read_a_master(engine: Any, model: Any, step: int) -> None:
        reads.append(zero3.safe_get_full_fp32_param(model.head.weight).clone())

    def stop_clipping(engine: Any, model: Any, step: int) -> None:
        if step == 2:  # steps 0 and 1 clipped; from step 2 on the norm is under the threshold
            engine.optimizer.gradient_clipping = 100.0

    kwargs: dict[str, Any] = {"precision": "bf16", "clip": 100.0}  # configured, never reached
    between = {"lr changed": change_lr, "parked": park, "accessor": read_a_master,
               "clipped, then not": stop_clipping}.get(case)
    if case == "fp32":
        kwargs = {"precision": "fp32", "clip": 0.0}
    elif case == "accumulated":
        kwargs["gas"] = 2
    elif case in ("clipped", "clipped, then not"):
        kwargs["clip"] = 1e-4
    elif case == "fp16 overflow":
        kwargs = {"precision": "fp32", "clip": 100.0, "fp16_scale_power": 24}
    elif case == "params on disk":
        kwargs["params_on_disk"] = tempfile.gettempdir()
    runs = {}
    for super_offload in (False, True):
        reads.clear()
        runs[super_offload] = train(rank, world, config(super_offload, **kwargs), between)
        runs[super_offload]["reads"] = list(reads)
    plain, overlapped = runs[False], runs[True]
    out = {
        "losses": plain["losses"] == overlapped["losses"],
        "differing": sorted(k for k in plain["states"] if not torch.equal(plain["states"][k], overlapped["states"][k])),
        "stats": overlapped["stats"],
        "skipped": (plain["skipped"], overlapped["skipped"]),
    }
    if case == "accessor":
        out["reads"] = all(torch.equal(a, b) for a, b in zip(runs[False]["reads"], runs[True]["reads"]))
    return out


CASES = {
    # case: (kept at least one early step (None: either), undone at least one and why)
    "bf16": (True, None),
    "fp32": (True, None),
    "params on disk": (True, None),
    "accumulated": (True, None),
    "clipped": (False, "the gradients are clipped"),
    "clipped, then not": (True, "the gradients are clipped"),
    "fp16 overflow": (None, "zero_grad dropped the gradients"),
    "lr changed": (False, "the hyperparameters changed"),
    "accessor": (False, "an accessor read or wrote the optimizer's state"),
    "parked": (False, "offload_states moved the state"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overlapped_host_step_trains_bit_identically(case: str) -> None:
    kept, undone_for = CASES[case]
    for out in run_ranks(2, compare, case):
        assert out["losses"] and out["differing"] == [], out
        stats = out["stats"]
        if kept is not None:
            assert (stats["kept"] > 0) == kept, stats
        if undone_for is None:
            assert stats["undone"] == 0, stats
        else:
            assert stats["reasons"].get(undone_for, 0) > 0, stats
        assert out["skipped"][0] == out["skipped"][1]
        if case == "fp16 overflow":
            assert out["skipped"][0] > 0, out  # the case overflowed at least once
        if case == "accessor":
            assert out["reads"], out  # the reader saw the masters as before the step
        # After a step refused for its values, the next backward steps nothing early: every step clipped is
        # speculated once (step 0); clipped then not, the backward after the first unclipped step speculates.
        if case == "clipped":
            assert stats["skipped"] == STEPS - 1 and stats["undone"] > 0, stats
            assert stats["skipped_reasons"] == {"the gradients are clipped": STEPS - 1}, stats
        elif case == "clipped, then not":
            assert stats["skipped"] == 2 and stats["kept"] > 0, stats  # steps 1 and 2; step 3 kept
        else:
            assert stats["skipped"] == 0, stats


def failing_early_step(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's early steps fail at step 1 (every one of them): every rank raises at its step, no rank's
    state changes, and training on after `zero_grad()` matches a run that skipped that batch."""
    data = models.batches("tokens", STEPS, 2 * world)
    bad = 1
    results = {}
    for skip_only in (True, False):
        torch.manual_seed(0)
        model = models.TiedTransformer(vocab=48)
        engine = zero3.initialize(model=model, config=config(not skip_only, "bf16", 100.0))[0]
        if engine.optimizer.early is not None:
            engine.optimizer.early.after_computation = True  # every sub-group early: rank 1's all fail
        raised: list[str] = []
        unchanged = True
        for step, (x, y) in enumerate(data):
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            if skip_only and step == bad:
                continue
            failing = not skip_only and step == bad
            if failing and rank == 1:
                torch_optimizer = engine.optimizer.optimizer
                original = torch_optimizer.step

                def broken(*args: Any, **kwargs: Any) -> None:
                    original(*args, **kwargs)  # part-way: the masters, moments and step counts have changed
                    # Every early step of this backward fails, after updating; the step itself works. (Told
                    # apart by thread: an early step may still be running when the backward returns.)
                    if threading.current_thread().name.startswith("zero3-early-step"):
                        raise RuntimeError("injected: an early step failed")

                torch_optimizer.step = broken
            before = states(engine, model) if failing else None
            try:
                engine.backward(models.loss_of(engine(x, y), model))
                engine.step()
            except RuntimeError as error:
                raised.append(str(error))
                engine.zero_grad()
            finally:
                if failing and rank == 1:
                    torch_optimizer.step = original
            if before is not None:
                after = states(engine, model)
                unchanged = all(torch.equal(before[k], after[k]) for k in before)
        results[skip_only] = (states(engine, model), raised, unchanged)
        engine.destroy()
    skipped, (overlapped, raised, unchanged) = results[True][0], results[False]
    return {"raised": raised, "unchanged": unchanged,
            "differing": sorted(k for k in skipped if not torch.equal(skipped[k], overlapped[k]))}


def test_a_failed_early_step_is_every_ranks_failure_and_lands_nowhere() -> None:
    for out in run_ranks(2, failing_early_step):
        assert len(out["raised"]) == 1 and "injected: an early step failed" in out["raised"][0], out
        assert out["unchanged"], out
        assert out["differing"] == [], out


def test_super_offload_needs_the_host_tier() -> None:
    for zero, words in (({"offload_optimizer": {"device": "none", "super_offload": True}}, "needs offload_optimizer"),
                        ({"offload_optimizer": {"device": "cpu", "super_offload": True}, "lean_memory": True},
                         "use one or the other")):
        with pytest.raises(ConfigError, match=words):
            load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **zero}})
