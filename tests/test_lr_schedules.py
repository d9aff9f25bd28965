"""DeepSpeed's five schedulers: the lr (and OneCycle's betas) every optimizer step runs with.

DeepSpeed's scheduler starts at iteration -1 and its engine steps it after each applied optimizer
step, so optimizer step n (from 1) runs with DeepSpeed's values at iteration n - 2. The `ds_*`
functions below are DeepSpeed's formulas written out in those terms, independently of
zero3.step.lr_schedules.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from zero3.config import ConfigError, load_config
from zero3.step.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
)

Scheduler = torch.optim.lr_scheduler.LRScheduler


def make_optimizer(*lrs: float, kind: type[torch.optim.Optimizer] = torch.optim.AdamW) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return kind(groups, lr=lrs[0])


def run(scheduler: Scheduler, steps: int) -> list[tuple[list[float], list[Any]]]:
    """(lrs, betas) of every group that optimizer steps 1..steps run with, stepped as the engine steps."""
    seen = []
    for _ in range(steps):
        groups = scheduler.optimizer.param_groups
        seen.append(([float(g["lr"]) for g in groups], [g.get("betas") for g in groups]))
        scheduler.optimizer.step()  # no grads: changes nothing, but keeps torch's order check quiet
        scheduler.step()
    return seen


def lrs_of(scheduler: Scheduler, steps: int) -> list[float]:
    return [lrs[0] for lrs, _ in run(scheduler, steps)]


# ---------------------------------------------------------- DeepSpeed's formulas


def ds_warmup_gamma(it: int, n: int, kind: str) -> float:
    return math.log(it + 1) / math.log(n) if kind == "log" else it / n


def ds_range_test(it: int, min_lr: float, size: int, rate: float, staircase: bool) -> float:
    interval = (it + 1) // size if staircase else (it + 1) / size
    return min_lr * (1 + rate * interval)


def ds_one_cycle(
    it: int, lo: float, hi: float, first: int, second: int | None = None, stairs: int = 0, decay_size: int = 0,
    lr_rate: float = 0.0, mom_lo: float = 0.8, mom_hi: float = 0.9, mom_rate: float = 0.0,
) -> tuple[float, float]:
    """(lr, momentum)."""
    if it == -1:
        return lo, mom_lo  # what the constructor writes
    second = first if second is None else second
    total = first + second
    if it < total:
        pos = (it + 1) % total
        if pos <= first:
            scale = pos / first if stairs <= 0 else math.floor(pos * stairs / first) / stairs
        else:
            scale = (total - pos) / second if stairs <= 0 else math.floor((total - pos) * stairs / second) / stairs
        return lo + (hi - lo) * scale, mom_hi - (mom_hi - mom_lo) * scale
    done = it - total + 1
    lr = lo / (1 + lr_rate * done / decay_size) if decay_size and lr_rate else lo
    mom = mom_hi * (1 + mom_rate * done / decay_size) if decay_size and mom_rate else mom_hi
    return lr, mom


def ds_warmup(it: int, lo: float, hi: float, n: int, kind: str, total: int | None = None) -> float:
    """WarmupLR (total None) and WarmupDecayLR."""
    n = max(2, n)
    if it < 0:
        return lo
    if it < n:
        gamma = ds_warmup_gamma(it, n, kind)
    elif total is None:
        gamma = 1.0
    else:
        gamma = max(0.0, (total - it) / max(1, total - n))
    return lo + (hi - lo) * gamma


def ds_cosine(it: int, base: float, total: int, min_ratio: float, n: int, cos_min: float, kind: str) -> float:
    n = max(2, n)
    if it < 0:
        return 0.0
    if it < n:
        return base * (min_ratio + (1 - min_ratio) * ds_warmup_gamma(it, n, kind))
    progress = min(1.0, (it - n + 1) / max(1, total - n))
    return base * max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


# Each case: its config section, and DeepSpeed's (lr, betas[0] or None) at iteration `it` for an
# AdamW whose lr is 1e-3.
CASES: dict[str, tuple[dict[str, Any], Callable[[int], tuple[float, float | None]]]] = {
    "LRRangeTest": (
        {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 5, "lr_range_test_step_rate": 2.0}},
        lambda it: (ds_range_test(it, 1e-3, 5, 2.0, False), None),
    ),
    "LRRangeTest-staircase": (
        {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 4,
                                           "lr_range_test_staircase": True}},
        lambda it: (ds_range_test(it, 1e-4, 4, 1.0, True), None),
    ),
    "OneCycle": (
        {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 5,
                                        "cycle_second_step_size": 7, "decay_step_size": 3, "decay_lr_rate": 0.5,
                                        "decay_mom_rate": 0.01}},
        lambda it: ds_one_cycle(it, 1e-4, 1e-3, 5, 7, decay_size=3, lr_rate=0.5, mom_rate=0.01),
    ),
    "OneCycle-stairs": (
        {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 6,
                                        "cycle_first_stair_count": 3, "cycle_min_mom": 0.85,
                                        "cycle_max_mom": 0.95}},
        lambda it: ds_one_cycle(it, 1e-4, 1e-3, 6, stairs=3, mom_lo=0.85, mom_hi=0.95),
    ),
    "WarmupLR": (
        {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3, "warmup_num_steps": 8}},
        lambda it: (ds_warmup(it, 1e-5, 2e-3, 8, "log"), None),
    ),
    "WarmupLR-linear-own-lr": (
        {"type": "WarmupLR", "params": {"warmup_num_steps": 6, "warmup_type": "linear"}},
        lambda it: (ds_warmup(it, 0.0, 1e-3, 6, "linear"), None),
    ),
    "WarmupDecayLR": (
        {"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_min_lr": 1e-5,
                                             "warmup_max_lr": 2e-3, "warmup_num_steps": 6}},
        lambda it: (ds_warmup(it, 1e-5, 2e-3, 6, "log", total=20), None),
    ),
    "WarmupDecayLR-linear": (
        {"type": "WarmupDecayLR", "params": {"total_num_steps": 15, "warmup_num_steps": 1,
                                             "warmup_type": "linear"}},
        lambda it: (ds_warmup(it, 0.0, 1e-3, 1, "linear", total=15), None),
    ),
    "WarmupCosineLR": (
        {"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_min_ratio": 0.1,
                                              "warmup_num_steps": 4}},
        lambda it: (ds_cosine(it, 1e-3, 20, 0.1, 4, 1e-4, "log"), None),
    ),
    "WarmupCosineLR-linear": (
        {"type": "WarmupCosineLR", "params": {"total_num_steps": 16, "warmup_num_steps": 5,
                                              "cos_min_ratio": 0.05, "warmup_type": "linear"}},
        lambda it: (ds_cosine(it, 1e-3, 16, 0.0, 5, 0.05, "linear"), None),
    ),
}
STEPS = 36  # past every case's warmup, cycle, decay and end


def build(section: dict[str, Any], optimizer: torch.optim.Optimizer) -> Scheduler:
    cfg = load_config({"scheduler": section})
    assert cfg.scheduler is not None
    return build_lr_scheduler(cfg.scheduler, optimizer)


@pytest.mark.parametrize("name", list(CASES))
def test_every_step_matches_deepspeeds_formulas(name: str) -> None:
    section, expected = CASES[name]
    seen = run(build(section, make_optimizer(1e-3)), STEPS)
    for n, (lrs, betas) in enumerate(seen, start=1):
        lr, momentum = expected(n - 2)
        assert lrs[0] == pytest.approx(lr, rel=1e-12, abs=1e-18), f"optimizer step {n}"
        if momentum is None:
            assert betas[0] == (0.9, 0.999), f"optimizer step {n}"  # the optimizer's own, untouched
        else:
            assert betas[0] == (pytest.approx(momentum, rel=1e-12), 0.99), f"optimizer step {n}"


def test_hand_values_of_the_first_steps() -> None:
    # The example: under DeepSpeed the first step runs at lr 0, the second at 1e-4.
    cosine = WarmupCosineLR(make_optimizer(1e-3), total_num_steps=10, warmup_min_ratio=0.1, warmup_num_steps=4)
    assert lrs_of(cosine, 6) == pytest.approx(
        [0.0, 1e-4, 5.5e-4, 1e-3 * (0.1 + 0.9 * math.log(3) / math.log(4)), 1e-3,
         1e-3 * (1e-4 + (1 - 1e-4) * (1 + math.cos(math.pi / 6)) / 2)], rel=1e-12)
    # WarmupLR's first two steps both run at warmup_min_lr.
    warmup = WarmupLR(make_optimizer(1.0), warmup_min_lr=0.2, warmup_max_lr=1.0, warmup_num_steps=4,
                      warmup_type="linear")
    assert lrs_of(warmup, 7) == pytest.approx([0.2, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    decay = WarmupDecayLR(make_optimizer(1.0), total_num_steps=6, warmup_min_lr=0.0, warmup_max_lr=1.0,
                          warmup_num_steps=2, warmup_type="linear")
    assert lrs_of(decay, 10) == pytest.approx([0.0, 0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0])
    range_test = LRRangeTest(make_optimizer(1.0), lr_range_test_min_lr=0.1, lr_range_test_step_size=2)
    assert lrs_of(range_test, 5) == pytest.approx([0.1, 0.15, 0.2, 0.25, 0.3])
    cycle = OneCycle(make_optimizer(1.0), cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=2)
    seen = run(cycle, 6)
    assert [lrs[0] for lrs, _ in seen] == pytest.approx([0.1, 0.3, 0.5, 0.3, 0.1, 0.1])
    # The momentum starts at cycle_min_mom, then runs against the lr from cycle_max_mom.
    assert [betas[0] for _, betas in seen] == [(0.8, 0.99), (pytest.approx(0.85), 0.99), (0.8, 0.99),
                                               (pytest.approx(0.85), 0.99), (0.9, 0.99), (0.9, 0.99)]


def test_one_cycle_leaves_an_optimizer_without_betas_alone(caplog: pytest.LogCaptureFixture) -> None:
    optimizer = make_optimizer(1.0, kind=torch.optim.SGD)
    optimizer.param_groups[0]["momentum"] = 0.5
    scheduler = OneCycle(optimizer, cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=2)
    assert "no betas" in caplog.text  # as DeepSpeed: a warning, and no momentum schedule
    assert lrs_of(scheduler, 3) == pytest.approx([0.1, 0.3, 0.5])
    assert optimizer.param_groups[0]["momentum"] == 0.5 and "betas" not in optimizer.param_groups[0]


def test_per_group_values() -> None:
    optimizer = make_optimizer(1.0, 2.0)
    scheduler = WarmupLR(optimizer, warmup_min_lr=[0.1, 0.2], warmup_num_steps=2, warmup_type="linear")
    assert [lrs for lrs, _ in run(scheduler, 4)] == [[0.1, 0.2], [0.1, 0.2], pytest.approx([0.55, 1.1]), [1.0, 2.0]]
    cosine = WarmupCosineLR(make_optimizer(0.1, 0.02), total_num_steps=4, warmup_num_steps=2,
                            warmup_type="linear", cos_min_ratio=0.0)
    seen = [lrs for lrs, _ in run(cosine, 4)]
    assert seen[1:] == [[0.0, 0.0], pytest.approx([0.05, 0.01]), pytest.approx([0.05, 0.01])]
    with pytest.raises(ValueError, match="cycle_max_lr: expected one value per param group"):
        OneCycle(make_optimizer(1.0, 2.0), cycle_min_lr=0.1, cycle_max_lr=[0.5])


@pytest.mark.parametrize("name", ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_deepspeeds_own_classes_agree(name: str) -> None:
    schedules = pytest.importorskip(
        "deepspeed.runtime.lr_schedules", reason="deepspeed is not installed (it is not a zero3 dependency)"
    )
    section, _ = CASES[name]
    ours_optimizer, theirs_optimizer = make_optimizer(1e-3), make_optimizer(1e-3)
    ours = build(section, ours_optimizer)
    theirs = getattr(schedules, name)(theirs_optimizer, **section["params"])
    for n in range(1, STEPS + 1):
        for mine, deepspeed in zip(ours_optimizer.param_groups, theirs_optimizer.param_groups):
            assert (mine["lr"], mine["betas"]) == (deepspeed["lr"], deepspeed["betas"]), f"optimizer step {n}"
        ours_optimizer.step()
        ours.step()
        theirs.step()
    assert ours.last_batch_iteration == theirs.last_batch_iteration  # type: ignore[attr-defined]


# ---------------------------------------------------------- state and engine


@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_round_trip_continues_identically(name: str) -> None:
    section, _ = CASES[name]
    optimizer_a = make_optimizer(1e-3)
    scheduler_a = build(section, optimizer_a)
    run(scheduler_a, 7)
    buffer = io.BytesIO()
    torch.save(scheduler_a.state_dict(), buffer)  # as checkpoints keep it: loadable weights-only
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    optimizer_b = make_optimizer(5e-2)  # another lr: the state decides, not the fresh optimizer
    scheduler_b = build(section, optimizer_b)
    scheduler_b.load_state_dict(state)
    assert scheduler_b.last_epoch == 7 and scheduler_b.get_last_lr() == scheduler_a.get_last_lr()
    assert run(scheduler_b, 20) == run(scheduler_a, 20)


def engine_lrs(rank: int, world: int, sections: dict[str, dict[str, Any]], steps: int) -> dict[str, Any]:
    import zero3
    from tests import models

    out: dict[str, Any] = {}
    data = models.batches("x8", steps, 4)
    for name, section in sections.items():
        torch.manual_seed(0)
        model = models.MLP()
        config = {"train_micro_batch_size_per_gpu": 4,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
                  "zero_optimization": {"stage": 3}, "scheduler": section}
        engine, _, _, scheduler = zero3.initialize(model=model, model_parameters=model.parameters(), config=config)
        seen = []
        for x, y in data:
            seen.append((engine.get_lr(), [g["betas"] for g in engine.optimizer.param_groups]))
            engine.backward(engine(x, y))
            engine.step()
        out[name] = {"seen": seen, "iteration": scheduler.last_batch_iteration}
        engine.destroy()
    return out


def test_the_engine_runs_each_step_at_deepspeeds_lr() -> None:
    from tests.distributed import run_ranks

    steps = 14
    names = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    result = run_ranks(1, engine_lrs, {name: CASES[name][0] for name in names}, steps)[0]
    for name in names:
        _, expected = CASES[name]
        assert result[name]["iteration"] == steps - 1  # one scheduler step per optimizer step, from -1
        for n, (lrs, betas) in enumerate(result[name]["seen"], start=1):
            lr, momentum = expected(n - 2)
            assert lrs == [pytest.approx(lr, rel=1e-12, abs=1e-18)] * len(lrs), f"{name}, optimizer step {n}"
            if momentum is not None:
                assert betas == [(pytest.approx(momentum, rel=1e-12), 0.99)] * len(betas), f"{name}, step {n}"


# ----------------------------------------------------------------------- config


def error_of(section: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({"scheduler": section})
    return str(info.value)


def test_deepspeeds_defaults() -> None:
    def params(section: dict[str, Any]) -> dict[str, Any]:
        cfg = load_config({"scheduler": section})
        assert cfg.scheduler is not None
        return cfg.scheduler.params.model_dump()

    assert params({"type": "LRRangeTest"}) == {
        "lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False}
    assert params({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}) == {
        "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
        "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
        "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0}
    assert params({"type": "WarmupLR"}) == {
        "warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"}
    assert params({"type": "WarmupDecayLR", "params": {"total_num_steps": 5000}}) == {
        "total_num_steps": 5000, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
        "warmup_type": "log"}
    assert params({"type": "WarmupCosineLR", "params": {"total_num_steps": 5000}}) == {
        "total_num_steps": 5000, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001,
        "warmup_type": "log"}


def test_bad_values_name_their_key() -> None:
    message = error_of({"type": "OneCycle"})
    assert "scheduler.params.cycle_min_lr: required" in message
    assert "scheduler.params.cycle_max_lr: required" in message
    message = error_of({"type": "OneCycle", "params": {
        "cycle_min_lr": -1e-4, "cycle_max_lr": [1e-3, "x"], "cycle_first_step_size": 0, "cycle_max_mom": 1.0}})
    assert "scheduler.params.cycle_min_lr: expected a number >= 0 (got -0.0001)" in message
    assert "scheduler.params.cycle_max_lr: expected a number, or a list" in message
    assert "scheduler.params.cycle_first_step_size" in message and "(got 0)" in message
    assert "scheduler.params.cycle_max_mom: expected a number in [0, 1) (got 1.0)" in message
    message = error_of({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0,
                                                          "lr_range_test_staircase": "yes"}})
    assert "scheduler.params.lr_range_test_step_size" in message
    assert "scheduler.params.lr_range_test_staircase" in message
    message = error_of({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}})
    assert "scheduler.params.total_num_steps: required" in message
    message = error_of({"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 20}})
    assert "scheduler.params.warmup_num_steps: must not exceed total_num_steps (10) (got 20)" in message
    # A warmup of 0 steps: refused as DeepSpeed (0.19.3 on) refuses it.
    message = error_of({"type": "WarmupLR", "params": {"warmup_num_steps": 0}})
    assert "scheduler.params.warmup_num_steps" in message and "(got 0)" in message
    message = error_of({"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "cos_min_ratio": 0.1}})
    assert "scheduler.params.cos_min_ratio: unknown key" in message
    message = error_of({"type": "WarmupDecay"})
    assert "scheduler.type: expected one of" in message
    for name in ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        assert f"'{name}'" in message


def test_schedulers_refuse_bad_arguments() -> None:
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(make_optimizer(1.0), warmup_type="exp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupLR(make_optimizer(1.0), warmup_num_steps=0)
    with pytest.raises(ValueError, match="must not exceed"):
        WarmupDecayLR(make_optimizer(1.0), total_num_steps=5, warmup_num_steps=6)
    with pytest.raises(ValueError, match="total_num_steps"):
        WarmupCosineLR(make_optimizer(1.0), total_num_steps=0, warmup_num_steps=1)
    with pytest.raises(ValueError, match="cycle_first_step_size"):
        OneCycle(make_optimizer(1.0), cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=0)
    with pytest.raises(ValueError, match="lr_range_test_step_size"):
        LRRangeTest(make_optimizer(1.0), lr_range_test_step_size=0)


# ------------------------------------------------------------ Hugging Face "auto"


@pytest.mark.parametrize(("warmup_steps", "expected_warmup"), [(0.1, 10), (0, 1)])
def test_hugging_face_auto_values_fill_warmup_decay(warmup_steps: float, expected_warmup: int, tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    from zero3.integrations.hf_config import fill_from_training_arguments

    args = transformers.TrainingArguments(output_dir=str(tmp_path), learning_rate=3e-4, warmup_steps=warmup_steps,
                                          max_steps=100, report_to=[], use_cpu=True)
    config = {"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": "auto", "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}}
    early = fill_from_training_arguments(config, args, world_size=1)  # steps not known yet: left "auto"
    assert early["scheduler"]["params"] == {
        "total_num_steps": "auto", "warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": "auto"}
    filled = fill_from_training_arguments(config, args, world_size=1, num_training_steps=100)
    # As transformers fills them: the step counts once known, and a warmup of at least 1 step.
    assert filled["scheduler"]["params"] == {
        "total_num_steps": 100, "warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": expected_warmup}
    scheduler = build(filled["scheduler"], make_optimizer(1.0))
    assert isinstance(scheduler, WarmupDecayLR)
    assert lrs_of(scheduler, 3)[:2] == [0.0, 0.0]
    written = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_max_lr": 1e-3}}}
    with pytest.raises(ValueError, match="total_num_steps=50") as info:
        fill_from_training_arguments(written, args, world_size=1, num_training_steps=100)
    assert "warmup_max_lr=0.001 but TrainingArguments.learning_rate=0.0003" in str(info.value)
