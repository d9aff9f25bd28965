"""The DeepSpeed-style config `zero3 train` builds from its options, merged with a --config file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from zero3.config import ConfigError


def build_config(args: argparse.Namespace) -> dict[str, Any]:
    """The DeepSpeed-style config the options describe."""
    if args.precision == "auto":
        args.precision = _default_precision(args.device)
    # A zero-length warmup would divide by zero in a WarmupLR-style schedule.
    warmup = max(1, min(100, args.steps // 10))
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": args.lr,
                "warmup_num_steps": warmup,
                "warmup_type": "linear",
            },
        },
        "bf16": {"enabled": args.precision == "bf16"},
        "fp16": {"enabled": args.precision == "fp16"},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": args.persistence_threshold,
        },
    }


def _default_precision(device_choice: str) -> str:
    """bf16, unless the ranks will compute on a CPU without bf16 units (said in one line)."""
    from zero3 import accelerator

    device = accelerator.resolve_device(None if device_choice == "auto" else device_choice)
    if device.type == "cuda" or accelerator.computes_bf16_natively(device):
        return "bf16"
    print(f"zero3 train: this CPU ({accelerator.cpu_capability()}) would emulate bf16 at about 170x the "
          "cost of fp32, so it trains in fp32 (--precision bf16 to insist)")
    return "fp32"


# Keys that only make sense together: a user file that sets one of a group takes
# the whole group, so "fp16": {"enabled": true} does not collide with our bf16, and
# a train_batch_size does not contradict our micro-batch and accumulation.
_OWNED_TOGETHER = (
    ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
    ("bf16", "fp16"),
)


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def merge_user_config(built: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    base = dict(built)
    for group in _OWNED_TOGETHER:
        if any(key in user for key in group):
            for key in group:
                base.pop(key, None)
    return _deep_merge(base, user)


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data
