"""A save whose state has the last save's layout, written without DCP's exchanges.

[Note: repeated saves]
`dcp.save` makes three exchanges between the ranks for every save: each rank's
plan gathered to the coordinator and the global plan sent back, then each
rank's write results (one per item) gathered to the coordinator, which writes
the metadata and sends it, whole, back to every rank. Automatic checkpoints
save the same layout every few steps (the same entries, boxes and item sizes),
and DCP's plan caching (zero3.checkpoint.planners' `SavePlanner`) already
makes the first exchange carry no items after the first save; the rest still
pickled and sent a few hundred objects per save (measured on the CPU, 6 x 512
GPT at two ranks, a save every step: each writer spent 70-80 ms of CPU a save
with them, 50-60 ms without).

So each rank remembers, per group, what its last complete save came to: the
state's layout, its final plan (as DCP's planner finished it), its write
results, and on the coordinator DCP's metadata and every rank's results. A
save whose layout every rank finds unchanged (one small exchange, below)
sets DCP's planner up on the new state, writes its file with the remembered
plan (the same `DataFileWriter`, so the same bytes, sums and failures), and
sends its results only if they differ from last time, in the exchange the
save makes anyway to agree on failures. The coordinator then writes the
metadata with DCP's own `finish`, the remembered metadata with this save's
results, as `dcp.save` would have with its cached global plan. The files are
the ones `dcp.save` writes. Anything else (a first save, a new layout on any
rank, a writer that has just started, a save that failed) goes through
`dcp.save`, and a rank forgets what it remembered when a save of its fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from zero3.checkpoint.chunks import RangeChunks
from zero3.checkpoint.data_files import DataFileWriter
from zero3.checkpoint.planners import SavePlanner

Layout = tuple[tuple[Any, ...], ...]


class Peers(Protocol):
    def all_gather_objects(self, obj: Any) -> list[Any]: ...


@dataclass
class LastSave:
    """What this rank's last complete save on a group came to (see the Note)."""

    number: int  # saves remembered on this group so far: equal on every rank that remembered the same ones
    layout: Layout
    plan: SavePlan  # this rank's final plan
    results: list[WriteResult]  # this rank's
    metadata: Metadata | None  # the coordinator's: DCP's global metadata
    all_results: list[list[WriteResult]] | None  # the coordinator's: every rank's results, by rank


_last: dict[str, LastSave] = {}  # by DCP's plan-cache key (the group's name and size), per process, as DCP's own


def layout(state: dict[str, Any]) -> Layout | None:
    """What the plan of a save of `state` (the flat entries) depends on; None where an entry is neither a
    tensor nor a RangeChunks (such a save always goes through DCP)."""
    found: list[tuple[Any, ...]] = []
    for key, entry in state.items():
        if isinstance(entry, RangeChunks):
            found.append((key, "range", entry.dtype, tuple(entry.shape), entry.start, entry.end))
        elif isinstance(entry, torch.Tensor):
            # DCP's metadata records these of a whole tensor (TensorProperties.create_from_tensor).
            found.append((key, "tensor", entry.dtype, tuple(entry.shape), entry.requires_grad, entry.is_pinned()))
        else:
            return None
    return tuple(found)


def agreed(peers: Peers, key: str, state_layout: Layout | None) -> LastSave | None:
    """The last save this one repeats, if every rank remembers the same one with this layout; else None.
    Collective (one exchange of a few bytes); a rank forgets what it remembered until the save is complete."""
    last = _last.pop(key, None)
    said = last.number if last is not None and state_layout is not None and last.layout == state_layout else None
    heard = peers.all_gather_objects(said)
    return last if said is not None and all(number == said for number in heard) else None


def write(last: LastSave, state: dict[str, Any], writer: DataFileWriter, planner: SavePlanner, rank: int) -> None:
    """This rank's file with the remembered plan (no exchange); `writer.results` then holds its results."""
    # What DCP's set-up of the planner comes to for zero3's state (the grouped entries flattened back to
    # these names: zero3.checkpoint.tag_write's `grouped`), without walking it again.
    planner.state_dict, planner.mappings, planner.is_coordinator = state, {key: (key,) for key in state}, rank == 0
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    Path(writer.path).mkdir(parents=True, exist_ok=True)
    planner.plan = last.plan
    writer.write_data(last.plan, planner).wait()


def changed_results(last: LastSave | None, writer: DataFileWriter) -> list[WriteResult] | None:
    """This rank's results, where the coordinator needs them: a repeated save whose items landed elsewhere
    in the file than last time (else None)."""
    if last is None:
        return None
    found = [(result.index, result.storage_data) for result in writer.results]
    return writer.results if found != [(result.index, result.storage_data) for result in last.results] else None


def finish(last: LastSave, writer: DataFileWriter, sent: list[list[WriteResult] | None]) -> None:
    """The coordinator's part of a repeated save: DCP's metadata file, with each rank's results (those it
    `sent`, else last time's)."""
    assert last.metadata is not None and last.all_results is not None
    all_results = [mine if mine is not None else before for mine, before in zip(sent, last.all_results)]
    writer.finish(metadata=last.metadata, results=all_results)
    last.all_results = all_results


def remember(key: str, last: LastSave | None, state_layout: Layout | None, planner: SavePlanner,
             writer: DataFileWriter, metadata: Metadata | None, rank: int) -> None:
    """Remember a complete save (every rank agreed it is): `last` if it repeated one, else what `dcp.save`
    came to (its `metadata`)."""
    if state_layout is None or (rank == 0 and last is None and (metadata is None or writer.all_results is None)):
        return
    if last is not None:
        last.number += 1
        last.results = writer.results
        _last[key] = last
        return
    _last[key] = LastSave(
        number=0, layout=state_layout, plan=planner.plan, results=writer.results,
        metadata=metadata if rank == 0 else None, all_results=writer.all_results,
    )


def forget(key: str) -> None:
    _last.pop(key, None)
