"""Reading a checkpoint runs none of its code: every unpickling is weights-only or allowlisted.

[Note: what a checkpoint may name]
A pickle names the callables that rebuild its objects, and unpickling calls
them: a file that names `os.system` runs it. So no file of a checkpoint is
read with a plain unpickler:
* the engine file (`zero3_engine.pt`: counters, scheduler, loss scale,
  hyperparameters, the client state) is read by `torch.load(weights_only=True)`,
  which admits tensors and plain containers and whatever the user registered
  with `torch.serialization.add_safe_globals`; where it holds only plain
  dense tensors, containers, numbers and strings (as it usually does), the
  tensor items' unpickler below reads it first, admitting less, at the C
  unpickler's speed;
* DCP's `.metadata` (torch's reader uses a plain `pickle.load`) is read by
  `CheckpointReader`, whose unpickler admits only the globals a DCP save
  writes (its metadata classes, `torch.Size`, dtypes, the layout and memory
  format lookups, a path);
* DCP's tensor items (each a `torch.save` of one tensor) are read by
  `VerifiedReader`: the plain dense tensor zero3 saves through an unpickler
  that admits only `_rebuild_tensor_v2`, the typed storages and
  `OrderedDict` (the tensor a view of the mapped file), anything else by
  `torch.load(weights_only=True)`;
* DCP's BYTE_IO entries (objects DCP would `torch.load(weights_only=False)`)
  are refused: zero3 saves none.
A file that names anything else raises `CheckpointError` naming the file and
the refused global, before any of it runs. `weights_only=False` (the user's
explicit word) reads the engine file as torch would without the guard.

[Note: verified reads]
A checkpoint's bytes are read once, and nothing reaches the engine until every
rank has checked what it read:
1. before DCP runs, `load` checks the engine file, `.metadata`, and any data
   file summed whole (a tag saved before item sums), the files split across
   ranks and the findings exchanged;
2. `read_items` maps each data file a rank needs (in DCP's read step,
   `VerifiedReader.read_data` for its plan; at the saved layout, without
   DCP, zero3.checkpoint.same_layout), checks each saved item it needs
   against the sum taken when the item was written (zero3.checkpoint.tags'
   `FileSums`), and holds the item as a tensor viewing the mapping (a small
   one is read into a buffer of its own instead: see `_READ_BELOW`; the
   disk is asked for them ahead: zero3.checkpoint.read_ahead's Note). It
   copies nothing into the engine; a damaged item is reported, naming the
   file and the item;
3. every rank's outcome is exchanged (DCP ends its read step with an
   all-gather of them, raising `CheckpointException` on every rank; a load
   at the saved layout sends its own with the load's one exchange), so a
   failure on one rank raises on all of them, each with nothing copied;
4. only after that does `commit` copy the held tensors into the targets
   (the engine's buffers, or a disk tier through the planner's write-back),
   as DCP's own reader would have as it read.
Between 2 and 4 a rank holds the saved items its plan reads (at the saving
world size, its own files: its shard of every state loaded) as mapped page
cache, not as copies: nothing is allocated for them but the small items'
buffers, the kernel may drop pages under memory pressure and read them
again, and a file truncated while it is mapped ends the process (SIGBUS), as
with `torch.load(mmap=True)`. DCP's own reader instead allocates each item in
turn and copies it into the engine at once, before the other ranks have read
theirs.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import struct
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from zero3.checkpoint.read_ahead import advise
from zero3.checkpoint.tags import CheckpointError, Checksum, FileSums, damage_error, file_problem, item_problem, mapped

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
    data = bytearray(file.read_bytes())  # (writable: the tensors read below are views of it)
    plain = _plain_contents(data)
    if plain is not _NOT_PLAIN:
        return plain
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        found = _GLOBAL.search(str(error))
        name = found.group(1) if found else "a global outside torch's weights-only allowlist"
        raise refusal(
            file, name, f"{OPT_IN}; or, for a class of your own, register it with "
            f"torch.serialization.add_safe_globals([{name.rsplit('.', 1)[-1]}])",
        ) from None


# An item below this many bytes is read rather than mapped: a page fault reads ahead around itself (up to
# the device's read-ahead, often megabytes), so faulting in a small item (a scalar saved in another rank's
# file) would read that much more of a file this rank otherwise does not need.
_READ_BELOW = 1 << 20


class VerifiedReader(CheckpointReader):
    """A `CheckpointReader` whose reads are checked and held: each saved item a plan needs is read once,
    checked against its sum, and kept; `commit` copies what was read into the planner's tensors once
    every rank's reads passed (see [Note: verified reads]).

    `sums` is the engine file's "files" (zero3.checkpoint.tags' `FileSums`): a data file summed whole
    was checked before DCP ran, a file summed per item is checked here.
    """

    def __init__(self, path: str | Path, sums: Mapping[str, FileSums], checksum: Checksum, trusted: bool = False) -> None:
        super().__init__(path, trusted)
        self.sums, self.checksum = sums, checksum
        self._held: list[tuple[ReadItem, torch.Tensor]] = []

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._held = []
        per_file: dict[str, dict[MetadataIndex, list[ReadItem]]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, {}).setdefault(item.storage_index, []).append(item)
        for name, saved in per_file.items():
            infos = (self.storage_data[index] for index in saved)
            advise(Path(self.path) / name, ((info.offset, info.length) for info in infos))
        problems: list[str] = []
        for name, saved in sorted(per_file.items()):
            problems += self._read_file(Path(self.path) / name, saved, planner)
        if problems:
            self._held = []
            raise damage_error(Path(self.path), problems)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, file: Path, saved: dict[MetadataIndex, list[ReadItem]], planner: LoadPlanner) -> list[str]:
        """One file's saved items, each checked, then held per read item; the problems found."""
        infos = {index: self.storage_data[index] for index in saved}
        checked, problems = read_items(file, self.sums.get(file.name), infos, self.checksum)
        for index, (raw, what) in checked.items():
            self._hold(raw, saved[index], planner, file, what)
        return problems

    def _hold(self, raw: memoryview, reads: list[ReadItem], planner: LoadPlanner, file: Path, what: str) -> None:
        """A checked saved item, kept as the pieces its read items copy (a BYTE_IO one handed to the planner)."""
        if reads[0].type == LoadItemType.BYTE_IO:
            for item in reads:
                planner.load_bytes(item, io.BytesIO(raw.tobytes()))  # zero3's planner refuses these
            return
        tensor = tensor_item(raw, file, what)
        self._held += [(item, _piece(tensor, item, file, what)) for item in reads]

    def commit(self, planner: LoadPlanner) -> None:
        """Copy what `read_data` held into the planner's tensors (DCP's own copy, made after every rank's
        reads passed), then let the mapped files go."""
        held, self._held = self._held, []
        for item, piece in held:
            target = planner.resolve_tensor(item).detach()  # (its shape is the item's lengths, as the piece's)
            target.copy_(piece)
            planner.commit_tensor(item, target)

    def release(self) -> None:
        """Let go of what was read and not committed (a load that failed)."""
        self._held = []


def read_items(
    file: Path, sums: FileSums | None, items: Mapping[MetadataIndex, Any], checksum: Checksum,
) -> tuple[dict[MetadataIndex, tuple[memoryview, str]], list[str]]:
    """The saved items of one data file (`items`: DCP's storage info of each, by index), read in file order
    and each checked against its sum (see [Note: verified reads]): the bytes of each item that passed, with
    the words that name it, and one line per problem found. Nothing is copied but the small items."""
    if sums is None:
        return {}, [f"{str(file)!r} is not among the files the save checksummed"]
    size, item_sums = sums
    if (problem := file_problem(file, size)) is not None:
        return {}, [problem]
    order = sorted(items, key=lambda index: items[index].offset)
    checked: dict[MetadataIndex, tuple[memoryview, str]] = {}
    problems = []
    view = mapped(file)
    with open(file, "rb", buffering=0) as source:
        for index in order:
            info = items[index]
            what = f"item {index.fqn} at {list(index.offset or ())}"
            if info.transform_descriptors:
                raise CheckpointError(f"{str(file)!r}: {what} was written through "
                                      f"{list(info.transform_descriptors)}, which zero3 never writes")
            if info.length < _READ_BELOW:  # (see `_READ_BELOW`)
                raw = memoryview(bytearray(info.length))
                raw = raw[: os.preadv(source.fileno(), [raw], info.offset)]
            else:
                raw = view[info.offset : info.offset + info.length]
            if not isinstance(item_sums, int):  # (a file summed whole was checked before the reads)
                if (problem := item_problem(file, raw, info.offset, info.length, item_sums, what, checksum)) is not None:
                    problems.append(problem)
                    continue
            checked[index] = (raw, what)
    return checked, problems


def _piece(tensor: torch.Tensor, item: ReadItem, file: Path, what: str) -> torch.Tensor:
    """The part of a saved item that a read item copies (a view), checked to lie inside it."""
    ends = [start + length for start, length in zip(item.storage_offsets, item.lengths)]
    if len(ends) != tensor.dim() or any(end > size for end, size in zip(ends, tensor.shape)):
        raise CheckpointError(f"{str(file)!r}: {what} holds a tensor of shape {list(tensor.shape)}, where the "
                              f"metadata reads up to {ends}")
    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


_NOT_PLAIN = object()  # what `_plain_contents` returns for a file that torch's weights-only reader must read


def _plain_contents(data: bytearray) -> Any:
    """A `torch.save` archive holding only plain containers, numbers, strings and plain dense tensors (an
    engine file), read by `_ItemUnpickler`'s allowlist (a subset of torch's weights-only one) at the C
    unpickler's speed, its tensors views of `data`; `_NOT_PLAIN` for anything else or anything that fails
    (torch's weights-only reader then reads it, and names what it refuses). torch's own weights-only
    unpickler runs in Python: about 10 ms for an engine file of 2 ranks' sums, on every rank, per load."""
    try:
        records = _records(memoryview(data))
        if not _native_byte_order(records):
            return _NOT_PLAIN
        return _ItemUnpickler(records).load()
    except Exception:  # noqa: BLE001 - torch's reader reads it, and reports what is wrong
        return _NOT_PLAIN


@dataclass(frozen=True)
class _Recipe:
    """How a plain item's pickle rebuilds its tensor: the storage record it views and the view's layout."""

    key: str
    dtype: torch.dtype
    numel: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def tensor(self, records: dict[str, memoryview]) -> torch.Tensor:
        storage = _storage(records[f"data/{self.key}"], self.dtype, self.numel)
        return storage.as_strided(self.size, self.stride, self.offset)


# The recipes of the item pickles seen, by the pickle's bytes: a rank's items of one dtype and shape have
# the same pickle (their data differs, in records of their own), so each is unpickled once per process.
_RECIPES: dict[bytes, _Recipe] = {}
_RECIPES_KEPT = 4096


def tensor_item(raw: memoryview, file: Path, what: str) -> torch.Tensor:
    """One DCP tensor item (the `torch.save` of one tensor): a plain dense tensor as a view of `raw`,
    anything else as `torch.load(weights_only=True)` reads it (see the first Note)."""
    try:
        records = _records(raw)
        pickled = bytes(records["data.pkl"])
        recipe = _RECIPES.get(pickled)
        if recipe is not None and _native_byte_order(records):
            return recipe.tensor(records)
        unpickler = _ItemUnpickler(records)
        tensor = unpickler.load_tensor()
        if tensor is not None:
            if (recipe := unpickler.recipe(tensor)) is not None:
                if len(_RECIPES) >= _RECIPES_KEPT:
                    _RECIPES.clear()
                _RECIPES[pickled] = recipe
            return tensor
        return torch.load(io.BytesIO(raw.tobytes()), map_location="cpu", weights_only=True)  # as DCP's reader
    except pickle.UnpicklingError as error:  # (DCP's own reader refuses the same, whatever the caller trusts)
        found = _GLOBAL.search(str(error))
        name = found.group(1) if found else "a global outside torch's weights-only allowlist"
        raise CheckpointError(f"{str(file)!r}: {what} names {name}, which a checkpoint's tensor may not (unpickling "
                              "it could run code). Nothing was loaded.") from None
    except Exception as error:  # noqa: BLE001 - any failure to read it is a damaged file
        raise CheckpointError(f"{str(file)!r}: {what} cannot be read ({type(error).__name__}: {error})") from None


class _Bytes(io.RawIOBase):
    """A read-only, seekable stream over a memoryview, copying nothing it is not asked for (for zipfile)."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._at = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._at = offset + (0, self._at, len(self._view))[whence]
        return self._at

    def readinto(self, out: Any) -> int:
        count = max(0, min(len(out), len(self._view) - self._at))
        out[:count] = self._view[self._at : self._at + count]
        self._at += count
        return count


_LOCAL_HEADER = 30  # a zip local file header's fixed part; its name and extra-field lengths are at 26 and 28
_END = struct.Struct("<4s4H2LH")  # the end of the central directory (no zip64 in use)
_ENTRY = struct.Struct("<4s6H3L5H2L")  # a central directory entry's fixed part, its name after it
_ZIP64 = 0xFFFFFFFF  # an entry field that zip64 holds instead


def _records(raw: memoryview) -> dict[str, memoryview]:
    """The records of a `torch.save` archive (stored, never compressed) by name past the archive's own
    folder: views of `raw`."""
    records = {}
    entries = _entries(raw)
    if entries is None:
        entries = [(info.filename, info.compress_type, info.file_size, info.header_offset)
                   for info in zipfile.ZipFile(_Bytes(raw)).infolist()]
    for name, compression, size, at in entries:
        if compression != zipfile.ZIP_STORED:
            raise zipfile.BadZipFile(f"{name} is compressed")
        start = at + _LOCAL_HEADER + int.from_bytes(raw[at + 26 : at + 28], "little") \
            + int.from_bytes(raw[at + 28 : at + 30], "little")
        records[name.split("/", 1)[-1]] = raw[start : start + size]
    return records


def _entries(raw: memoryview) -> list[tuple[str, int, int, int]] | None:
    """(name, compression, size, local header offset) of each record, from the central directory as
    `torch.save` writes it (no comment, every size and offset in its 32-bit field); None for any other
    archive, which `zipfile` reads instead. A lookup a few times faster than zipfile's, once per item."""
    if len(raw) < _END.size:
        return None
    signature, _, _, _, count, size, start, comment = _END.unpack_from(raw, len(raw) - _END.size)
    end = start + size
    if signature != b"PK\x05\x06" or comment or end > len(raw) - _END.size:
        return None
    entries = []
    at = start
    for _ in range(count):
        if at + _ENTRY.size > end:
            return None
        (signature, _, _, flags, compression, _, _, _, _, file_size, name_length, extra_length, comment_length,
         _, _, _, header) = _ENTRY.unpack_from(raw, at)
        if signature != b"PK\x01\x02" or _ZIP64 in (file_size, header):
            return None
        name = bytes(raw[at + _ENTRY.size : at + _ENTRY.size + name_length])
        entries.append((name.decode("utf-8" if flags & 0x800 else "cp437"), compression, file_size, header))
        at += _ENTRY.size + name_length + extra_length + comment_length
    return entries


# The storages a plain dense tensor's pickle names, by name (the classes' own `dtype` is deprecated to read).
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


class _NotPlain(Exception):
    """The item is not the plain dense tensor `_ItemUnpickler` reads: torch's own reader reads it."""


class _ItemUnpickler(pickle.Unpickler):
    """The pickle of one plain dense tensor, whose storage becomes a view of its record (nothing copied)."""

    def __init__(self, records: dict[str, memoryview]) -> None:
        super().__init__(io.BytesIO(records["data.pkl"]))
        self._records = records
        self._storages: list[tuple[torch.Tensor, str, torch.dtype, int]] = []  # (storage, key, dtype, numel)

    def load_tensor(self) -> torch.Tensor | None:
        """The tensor, or None where it is anything else than a plain dense one in this machine's byte order."""
        if not _native_byte_order(self._records):
            return None
        try:
            tensor = self.load()
        except _NotPlain:
            return None
        return tensor if isinstance(tensor, torch.Tensor) else None

    def recipe(self, tensor: torch.Tensor) -> _Recipe | None:
        """How `load_tensor` made `tensor`, where it was one view of one storage (then any item with the same
        pickle is that view of its own record)."""
        if len(self._storages) != 1:
            return None
        storage, key, dtype, numel = self._storages[0]
        if tensor.untyped_storage().data_ptr() != storage.untyped_storage().data_ptr():
            return None
        return _Recipe(key, dtype, numel, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise _NotPlain

    def persistent_load(self, saved_id: Any) -> torch.Tensor:
        if not (isinstance(saved_id, tuple) and len(saved_id) == 5):
            raise _NotPlain
        kind, dtype, key, _location, numel = saved_id
        record = self._records.get(f"data/{key}")
        if kind != "storage" or not isinstance(dtype, torch.dtype) or record is None:
            raise _NotPlain
        storage = _storage(record, dtype, numel)
        self._storages.append((storage, str(key), dtype, numel))
        return storage


def _rebuild_tensor(
    storage: torch.Tensor, offset: int, size: tuple[int, ...], stride: tuple[int, ...], requires_grad: bool,
    hooks: Any, metadata: Any = None,
) -> torch.Tensor:
    if hooks or metadata:
        raise _NotPlain
    return storage.as_strided(size, stride, offset)


def _native_byte_order(records: Mapping[str, memoryview]) -> bool:
    """Whether a `torch.save` archive's numbers are in this machine's byte order (no record: they are)."""
    byteorder = records.get("byteorder")
    return byteorder is None or bytes(byteorder).decode() == sys.byteorder


def _storage(record: memoryview, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A storage record as a flat tensor viewing it."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(record, dtype=dtype, count=numel)
