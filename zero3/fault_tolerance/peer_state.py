"""This rank's whole training state, as a recovering peer receives it, and how it is applied.

[Note: a peer's state]
A recovering replica group takes, rank by rank, the state of the healthy
group's rank with the same shard rank (zero3.fault_tolerance.replicas' Note):
the groups share the config and the shard group's size, so each of its flat
buffers (the 16-bit shards, the fp32 masters, each optimizer state) has the
same layout on both ranks, and it is sent whole: no per-parameter pieces to
build or match. Besides the buffers: each stepped parameter's scalar states
(Adam's step count) and which parameters torch has not stepped yet, the
groups' hyperparameters, the step counters, the loss scaler, the scheduler,
and the rank state a checkpoint saves (random generators, the objects given
to `register_checkpoint_state`).

The buffers are the live ones, not copies: torchft reads them while the
training thread runs the forward and backward, which write none of them, and
stops serving them (its commit takes the transport's write lock) before the
step writes them. A buffer that lives on disk (a disk tier, or one
`offload_states` parked) is read into host memory to be sent. The rank state
is the one taken at the start of the step (`mark_step_start`): the generators
and a data loader move during the forward, on the training thread, so a
reading from torchft's thread would catch them anywhere.

A received state is checked (the parameter names, sizes and shard geometry,
every buffer's size and dtype) and only staged: torchft hands it over rank by
rank, and a rank whose transfer failed (its peer died sending) has none. The
group then agrees (zero3.fault_tolerance.replica_step): where any rank's
transfer failed, no rank applies its staged state, since a group whose ranks
recovered in part would hold shards from two different steps, and no later
quorum would notice.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zero3.engine_state import GradientBuffers, state_list
from zero3.enums import OffloadStateType
from zero3.fault_tolerance.replicas import FaultToleranceError
from zero3.partition.flat_buffer import FlatBuffer
from zero3.partition.sharded_param import ShardedParam

FORMAT = 1


class PeerOptimizer(Protocol):
    """The optimizer's part of a peer's state (zero3.step.optimizer's `ZeroOptimizer`)."""

    params: list[ShardedParam]  # every trained parameter, in the optimizer's order
    hp_params: FlatBuffer | None  # the fp32 masters' buffer (None: the masters are the shards)
    moments: Mapping[str, FlatBuffer]
    grads: GradientBuffers  # not sent: a peer is sent the state between steps
    param_groups: list[dict[str, Any]]
    optimizer: torch.optim.Optimizer

    def has_state(self, sp: ShardedParam) -> bool: ...

    def scalar_state(self, sp: ShardedParam) -> dict[str, torch.Tensor]: ...

    def set_states(self, scalars_by_param: Mapping[ShardedParam, dict[str, torch.Tensor] | None]) -> None: ...


@dataclass(frozen=True)
class PeerView:
    """What a peer's state is read from and written into: the engine makes one when asked."""

    lp_buffers: Sequence[FlatBuffer]  # the 16-bit shards' buffers
    sharded_params: Sequence[ShardedParam]
    shard: tuple[int, int]  # the shard group's size and this rank's place in it
    optimizer: PeerOptimizer | None
    counters: tuple[int, int, int]  # global steps, micro steps, skipped steps
    loss_scaler: dict[str, Any]
    lr_scheduler: dict[str, Any] | None
    rank_state: Callable[[], dict[str, Any] | None]  # as a checkpoint saves it (taken when called)


@dataclass(frozen=True)
class Recovered:
    """What a peer's state brings besides its buffers and optimizer states, for the engine to apply."""

    counters: tuple[int, int, int]
    loss_scaler: dict[str, Any]
    lr_scheduler: dict[str, Any] | None
    rank_state: dict[str, Any] | None


def _readable(buffer: FlatBuffer) -> torch.Tensor:
    """The buffer's values: the live tensor where it is in memory, else a host copy read from its file."""
    if buffer.file is None:
        return buffer.tensor
    into = torch.empty(buffer.numel, dtype=buffer.dtype)
    buffer.read_into(0, into)
    return into


class PeerState:
    """One engine's state for torchft's checkpoint transport (see the Note)."""

    def __init__(self, view: Callable[[], PeerView], report_error: Callable[[BaseException], None]) -> None:
        self._view = view
        self._report_error = report_error
        self._rank_state: dict[str, Any] | None = None
        self.failure: BaseException | None = None  # why the last state received does not fit, if it does not
        self.staged: dict[str, Any] | None = None  # a peer's state received and checked, not applied yet

    # ---- what is sent --------------------------------------------------------------
    def mark_step_start(self) -> None:
        """The rank state as the step begins (see the Note), on the training thread."""
        self._rank_state = copy.deepcopy(self._view().rank_state())

    @staticmethod
    def _buffers(view: PeerView) -> dict[str, FlatBuffer]:
        """The engine's state a peer receives: all of it but this step's gradients (zero3.engine_state)."""
        return {entry.key: entry.buffer for entry in state_list(view.lp_buffers, view.optimizer)
                if entry.state is not OffloadStateType.lp_grads}

    def _layout(self, view: PeerView) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "shard": list(view.shard),
            "params": [[sp.name, sp.numel] for sp in view.sharded_params],
            "buffers": {key: [buffer.numel, str(buffer.dtype)] for key, buffer in self._buffers(view).items()},
            "optimizer": None if view.optimizer is None else type(view.optimizer.optimizer).__name__,
        }

    def state_dict(self) -> dict[str, Any]:
        """What a recovering peer with this shard rank receives (torchft calls it on its quorum thread)."""
        view = self._view()
        optimizer = view.optimizer
        scalars: dict[str, dict[str, torch.Tensor]] = {}
        groups: list[dict[str, Any]] = []
        if optimizer is not None:
            for sp in optimizer.params:
                if optimizer.has_state(sp):
                    scalars[sp.name] = optimizer.scalar_state(sp)
            groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        return {
            "layout": self._layout(view),
            "buffers": {key: _readable(buffer) for key, buffer in self._buffers(view).items()},
            "scalars": scalars,
            "param_groups": copy.deepcopy(groups),
            "counters": list(view.counters),
            "loss_scaler": copy.deepcopy(view.loss_scaler),
            "lr_scheduler": copy.deepcopy(view.lr_scheduler),
            "rank_state": self._rank_state if self._rank_state is not None else copy.deepcopy(view.rank_state()),
        }

    # ---- what is received ------------------------------------------------------------
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Stage a healthy peer's state (torchft calls it on the training thread, at the commit or before
        the forward); `apply_staged` applies it once the group agreed. A state that does not fit is not
        staged: torchft is told, so the group's commit says no, and the engine raises the reason on every
        rank of the group."""
        try:
            self._check(state)
        except Exception as error:  # noqa: BLE001 - reported through the commit, raised by the engine
            self.failure = error
            self._report_error(error)
            return
        self.staged = state

    def _check(self, state: dict[str, Any]) -> None:
        view = self._view()
        parked = [buffer.state for buffer in self._buffers(view).values() if buffer.parked and buffer.store is None]
        if parked:
            raise FaultToleranceError(
                f"a peer's state arrived while this rank's {sorted(set(parked))} are offloaded by offload_states(); "
                "call engine.reload_states() before training, so that a recovery can write them")
        mine = self._layout(view)
        theirs = state.get("layout")
        if theirs == mine:
            return
        if not isinstance(theirs, dict):
            raise FaultToleranceError("a peer's state for recovery has no layout: it is not a zero3 engine's")
        differences = [f"{key}: ours {mine.get(key)!r}, the peer's {theirs.get(key)!r}"
                       for key in mine if theirs.get(key) != mine.get(key)]
        raise FaultToleranceError(
            "the healthy peer's state does not fit this rank's engine (every replica group must run the same model, "
            "config and number of ranks): " + "; ".join(differences)[:2000])

    def apply_staged(self) -> Recovered:
        """Write the staged state's buffers and optimizer states; the rest is returned for the engine."""
        state, self.staged = self.staged, None
        assert state is not None
        view = self._view()
        optimizer = view.optimizer
        buffers = self._buffers(view)
        for key, values in state["buffers"].items():
            buffers[key].write_range(0, values)
        if optimizer is not None:
            by_name = {sp.name: sp for sp in optimizer.params}
            saved = state["scalars"]
            optimizer.set_states({sp: saved.get(name) for name, sp in by_name.items()})
            for group, theirs in zip(optimizer.param_groups, state["param_groups"]):
                group.update(theirs)
        global_steps, micro_steps, skipped_steps = state["counters"]
        return Recovered(counters=(global_steps, micro_steps, skipped_steps), loss_scaler=state["loss_scaler"],
                         lr_scheduler=state["lr_scheduler"], rank_state=state["rank_state"])

    def discard_staged(self) -> None:
        self.staged = None
