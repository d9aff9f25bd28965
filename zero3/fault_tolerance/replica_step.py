"""Where an engine's step meets torchft: the quorum at the forward, the average, the commit (zero3.fault_tolerance.replicas' Note)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zero3.config import FaultToleranceConfig
from zero3.fault_tolerance.peer_state import PeerState, PeerView, Recovered
from zero3.fault_tolerance.replicas import FaultTolerantReplicas
from zero3.step_protocol import StepProtocol


class ReplicaStep:
    """The engine's side of torchft: one per engine with `fault_tolerance.enabled`. It reads and writes the
    engine's state through `view` (zero3.fault_tolerance.peer_state), and hands what a recovery brings
    besides to `apply`, as it lands."""

    def __init__(self, config: FaultToleranceConfig, grads_device: torch.device, protocol: StepProtocol,
                 all_gather_objects: Callable[[Any], list[Any]], view: Callable[[], PeerView],
                 apply: Callable[[Recovered], None]) -> None:
        self.protocol = protocol
        self._apply = apply
        self.peer_state = PeerState(view, report_error=lambda error: self.replicas.manager.report_error(error))
        self.replicas = FaultTolerantReplicas(config, grads_device, self.peer_state.state_dict,
                                              self.peer_state.load_state_dict, all_gather_objects)
        self.recovered = False  # a peer's state was applied since the engine last looked (`take_recovered`)
        self._torchft_before: dict[str, int] = {}
        self.recoveries = 0  # times this rank took its state from a peer

    def begin_step(self) -> None:
        """At a training forward: the step's quorum, once per step, with the rank state as the step begins."""
        if self.replicas.open:
            return
        self.peer_state.mark_step_start()
        self._torchft_before = self.replicas.manager.state_dict()  # put back if a recovery is not applied
        self.replicas.begin_step()
        if not self.replicas.async_quorum:  # a recovery landed before the forward: gathered copies follow it
            self._settle_recovery()

    def average(self, tensor: torch.Tensor) -> None:
        if not self.replicas.open:
            self.begin_step()
        self.replicas.average(tensor)

    def commit(self) -> bool:
        """The quorum's vote on this step, alike on every rank of the group; a recovery that could not be
        applied raises on every rank of the group, with nothing of the step applied."""
        committed = self.replicas.commit()
        if self.replicas.async_quorum:  # (before the forward, torchft hands a recovery over in begin_step only)
            self._settle_recovery()
        return committed

    def _settle_recovery(self) -> None:
        """The peers' states staged on this group's ranks (zero3.fault_tolerance.peer_state's Note) are
        applied where torchft asked for them, or nowhere: nowhere if a rank's transfer or anything else of
        torchft's failed on any rank (the group's commit says no then, and torchft's step count goes back,
        so the next quorum heals again), and an error on every rank where a state does not fit.

        torchft decides healing per rank: a group behind the others heals on every rank, while its first
        quorum (torchft's `init_sync`) may heal some ranks of each group from another group's same rank."""
        failure, self.peer_state.failure = self.peer_state.failure, None
        staged = self.peer_state.staged is not None
        errored = self.replicas.manager.errored() is not None
        any_failed, any_staged, any_errored = self.protocol.flags([failure is not None, staged, errored])
        if any_staged and (any_failed or any_errored):
            self.peer_state.discard_staged()
            self.replicas.manager.load_state_dict(self._torchft_before)  # still behind: healed again next time
        if any_failed:
            self.replicas.abandon()  # (the quorum before the forward: the next forward starts another)
            self.protocol.fail_together("fault-tolerant recovery", failure,
                                        " (the step was not applied; this group stays behind its peers)")
        if not any_staged or any_errored:
            return
        if staged:
            self._apply(self.peer_state.apply_staged())
            self.recoveries += 1
        self.recovered = True  # on every rank: what is gathered follows, together

    def take_recovered(self) -> bool:
        recovered, self.recovered = self.recovered, False
        return recovered

    def abandon(self) -> None:
        """The step raised on every rank of the group before its vote."""
        self.replicas.abandon()

    def require_closed(self, what: str) -> None:
        """Refuse a call that moves state while a quorum is open (a peer may be reading it, or this rank
        receiving one): it is open from a training forward until that step's `engine.step()`."""
        if self.replicas.open:
            raise RuntimeError(
                f"engine.{what}() refused: a fault-tolerance quorum is open (from this step's first training "
                "forward until its engine.step(): a recovering peer may be reading this rank's state, or this rank "
                f"receiving one); call {what} after engine.step()")

    def close(self) -> None:
        self.replicas.close()
