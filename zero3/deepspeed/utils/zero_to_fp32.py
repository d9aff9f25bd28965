"""`deepspeed.utils.zero_to_fp32`: a checkpoint's whole fp32 weights, offline (one process, no GPU).

For zero3's checkpoints (any world size), `zero3.checkpoint.export` reads each parameter whole from its
chunks; for DeepSpeed's own ZeRO-3 directories (pickles: `trust_checkpoint=True` is the opt-in),
`zero3.checkpoint.deepspeed_files` joins each master from the ranks' flat partitions, as DeepSpeed's own
script does.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from zero3.checkpoint import deepspeed_files
from zero3.checkpoint.export import export
from zero3.checkpoint.tags import CheckpointError
from zero3.checkpoint.weights import ShardedSafetensors, parse_size
from zero3.partition.sharded_param import sharded

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             trust_checkpoint: bool = False) -> dict[str, torch.Tensor]:
    """{name: fp32 tensor} of the checkpoint's parameters and persistent buffers (memory holds them all)."""
    if exclude_frozen_parameters:
        raise NotImplementedError("exclude_frozen_parameters=True: zero3's checkpoints do not mark frozen "
                                  "parameters apart; filter the returned dict by the model's requires_grad")
    if deepspeed_files.holds_deepspeed_tag(checkpoint_dir, tag):
        return deepspeed_files.whole_weights(_read_deepspeed(checkpoint_dir, tag, trust_checkpoint))
    with tempfile.TemporaryDirectory() as out:
        files = export(checkpoint_dir, out, dtype="fp32", tag=tag, trust_checkpoint=trust_checkpoint)
        state: dict[str, torch.Tensor] = {}
        for path in files:
            if path.suffix == ".safetensors":
                state.update(load_file(path))
    return state


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike[str],
                                         tag: str | None = None, trust_checkpoint: bool = False) -> nn.Module:
    """The checkpoint's fp32 weights loaded into `model` (`load_state_dict(strict=False)`), which is returned.
    A model no engine holds is moved to the CPU first, as DeepSpeed's does; an engine's model must have its
    parameters whole, inside `GatheredParameters(..., modifier_rank=...)` (what lasts is what that context
    keeps), and stays where it is."""
    released = [name for name, p in model.named_parameters() if sharded(p) is not None and p.numel() == 0]
    if released:
        named = ", ".join(released[:3]) + (", ..." if len(released) > 3 else "")
        raise ValueError(f"load_state_dict_from_zero_checkpoint: the model's parameters ({named}) are partitioned: "
                         "load into a model no engine holds, or inside zero3.GatheredParameters(model.parameters(), "
                         "modifier_rank=0), or resume the engine with engine.load_checkpoint")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, trust_checkpoint=trust_checkpoint)
    if not any(sharded(p) is not None for p in model.parameters()):
        model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str],
                                               output_dir: str | os.PathLike[str],
                                               max_shard_size: str | int = "5GB", safe_serialization: bool = True,
                                               tag: str | None = None, exclude_frozen_parameters: bool = False,
                                               trust_checkpoint: bool = False) -> list[Path]:
    """Write the checkpoint's fp32 weights under `output_dir` as safetensors (Hugging Face's sharded layout
    above `max_shard_size`); returns the files written."""
    if not safe_serialization:
        raise NotImplementedError("safe_serialization=False: zero3 writes weights as safetensors only "
                                  "(a pickle is code to whoever loads it)")
    if exclude_frozen_parameters:
        raise NotImplementedError("exclude_frozen_parameters=True: zero3's checkpoints do not mark frozen "
                                  "parameters apart")
    if deepspeed_files.holds_deepspeed_tag(checkpoint_dir, tag):
        state = _read_deepspeed(checkpoint_dir, tag, trust_checkpoint)
        writer = ShardedSafetensors(output_dir, "model.safetensors", parse_size(max_shard_size))
        for name, value in deepspeed_files.whole_weights(state).items():
            writer.add(name, value)
        return writer.close()
    return export(checkpoint_dir, output_dir, dtype="fp32", max_shard_bytes=parse_size(max_shard_size), tag=tag,
                  trust_checkpoint=trust_checkpoint)


def _read_deepspeed(checkpoint_dir: str | os.PathLike[str], tag: str | None,
                    trust_checkpoint: bool) -> deepspeed_files.DeepSpeedState:
    if not trust_checkpoint:
        raise CheckpointError(f"reading DeepSpeed checkpoint {str(checkpoint_dir)!r} refused: "
                              f"{deepspeed_files.TRUST_NEEDED}")
    return deepspeed_files.read(checkpoint_dir, tag, trusted=True)
