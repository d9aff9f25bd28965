"""This torchrun job as one replica group of a torchft job: the quorum, the replicas' average, the commit.

[Note: replica groups on torchft]
With `fault_tolerance.enabled`, each torchrun job is one shard group (the
engine shards over its ranks as plain ZeRO-3 does) and the jobs are the
replicas: HSDP's replicate dimension, held by torchft instead of a process
group fixed at start. torchft's `Manager` (one per rank) does the rest:
* `begin_step` (the first forward of an accumulation window) starts a quorum:
  torchft's lighthouse decides which replica groups take part in this step and
  reconfigures the cross-replica process group when that changes. With
  `async_quorum` it forms while the forward runs.
* `average` is the replicas' gradient sum, once per step, where a fixed
  replicate group would all-reduce (zero3.comm's [Note: the replicas' sum,
  once a step]): torchft's fault-tolerant all-reduce over the ranks holding
  the same shard in the other groups, divided by the groups taking part. A
  peer that dies during it makes it an error, not a hang.
* `commit` is the step's commit point: torchft's `should_commit`, which every
  rank of the group answers alike (it votes inside the group), asked after
  the engine's own agreement that no rank of the group failed and before
  anything changes. A step it refuses is dropped on every rank of the group:
  the gradients go, nothing is applied, and the step is not counted.
* A group behind the others (restarted after a kill) is healed by torchft:
  the quorum names a healthy peer, and each rank fetches that peer's same
  shard rank's state over torchft's checkpoint transport (zero3.fault_tolerance.peer_state
  says what it holds), applied at the commit (`async_quorum`) or before the
  forward. The healing group's gradients count for nothing in that step (torchft
  zeroes them), so its step applies the peers' average to the peers' state:
  it leaves that step bit-identical to them.
Only torchft crosses between groups; every other collective stays inside the
group, so a group that dies takes nothing of the others with it. A rank lost
inside a group takes its group down (its peers in the group raise on the
engine's timeout), and the group comes back as a whole.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zero3.config import FaultToleranceConfig

log = logging.getLogger("zero3")

STATE_KEY = "zero3"  # the name the engine's state is registered under in torchft's Manager


class FaultToleranceError(RuntimeError):
    """fault_tolerance is set up wrongly (torchft missing, no lighthouse), or a recovery cannot apply."""


def _torchft() -> Any:
    try:
        from torchft import manager, process_group
    except ImportError as error:
        raise FaultToleranceError(
            "fault_tolerance.enabled needs torchft (pip install torchft); it could not be imported: "
            f"{error}") from error
    return manager, process_group


@dataclass(frozen=True)
class Setup:
    """Where this group meets torchft: the lighthouse, the group's name, the host of this group's store."""

    lighthouse: str
    replica_id: str
    host: str


def check_setup(config: FaultToleranceConfig) -> Setup:
    """The config and the environment, checked (torchft importable too): `zero3.initialize` calls it before
    anything is built, so a missing lighthouse fails before the model is partitioned."""
    _torchft()
    lighthouse = config.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lighthouse:
        raise FaultToleranceError(
            "fault_tolerance.enabled: no lighthouse address; set fault_tolerance.lighthouse or "
            "TORCHFT_LIGHTHOUSE (http://host:29510, where torchft_lighthouse runs)")
    replica_id = config.replica_id or os.environ.get("TORCHFT_REPLICA_ID")
    if not replica_id:
        raise FaultToleranceError(
            "fault_tolerance.enabled: no replica group name; set fault_tolerance.replica_id or "
            "TORCHFT_REPLICA_ID (one per torchrun job, e.g. 0, 1, ...)")
    host = os.environ.get("MASTER_ADDR")
    if not host:
        raise FaultToleranceError(
            "fault_tolerance.enabled: MASTER_ADDR not set; launch each replica group with torchrun, whose "
            "rank 0 host torchft's store runs on")
    return Setup(lighthouse, str(replica_id), host)


class FaultTolerantReplicas:
    """torchft's Manager for this rank, and where a step meets it (see the Note).

    `state_dict` and `load_state_dict` are this rank's state for a recovering peer (zero3.fault_tolerance.peer_state);
    `load_state_dict` runs on the training thread, inside `commit` (async quorum) or `begin_step`.
    """

    def __init__(self, config: FaultToleranceConfig, grads_device: torch.device,
                 state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None],
                 share: Callable[[Any], list[Any]]) -> None:
        setup = check_setup(config)
        manager_module, pg_module = _torchft()
        # torchft meets this group's ranks (and the other groups their cross-replica groups) in a store. Not
        # torchrun's: that one outlives a restarted attempt, whose ranks would read the dead attempt's manager
        # address there (zero3.default_group's [Note: one store namespace per attempt]). One made by this attempt's
        # rank 0 dies with it; its port reaches the other ranks over the engine's own group (`share`).
        self._store = dist.TCPStore(setup.host, 0, is_master=True, wait_for_workers=False) if dist.get_rank() == 0 else None
        store_port = share(self._store.port if self._store is not None else None)[0]
        timeout = timedelta(seconds=config.timeout_s)
        # The replicas' sum runs where the gradient shards live: gloo for host memory (the CPU, ZeRO-Offload).
        if grads_device.type == "cuda":
            pg = pg_module.ProcessGroupNCCL(timeout=timeout)
        else:
            pg = pg_module.ProcessGroupGloo(timeout=timeout)
        self.async_quorum = config.async_quorum
        self.manager = manager_module.Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=config.min_replicas,
            use_async_quorum=config.async_quorum, init_sync=config.init_sync, timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s), rank=dist.get_rank(),
            world_size=dist.get_world_size(), store_addr=setup.host, store_port=store_port, lighthouse_addr=setup.lighthouse,
            replica_id=setup.replica_id,
        )
        self.manager.register_state_dict_fn(STATE_KEY, load_state_dict, state_dict)
        self._open = False  # a quorum was started and its step not yet committed or dropped

    # ---- the step ------------------------------------------------------------------
    @property
    def open(self) -> bool:
        """Whether a quorum is under way (a peer may be reading this rank's state, or this rank one's)."""
        return self._open

    def begin_step(self) -> None:
        """Start this step's quorum, once per step (the first forward of its window)."""
        if self._open:
            return
        self.manager.start_quorum()
        self._open = True

    def average(self, tensor: torch.Tensor) -> None:
        """The replicas' average of `tensor`, in place (see the Note). A failure here (a peer that died)
        is recorded by torchft and turns the commit down; the tensor is then not used."""
        self.manager.allreduce(tensor).wait()

    def commit(self) -> bool:
        """The step's commit vote (see the Note): True on every rank of the group, or False on every one.
        A recovery pending from the quorum is staged first (torchft's order)."""
        self._open = False
        return bool(self.manager.should_commit())

    def abandon(self) -> None:
        """The step raised on every rank of the group before its commit: the next forward starts a new quorum."""
        self._open = False

    def participants(self) -> int:
        """Replica groups in this step's quorum (waits for it)."""
        return self.manager.num_participants()

    def current_step(self) -> int:
        """Steps committed, as torchft counts them (the engine's global_steps where every step committed)."""
        return self.manager.current_step()

    def follow_checkpoint(self, global_steps: int) -> None:
        """A checkpoint loaded from disk: torchft's step count follows it, so the quorum compares like with like."""
        self.manager.load_state_dict({"step": global_steps, "batches_committed": self.manager.batches_committed()})

    def close(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception as error:  # noqa: BLE001 - teardown goes on; the error is logged
            log.warning("fault_tolerance: torchft's manager did not shut down cleanly: %s", error)
