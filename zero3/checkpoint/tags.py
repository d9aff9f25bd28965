"""A checkpoint directory: tags, the `latest` marker, completeness, checksums, pruning.

[Note: crash-safe tags]
`save_dir/<tag>/` holds DCP's files (one or more `__<rank>_<n>.distcp` per
rank, and `.metadata`) and `zero3_engine.pt`, the engine's own state with a
checksum of every item of every DCP data file and of `.metadata` ([Note:
checksums]). A save writes
into `save_dir/.<tag>.incomplete/`; only after every rank's files are
written and checksummed does rank 0 write `zero3_engine.pt` into it (last,
by rename), move the directory to `<tag>`
(an older `<tag>` is moved aside first and removed after), and then replace
`latest` (a temporary file renamed over it). A rank killed at any point
before that leaves `latest` naming the previous complete tag. `keep_last`
removes older complete tags, oldest first, only after `latest` names the new
one. A load checks the files against their checksums before it changes any
state (each item as it is read: zero3.checkpoint.trust's [Note: verified
reads]), so a truncated or corrupted file is reported, naming it, and the
live engine keeps its state.

[Note: recycled data files]
Periodic saves write a tag's worth of data files every few steps, and
`keep_last` removes as many. On a disk mounted with online discard (common on
cloud VMs) and in most virtual disks, freeing a file's blocks and allocating
new ones costs the host work that it takes from this VM's CPUs (measured here,
both cores busy: 0.5 s of CPU stolen per GB unlinked). So `prune` keeps the
oldest removed tag's directory as `save_dir/.recycled` (hidden: no load and no
listing of tags sees it), and the next save starts from it: rank 0 renames it
to the save's `.incomplete` directory, keeping only the data files this save's
ranks write (by name), and each rank writes its file over the old one in place
(`DirectFile` opens without truncating and cuts the file to what it wrote).
Until the save is published the directory is incomplete like any other, so a
crash leaves `latest` as it was. It costs one tag's files on disk beside the
`keep_last` ones, which a save held anyway while it wrote the new tag.

[Note: checksums]
A load sums every byte it reads, so the sum's speed is part of every load's.
Tags are summed with XXH3-64 (the `xxhash` library: about 22 GB/s on one
core here, against zlib's CRC-32 at 3.5, and it releases the GIL, so an
async save's sums do not hold the training thread); the engine file names
the algorithm (`"checksum"`), and a tag saved before it did is read with the
CRC-32 it was written with. The engine file's own sum (`zero3_engine.pt.crc32`,
a few kilobytes summed) stays a CRC-32, so every zero3 reads it.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import stat
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import xxhash

ENGINE_FILE = "zero3_engine.pt"
# The engine file's own size and CRC-32 (it holds every other file's): checked before it is read.
ENGINE_SUM = "zero3_engine.pt.crc32"
METADATA = ".metadata"
LATEST = "latest"
INCOMPLETE = ".incomplete"
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.=+-]*")
_CHUNK = 16 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked; the message names the file and the problem."""


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or tag.endswith(INCOMPLETE) or tag == LATEST:
        raise CheckpointError(
            f"checkpoint tag {tag!r}: expected a name of letters, digits and _ . = + - (not starting with "
            f"a dot, not {LATEST!r})"
        )
    return tag


RECYCLED = ".recycled"  # a pruned tag's data files, which the next save writes over
DCP_SUFFIX = ".distcp"  # (DCP's DEFAULT_SUFFIX)


def staging_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".{tag}{INCOMPLETE}"


def resolve(load_dir: str | os.PathLike[str], tag: str | None) -> Path:
    """The complete tag directory to load: `tag`, or the one `latest` names."""
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist")
    if tag is None:
        marker = root / LATEST
        if not marker.is_file():
            raise CheckpointError(
                f"{str(marker)!r} does not exist: no complete checkpoint was saved in {str(root)!r} "
                "(or pass tag=)"
            )
        tag = marker.read_text().strip()
    path = root / check_tag(tag)
    if not path.is_dir():
        have = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        raise CheckpointError(f"checkpoint tag {tag!r} not found in {str(root)!r} (tags there: {have})")
    if not (path / ENGINE_FILE).is_file():
        raise CheckpointError(f"{str(path / ENGINE_FILE)!r} is missing: the save of tag {tag!r} did not complete")
    return path


def latest_tag(load_dir: str | os.PathLike[str]) -> str | None:
    """The tag `load_dir`'s `latest` marker names; None where there is none (DeepSpeed's resume idiom
    treats a directory without one as "nothing saved yet", not as an error)."""
    marker = Path(load_dir) / LATEST
    return marker.read_text().strip() if marker.is_file() else None


def dcp_files(path: Path, rank: int | None = None) -> list[Path]:
    """DCP's data files in `path` (one rank's, or all), sorted."""
    pattern = f"__{rank}_*.distcp" if rank is not None else "__*_*.distcp"
    return sorted(path.glob(pattern))


def dcp_writers(path: Path) -> set[int]:
    """The ranks whose data files are in `path` (`__<rank>_<n>.distcp`, as `dcp_files` finds them)."""
    prefixes = (file.name[2:].split("_", 1)[0] for file in dcp_files(path))
    return {int(prefix) for prefix in prefixes if prefix.isdigit()}


ItemSums = dict[int, tuple[int, int]]
"""The items of one DCP data file, by their offset in it: (the item's bytes, their sum)."""
FileSums = tuple[int, int | ItemSums]
"""A file's entry in the engine file's "files": (its bytes, its sum); for a DCP data file saved since
items are summed, (its bytes, each item's sums). A load checks a whole-file sum before it reads (a
tag saved before item sums, and `.metadata`), and an item's as it reads the item."""


@dataclass(frozen=True)
class Checksum:
    """One algorithm a tag's files are summed with (see [Note: checksums])."""

    name: str
    of: Callable[[memoryview | bytes], int]  # a buffer's sum
    start: Callable[[], RunningSum]  # a sum taken piece by piece (`update`, then `intdigest`)

    def of_file(self, path: Path) -> int:
        """A file's sum, read in chunks."""
        running = self.start()
        with open(path, "rb", buffering=0) as source:
            while chunk := source.read(_CHUNK):
                running.update(chunk)
        return running.intdigest()


class RunningSum(Protocol):
    def update(self, data: memoryview | bytes) -> None: ...

    def intdigest(self) -> int: ...


class _RunningCrc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: memoryview | bytes) -> None:
        self._value = zlib.crc32(data, self._value)

    def intdigest(self) -> int:
        return self._value


CRC32 = Checksum("crc32", zlib.crc32, _RunningCrc32)
XXH3_64 = Checksum("xxh3_64", xxhash.xxh3_64_intdigest, xxhash.xxh3_64)
SAVED_WITH = XXH3_64  # what a save sums with
_KNOWN = {c.name: c for c in (CRC32, XXH3_64)}


def saved_checksum(engine_state: Mapping[str, Any]) -> Checksum:
    """The algorithm an engine file names (its "checksum"; CRC-32 for a tag saved before it was written)."""
    name = engine_state.get("checksum", CRC32.name)
    try:
        return _KNOWN[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"the checkpoint's files are summed with {name!r}, which this zero3 does not know "
                              f"(expected one of {sorted(_KNOWN)}): a newer zero3 saved it?") from None


def checksums(files: list[Path], checksum: Checksum) -> dict[str, tuple[int, int]]:
    """name -> (bytes, sum)."""
    return {f.name: (f.stat().st_size, checksum.of_file(f)) for f in files}


def mapped(file: Path) -> memoryview:
    """The file's bytes, mapped copy-on-write (so that a tensor may view them; nothing writes them), and
    unmapped once nothing refers to them."""
    with open(file, "rb") as source:
        if os.fstat(source.fileno()).st_size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(source.fileno(), 0, access=mmap.ACCESS_COPY))


def item_checksums(file: Path, items: list[tuple[int, int]], checksum: Checksum) -> tuple[int, ItemSums]:
    """A DCP data file's entry (see `FileSums`): its bytes and each of `items` (offset, bytes) summed."""
    view = mapped(file)
    return len(view), {offset: (length, checksum.of(view[offset : offset + length])) for offset, length in items}


def item_problem(file: Path, data: memoryview, offset: int, length: int, sums: ItemSums, what: str,
                 checksum: Checksum) -> str | None:
    """What is wrong with the item of a data file at `offset` (`length` bytes, of which `data` holds what the
    file has), if anything."""
    expected = sums.get(offset)
    where = f"{str(file)!r}: {what} (bytes {offset}..{offset + length})"
    if expected is None or expected[0] != length:
        return f"{where} is not an item the save checksummed (the metadata and the engine file disagree)"
    if len(data) != length:
        return f"{where} lies past the file's end (truncated?)"
    if checksum.of(data) != expected[1]:
        return f"{where} does not match the checksum taken when it was written (corrupted)"
    return None


def write_engine_sum(file: Path) -> None:
    """Beside the engine file (before it is renamed into place): its size and CRC-32."""
    write_atomically(file.parent / ENGINE_SUM, f"{file.stat().st_size} {CRC32.of_file(file)}")


def check_engine_file(path: Path) -> None:
    """The engine file against its sum; a tag saved before sums were written has none and is read as is."""
    sum_file = path / ENGINE_SUM
    if not sum_file.is_file():
        return
    try:
        size, crc = (int(part) for part in sum_file.read_text().split())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{str(sum_file)!r} cannot be read ({error})") from None
    problems = damaged(path, {ENGINE_FILE: (size, crc)}, [ENGINE_FILE], CRC32)
    if problems:
        raise damage_error(path, problems)


def damage_error(path: Path, problems: list[str]) -> CheckpointError:
    """The error a load raises for a tag whose files do not match their sums (one line per file or item);
    the lines travel with it (`problems`), so that ranks can merge what each found."""
    error = CheckpointError(f"the checkpoint {str(path)!r} is damaged; nothing was loaded:\n  " + "\n  ".join(problems))
    error.problems = list(problems)  # type: ignore[attr-defined]
    return error


def file_problem(file: Path, size: int) -> str | None:
    """A missing file, or one of another size than was written."""
    if not file.is_file():
        return f"{str(file)!r} is missing"
    if file.stat().st_size != size:
        return f"{str(file)!r} has {file.stat().st_size} bytes, {size} were written (truncated?)"
    return None


def damaged(path: Path, expected: dict[str, FileSums], names: list[str], checksum: Checksum) -> list[str]:
    """Problems with these files of a tag, one line each (a missing, truncated or corrupted file, or item)."""
    problems = []
    for name in names:
        file = path / name
        size, sums = expected[name]
        if (problem := file_problem(file, size)) is not None:
            problems.append(problem)
        elif isinstance(sums, int):
            if checksum.of_file(file) != sums:
                problems.append(f"{str(file)!r} does not match the checksum taken when it was written (corrupted)")
        else:
            view = mapped(file)
            found = (item_problem(file, view[offset : offset + length], offset, length, sums, "the item", checksum)
                     for offset, (length, _) in sorted(sums.items()))
            problems += [problem for problem in found if problem is not None]
    return problems


def publish(save_dir: Path, tag: str, write_latest: bool = True) -> Path:
    """Rank 0, once every rank's files are complete: the staged tag becomes `tag`, then `latest` names it."""
    staged, final = staging_dir(save_dir, tag), save_dir / tag
    old = save_dir / f".{tag}.replaced"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    staged.rename(final)
    if write_latest:
        write_atomically(save_dir / LATEST, tag)
    shutil.rmtree(old, ignore_errors=True)
    _sync_directory(save_dir)
    return final


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


def prune(save_dir: Path, keep_last: int, newest: str) -> list[str]:
    """Remove complete tags beyond the newest `keep_last` (by completion time); returns the removed tags. The
    oldest one's files are kept aside for the next save to write over ([Note: recycled data files])."""
    tags = [p for p in save_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / ENGINE_FILE).is_file()]
    tags.sort(key=lambda p: (p.name == newest, (p / ENGINE_FILE).stat().st_mtime_ns))
    removed = []
    for path in tags[: max(len(tags) - keep_last, 0)]:
        if path.name != newest:
            if removed or (save_dir / RECYCLED).exists():
                shutil.rmtree(path)
            else:
                path.rename(save_dir / RECYCLED)  # no longer a tag: hidden, never loaded
            removed.append(path.name)
    return removed


def new_staging_dir(save_dir: Path, tag: str, world_size: int) -> Path:
    """Rank 0, as a save starts: the empty directory `tag` is written into, or the recycled one holding only
    the data files this save's ranks will write over (the rest removed)."""
    staged = staging_dir(save_dir, tag)
    shutil.rmtree(staged, ignore_errors=True)  # what an interrupted save of this tag left
    recycled = save_dir / RECYCLED
    if not recycled.is_dir():
        staged.mkdir()
        return staged
    recycled.rename(staged)
    kept = {f"__{rank}_0{DCP_SUFFIX}" for rank in range(world_size)}
    for entry in staged.iterdir():
        found = entry.lstat()
        # Only a plain file of its own: one hard-linked elsewhere (a backup made with `cp -l`) must not change.
        if entry.name in kept and stat.S_ISREG(found.st_mode) and found.st_nlink == 1:
            continue
        shutil.rmtree(entry) if stat.S_ISDIR(found.st_mode) else entry.unlink()
    return staged


def _sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
