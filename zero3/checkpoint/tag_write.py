"""Writing one tag: every rank's data file, its sums, then rank 0's engine file and the publication, with a
failure anywhere agreed so that every rank raises the same error and no partial tag is left (a blocking
save runs it on the training thread, an async one in a thread or the checkpoint writer process:
zero3.checkpoint.async_saves)."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from zero3.checkpoint import repeat_saves
from zero3.checkpoint.data_files import DataFileWriter
from zero3.checkpoint.planners import SavePlanner
from zero3.checkpoint.tags import (
    ENGINE_FILE, LATEST, METADATA, SAVED_WITH, CheckpointError, FileSums, checksums, dcp_files, prune, publish,
    staging_dir, write_engine_sum,
)
from zero3.comm import Communicator

log = logging.getLogger("zero3")


class WriteGroup(Protocol):
    """The ranks a tag is written by, as the writing reaches them: DCP's process group and two exchanges."""

    group: Any  # the torch process group DCP runs on (None: the default group)

    def all_gather_objects(self, obj: Any) -> list[Any]: ...

    def barrier(self) -> None: ...


@dataclass(frozen=True)
class CommGroup:
    """One of the engine's groups, through its communicator (a blocking save, or an async one in a thread)."""

    comm: Communicator
    group: Any

    def all_gather_objects(self, obj: Any) -> list[Any]:
        return self.comm.all_gather_objects(obj, self.group)

    def barrier(self) -> None:
        self.comm.barrier(self.group)


@dataclass
class Write:
    """Writing one tag once its entries are fixed: DCP's files, their checksums, then the publication
    (by the training process, or by its checkpoint writer process: zero3.checkpoint.writer_process)."""

    root: Path
    tag: str
    engine_state: dict[str, Any]  # rank 0's engine state, as it was when the save was called (empty elsewhere)
    save_latest: bool
    keep_last: int | None
    rank: int  # this rank in the job

    def run(self, peers: WriteGroup, state: dict[str, Any], on_read: Callable[[], None] | None = None) -> Path:
        """Write, check, publish; a failure anywhere is every rank's `CheckpointError` (see `agree`), agreed
        among `peers` (an async save's own group, off the training thread's). `on_read` is called once this
        rank's data file holds every item of `state` (before its sync and the publication): an async save
        that reads the engine's buffers in place lets the engine change them from then on."""
        staged = staging_dir(self.root, self.tag)
        key = plan_cache_key(peers.group)
        state_layout = repeat_saves.layout(state)
        # A save with the last one's layout on every rank skips DCP's exchanges (repeat_saves' Note).
        last = repeat_saves.agreed(peers, key, state_layout)
        problem, sums, metadata = None, {}, None
        # Each item of this rank's file is summed as it is written, so that a load checks each as it reads
        # it (zero3.checkpoint.trust's [Note: verified reads]); rank 0 also sums the metadata, whole.
        writer = DataFileWriter(staged, SAVED_WITH, on_read)
        planner = SavePlanner(cache_key=key)
        try:
            if last is None:
                metadata = dcp.save(grouped(state), storage_writer=writer, planner=planner, process_group=peers.group)
            else:
                repeat_saves.write(last, state, writer, planner, self.rank)
            sums = dict(writer.sums)
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException
            problem, sums = save_failure(error, staged, self.rank), {}
        heard = peers.all_gather_objects((problem, sums, repeat_saves.changed_results(last, writer)))
        agree(peers, [found for found, _, _ in heard], self.root, self.tag, self.rank)
        if self.rank == 0:
            try:
                if last is not None:
                    repeat_saves.finish(last, writer, [results for _, _, results in heard])
                files: dict[str, FileSums] = dict(checksums([staged / METADATA], SAVED_WITH))
                for _, found, _ in heard:
                    files.update(found)
                for leftover in dcp_files(staged):  # a recycled file no rank wrote over (a larger world's)
                    if leftover.name not in files:
                        leftover.unlink()
                temporary = staged / f".{ENGINE_FILE}.tmp"
                torch.save(self.engine_state | {"files": files, "checksum": SAVED_WITH.name}, temporary)
                write_engine_sum(temporary)
                os.replace(temporary, staged / ENGINE_FILE)  # the tag's completeness marker: written last
                publish(self.root, self.tag, self.save_latest)
            except Exception as error:  # noqa: BLE001 - told to every rank below
                problem = save_failure(error, staged, 0)
            if problem is None and self.keep_last is not None:
                self._prune()  # before the agreement: a save that returned, on any rank, has pruned
        agree(peers, peers.all_gather_objects(problem), self.root, self.tag, self.rank)
        repeat_saves.remember(key, last, state_layout, planner, writer, metadata, self.rank)
        return self.root / self.tag

    def _prune(self) -> None:
        """Rank 0: the tags beyond `keep_last` removed, once this one is published. A failure to remove one
        leaves it, with a warning: the tag just saved is complete, and the next save prunes again."""
        assert self.keep_last is not None
        try:
            removed = prune(self.root, self.keep_last, self.tag)
        except Exception as error:  # noqa: BLE001 - whatever it is, the other ranks wait in the agreement after it
            log.warning("checkpoint: tag %r was saved, but the tags beyond keep_last=%d could not all be removed "
                        "from %r (%s); the next save tries again", self.tag, self.keep_last, str(self.root), error)
            return
        if removed:
            log.info("checkpoint: removed tags %s (keep_last=%d)", removed, self.keep_last)


def grouped(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The flat state (`model.<name>`, `optim.<name>.<state>`, `buffer.<name>`) as one dict per kind. DCP
    flattens it back to the same names, so the files are the same; it runs Python per top-level entry
    (a log record each, about 0.1 ms), which a few hundred entries made 27 ms of every save's CPU."""
    kinds: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        kind, _, name = key.partition(".")
        kinds.setdefault(kind, {})[name] = value
    return kinds


def plan_cache_key(group: Any) -> str:
    """DCP's plan-cache key for saves on `group` (zero3.checkpoint.planners' `SavePlanner`)."""
    group = group if group is not None else dist.group.WORLD
    return f"zero3:{dist.get_world_size(group)}:{group.group_name}"


def save_failure(error: BaseException, directory: Path, rank: int) -> str:
    """What went wrong, in words: the OS's reason where there is one (torch's writer reports a full disk as
    "unexpected pos ..."), with the file or directory."""
    cause = error
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: each failing rank's exception
    if failures:
        rank, (cause, *_) = next(iter(failures.items()))  # the rank it happened on, not this one
    seen: set[int] = set()
    found: BaseException | None = cause
    while found is not None and id(found) not in seen and not isinstance(found, OSError):
        seen.add(id(found))
        found = found.__cause__ or found.__context__
    where = directory
    if isinstance(found, OSError) and found.errno is not None:
        where = Path(found.filename) if found.filename else directory
        return f"{os.strerror(found.errno).lower()} while writing {str(where)!r} (rank {rank})"
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    except OSError:
        free = -1
    if 0 <= free < _NEARLY_FULL:
        return f"no space left on device while writing {str(directory)!r} (rank {rank}; {free} bytes free)"
    return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''} while writing " \
           f"{str(directory)!r} (rank {rank})"


_NEARLY_FULL = 1 << 20  # bytes: a write that failed with less free than this failed for room


def agree(peers: WriteGroup, heard: list[str | None], root: Path, tag: str, rank: int) -> None:
    """Every rank has `heard` whether any failed (each rank's problem, gathered); if one did, the partial tag
    is removed and every rank raises the same CheckpointError (what `latest` names is untouched)."""
    problems = [found for found in heard if found is not None]
    if not problems:
        return
    if rank == 0:
        shutil.rmtree(staging_dir(root, tag), ignore_errors=True)
    peers.barrier()  # every rank raises once the partial tag is gone
    latest = root / LATEST
    kept = f"'latest' still names {latest.read_text().strip()!r}" if latest.is_file() else "no tag was published"
    raise CheckpointError(f"save_checkpoint of tag {tag!r} into {str(root)!r} failed: {problems[0]}. Nothing was "
                          f"saved ({kept}); the partial files were removed.")
