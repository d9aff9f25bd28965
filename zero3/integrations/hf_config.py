"""Hugging Face's DeepSpeed config template, filled from `TrainingArguments` as its integration fills it.

The template (transformers' docs, `ds_config_zero3.json`) writes `"auto"` for
what the Trainer already knows. Each `"auto"` gets the value Hugging Face's
DeepSpeed integration gives it; a value written out must agree with the
Trainer's argument (as there: one error lists every disagreement), so the
config and `TrainingArguments` cannot say two things. What the config
leaves "auto" and no rule here fills reaches `zero3.load_config`, which
names the key.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from zero3.config import read_config_file

AUTO = "auto"


def read_zero3_config(zero3_config: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """A zero3 config given as a dict, or the JSON file a path names."""
    if isinstance(zero3_config, dict):
        return zero3_config
    if isinstance(zero3_config, (str, os.PathLike)):
        return read_config_file(zero3_config)
    raise TypeError(f"zero3_config must be a dict or a path to a JSON file, got {type(zero3_config).__name__}")


def _lookup(config: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    """The dict holding `dotted`'s last key (None if a section on the way is absent), and that key."""
    *sections, key = dotted.split(".")
    node: Any = config
    for section in sections:
        node = node.get(section) if isinstance(node, dict) else None
        if node is None:
            return None, key
    return (node if isinstance(node, dict) else None), key


class _Filler:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.mismatches: list[str] = []

    def match(self, dotted: str, value: Any, argument: str) -> None:
        """Fill an "auto"; a written value must equal the Trainer's `argument`."""
        node, key = _lookup(self.config, dotted)
        if node is None or key not in node:
            return
        if node[key] == AUTO:
            node[key] = value
        elif not _same(node[key], value):
            self.mismatches.append(f"{dotted}={node[key]!r} but TrainingArguments.{argument}={value!r}")

    def only(self, dotted: str, value: Any) -> None:
        """Fill an "auto"; a written value is kept (the Trainer has no argument for it)."""
        node, key = _lookup(self.config, dotted)
        if node is not None and node.get(key) == AUTO:
            node[key] = value


def _same(written: Any, value: Any) -> bool:
    if isinstance(written, (list, tuple)) and isinstance(value, (list, tuple)):
        return len(written) == len(value) and all(_same(a, b) for a, b in zip(written, value))
    if isinstance(written, bool) or isinstance(value, bool):
        return written is value
    if isinstance(written, (int, float)) and isinstance(value, (int, float)):
        return float(written) == float(value)
    return written == value


def hidden_size_of(model: Any) -> int | None:
    """The model config's hidden size (`hidden_size`, or the largest of `hidden_sizes`), if it has one."""
    model_config = getattr(model, "config", None)
    if model_config is None:
        return None
    if getattr(model_config, "hidden_size", None) is not None:
        return int(model_config.hidden_size)
    sizes = getattr(model_config, "hidden_sizes", None)
    return int(max(sizes)) if sizes else None


def fill_from_training_arguments(
    config: dict[str, Any], args: Any, world_size: int, model: Any = None, num_training_steps: int | None = None,
) -> dict[str, Any]:
    """A copy of DeepSpeed-format `config` with its "auto" values filled from `args` (a TrainingArguments),
    the world size, the model's hidden size and, once known, the number of training steps (left "auto"
    while None). Raises ValueError listing every value that disagrees with `args`."""
    filled = copy.deepcopy(config)
    fill = _Filler(filled)
    micro = args.per_device_train_batch_size
    accumulation = args.gradient_accumulation_steps
    fill.match("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    fill.match("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    fill.match("train_batch_size", world_size * micro * accumulation,
               "per_device_train_batch_size * gradient_accumulation_steps * world size")
    fill.match("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    fill.match("optimizer.params.lr", args.learning_rate, "learning_rate")
    fill.match("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1, adam_beta2")
    fill.match("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    fill.match("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    fill.only("scheduler.params.warmup_min_lr", 0)
    fill.match("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    fill.match("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16")
    fill.match("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16")
    if "bf16" not in filled and "fp16" not in filled and (args.bf16 or args.fp16):
        # A config silent on precision follows the arguments, as accelerate's DeepSpeed plugin makes it.
        filled["bf16" if args.bf16 else "fp16"] = {"enabled": True}
    hidden = hidden_size_of(model)
    if hidden is not None:
        fill.only("zero_optimization.reduce_bucket_size", hidden * hidden)
        fill.only("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
        fill.only("zero_optimization.stage3_param_persistence_threshold", 10 * hidden)
    if num_training_steps is not None:
        fill.match("scheduler.params.total_num_steps", num_training_steps, "max_steps (as computed)")
        # At least 1, as transformers fills it: DeepSpeed (0.19.3 on) and zero3 refuse a warmup of 0 steps,
        # and 1 or 0 gave the same (2-step) warmup where 0 was accepted.
        fill.match("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)),
                   "warmup_steps (as computed)")
    if fill.mismatches:
        raise ValueError(
            "the zero3 config disagrees with the TrainingArguments (write \"auto\" or the same value): "
            + "; ".join(fill.mismatches)
        )
    return filled
