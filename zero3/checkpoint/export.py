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
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zero3.checkpoint.state import read_engine_state
from zero3.checkpoint.tags import CheckpointError, damaged, resolve
from zero3.checkpoint.weights import ShardedSafetensors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export(
    checkpoint_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str = "fp32",
    max_shard_bytes: int = 5 * 10**9, tag: str | None = None, filename: str = "model.safetensors",
) -> list[Path]:
    """Write the checkpoint's parameters (fp32 masters, or 16-bit values where there is no master) and
    persistent buffers; floating-point tensors in `dtype`."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    path = resolve(checkpoint_dir, tag)
    state = read_engine_state(path)
    problems = damaged(path, state["files"], sorted(state["files"]))
    if problems:
        raise CheckpointError(f"the checkpoint {str(path)!r} is damaged:\n  " + "\n  ".join(problems))
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
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
            dcp.load({key: whole}, storage_reader=FileSystemReader(path), no_dist=True)
        writer.add(name, whole.to(DTYPES[dtype]) if whole.is_floating_point() else whole)
        del whole
    return writer.close()
