"""`zero3 export`: a checkpoint's weights as safetensors, offline (one process, no GPU, no process group).

Each `model.<name>` tensor is read whole from the checkpoint's chunks (DCP
reassembles it, whatever world size saved it) one at a time, converted to
the asked dtype and handed to `ShardedSafetensors`, which writes a shard as
soon as the next tensor would overflow it: memory holds one shard's worth of
tensors, plus the one being read. The files are checked against their
checksums first.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zero3.checkpoint.planners import LoadPlanner
from zero3.checkpoint.state import read_engine_state
from zero3.checkpoint.trust import CheckpointReader
from zero3.checkpoint.tags import CheckpointError, damaged, resolve, saved_checksum
from zero3.checkpoint.weights import ShardedSafetensors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export(
    checkpoint_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str = "fp32",
    max_shard_bytes: int = 5 * 10**9, tag: str | None = None, filename: str = "model.safetensors",
    trust_checkpoint: bool = False,
) -> list[Path]:
    """Write the checkpoint's parameters (fp32 masters, or 16-bit values where there is no master) and
    persistent buffers; floating-point tensors in `dtype`. Every file is read weights-only or through
    the metadata allowlist unless `trust_checkpoint` (zero3.checkpoint.trust); nothing is written
    before the checkpoint has been read and checked."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    path = resolve(checkpoint_dir, tag)
    state = read_engine_state(path, weights_only=not trust_checkpoint)
    problems = damaged(path, state["files"], sorted(state["files"]), saved_checksum(state))
    if problems:
        raise CheckpointError(f"the checkpoint {str(path)!r} is damaged:\n  " + "\n  ".join(problems))
    saved = CheckpointReader(path, trusted=trust_checkpoint).read_metadata().state_dict_metadata
    writer = ShardedSafetensors(out_dir, filename, max_shard_bytes)
    names = [(f"model.{name}", name) for name in state["params"]]  # the model's own order
    names += [(f"buffer.{name}", name) for name in state.get("buffers", [])]
    for key, name in names:
        meta = saved.get(key)
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"{str(path)!r} has no tensor {key!r} (the engine file lists it)")
        whole = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ...": one process is the point
            dcp.load({key: whole}, storage_reader=CheckpointReader(path, trust_checkpoint), planner=LoadPlanner(),
                     no_dist=True)
        writer.add(name, whole.to(DTYPES[dtype]) if whole.is_floating_point() else whole)
        del whole
    return writer.close()
