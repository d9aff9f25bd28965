"""Replica groups on torchft: a group killed mid-training comes back with its peer's state, bit for bit,
while the others train on (zero3.fault_tolerance).

Each case runs a real torchft lighthouse in this process and each replica
group as its own `torchrun --standalone` job of 2 ranks (tests/ft_job.py),
whose ranks SIGKILL themselves at chosen points of chosen attempts. The
groups write what they saw per step (loss, quorum size, commit, recovery,
a digest of each rank's whole state); the test judges from those files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torchft.coordination import LighthouseServer

from tests.distributed import run_ranks, script_env

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "ft_job.py"
DEADLINE_S = 240


@pytest.fixture
def lighthouse() -> Iterator[LighthouseServer]:
    # A dead group is dropped from the quorum after 1 s without heartbeats (torchft's default: 5 s). A group
    # that asks for a quorum waits up to 3 s for the other live group to ask too: longer than a group training
    # alone waits between its steps (--alone-sleep 2), so two live groups never settle into quorums of one each,
    # out of phase (each with min_replicas 1 would train on alone: a split the tests' kills would then land in).
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000, heartbeat_timeout_ms=1000)
    yield server
    server.shutdown()


def start_group(out: Path, lighthouse: LighthouseServer, group: int, *args: str, restarts: int = 0) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--max-restarts", str(restarts), "--monitor-interval", "0.1", str(JOB), str(out),
               "--group", str(group), *args]
    # A cluster user sets GLOO_SOCKET_IFNAME to the interface between the nodes.
    env = script_env(str(REPO), GLOO_SOCKET_IFNAME="lo", TORCHFT_LIGHTHOUSE=lighthouse.address())
    log = (out / f"torchrun_g{group}.log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)


def finish(out: Path, groups: list[subprocess.Popen]) -> None:
    """Every group ends, successfully, before the deadline (a hang is a failure, never a stuck test)."""
    try:
        for process in groups:
            process.wait(timeout=DEADLINE_S)
    finally:
        for process in groups:
            if process.poll() is None:
                process.kill()
    for group, process in enumerate(groups):
        log = (out / f"torchrun_g{group}.log").read_text()
        assert process.returncode == 0, f"group {group} failed:\n" + "\n".join(
            line for line in log.splitlines() if "torchft::" not in line)[-6000:]


def records(out: Path, group: int, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"g{group}_r{rank}.jsonl").read_text().splitlines()]


def committed_by_step(lines: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The last committed record of each step (a restarted attempt rewrites the steps it redoes)."""
    return {line["step"]: line for line in lines if line["committed"]}


def check_rejoined(out: Path, killed_at: int, last_attempt: int, steps: int) -> None:
    """Group 1 came back in `last_attempt` with group 0's state and stayed equal to it to the end;
    group 0 trained on, alone, while it was away, and dropped at most the steps the kills cut (one each)."""
    for rank in (0, 1):
        healthy, back = records(out, 0, rank), records(out, 1, rank)
        rejoined = [line for line in back if line["attempt"] == last_attempt]
        assert rejoined, f"group 1 rank {rank} never trained in attempt {last_attempt}: {back}"
        assert rejoined[0]["recoveries"] == 1, rejoined[0]  # its first step took the peer's state
        assert all(line["recoveries"] == 0 for line in rejoined[1:])
        assert rejoined[0]["step"] > killed_at  # it joined where the others were, not where it died
        theirs = committed_by_step(healthy)
        for line in rejoined:
            assert line["committed"]
            assert line["digest"] == theirs[line["step"]]["digest"], (rank, line["step"])
        assert rejoined[-1]["step"] == steps
        alone = [line for line in healthy if line["committed"] and killed_at <= line["step"] < rejoined[0]["step"]]
        assert alone and all(line["participants"] == 1 for line in alone), healthy
        assert sum(not line["committed"] for line in healthy) <= last_attempt, healthy
        # Every step applied once from the first on, none skipped (the first may come after the other group's
        # steps, copied by torchft's first quorum, which brings a group that starts later to the one training).
        assert sorted(theirs) == list(range(min(theirs), steps + 1)), sorted(theirs)
    final = [torch.load(out / f"final_g{group}.pt") for group in (0, 1)]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][name], final[1][name]) for name in final[0])


@pytest.mark.timeout(300)
def test_a_group_killed_mid_step_rejoins_with_its_peers_state_bit_identical(tmp_path: Path, lighthouse) -> None:
    """fp32, the optimizer's states on disk (read from their files to be sent, written there when received)."""
    steps = 16
    for group in (0, 1):
        (tmp_path / f"nvme{group}").mkdir()
    groups = [
        start_group(tmp_path, lighthouse, group, "--steps", str(steps), "--offload-optimizer", "nvme",
                    "--nvme-path", str(tmp_path / f"nvme{group}"), *extra, restarts=restarts)
        for group, extra, restarts in ((0, ("--alone-sleep", "2", "--wait-for-group", "1"), 0),
                                        (1, ("--kill", "0:4:mid_step", "--wait-for-group", "0"), 1))
    ]
    finish(tmp_path, groups)
    check_rejoined(tmp_path, killed_at=4, last_attempt=1, steps=steps)
    assert not list(tmp_path.glob("**/*.distcp"))  # the recovery read no checkpoint: there is none


@pytest.mark.timeout(300)
def test_a_group_killed_in_its_quorum_then_in_its_recovery_retries_and_its_host_tier_states_arrive(
        tmp_path: Path, lighthouse) -> None:
    """bf16, the optimizer on the host, the quorum before the forward: the first attempt dies right after its
    step's quorum started, the second while applying the peer's state; the third recovers."""
    steps = 30
    common = ["--steps", str(steps), "--precision", "bf16", "--offload-optimizer", "cpu", "--sync-quorum"]
    groups = [
        start_group(tmp_path, lighthouse, 0, *common, "--alone-sleep", "2", "--wait-for-group", "1"),
        start_group(tmp_path, lighthouse, 1, *common, "--kill", "0:3:quorum", "--kill", "1:0:recovery",
                    "--wait-for-group", "0", restarts=2),
    ]
    finish(tmp_path, groups)
    assert not [line for line in records(tmp_path, 1, 0) if line["attempt"] == 1]  # died in its recovery
    check_rejoined(tmp_path, killed_at=3, last_attempt=2, steps=steps)


@pytest.mark.timeout(300)
def test_a_peer_state_that_does_not_fit_is_refused_on_every_rank_of_the_joining_group(tmp_path: Path,
                                                                                       lighthouse) -> None:
    """Group 1 runs another optimizer (another layout): it raises on both ranks when group 0's state arrives,
    with nothing applied, and group 0 trains on to its end."""
    steps = 10
    # Group 0 waits 2 s a step while alone, so that group 1, built after group 0's first step, meets it.
    groups = [start_group(tmp_path, lighthouse, 0, "--steps", str(steps), "--alone-sleep", "2"),
              start_group(tmp_path, lighthouse, 1, "--steps", str(steps), "--optimizer", "Lion",
                          "--join-after-group", "0")]
    groups[1].wait(timeout=DEADLINE_S)
    assert groups[1].returncode != 0
    log = (tmp_path / "torchrun_g1.log").read_text()
    for rank in (0, 1):
        failure = [line for line in log.splitlines() if line.startswith(f"[rank{rank}]: ") and "Error" in line]
        assert any("does not fit this rank's engine" in line and "'Lion'" in line and "'AdamW'" in line
                   for line in failure), failure
    assert not (tmp_path / "g1_r0.jsonl").exists() or not records(tmp_path, 1, 0)  # it never stepped
    finish(tmp_path, groups[:1])
    healthy = committed_by_step(records(tmp_path, 0, 0))
    assert sorted(healthy) == list(range(1, steps + 1))


@pytest.mark.timeout(300)
def test_the_replicas_gradient_average_matches_plain_torch(tmp_path: Path) -> None:
    """Two groups of 2 ranks, no dropout, both groups required in every quorum, built alike (so no first copy
    between them): each step applies the mean of the 4 ranks' gradients, as one plain torch model trained on
    both groups' batches does."""
    from tests import ft_job
    from tests.restart_job import DropoutLM
    from zero3.config import load_config
    from zero3.step.lr_schedules import build_lr_scheduler

    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200, heartbeat_timeout_ms=1000)
    try:
        steps = 5
        common = ["--steps", str(steps), "--no-dropout", "--min-replicas", "2", "--no-init-sync"]
        finish(tmp_path, [start_group(tmp_path, server, group, *common) for group in (0, 1)])
    finally:
        server.shutdown()
    for group in (0, 1):
        lines = records(tmp_path, group, 0)
        assert [line["step"] for line in lines] == list(range(1, steps + 1)), lines
        assert all(line["participants"] == 2 and line["recoveries"] == 0 for line in lines), lines
    args = ft_job.parse([str(tmp_path), "--group", "0", "--no-dropout"])
    cfg = load_config(ft_job.config(args))
    torch.manual_seed(1)
    model = DropoutLM()
    model.drop.p = 0.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = build_lr_scheduler(cfg.scheduler, optimizer)
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        rows = [ft_job.batch(group, step, rank, 2, 2) for group in (0, 1) for rank in (0, 1)]
        batch = torch.cat(rows)
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    final = torch.load(tmp_path / "final_g0.pt")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(180)
def test_the_example_trains_two_groups_together(tmp_path: Path, lighthouse) -> None:
    """examples/fault_tolerant_train.py, as docs/fault_tolerance.md starts it (groups of one rank here)."""
    groups = []
    for group in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                   str(REPO / "examples" / "fault_tolerant_train.py"), "--steps", "50"]
        env = script_env(str(REPO), GLOO_SOCKET_IFNAME="lo", TORCHFT_LIGHTHOUSE=lighthouse.address(),
                         TORCHFT_REPLICA_ID=str(group))
        log = (tmp_path / f"torchrun_g{group}.log").open("w")  # (a pipe nobody drains would stall the group)
        groups.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env))
    finish(tmp_path, groups)
    for group in (0, 1):
        out = (tmp_path / f"torchrun_g{group}.log").read_text()
        assert f"group {group} step 50: loss" in out, out[-3000:]
        assert "2 group(s) in the step" in out, out[-3000:]  # they trained together


def _one_group(rank: int, world_size: int, lighthouse_address: str) -> dict[str, Any]:
    """A group of one rank alone in its quorum: what the engine refuses while the quorum is open (and without
    a lighthouse at all)."""
    import zero3
    from tests import ft_job
    from tests.restart_job import DropoutLM
    from zero3.fault_tolerance import FaultToleranceError

    args = ft_job.parse(["unused", "--group", "0"])
    seen: dict[str, Any] = {}
    os.environ.pop("TORCHFT_LIGHTHOUSE", None)
    untouched = DropoutLM()
    try:
        zero3.initialize(model=untouched, config=ft_job.config(args))
    except FaultToleranceError as error:
        seen["no_lighthouse"] = str(error)
    # Refused before anything was built: the model's parameters are whole, as they were.
    seen["untouched"] = [tuple(p.shape) for p in untouched.parameters()] == [
        tuple(p.shape) for p in DropoutLM().parameters()] and all(p.numel() > 0 for p in untouched.parameters())
    os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse_address
    torch.manual_seed(1)
    engine, *_ = zero3.initialize(model=DropoutLM(), config=ft_job.config(args))
    rows = ft_job.batch(0, 1, 0, 1, 2)
    loss = engine(rows[:, :-1], rows[:, 1:])
    for call in (lambda: engine.offload_states(), lambda: engine.reload_states()):
        try:
            call()
            seen.setdefault("refused", []).append(None)
        except RuntimeError as error:
            seen.setdefault("refused", []).append(str(error))
    engine.backward(loss)
    engine.step()
    engine.offload_states()  # between steps: allowed
    engine.reload_states()
    seen["participants"] = engine.fault_tolerance.replicas.participants()
    seen["global_steps"] = engine.global_steps
    seen["torchft_step"] = engine.fault_tolerance.replicas.current_step()
    engine.destroy()
    return seen


@pytest.mark.timeout(120)
def test_offloading_waits_for_the_quorum_to_close() -> None:
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=1000)
    try:
        (seen,) = run_ranks(1, _one_group, server.address())
    finally:
        server.shutdown()
    assert all(message is not None and "quorum is open" in message and "after engine.step()" in message
               for message in seen["refused"]), seen
    assert seen["participants"] == 1
    assert "TORCHFT_LIGHTHOUSE" in seen["no_lighthouse"] and "fault_tolerance.lighthouse" in seen["no_lighthouse"]
    assert seen["untouched"]
    assert seen["global_steps"] == seen["torchft_step"] == 1


def test_missing_lighthouse_and_conflicting_settings_are_refused() -> None:
    from zero3.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="mics_shard_size"):
        load_config({"fault_tolerance": {"enabled": True}, "zero_optimization": {"mics_shard_size": 2}})
    with pytest.raises(ConfigError, match="super_offload"):
        load_config({"fault_tolerance": {"enabled": True},
                     "zero_optimization": {"offload_optimizer": {"device": "cpu", "super_offload": True}}})
    with pytest.raises(ConfigError, match="replica_id"):
        load_config({"fault_tolerance": {"enabled": True, "replica_id": " "}})
