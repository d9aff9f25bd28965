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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zero3.fault_tolerance.replicas import FaultToleranceError

if TYPE_CHECKING:
    from zero3.partition.flat_buffer import FlatBuffer
    from zero3.runtime.engine import ZeroEngine

FORMAT = 1


def _readable(buffer: FlatBuffer) -> torch.Tensor:
    """The buffer's values: the live tensor where it is in memory, else a host copy read from its file."""
    if buffer.file is None:
        return buffer.tensor
    into = torch.empty(buffer.numel, dtype=buffer.dtype)
    buffer.read_into(0, into)
    return into


class PeerState:
    """One engine's state for torchft's checkpoint transport (see the Note)."""

    def __init__(self, engine: ZeroEngine, report_error: Callable[[BaseException], None]) -> None:
        self.engine = engine
        self._report_error = report_error
        self._rank_state: dict[str, Any] | None = None
        self.failure: BaseException | None = None  # why the last state received does not fit, if it does not
        self.staged: dict[str, Any] | None = None  # a peer's state received and checked, not applied yet

    # ---- what is sent --------------------------------------------------------------
    def mark_step_start(self) -> None:
        """The rank state as the step begins (see the Note), on the training thread."""
        self._rank_state = copy.deepcopy(self.engine._rank_state())

    def _buffers(self) -> dict[str, FlatBuffer]:
        engine = self.engine
        buffers = {f"lp_params.{index}": buffer for index, buffer in enumerate(engine.parts.lp_buffers)}
        optimizer = engine.optimizer
        if optimizer is not None:
            if optimizer.hp_params is not None:
                buffers["hp_params"] = optimizer.hp_params
            for name, buffer in optimizer.moments.items():
                buffers[f"optim_states.{name}"] = buffer
        return buffers

    def _layout(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "format": FORMAT,
            "shard": [engine.mesh.shard_size, engine.mesh.shard_rank],
            "params": [[sp.name, sp.numel] for sp in engine.parts.sharded_params],
            "buffers": {key: [buffer.numel, str(buffer.dtype)] for key, buffer in self._buffers().items()},
            "optimizer": None if engine.optimizer is None else type(engine.optimizer.optimizer).__name__,
        }

    def state_dict(self) -> dict[str, Any]:
        """What a recovering peer with this shard rank receives (torchft calls it on its quorum thread)."""
        engine = self.engine
        optimizer = engine.optimizer
        scalars: dict[str, dict[str, torch.Tensor]] = {}
        groups: list[dict[str, Any]] = []
        if optimizer is not None:
            for sp in optimizer.params:
                if optimizer.has_state(sp):
                    scalars[sp.name] = optimizer.scalar_state(sp)
            groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        return {
            "layout": self._layout(),
            "buffers": {key: _readable(buffer) for key, buffer in self._buffers().items()},
            "scalars": scalars,
            "param_groups": copy.deepcopy(groups),
            "counters": [engine.global_steps, engine.micro_steps, engine.skipped_steps],
            "loss_scaler": copy.deepcopy(engine.loss_scaler.state_dict()),
            "lr_scheduler": None if engine.lr_scheduler is None else copy.deepcopy(engine.lr_scheduler.state_dict()),
            "rank_state": self._rank_state if self._rank_state is not None else copy.deepcopy(engine._rank_state()),
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
        parked = [buffer.state for buffer in self._buffers().values() if buffer.parked and buffer.store is None]
        if parked:
            raise FaultToleranceError(
                f"a peer's state arrived while this rank's {sorted(set(parked))} are offloaded by offload_states(); "
                "call engine.reload_states() before training, so that a recovery can write them")
        mine = self._layout()
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

    def apply_staged(self) -> None:
        state, self.staged = self.staged, None
        assert state is not None
        engine = self.engine
        optimizer = engine.optimizer
        buffers = self._buffers()
        for key, values in state["buffers"].items():
            buffers[key].write_range(0, values)
        if optimizer is not None:
            by_name = {sp.name: sp for sp in optimizer.params}
            saved = state["scalars"]
            optimizer.set_states({sp: saved.get(name) for name, sp in by_name.items()})
            for group, theirs in zip(optimizer.param_groups, state["param_groups"]):
                group.update(theirs)
            optimizer.lp_stale = False  # the 16-bit shards came with the masters
        engine.global_steps, engine.micro_steps, engine.skipped_steps = state["counters"]
        engine.loss_scaler.load_state_dict(state["loss_scaler"])
        if engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        engine._apply_rank_state(state["rank_state"])

    def discard_staged(self) -> None:
        self.staged = None
