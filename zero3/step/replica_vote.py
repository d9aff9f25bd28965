"""What the step asks of torchft's replicas (zero3.fault_tolerance.replica_step implements it), declared
here, in the step's own room, so the step never reaches up into fault tolerance."""

from __future__ import annotations

from typing import Protocol

import torch


class ReplicaVote(Protocol):
    """What the step asks of torchft's replicas (zero3.fault_tolerance.replica_step), where it runs with them."""

    def average(self, tensor: torch.Tensor) -> None:
        """The replica groups' average of `tensor`, in place."""
        ...

    def commit(self) -> bool:
        """The quorum's vote on this step (a recovering group takes its peer's state in it)."""
        ...

    def abandon(self) -> None:
        """The step raised on every rank of the group before its vote."""
        ...
