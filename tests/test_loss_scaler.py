from __future__ import annotations

import pytest

from zero3.config import load_config
from zero3.step.loss_scaler import DynamicLossScaler, LossScaler, build_loss_scaler


def test_static_scaler_never_changes() -> None:
    scaler = LossScaler(128.0)
    assert scaler.dynamic is False
    for overflow in (True, True, False, True):
        scaler.update(overflow)
        assert scaler.loss_scale == 128.0
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.loss_scale == 128.0
    with pytest.raises(ValueError):
        LossScaler(0.0)


def test_scale_halves_after_hysteresis_overflows() -> None:
    scaler = DynamicLossScaler(initial_scale=1024.0, hysteresis=3)
    assert scaler.dynamic is True
    scaler.update(True)
    scaler.update(True)
    assert scaler.loss_scale == 1024.0  # two overflows absorbed by hysteresis
    scaler.update(True)
    assert scaler.loss_scale == 512.0
    # Budget exhausted: every further overflow halves until a window passes.
    scaler.update(True)
    assert scaler.loss_scale == 256.0


def test_hysteresis_one_halves_immediately() -> None:
    scaler = DynamicLossScaler(initial_scale=8.0, hysteresis=1)
    scaler.update(True)
    assert scaler.loss_scale == 4.0


def test_scale_never_below_min() -> None:
    scaler = DynamicLossScaler(initial_scale=8.0, hysteresis=1, min_scale=2.0)
    for _ in range(10):
        scaler.update(True)
    assert scaler.loss_scale == 2.0


def test_scale_doubles_after_clean_window() -> None:
    scaler = DynamicLossScaler(initial_scale=16.0, scale_window=4, hysteresis=2)
    for _ in range(3):
        scaler.update(False)
    assert scaler.loss_scale == 16.0
    scaler.update(False)  # fourth clean step completes the window
    assert scaler.loss_scale == 32.0
    for _ in range(4):
        scaler.update(False)
    assert scaler.loss_scale == 64.0


def test_window_restarts_after_overflow() -> None:
    scaler = DynamicLossScaler(initial_scale=16.0, scale_window=3, hysteresis=2)
    scaler.update(False)
    scaler.update(True)  # absorbed by hysteresis, but restarts the window
    assert scaler.loss_scale == 16.0
    scaler.update(False)
    scaler.update(False)
    assert scaler.loss_scale == 16.0
    scaler.update(False)  # three clean steps since the overflow
    assert scaler.loss_scale == 32.0


def test_growth_restores_hysteresis_budget() -> None:
    scaler = DynamicLossScaler(initial_scale=16.0, scale_window=2, hysteresis=2)
    scaler.update(True)  # budget 2 -> 1
    scaler.update(False)
    scaler.update(False)  # window done: scale up and budget back to 2
    assert scaler.loss_scale == 32.0
    scaler.update(True)
    assert scaler.loss_scale == 32.0  # absorbed again
    scaler.update(True)
    assert scaler.loss_scale == 16.0


def test_non_consecutive_overflows_accumulate_without_consecutive_hysteresis() -> None:
    scaler = DynamicLossScaler(initial_scale=16.0, scale_window=100, hysteresis=2)
    scaler.update(True)
    scaler.update(False)
    scaler.update(True)
    assert scaler.loss_scale == 8.0


def test_consecutive_hysteresis_resets_on_clean_step() -> None:
    scaler = DynamicLossScaler(initial_scale=16.0, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    for _ in range(5):
        scaler.update(True)
        scaler.update(False)
    assert scaler.loss_scale == 16.0  # never two overflows in a row
    scaler.update(True)
    scaler.update(True)
    assert scaler.loss_scale == 8.0


def test_state_dict_round_trip() -> None:
    a = DynamicLossScaler(initial_scale=64.0, scale_window=5, hysteresis=3)
    for overflow in (True, False, True, True, False, False):
        a.update(overflow)
    b = DynamicLossScaler(initial_scale=64.0, scale_window=5, hysteresis=3)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    sequence = (False, False, False, True, True, True, True, False) + (False,) * 12
    for overflow in sequence:
        a.update(overflow)
        b.update(overflow)
        assert b.loss_scale == a.loss_scale
    assert b.state_dict() == a.state_dict()


def test_dynamic_rejects_bad_args() -> None:
    with pytest.raises(ValueError):
        DynamicLossScaler(scale_window=0)
    with pytest.raises(ValueError):
        DynamicLossScaler(hysteresis=0)
    with pytest.raises(ValueError):
        DynamicLossScaler(scale_factor=1.0)


def test_build_loss_scaler_from_config() -> None:
    dynamic = build_loss_scaler(
        load_config(
            {"fp16": {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 7, "hysteresis": 4, "min_loss_scale": 0.25}}
        ).fp16
    )
    assert isinstance(dynamic, DynamicLossScaler)
    assert dynamic.loss_scale == 1024.0
    assert (dynamic.scale_window, dynamic.hysteresis, dynamic.min_scale) == (7, 4, 0.25)

    static = build_loss_scaler(load_config({"fp16": {"enabled": True, "loss_scale": 256}}).fp16)
    assert isinstance(static, LossScaler) and static.loss_scale == 256.0

    off = build_loss_scaler(load_config({"bf16": {"enabled": True}}).fp16)
    assert isinstance(off, LossScaler) and off.loss_scale == 1.0
