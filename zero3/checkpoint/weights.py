"""Consolidated weights users can take away: safetensors files, sharded in Hugging Face's layout when large.

Both ways out use `ShardedSafetensors`: `engine.save_16bit_model` from a live
engine (streamed by `engine.iter_full_params`, one parameter gathered at a
time; rank 0 writes) and `zero3 export` from a checkpoint (one process, one
shard's worth of tensors in memory at most).
Each parameter is written once under one name: a tied weight under its
first name, which `safetensors.torch.load_model` maps back onto every name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from zero3.checkpoint.state import persistent_buffers

INDEX_SUFFIX = ".index.json"
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes (Hugging Face's max_shard_size spelling)."""
    if isinstance(text, int):
        value = text
    else:
        cleaned = text.strip().upper().replace(" ", "")
        unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if cleaned.endswith(u)), "B")
        number = cleaned[: len(cleaned) - len(unit)] if cleaned.endswith(unit) else cleaned
        try:
            value = int(float(number) * _UNITS[unit])
        except ValueError:
            raise ValueError(f"max shard size {text!r}: expected a size such as '5GB', '500MB' or 1000000") from None
    if value <= 0:
        raise ValueError(f"max shard size {text!r}: expected a positive size")
    return value


class ShardedSafetensors:
    """Writes tensors into `filename`, or, past `max_shard_bytes`, into HF-style shards plus an index.

    A shard is written as soon as the next tensor would overflow it, so memory holds one shard's
    tensors at most. Shards get their final names (`model-00001-of-00003.safetensors`) at `close()`.
    """

    def __init__(self, out_dir: str | os.PathLike[str], filename: str, max_shard_bytes: int) -> None:
        if not filename.endswith(".safetensors"):
            raise ValueError(f"weights file name {filename!r}: expected a name ending in .safetensors")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.filename = filename
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out_dir / f".{self.filename}.part{len(self._written) + 1}"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Final names for the written files (one file, or shards and the index); returns them."""
        if self._pending or not self._written:
            self._flush()
        if len(self._written) == 1:
            final = self.out_dir / self.filename
            os.replace(self._written[0][0], final)
            return [final]
        stem = self.filename[: -len(".safetensors")]
        count = len(self._written)
        weight_map: dict[str, str] = {}
        finals = []
        for number, (path, names) in enumerate(self._written, start=1):
            final = self.out_dir / f"{stem}-{number:05d}-of-{count:05d}.safetensors"
            os.replace(path, final)
            finals.append(final)
            weight_map.update({name: final.name for name in names})
        index = self.out_dir / f"{self.filename}{INDEX_SUFFIX}"
        index.write_text(json.dumps({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, indent=2))
        return finals + [index]


class TorchStateDictFile:
    """DeepSpeed's format for a name that is not `.safetensors` (its default `pytorch_model.bin`): one
    `torch.save` of the whole state dict, written under a temporary name and then renamed."""

    def __init__(self, out_dir: str | os.PathLike[str], filename: str) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.filename = filename
        self._tensors: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._tensors[name] = tensor.detach().to("cpu").contiguous()

    def close(self) -> list[Path]:
        final = self.out_dir / self.filename
        partial = self.out_dir / f".{self.filename}.part"
        torch.save(self._tensors, partial)
        os.replace(partial, final)
        return [final]


def check_weights_name(filename: str) -> None:
    """A weights file name, checked on every rank before anything is gathered."""
    if not isinstance(filename, str) or not filename or "/" in filename or filename in (".", ".."):
        raise ValueError(f"weights file name {filename!r}: expected a file name (no directory)")


def consolidated_state_dict(
    rank: int, module: torch.nn.Module, stream: Callable[[list[str] | None], Iterable[tuple[str, torch.Tensor]]],
    exclude_frozen_parameters: bool,
) -> dict[str, torch.Tensor] | None:
    """The whole state dict, parameters then buffers in `module.state_dict()`'s order, on rank 0 (None on the
    others): every parameter gathered one at a time by `stream(names)` (collective) and copied there. A tied
    weight is one tensor under each of its names, as `load_state_dict` wants."""
    names = None
    if exclude_frozen_parameters:
        names = [name for name, param in module.named_parameters() if param.requires_grad]
    whole: dict[str, torch.Tensor] = {}
    for name, tensor in stream(names):
        if rank == 0:
            whole[name] = tensor.detach().to("cpu", copy=True)
    if rank != 0:
        return None
    first_name: dict[int, str] = {}
    state: dict[str, torch.Tensor] = {}
    parameter_names = dict(module.named_parameters(remove_duplicate=False))
    buffers = persistent_buffers(module)
    for name in module.state_dict():
        if name in parameter_names:
            first = first_name.setdefault(id(parameter_names[name]), name)
            if first in whole:
                state[name] = whole[first]
        elif name in buffers:
            state[name] = buffers[name].detach().to("cpu", copy=True)
    return state


def save_live(
    rank: int, module: torch.nn.Module, stream: Callable[[list[str] | None], Iterable[tuple[str, torch.Tensor]]],
    save_dir: str | os.PathLike[str], filename: str, max_shard_bytes: int, exclude_frozen_parameters: bool,
) -> tuple[list[Path], Exception | None]:
    """Write the whole parameters that `stream(names)` yields (an engine's `iter_full_params`: one gathered
    at a time, collective); rank 0 writes each once (a tied weight under its first name), then the buffers:
    safetensors for a `.safetensors` name, DeepSpeed's torch.save state dict otherwise. A write that fails
    on rank 0 does not stop the stream (the other ranks are in it): it is returned, for every rank to raise."""
    check_weights_name(filename)
    names = None
    if exclude_frozen_parameters:
        names = [name for name, param in module.named_parameters() if param.requires_grad]
    failure: Exception | None = None
    writer: ShardedSafetensors | TorchStateDictFile | None = None
    if rank == 0:
        try:
            writer = (ShardedSafetensors(save_dir, filename, max_shard_bytes) if filename.endswith(".safetensors")
                      else TorchStateDictFile(save_dir, filename))
        except Exception as error:  # noqa: BLE001 - returned, for every rank to raise
            failure = error
    for name, tensor in stream(names):
        if writer is not None and failure is None:
            try:
                # Kept past the next item, so copied (moving it to the host copies a device tensor already).
                writer.add(name, tensor.clone() if tensor.device.type == "cpu" else tensor)
            except Exception as error:  # noqa: BLE001 - returned, for every rank to raise
                failure = error
    if writer is None or failure is not None:
        return [], failure
    try:
        for name, value in persistent_buffers(module).items():  # never partitioned: whole on every rank
            writer.add(name, value)
        return writer.close(), None
    except Exception as error:  # noqa: BLE001 - returned, for every rank to raise
        return [], error
