"""What an engine's checkpoint holds, and how it is saved and loaded (torch.distributed.checkpoint).

Per parameter, under its own name and global shape (see [Note: checkpoint
chunks]): `model.<name>` is the fp32 master, or, for a parameter with no
master (frozen, or an engine without an optimizer), the 16-bit values, which
then cannot be derived; `optim.<name>.<state>` is each elementwise state of
the optimizer (Adam: `exp_avg`, `exp_avg_sq`) and each scalar one (Adam:
`step`), for a parameter the optimizer has stepped (torch creates a
parameter's state at its first step, and so does a load: a parameter saved
without state gets none). The 16-bit shards of trained
parameters are not saved: a load writes them from the masters. The engine's
own state (step counters, loss scaler, scheduler, the optimizer's type and
hyperparameters, the client state, each file's checksum) goes into
`zero3_engine.pt`, written last (see [Note: crash-safe tags]).
"""

from __future__ import annotations

import copy
import gc
import logging
import os
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from zero3.checkpoint.chunks import RangeChunks
from zero3.checkpoint.planners import LoadPlanner
from zero3.checkpoint.read_ahead import PageIn, page_in_own_files
from zero3.checkpoint.same_layout import SameLayoutLoad
from zero3.checkpoint.trust import CheckpointReader, VerifiedReader, load_engine_file
from zero3.checkpoint.tag_write import CommGroup, Write, agree, save_failure
from zero3.checkpoint.tags import (
    ENGINE_FILE, CheckpointError, check_engine_file, check_tag, damage_error, damaged, new_staging_dir, resolve,
    saved_checksum,
)
from zero3.comm import Communicator
from zero3.rank_failure import describe, first_failure
from zero3.step_protocol import StepProtocol
from zero3.offload.host import HostBufferPool
from zero3.partition.flat_buffer import Slot
from zero3.partition.sharded_param import ShardedParam

if TYPE_CHECKING:
    from zero3.checkpoint.async_saves import AsyncSaves

log = logging.getLogger("zero3")

FORMAT = 1


def _chunks(sp: ShardedParam, slot: Slot, dtype: torch.dtype) -> RangeChunks:
    start, end = sp.whole_range()  # an expert share's shard, placed in the whole [E, ...] tensor
    shape = tuple(sp.whole_shape)
    buffer = slot.buffer
    if buffer.store is None:
        return RangeChunks(shape, dtype, start, end, values=slot.view()[: end - start], home=slot)

    def read(offset: int, numel: int) -> torch.Tensor:
        return buffer.read_range(slot.offset + offset, numel)

    def write(offset: int, values: torch.Tensor) -> None:
        buffer.write_range(slot.offset + offset, values)

    return RangeChunks(shape, dtype, start, end, read=read, write=write)


class MasterShards(Protocol):
    """One parameter's optimizer-side shards, as a checkpoint reads them."""

    hp: Slot
    moments: dict[str, Slot]


class CheckpointedOptimizer(Protocol):
    """What a save or a load reads and writes of the engine's optimizer (zero3.step.optimizer)."""

    params: list[ShardedParam]
    masters: Mapping[ShardedParam, MasterShards]
    optimizer: torch.optim.Optimizer  # torch's, stepping the masters: its type and hyperparameters are saved
    state_names: tuple[str, ...]  # its elementwise states
    lp_stale: bool

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def has_state(self, sp: ShardedParam) -> bool: ...

    def scalar_state(self, sp: ShardedParam) -> dict[str, torch.Tensor]: ...

    def set_states(self, scalars_by_param: Mapping[ShardedParam, dict[str, torch.Tensor] | None]) -> None: ...


@dataclass(frozen=True)
class TrainingCounters:
    """Where training stands: what a checkpoint records besides the tensors, and a load restores."""

    global_steps: int
    micro_steps: int
    skipped_steps: int


@dataclass(frozen=True)
class CheckpointedEngine:
    """What a save or a load reads of an engine (the engine builds it; nothing here writes back to it)."""

    module: torch.nn.Module
    comm: Communicator
    protocol: StepProtocol  # where a save's and a load's ranks agree (zero3.step_protocol)
    rank: int  # in the job
    world_size: int
    compute_dtype: torch.dtype
    device: torch.device
    sharded_params: list[ShardedParam]
    optimizer: CheckpointedOptimizer | None
    loss_scaler: Any  # state_dict() / load_state_dict()
    lr_scheduler: Any  # None, or state_dict() / load_state_dict()
    host_pool: HostBufferPool
    counters: TrainingCounters
    # This rank's own state beside the engine's (its RNG, the objects registered with the engine): gathered
    # to rank 0 and saved per rank, in rank order, as "rank_states".
    rank_state: dict[str, Any] | None = None
    # Recorded beside the engine's state, for the engine to compare at a load (the global batch).
    facts: dict[str, Any] | None = None


@dataclass(frozen=True)
class Restored:
    """What a load read, for the engine to apply: its counters and the scheduler's state (None when
    the caller asked for the module only), the client state, and what was saved per rank and about
    the run (`rank_states`, `facts`: absent from a checkpoint older than them)."""

    path: str
    client_state: Any
    counters: TrainingCounters | None
    loss_scaler: dict[str, Any] | None
    lr_scheduler: dict[str, Any] | None
    world_size: int = 0  # the world the checkpoint was saved at
    rank_states: list[dict[str, Any]] | None = None
    facts: dict[str, Any] | None = None


def entries(engine: CheckpointedEngine, optimizer_states: bool, saved: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """This rank's state-dict for DCP (views of the engine's buffers where they are in memory).

    For a save, a parameter's optimizer state is there if it has one; for a load (`saved`: the
    checkpoint's metadata), if the checkpoint has one (its scalars read into fresh tensors).
    """
    out: dict[str, Any] = {}
    optimizer = engine.optimizer
    saved_states = _saved_states(saved) if saved is not None else {}
    for sp in engine.sharded_params:
        slots = optimizer.masters.get(sp) if optimizer is not None else None
        if optimizer is not None and slots is not None:
            out[f"model.{sp.name}"] = _chunks(sp, slots.hp, torch.float32)
            prefix = f"optim.{sp.name}."
            if not optimizer_states:
                continue
            if saved is None:
                if optimizer.has_state(sp):
                    for name in optimizer.state_names:
                        out[prefix + name] = _chunks(sp, slots.moments[name], torch.float32)
                    for name, value in optimizer.scalar_state(sp).items():
                        out[prefix + name] = value
            elif sp.name in saved_states:
                for name in optimizer.state_names:
                    out[prefix + name] = _chunks(sp, slots.moments[name], torch.float32)
                for scalar, meta in saved_states[sp.name].items():
                    if scalar not in optimizer.state_names and isinstance(meta, TensorStorageMetadata):
                        out[prefix + scalar] = torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
        else:
            assert sp.lp_slot is not None
            out[f"model.{sp.name}"] = _chunks(sp, sp.lp_slot, sp.dtype)
    for name, buffer in persistent_buffers(engine.module).items():
        out[f"buffer.{name}"] = buffer  # whole on every rank: written once, loaded in place
    return out


def _saved_states(saved: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The checkpoint's optimizer states (`optim.<parameter>.<state>`: a state's name has no dot), by parameter."""
    found: dict[str, dict[str, Any]] = {}
    for key, meta in saved.items():
        if key.startswith("optim."):
            name, _, state_name = key[len("optim."):].rpartition(".")
            found.setdefault(name, {})[state_name] = meta
    return found


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers that belong in its state (never partitioned)."""
    params = set(dict(module.named_parameters(remove_duplicate=False)))
    return {name: value for name, value in module.state_dict().items() if name not in params}


def _engine_state(engine: CheckpointedEngine, client_state: Any, rank_states: list[Any] | None) -> dict[str, Any]:
    optimizer = engine.optimizer
    return {
        "rank_states": rank_states,
        "facts": engine.facts,
        "format": FORMAT,
        "world_size": engine.world_size,
        "compute_dtype": str(engine.compute_dtype),
        "global_steps": engine.counters.global_steps,
        "micro_steps": engine.counters.micro_steps,
        "skipped_steps": engine.counters.skipped_steps,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "optimizer": None if optimizer is None else {
            "type": type(optimizer.optimizer).__name__,
            "state_names": list(optimizer.state_names),
            "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
        },
        "params": {sp.name: list(sp.whole_shape) for sp in engine.sharded_params},
        "buffers": list(persistent_buffers(engine.module)),
        "client_state": client_state,
    }


def save(
    engine: CheckpointedEngine, save_dir: str | os.PathLike[str], tag: str | None, client_state: Any,
    save_latest: bool, keep_last: int | None, saves: AsyncSaves | None = None,
) -> Future[Path] | Path:
    """Every rank writes its own pieces; rank 0 publishes the tag once all are complete (collective).

    With `saves` (an async save) the state is first staged in host memory and written in the
    background (zero3.checkpoint.async_saves), and a Future is returned; else the path, once published.
    """
    comm = engine.comm
    tag = check_tag(tag if tag is not None else f"global_step{engine.counters.global_steps}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last={keep_last!r}: expected a positive number of tags to keep, or None")
    tags = comm.all_gather_objects(tag)
    if len(set(tags)) > 1:
        raise CheckpointError(f"the ranks asked for different checkpoint tags {tags}: every rank must pass the same")
    root = Path(save_dir)
    problem = None
    if engine.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            new_staging_dir(root, tag, comm.job_size)
        except OSError as error:
            problem = save_failure(error, root, 0)
    peers = CommGroup(comm, engine.protocol.scope.group)
    agree(peers, peers.all_gather_objects(problem), root, tag, engine.rank)  # rank 0's failure is every rank's
    # The engine's own state is taken now (an async write must not see later steps): a copy, so that
    # the writer never has to read anything back (see zero3.checkpoint.trust's Note).
    rank_states = comm.all_gather_objects(engine.rank_state) if engine.rank_state is not None else None
    engine_state = copy.deepcopy(_engine_state(engine, client_state, rank_states)) if engine.rank == 0 else {}
    live = entries(engine, optimizer_states=engine.optimizer is not None)
    job = Write(root, tag, engine_state, save_latest, keep_last, engine.rank)
    if saves is None:
        return job.run(CommGroup(comm, comm.control_group), live)
    return saves.submit(job, live)


def read_engine_state(path: Path, weights_only: bool = True) -> dict[str, Any]:
    """The engine file, checked against its sum, then read weights-only unless the caller trusts it
    (zero3.checkpoint.trust)."""
    file = path / ENGINE_FILE
    check_engine_file(path)
    try:
        state = load_engine_file(file, weights_only)
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure to read it is a damaged file
        raise CheckpointError(f"{str(file)!r} cannot be read ({type(error).__name__}: {error})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{str(file)!r} is not a zero3 checkpoint of format {FORMAT}")
    return state


def _read_metadata(path: Path, trusted: bool = False) -> Metadata:
    """DCP's description of every saved entry and where its items lie (read through the allowlist unless
    trusted)."""
    return CheckpointReader(path, trusted).read_metadata()


def _misfits(saved: dict[str, Any], wanted: dict[str, Any], strict: bool) -> list[str]:
    """Names and shapes that differ between the checkpoint and this engine, one line each."""
    problems = []
    for key, entry in wanted.items():
        meta = saved.get(key)
        if meta is None:
            if strict or not key.startswith(("model.", "buffer.")):
                problems.append(f"{key}: in this model, not in the checkpoint")
            continue
        if isinstance(entry, RangeChunks):
            if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != entry.shape:
                size = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "not a tensor"
                problems.append(f"{key}: shape {list(entry.shape)} here, {list(size) if size != 'not a tensor' else size} "
                                "in the checkpoint")
        elif isinstance(meta, BytesStorageMetadata):
            problems.append(f"{key}: a tensor here, not in the checkpoint")
    if strict:
        problems += [
            f"{key}: in the checkpoint, not in this model"
            for key in saved if key.startswith(("model.", "buffer.")) and key not in wanted
        ]
    return problems


def _check(
    engine: CheckpointedEngine, path: Path, load_optimizer_states: bool, load_module_only: bool, strict: bool,
    weights_only: bool,
) -> tuple[dict[str, Any], bool, Metadata, dict[str, Any]]:
    """This rank's checks of the tag at `path` before a load reads anything into the engine (no collective):
    its engine state, whether the optimizer's states load, DCP's metadata, and this rank's state-dict to
    load (the entries the checkpoint has, unless strict)."""
    state = read_engine_state(path, weights_only)
    optimizer = engine.optimizer
    with_optimizer = optimizer is not None and load_optimizer_states and not load_module_only
    if with_optimizer:
        assert optimizer is not None
        saved = state["optimizer"]
        here = type(optimizer.optimizer).__name__
        if saved is None or saved["type"] != here:
            raise CheckpointError(
                f"{str(path / ENGINE_FILE)!r}: the checkpoint's optimizer is {saved and saved['type']}, this engine's "
                f"is {here} (pass load_optimizer_states=False to load only the parameters)"
            )
        if len(saved["param_groups"]) != len(optimizer.param_groups):
            raise CheckpointError(
                f"{str(path / ENGINE_FILE)!r}: the checkpoint has {len(saved['param_groups'])} optimizer parameter "
                f"groups, this engine {len(optimizer.param_groups)}"
            )
    metadata = _read_metadata(path, trusted=not weights_only)
    saved_entries = metadata.state_dict_metadata
    wanted = entries(engine, optimizer_states=with_optimizer, saved=saved_entries)
    problems = _misfits(saved_entries, wanted, strict)
    if problems:
        raise CheckpointError(
            f"the checkpoint {str(path)!r} does not fit this model ({len(problems)} differences):\n  "
            + "\n  ".join(problems)
        )
    if not strict:
        wanted = {key: value for key, value in wanted.items() if key in saved_entries}
    return state, with_optimizer, metadata, wanted


def _read_failure(error: CheckpointException, path: Path, rank: int) -> BaseException:
    """What every rank raises when DCP reports that some rank's load failed: the damage every failing rank
    found, merged; else this rank's own failure, or the first failing rank's."""
    failures = {found: failure for found, (failure, _) in sorted(error.failures.items())}
    lines = [line for failure in failures.values() for line in getattr(failure, "problems", ())]
    if lines:
        return damage_error(path, list(dict.fromkeys(lines)))  # ranks that read the same item report it once
    if rank in failures:
        return failures[rank]
    everyone = [describe(failures.get(found)) for found in range(max(failures) + 1)]
    return first_failure(everyone, "load_checkpoint") or error


def _load_resharded(engine: CheckpointedEngine, path: Path, state: dict[str, Any], wanted: dict[str, Any],
                    weights_only: bool) -> None:
    """`wanted` read through DCP, which matches each box with the saved chunks it overlaps (collective): a
    load at another world size or layout. Each item is checked as it is read, and nothing is copied into
    the engine until every rank's reads passed (zero3.checkpoint.trust's [Note: verified reads])."""
    reader = VerifiedReader(path, state["files"], saved_checksum(state), trusted=not weights_only)
    planner = LoadPlanner()
    try:
        dcp.load(wanted, storage_reader=reader, planner=planner, process_group=engine.comm.control_group)
    except CheckpointException as error:  # on every rank, each with nothing copied into the engine
        reader.release()
        failure = _read_failure(error, path, engine.rank)
        raise failure from (None if isinstance(failure, CheckpointError) else error)
    reader.commit(planner)


@contextmanager
def _collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration, then as it was.

    A full collection walks every object of the process (a training process holds hundreds of thousands),
    and a load allocates enough (the metadata, a record per item) to set one off now and then: on one rank,
    it holds every rank in the load's exchange. What a load allocates holds no cycles worth collecting."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_collection_paused()
def load(
    engine: CheckpointedEngine, load_dir: str | os.PathLike[str], tag: str | None, load_optimizer_states: bool,
    load_lr_scheduler_states: bool, load_module_only: bool, strict: bool, weights_only: bool = True,
) -> Restored:
    """Check everything, then read into the engine's buffers (collective). The masters are loaded and
    the 16-bit shards marked stale (the engine rewrites them); the counters come back to be applied.
    A refused or damaged file raises the same error on every rank, with nothing loaded: the engine
    file and the metadata are read by every rank before the first collective, and each item is checked
    as it is read, before any is copied (zero3.checkpoint.trust's [Note: verified reads]). At the layout
    the checkpoint was saved with, each rank reads its items itself, without DCP
    (zero3.checkpoint.same_layout's Note); at another, DCP reshards."""
    optimizer = engine.optimizer
    own: Exception | None = None
    found: list[str] = []
    direct: SameLayoutLoad | None = None
    misread: list[str] = []
    paging: PageIn | None = None
    try:
        path = resolve(load_dir, tag)
        if optimizer is not None and load_optimizer_states and not load_module_only:  # (it reads every state)
            paging = page_in_own_files(path, engine.rank, engine.world_size)  # (zero3.checkpoint.read_ahead's Note)
        state, with_optimizer, metadata, wanted = _check(engine, path, load_optimizer_states, load_module_only,
                                                         strict, weights_only)
        # The files summed whole (`.metadata`; every file of a tag saved before item sums), the work split
        # across ranks, before anything changes; the items summed one by one are checked as they are read.
        names = sorted(name for name, (_, sums) in state["files"].items() if isinstance(sums, int))
        checksum = saved_checksum(state)
        found = damaged(path, state["files"], names[engine.rank :: engine.world_size], checksum)
        if not found:  # at the saved layout, read now (see zero3.checkpoint.same_layout's Note)
            direct = SameLayoutLoad.plan(wanted, metadata)
            if direct is not None:
                misread = direct.read(path, state["files"], checksum)
    except Exception as error:  # noqa: BLE001 - every rank raises it, below
        own = error
    finally:
        if paging is not None:
            paging.stop()
    # One exchange: what each rank's checks found (a rank may see other files than the rest: its own disk),
    # whether it could read at the saved layout, and what those reads found.
    everyone = engine.protocol.outcomes(own, (found, direct is not None, misread))
    at_saved_layout = all(read_directly for _, (_, read_directly, _) in everyone)
    try:
        if own is not None:
            raise own
        peer = engine.protocol.first_failure("load_checkpoint", everyone)
        if peer is not None:
            raise peer
        found = [line for _, (lines, _, _) in everyone for line in lines]
        if found:
            raise damage_error(path, found)
        if at_saved_layout:
            assert direct is not None
            misread = list(dict.fromkeys(line for _, (_, _, lines) in everyone for line in lines))  # (once per item)
            if misread:
                raise damage_error(path, misread)
            direct.commit()
    finally:
        if direct is not None:
            direct.release()  # what was read and not copied: a failed load, or one that goes through DCP
    if not at_saved_layout:
        _load_resharded(engine, path, state, wanted, weights_only)

    if optimizer is not None:
        if with_optimizer:
            stepped: dict[str, dict[str, torch.Tensor]] = {}  # each stepped parameter's scalars, by its name
            for key, value in wanted.items():
                if key.startswith("optim."):
                    name, state_name = key[len("optim."):].rsplit(".", 1)  # a state's name has no dot
                    scalars = stepped.setdefault(name, {})
                    if isinstance(value, torch.Tensor):
                        scalars[state_name] = value
            optimizer.set_states({sp: stepped.get(sp.name) for sp in optimizer.params})
            for group, saved_group in zip(optimizer.param_groups, state["optimizer"]["param_groups"]):
                group.update(saved_group)
        optimizer.lp_stale = True  # the 16-bit shards follow the loaded masters (the engine rewrites them)
    if load_module_only:
        return Restored(str(path), state["client_state"], None, None, None, state["world_size"])
    counters = TrainingCounters(state["global_steps"], state["micro_steps"], state["skipped_steps"])
    scheduler = state["lr_scheduler"] if load_lr_scheduler_states else None
    return Restored(str(path), state["client_state"], counters, state["loss_scaler"], scheduler, state["world_size"],
                    state.get("rank_states"), state.get("facts"))
