"""The `fault_tolerance` section: torchft replica groups."""

from __future__ import annotations

from pydantic import Field, model_validator

from zero3.config.base import _KeyedError, _Model


class FaultToleranceConfig(_Model):
    """The `fault_tolerance` section: this torchrun job is one replica group of a torchft job
    (zero3.fault_tolerance's Note). The replicas' gradient average runs through torchft's Manager,
    each step commits where its quorum says so, and a group that comes back takes its state from a
    healthy peer."""

    enabled: bool = False
    # This group's name among the replica groups (torchft's replica_id; its trailing digits number it).
    # None: the TORCHFT_REPLICA_ID environment variable.
    replica_id: str | None = None
    # The lighthouse's address (http://host:port); None: the TORCHFT_LIGHTHOUSE environment variable.
    lighthouse: str | None = None
    # Replica groups a step needs to commit (torchft's min_replica_size).
    min_replicas: int = Field(default=1, ge=1)
    # torchft's timeouts: its collectives, should_commit and a recovery's transfer; and forming a quorum.
    timeout_s: float = Field(default=60.0, gt=0)
    quorum_timeout_s: float = Field(default=60.0, gt=0)
    # The quorum forms during the forward (torchft's default); false: before it, so a recovery lands
    # before the step's forward rather than at its commit.
    async_quorum: bool = True
    # torchft's first quorum copies each rank's state from one group to the others, so that groups whose
    # models were initialized differently start equal; false where every group builds the same weights
    # (the same seed), which also lets the first step average every group's gradients.
    init_sync: bool = True

    @model_validator(mode="after")
    def _named(self) -> FaultToleranceConfig:
        if self.replica_id is not None and not self.replica_id.strip():
            raise _KeyedError(("replica_id",), "expected a non-empty name for this replica group", (self.replica_id,))
        if self.lighthouse is not None and not self.lighthouse.strip():
            raise _KeyedError(("lighthouse",), "expected the lighthouse's address, as http://host:port",
                              (self.lighthouse,))
        return self
