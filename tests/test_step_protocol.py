"""The step protocol's agreements scoped to one replica group (the seam for a fault-tolerance manager):
4 ranks as 2 replica groups of 2, each group's protocol made with `Scope.of(group)`. A failure in one group is
raised on that group's ranks alone, naming the failing rank by its job rank, while the other group agrees that
nothing failed and goes on; the job-wide protocol still carries one rank's failure to all four. Every collective
runs on groups with a 60 s timeout, so a rank that skipped one fails the test instead of hanging it."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from tests.distributed import run_ranks
from zero3.comm import Communicator
from zero3.rank_failure import Scope
from zero3.step_protocol import StepProtocol

WORLD = 4
FAILING = 3  # a rank of the second replica group
DEADLINE = datetime.timedelta(seconds=60)


def outcome(call: object) -> str:
    try:
        result = call()  # type: ignore[operator]
    except Exception as error:  # noqa: BLE001 - what each rank saw is the result
        return f"{type(error).__name__}: {error}"
    return f"ok {result!r}"


def scoped(rank: int, world: int) -> dict[str, object]:
    dist.init_process_group("gloo", timeout=DEADLINE)
    groups = [dist.new_group([0, 1], backend="gloo", timeout=DEADLINE),
              dist.new_group([2, 3], backend="gloo", timeout=DEADLINE)]
    job_group = dist.new_group(list(range(world)), backend="gloo", timeout=DEADLINE)
    comm = Communicator()
    mine = groups[rank // 2]
    replica = StepProtocol(comm, Scope.of(mine))
    job = StepProtocol(comm, Scope(job_group, tuple(range(world))))
    seen: dict[str, object] = {"scope": replica.scope.ranks}

    def fail_on(failing: int) -> OSError | None:
        return OSError(f"disk of rank {failing} gone") if rank == failing else None

    # One failure flag, settled within the replica group.
    seen["settle"] = outcome(lambda: replica.raise_together("step", fail_on(FAILING)))
    # A call between steps: it raises on rank 0, whose group alone raises; the other group gets its result.
    seen["agree"] = outcome(lambda: replica.agree("offload_states", lambda: 1 / (rank - 0) and rank))
    # What an agreement exchanges beyond its flags comes back under job ranks.
    seen["exchange"] = replica.exchange(f"from {rank}")
    # The first failure of an outcomes exchange names the job rank, not the index in the group.
    outcomes = replica.outcomes(fail_on(FAILING), payload=rank)
    failure = replica.first_failure("load_checkpoint", outcomes)
    seen["first_failure"] = None if failure is None else str(failure)
    # The job-wide protocol: the same failure reaches every rank.
    seen["job_settle"] = outcome(lambda: job.raise_together("step", fail_on(FAILING)))
    # And the groups are still in step: one more flag round in each.
    seen["after"] = replica.flags([rank == 1])[0]
    return seen


def test_a_replica_groups_failure_is_agreed_within_that_group_alone() -> None:
    for rank, seen in enumerate(run_ranks(WORLD, scoped)):
        group = (0, 1) if rank < 2 else (2, 3)
        assert seen["scope"] == group
        if rank in (2, 3):
            expected = "OSError: disk of rank 3 gone" if rank == FAILING else \
                "OSError: rank 3 failed in step: OSError: disk of rank 3 gone"
            assert seen["settle"] == expected, (rank, seen["settle"])
            assert seen["agree"] == f"ok {rank}", (rank, seen["agree"])
            assert seen["first_failure"] == "rank 3 failed in load_checkpoint: OSError: disk of rank 3 gone"
        else:
            assert seen["settle"] == "ok None", (rank, seen["settle"])
            assert seen["first_failure"] is None
            if rank == 0:
                assert seen["agree"] == "ZeroDivisionError: division by zero", seen["agree"]
            else:
                assert seen["agree"] == "ZeroDivisionError: rank 0 failed in offload_states: ZeroDivisionError: " \
                    "division by zero", seen["agree"]
        assert seen["exchange"] == [(r, f"from {r}") for r in group]
        job_expected = "OSError: disk of rank 3 gone" if rank == FAILING else \
            "OSError: rank 3 failed in step: OSError: disk of rank 3 gone"
        assert seen["job_settle"] == job_expected, (rank, seen["job_settle"])
        assert seen["after"] is (rank < 2)
