"""Whole parameters, streamed one at a time: `engine.iter_full_params`, for a generator's weight loading.

[Note: streaming whole parameters]
An RLHF loop hands the actor's weights to a generator (vLLM's
`load_weights`, SGLang's `update_weights_from_tensor`) every few steps, often
while the actor's other states are parked. Each parameter is gathered on its
own into one flat buffer, reused for every parameter: this rank's shard is
written straight into its chunk of the buffer and all-gathered in place, and
the rank-major output of one parameter already is its padded full value, so
nothing is copied out. The extra memory is that buffer: the largest streamed
parameter, so at most the largest unit. (Gathering a whole unit in one
collective would hold its output and a copy-out buffer: twice the unit. A
fresh buffer per parameter could briefly overlap the last one, which a
collective's worker thread may still be letting go of.) Reusing the buffer is
why a yielded tensor is valid only until the next one is asked for.

The shard is read from wherever `lp_params` is, without moving the state
(`FlatBuffer.read_into`): the flat buffer on the device or in host memory (the
offload_param cpu tier, or parked by `offload_states(device="cpu")`), or the
file that holds it (the offload_param disk tier's, or the one
`offload_states(device="nvme")` parked it in). Only the one parameter's range
is read, straight into its chunk when it needs no cast and no device copy
(else through host pieces of at most STAGING_BYTES); the state stays parked
and `state_report()` does not change.

`dtype` is applied to the shard before the gather: a cast is elementwise, so
it gives the values a cast of the whole would, and the gathered buffer is
already the tensor the consumer gets. A world of one has nothing to gather: a
shard in memory, on the device, in the asked dtype is the whole parameter,
and is yielded as a view of it (no memory at all).

A shared-out expert weight (zero3.moe.expert_parallel) is gathered in two
steps: its share from the ranks that shard it (its unit's expert-data group)
into the buffer, then the shares of the expert-parallel group, each a
contiguous run of the whole's rows in group-rank order, into a second buffer
the size of the largest whole expert weight: the tensor yielded is `[E, ...]`
as the model has it without expert parallelism.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from zero3.comm import Communicator
from zero3.moe.expert_parallel import ExpertShare, expert_share
from zero3.partition.collectives import ParamGather
from zero3.partition.flat_buffer import Slot
from zero3.partition.sharded_param import ShardedParam, require_sharded
from zero3.partition.unit import unit_of


# The host memory a shard read from disk passes through when it is cast or bound for a device.
STAGING_BYTES = 64 << 20


class ParkedStates(Protocol):
    """Where `offload_states` put the states (the StateOffloader)."""

    def settle(self) -> None: ...


def stream(
    module: nn.Module,
    gather: ParamGather,
    parked: ParkedStates,
    dtype: torch.dtype,
    names: Iterable[str] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Check the request (collective: every rank the same), then return the stream of whole parameters.

    The checks run now, not at the first `next()`: an unknown name raises before anything is gathered.
    """
    return _gathered(request(module, gather, dtype, names), gather, parked, dtype)


def request(
    module: nn.Module, gather: ParamGather, dtype: torch.dtype, names: Iterable[str] | None,
) -> list[tuple[str, ShardedParam]]:
    """The parameters a stream yields, once the request is checked (collective: every rank the same)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"iter_full_params: dtype must be a torch.dtype or None, got {dtype!r}")
    wanted: list[str] | None = None
    if names is not None:
        listed = [] if isinstance(names, str) else list(names)
        if isinstance(names, str) or not all(isinstance(name, str) for name in listed):
            raise TypeError(f"iter_full_params: names must be a collection of parameter names (str), got {names!r}")
        wanted = sorted(set(listed))
    _check_same_request(gather, dtype, wanted)
    return select(module, wanted)


def select(module: nn.Module, names: Collection[str] | None) -> list[tuple[str, ShardedParam]]:
    """(name, parameter) in named_parameters order, each parameter once: a tied weight under its first
    name, or, with `names`, under its first name that `names` holds. Unknown names raise ValueError."""
    wanted = None if names is None else set(names)
    known: set[str] = set()
    chosen: dict[int, tuple[str, ShardedParam]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        known.add(name)
        if id(param) in chosen or (wanted is not None and name not in wanted):
            continue
        chosen[id(param)] = (name, require_sharded(param, f"iter_full_params: parameter {name}"))
    unknown = sorted(wanted - known) if wanted is not None else []
    if unknown:
        raise ValueError(f"iter_full_params: the model has no parameter named {', '.join(map(repr, unknown))}")
    return list(chosen.values())


def _check_same_request(gather: ParamGather, dtype: torch.dtype, names: list[str] | None) -> None:
    """Every rank asks for the same stream, or every rank raises (different ones would gather
    different parameters and hang, or trade shards of different parameters)."""
    if gather.comm is None or not gather.mesh.sharded:
        return
    requests = gather.comm.all_gather_objects((str(dtype), names))
    if any(request != requests[0] for request in requests):
        differing = [rank for rank, request in enumerate(requests) if request != requests[0]]
        raise ValueError(
            "iter_full_params is collective: every rank must pass the same dtype and names "
            f"(ranks {differing} differ from rank 0)"
        )


class GatherBuffer:
    """The one flat buffer every parameter is gathered into in turn, made at its first use; and the one
    host piece that a shard read from disk passes through when it is cast or bound for a device."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, shard_numel: int,
                 whole_numel: int = 0) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.shard_numel = shard_numel  # the largest shard read through the staging piece
        self.whole_numel = whole_numel  # the largest whole expert weight (see the Note)
        self._tensor: torch.Tensor | None = None
        self._whole: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None

    def take(self, numel: int) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return self._tensor[:numel]

    def take_whole(self, numel: int) -> torch.Tensor:
        if self._whole is None:
            self._whole = torch.empty(self.whole_numel, dtype=self.dtype, device=self.device)
        return self._whole[:numel]

    def staging(self, dtype: torch.dtype) -> torch.Tensor:
        """The staging piece, made once for the whole walk at the size its largest shard needs: a fresh
        piece per parameter could be made before the reader thread had let go of the last one, and two
        were alive now and then (test_full_params' fp32-from-disk bound)."""
        if self._staging is None or self._staging.dtype != dtype:
            self._staging = torch.empty(min(max(1, STAGING_BYTES // dtype.itemsize), self.shard_numel), dtype=dtype)
        return self._staging


def _gathered(
    chosen: list[tuple[str, ShardedParam]], gather: ParamGather, parked: ParkedStates, dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    if not chosen:
        return
    parked.settle()  # background offload writes or reloads land first: each buffer is where it says
    output = GatherBuffer(max(sp.padded_numel for _, sp in chosen), dtype, chosen[0][1].placeholder.device,
                          max(sp.shard_numel for _, sp in chosen),
                          max((sp.whole_shape.numel() for _, sp in chosen if expert_share(sp.param)), default=0))
    for name, sp in chosen:
        yield name, whole(sp, gather, output)
    del output
    Communicator.forget_released()  # the collectives' aliases of the buffer go with it


def whole(sp: ShardedParam, gather: ParamGather, output: GatherBuffer) -> torch.Tensor:
    """One parameter, whole (`sp.whole_shape`), on the engine's device, in the buffer's dtype (collective);
    `gather` is the dense parameters' (an expert weight's share is gathered by its own unit's)."""
    share = expert_share(sp.param)
    if share is None:
        return _gathered_shards(sp, gather, output)
    return _whole_experts(sp, share, output)


def _whole_experts(sp: ShardedParam, share: ExpertShare, output: GatherBuffer) -> torch.Tensor:
    """A shared-out expert weight: its share gathered, then every share of the expert-parallel group."""
    unit = unit_of(sp)
    assert unit is not None and unit.gather.comm is not None, f"{sp.name}: an expert share has its engine's unit"
    values = _gathered_shards(sp, unit.gather.exact(), output).reshape(-1)
    topology = unit.gather.comm.topology
    assert topology is not None and topology.experts is not None, f"{sp.name}: an expert share has its groups"
    shares = ParamGather(topology.experts, unit.gather.comm, own_group=True)  # rank-major: expert order
    return shares.gather(values, output.take_whole(sp.whole_shape.numel())).view(sp.whole_shape)


def _gathered_shards(sp: ShardedParam, gather: ParamGather, output: GatherBuffer) -> torch.Tensor:
    """The parameter as this rank's module holds it (`sp.shape`), its shards gathered over `gather`'s mesh."""
    slot = sp.lp_slot
    if slot is not None and not gather.mesh.sharded:
        buffer = slot.buffer
        if not buffer.parked and buffer.dtype == output.dtype and buffer.device == output.device:
            return slot.view()[: sp.numel].view(sp.shape)  # a shard group of one: the shard is the parameter
    full = output.take(sp.padded_numel)
    own = full.narrow(0, gather.mesh.shard_rank * sp.shard_numel, sp.shard_numel)
    read_own_shard(sp, own, output)
    if sp.shard_numel > 0:
        gather.gather(own, full)  # in place: this rank's shard already sits in its chunk
    return full[: sp.numel].view(sp.shape)


def read_own_shard(sp: ShardedParam, into: torch.Tensor, staging: GatherBuffer) -> None:
    """This rank's shard of `sp`, as a gather sends it, into `into` (cast to its dtype), from wherever it
    lives; a lean parameter's (zero3.partition.lean) is its master, read wherever it is, cast to its 16 bits."""
    if sp.lp_slot is not None:
        read_shard(sp.lp_slot, into, staging)
        return
    assert sp.lean_master is not None, f"parameter {sp.name} has no shard storage"
    fp32 = torch.empty(sp.shard_numel, dtype=torch.float32, device=into.device)
    read_shard(sp.lean_master, fp32, staging)
    into.copy_(fp32.to(sp.dtype))


def read_shard(slot: Slot, into: torch.Tensor, output: GatherBuffer) -> None:
    """This rank's shard of one parameter into `into` (cast to its dtype), from wherever it lives."""
    buffer = slot.buffer
    if buffer.file is None or (into.device.type == "cpu" and into.dtype == buffer.dtype):
        buffer.read_into(slot.offset, into)  # from memory, or from its file straight into its place
        return
    staging = output.staging(buffer.dtype)  # a cast, or a device: through one bounded host piece
    step = staging.numel()
    for start in range(0, slot.numel, step):
        piece = staging[: min(step, slot.numel - start)]
        buffer.read_into(slot.offset + start, piece)
        into[start : start + piece.numel()].copy_(piece)
