"""The engine's state-offloading API (`offload_states`, `reload_states`, where each state lives).

A mixin of `ZeroEngine`: the bodies are the offloader's; what is here checks
the arguments and the moment, and lets go of every view of a state before it
moves.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zero3.comm import Communicator
from zero3.enums import OffloadDevice, OffloadStateType, parse_offload_device, parse_state, parse_states
from zero3.offload.manager import StateOffloader
from zero3.offload.report import StateReport
from zero3.partition.flat_buffer import StateOffloadedError
from zero3.step_protocol import StepProtocol
from zero3.engine.build import EngineParts

if TYPE_CHECKING:
    from zero3.checkpoint.async_saves import AsyncSaves
    from zero3.fault_tolerance.replica_step import ReplicaStep

# The states each training call reads or writes (a call refuses to run while one is offloaded).
FORWARD_NEEDS = (OffloadStateType.lp_params,)
BACKWARD_NEEDS = (OffloadStateType.lp_params, OffloadStateType.lp_grads, OffloadStateType.contiguous_grad_buffer)
CHECKPOINT_NEEDS = (OffloadStateType.hp_params, OffloadStateType.lp_params, OffloadStateType.optim_states)
STEP_NEEDS = (
    OffloadStateType.hp_params, OffloadStateType.lp_params, OffloadStateType.lp_grads, OffloadStateType.optim_states,
)


class OffloadMethods:
    comm: Communicator
    protocol: StepProtocol
    parts: EngineParts
    offloader: StateOffloader
    saves: AsyncSaves
    _check_alive: Callable[[], None]  # the engine's: refuses a destroyed engine
    fault_tolerance: ReplicaStep | None  # torchft's side of the step (zero3.fault_tolerance), if enabled

    def offload_states(
        self,
        include: Any = None,
        device: OffloadDevice | str = OffloadDevice.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
        nvme_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Move this rank's states off the device: `include` (None = all five) to "cpu" or "nvme" (disk).

        Gathered parameters and in-flight prefetches are released first. The
        disk tier writes under `nvme_path` (default: the config's
        zero_optimization.offload_param.nvme_path). Offloading a state that is
        already offloaded does nothing. Every argument is checked, and disk
        space reserved, before anything moves. Collective: call on every rank
        between training steps. If it fails on any rank (its disk), every rank
        raises and none keeps what this call offloaded.
        """
        self._check_alive()
        states = parse_states(include)
        target = parse_offload_device(device)
        self.parts.check_between_steps("offload_states")
        if self.fault_tolerance is not None:
            self.fault_tolerance.require_closed("offload_states")
        mark = self.offloader.mark()

        def offload() -> None:
            root = self.offloader.disk_root(nvme_path) if target is OffloadDevice.nvme else None
            self.offloader.offload(states, target, bool(pin_memory), bool(non_blocking), root, self._prepare_offload)

        self.protocol.agree("offload_states", offload, " (no rank keeps this call's states offloaded)",
                            undo=lambda: self.offloader.undo(mark))
        self.saves.release_unused_state()  # what async saves read in place, once all of it moved out

    def pin_offload_buffers(self, include: Any = None) -> int:
        """Page-lock, in a background thread, the host buffers that `offload_states(include,
        device="cpu")` will copy into, so that its first call runs at the copy speed.

        Page-locking is the slow part of a first offload (seconds per GiB); call this after
        `initialize` and keep training meanwhile. An `offload_states` that needs a buffer still
        being made waits for it. Returns how many buffers are being made: none on the CPU (the
        states live in host memory already), or when they exist from an earlier call or offload.
        Not collective; best effort (a failure is logged, and offload_states makes what is missing).
        """
        self._check_alive()
        return self.offloader.pin_ahead(parse_states(include))

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back every offloaded state, bit-exact; recreate a freed scratch bucket.

        With `non_blocking=True` the copies finish in the background and any
        later use of a state waits for its copy. Collective: if a read fails on
        any rank, every rank raises; what failed stays offloaded, and a second
        call on every rank tries it again.
        """
        self._check_alive()
        self.parts.check_between_steps("reload_states")
        if self.fault_tolerance is not None:
            self.fault_tolerance.require_closed("reload_states")
        self.protocol.agree("reload_states", lambda: self.offloader.reload(bool(non_blocking)),
                            " (what failed stays offloaded, intact: call engine.reload_states() again on every rank)")

    def state_devices(self, state: OffloadStateType | str) -> set[torch.device]:
        """The devices whose memory holds `state` (see zero3.get_state_devices)."""
        self._check_alive()
        return self.offloader.devices(parse_state(state))

    def state_report(self) -> StateReport:
        """Per state, where it lives and its bytes there (a dict; `print()` it for a table)."""
        self._check_alive()
        return self.offloader.report()

    def _prepare_offload(self, states: set[OffloadStateType]) -> None:
        """Let go of every view of the states about to move (see zero3.offload.manager's Note)."""
        parts = self.parts
        if parts.optimizer is not None:
            parts.optimizer.undo_early_steps("offload_states moved the state")
        parts.backward.finish()
        parts.coordinator.release_all()
        self.comm.settle()  # collectives' aliases would keep released memory (the scratch bucket) resident
        if OffloadStateType.lp_params in states and parts.persistent_unit is not None:
            parts.persistent_unit.reshard()  # re-gathered by the next forward
        if OffloadStateType.lp_params in states and parts.secondary is not None:
            parts.secondary.drop_buffer()  # hpZ's secondary shards: made and filled by the next training forward
        masters = {OffloadStateType.hp_params, OffloadStateType.optim_states}
        if parts.optimizer is not None and parts.optimizer.masters_are_shards:
            masters.add(OffloadStateType.lp_params)  # the masters view the shards
        if parts.optimizer is not None and states & masters:
            parts.optimizer.unbind_views()
        if parts.grads is not None and OffloadStateType.lp_grads in states:
            parts.grads.forget_views()

    def _require_resident(self, what: str, needed: tuple[OffloadStateType, ...]) -> None:
        if self.parts.lean and OffloadStateType.lp_params in needed:
            needed = (*needed, OffloadStateType.hp_params)  # the lean units' gathers cast the masters
        away = self.offloader.missing(needed)
        if away:
            names = ", ".join(state.value for state in away)
            raise StateOffloadedError(
                f"engine.{what}() needs {names}, offloaded by offload_states(); call engine.reload_states() first"
            )
