from __future__ import annotations

import math

import pytest
import torch

from zero3.config import load_config
from zero3.runtime.lr_schedules import WarmupCosineLR, WarmupLR, build_lr_scheduler


def make_optimizer(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def advance(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> None:
    for _ in range(steps):
        # optimizer first, as torch expects (no grads, so it changes nothing)
        scheduler.optimizer.step()
        scheduler.step()


def group_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in optimizer.param_groups]


# ------------------------------------------------------------------ WarmupLR


def warmup_lr_formula(s: int, lo: float, hi: float, n: int, kind: str) -> float:
    if s >= n:
        return hi
    gamma = math.log(s + 1) / math.log(n) if kind == "log" else s / n
    return lo + (hi - lo) * gamma


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_matches_formula(kind: str) -> None:
    opt = make_optimizer(0.5, 0.7)  # the groups' own lrs are replaced
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type=kind)
    taken = 0
    for target in (0, 1, 3, 9, 10, 11, 25):
        advance(sched, target - taken)
        taken = target
        expected = warmup_lr_formula(target, 0.01, 0.1, 10, kind)
        assert group_lrs(opt) == pytest.approx([expected, expected], rel=1e-12)
        assert sched.get_last_lr() == pytest.approx([expected, expected], rel=1e-12)


def test_warmup_lr_hand_values() -> None:
    opt = make_optimizer(1.0)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=100, warmup_type="log")
    assert group_lrs(opt) == [0.0]  # log(1) = 0 at step 0
    advance(sched, 9)
    assert group_lrs(opt)[0] == pytest.approx(0.5)  # log(10) / log(100)
    advance(sched, 91)
    assert group_lrs(opt)[0] == 1.0

    opt = make_optimizer(1.0)
    sched = WarmupLR(opt, warmup_min_lr=0.2, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    values = [group_lrs(opt)[0]]
    for _ in range(5):
        advance(sched, 1)
        values.append(group_lrs(opt)[0])
    assert values == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])


def test_warmup_lr_single_step_log_warmup() -> None:
    opt = make_optimizer(1.0)
    WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.3, warmup_num_steps=1, warmup_type="log")
    assert group_lrs(opt) == [pytest.approx(0.3)]


def test_warmup_lr_zero_warmup_is_max() -> None:
    opt = make_optimizer(1.0)
    WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.3, warmup_num_steps=0)
    assert group_lrs(opt) == [0.3]


def test_warmup_lr_rejects_bad_args() -> None:
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(make_optimizer(1.0), warmup_type="exp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupLR(make_optimizer(1.0), warmup_num_steps=-1)


# ------------------------------------------------------------ WarmupCosineLR


def cosine_ratio_formula(s: int, total: int, min_ratio: float, n: int, cos_min: float, kind: str) -> float:
    if s < n:
        gamma = math.log(s + 1) / math.log(n) if kind == "log" else s / n
        return min_ratio + (1 - min_ratio) * gamma
    progress = min(max((s - n) / (total - n), 0.0), 1.0)
    return cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_matches_formula(kind: str) -> None:
    opt = make_optimizer(0.1, 0.02)
    sched = WarmupCosineLR(
        opt, total_num_steps=50, warmup_min_ratio=0.1, warmup_num_steps=10, cos_min_ratio=0.05, warmup_type=kind
    )
    taken = 0
    for target in (0, 1, 5, 9, 10, 11, 30, 49, 50, 51, 80):
        advance(sched, target - taken)
        taken = target
        ratio = cosine_ratio_formula(target, 50, 0.1, 10, 0.05, kind)
        assert group_lrs(opt) == pytest.approx([0.1 * ratio, 0.02 * ratio], rel=1e-12)
    # Past the end it stays at the floor.
    assert group_lrs(opt) == pytest.approx([0.1 * 0.05, 0.02 * 0.05])


def test_warmup_cosine_hand_values() -> None:
    opt = make_optimizer(1.0)
    sched = WarmupCosineLR(
        opt, total_num_steps=20, warmup_min_ratio=0.0, warmup_num_steps=10, cos_min_ratio=0.0, warmup_type="linear"
    )
    assert group_lrs(opt) == [0.0]
    advance(sched, 5)
    assert group_lrs(opt)[0] == pytest.approx(0.5)
    advance(sched, 5)  # end of warmup: full lr
    assert group_lrs(opt)[0] == pytest.approx(1.0)
    advance(sched, 5)  # halfway through the cosine
    assert group_lrs(opt)[0] == pytest.approx(0.5)
    advance(sched, 5)
    assert group_lrs(opt)[0] == pytest.approx(0.0, abs=1e-15)


def test_warmup_cosine_warmup_equal_total() -> None:
    opt = make_optimizer(1.0)
    sched = WarmupCosineLR(opt, total_num_steps=4, warmup_num_steps=4, cos_min_ratio=0.1, warmup_type="linear")
    advance(sched, 3)
    assert group_lrs(opt)[0] == pytest.approx(0.75)
    advance(sched, 1)
    assert group_lrs(opt)[0] == pytest.approx(0.1)


def test_warmup_cosine_rejects_bad_args() -> None:
    with pytest.raises(ValueError, match="must not exceed"):
        WarmupCosineLR(make_optimizer(1.0), total_num_steps=5, warmup_num_steps=6)
    with pytest.raises(ValueError, match="total_num_steps"):
        WarmupCosineLR(make_optimizer(1.0), total_num_steps=0, warmup_num_steps=0)


# ------------------------------------------------------------ state and build


@pytest.mark.parametrize("cls", ["WarmupLR", "WarmupCosineLR"])
def test_state_dict_round_trip(cls: str) -> None:
    def build(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        if cls == "WarmupLR":
            return WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=20)
        return WarmupCosineLR(opt, total_num_steps=40, warmup_num_steps=10)

    opt_a = make_optimizer(0.1)
    sched_a = build(opt_a)
    advance(sched_a, 15)
    state = sched_a.state_dict()

    opt_b = make_optimizer(0.1)
    sched_b = build(opt_b)
    sched_b.load_state_dict(state)
    assert sched_b.last_epoch == 15
    advance(sched_a, 7)
    advance(sched_b, 7)
    assert group_lrs(opt_b) == group_lrs(opt_a)
    assert sched_b.get_last_lr() == sched_a.get_last_lr()


def test_build_from_config() -> None:
    cfg = load_config(
        {
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.2, "warmup_num_steps": 4, "warmup_type": "linear"},
            }
        }
    )
    assert cfg.scheduler is not None
    opt = make_optimizer(1.0)
    sched = build_lr_scheduler(cfg.scheduler, opt)
    assert isinstance(sched, WarmupLR)
    advance(sched, 2)
    assert group_lrs(opt)[0] == pytest.approx(0.1)

    cfg = load_config(
        {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 30, "warmup_num_steps": 10}}}
    )
    assert cfg.scheduler is not None
    opt = make_optimizer(0.4)
    sched = build_lr_scheduler(cfg.scheduler, opt)
    assert isinstance(sched, WarmupCosineLR)
    assert (sched.total_num_steps, sched.warmup_num_steps, sched.cos_min_ratio, sched.warmup_type) == (
        30,
        10,
        0.0001,
        "log",
    )
    advance(sched, 20)
    expected = 0.4 * cosine_ratio_formula(20, 30, 0.0, 10, 0.0001, "log")
    assert group_lrs(opt)[0] == pytest.approx(expected)
