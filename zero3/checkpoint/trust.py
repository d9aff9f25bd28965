"""Reading a checkpoint runs none of its code: every unpickling is weights-only or allowlisted.

[Note: what a checkpoint may name]
A pickle names the callables that rebuild its objects, and unpickling calls
them: a file that names `os.system` runs it. So no file of a checkpoint is
read with a plain unpickler:
* the engine file (`zero3_engine.pt`: counters, scheduler, loss scale,
  hyperparameters, the client state) is read by `torch.load(weights_only=True)`,
  which admits tensors and plain containers and whatever the user registered
  with `torch.serialization.add_safe_globals`;
* DCP's `.metadata` (torch's reader uses a plain `pickle.load`) is read by
  `CheckpointReader`, whose unpickler admits only the globals a DCP save
  writes (its metadata classes, `torch.Size`, dtypes, the layout and memory
  format lookups, a path);
* DCP's BYTE_IO entries (objects DCP would `torch.load(weights_only=False)`)
  are refused: zero3 saves none.
A file that names anything else raises `CheckpointError` naming the file and
the refused global, before any of it runs. `weights_only=False` (the user's
explicit word) reads the engine file as torch would without the guard.
"""

from __future__ import annotations

import io
import logging
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from zero3.checkpoint.tags import CheckpointError

log = logging.getLogger("zero3")

# What a DCP `.metadata` of a zero3 save names (checked against the files torch 2.13 writes).
_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided, ... by name
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or _is_dtype(module, name):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


class _Refused(pickle.UnpicklingError):
    def __init__(self, global_name: str) -> None:
        super().__init__(global_name)
        self.global_name = global_name


OPT_IN = "pass weights_only=False to load_checkpoint (zero3 export: --trust-checkpoint)"


def refusal(file: Path | str, global_name: str, opt_in: str = OPT_IN) -> CheckpointError:
    return CheckpointError(
        f"{str(file)!r} names {global_name}, which a checkpoint may not load by default (unpickling it could run "
        f"code). Nothing was loaded. If you trust this file, {opt_in}"
    )


class CheckpointReader(FileSystemReader):
    """torch's FileSystemReader, with `.metadata` read through the allowlist (see the Note) unless
    `trusted` (the user's explicit word)."""

    def __init__(self, path: str | Path, trusted: bool = False) -> None:
        super().__init__(path)
        self.trusted = trusted

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.trusted:
            return super().read_metadata(*args, **kwargs)
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            with open(path, "rb") as file:
                metadata = _MetadataUnpickler(file).load()
        except _Refused as refused:
            raise refusal(path, refused.global_name) from None
        except Exception as error:  # noqa: BLE001 - any failure to read it is a damaged file
            raise CheckpointError(f"{str(path)!r} cannot be read ({type(error).__name__}: {error})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{str(path)!r} is not DCP metadata (it holds a {type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_engine_file(file: Path, weights_only: bool = True) -> Any:
    """The engine file's contents: weights-only unless the caller trusts it (see the Note)."""
    if not weights_only:
        log.warning("loading %s with weights_only=False: any code it names will run", file)
        return torch.load(file, weights_only=False, map_location="cpu")
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        found = _GLOBAL.search(str(error))
        name = found.group(1) if found else "a global outside torch's weights-only allowlist"
        raise refusal(
            file, name, f"{OPT_IN}; or, for a class of your own, register it with "
            f"torch.serialization.add_safe_globals([{name.rsplit('.', 1)[-1]}])",
        ) from None


def load_engine_bytes(data: bytes) -> Any:
    """An engine state this process serialized itself (the async save's copy): still weights-only."""
    return torch.load(io.BytesIO(data), weights_only=True)
