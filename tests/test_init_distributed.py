"""`zero3.init_distributed` and the engine's collective timeout.

Restarts: torchrun's agent keeps one TCPStore for all of a job's attempts, so a restarted attempt
found the dead attempt's process-group keys there and gloo's connectFullMesh went to the dead
attempt's ports (zero3.default_group's [Note: one store namespace per attempt]). The job here kills one rank
per attempt at a different point each time (after the default group, after the engine's side groups,
mid-step, after a step) and the last attempt must finish. The suite runs 4 kills; the same script
runs 20 by hand:

    GLOO_SOCKET_IFNAME=lo ZERO3_ACCELERATOR=cpu PYTHONPATH=. python -m torch.distributed.run --standalone \\
        --nproc_per_node 2 --max-restarts 20 tests/test_init_distributed.py restart OUT 20

Timeout: a rank blocked in an engine collective with a peer that hangs (SIGSTOP) or died (SIGKILL)
raises within about `comm_timeout_s`, and its process ends.

Run as a script, this file is the ranks' program (`restart` and `hang` below).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CFG = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3},
    "steps_per_print": None,
}
KILL_POINTS = ("after_init", "after_initialize", "mid_step", "after_step")


# ---- the ranks' programs ------------------------------------------------------------------------------
def _note(out: Path, rank: int, attempt: int, what: str) -> None:
    with open(out / f"log.{rank}", "a") as f:
        f.write(f"{attempt} {what}\n")


def restart(out: Path, kills: int) -> None:
    """One torchrun attempt. Attempt k < kills: rank k % 2 SIGKILLs itself at KILL_POINTS[k % 4]."""
    import torch.distributed as dist

    import zero3

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])

    def maybe_die(point: str) -> None:
        if attempt < kills and rank == attempt % 2 and point == KILL_POINTS[attempt % len(KILL_POINTS)]:
            _note(out, rank, attempt, f"die {point}")
            os.kill(os.getpid(), signal.SIGKILL)

    zero3.init_distributed()
    user_group = dist.new_group(backend="gloo")  # a group of the user's own, beside the engine's
    dist.all_reduce(torch.ones(1), group=user_group)
    _note(out, rank, attempt, "init")
    maybe_die("after_init")
    torch.manual_seed(0)
    engine, *_ = zero3.initialize(model=torch.nn.Linear(8, 8), config=CFG)  # opens the side groups
    maybe_die("after_initialize")
    x = torch.ones(1, 8)
    for _ in range(2):
        loss = engine(x).square().mean()
        maybe_die("mid_step")
        engine.backward(loss)
        engine.step()
        maybe_die("after_step")
    engine.destroy()
    _note(out, rank, attempt, "complete" if attempt == kills else "nobody died")
    dist.destroy_process_group()


def hang(out: Path, scenario: str, timeout_s: float) -> None:
    """Scenario "HOW@WHERE[+users_group]": rank 1 stops (SIGSTOP: a hung peer) or dies (SIGKILL) before
    WHERE (the forward, or the step); rank 0 runs on into the engine's collectives and writes what it
    saw to out/seen.json. With +users_group the default group is made before zero3.initialize."""
    import torch._dynamo  # noqa: F401  (imported by the first optimizer otherwise: not inside a timed collective)

    import zero3

    how, _, where = scenario.partition("@")
    where, users_group = where.removesuffix("+users_group"), where.endswith("+users_group")
    rank = int(os.environ["RANK"])
    (out / f"ready.{rank}").touch()  # both ranks past their imports before the first timed rendezvous
    deadline = time.monotonic() + 120
    while not all((out / f"ready.{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.01)
    if users_group:
        zero3.init_distributed()  # the default group is the user's, with torch's default timeout (30 min)
    engine, *_ = zero3.initialize(model=torch.nn.Linear(8, 8), config={**CFG, "comm_timeout_s": timeout_s})
    x = torch.ones(1, 8)
    engine.backward(engine(x).square().mean())
    engine.step()  # one healthy step together
    if rank == 1:
        if where == "step":
            engine.backward(engine(x).square().mean())
        os.kill(os.getpid(), signal.SIGSTOP if how == "stopped" else signal.SIGKILL)
        time.sleep(600)  # a stopped rank is killed by the test
        return
    phase, start = "forward", time.monotonic()
    seen: dict = {}
    try:
        loss = engine(x).square().mean()
        phase = "backward"
        engine.backward(loss)
        phase = "step"
        engine.step()
        phase = "returned"
    except Exception as error:  # what a blocked collective ends with
        seen["error"] = f"{type(error).__name__}: {error}"[:400]
    seen.update(phase=phase, waited=time.monotonic() - start, raised_at=time.time())
    (out / "seen.json").write_text(json.dumps(seen))


# ---- cheap checks ---------------------------------------------------------------------------------------
def test_arguments_are_checked_before_anything_is_joined() -> None:
    import zero3

    with pytest.raises(ValueError, match="positive"):
        zero3.init_distributed(timeout=0)
    with pytest.raises(ValueError, match="positive"):
        zero3.init_distributed(timeout=datetime.timedelta(seconds=-1))
    with pytest.raises(TypeError, match="timedelta"):
        zero3.init_distributed(timeout="30")
    with pytest.raises(TypeError, match="backend name"):
        zero3.init_distributed(dist_backend=torch.device("cpu"))
    with pytest.raises(TypeError, match="dist_init_required"):
        zero3.init_distributed(dist_init_required="yes")
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="dist_init_required=False"):
            zero3.init_distributed(dist_init_required=False)


@pytest.mark.parametrize("value", [0, -5, "5", float("inf")])
def test_comm_timeout_s_must_be_a_positive_number(value: object) -> None:
    import zero3

    with pytest.raises(zero3.ConfigError, match="comm_timeout_s"):
        zero3.load_config({**CFG, "comm_timeout_s": value})
    assert zero3.load_config(CFG).comm_timeout_s is None
    assert zero3.load_config({**CFG, "comm_timeout_s": 5}).comm_timeout_s == 5.0


def group_timeouts(rank: int, world: int, user_timeout_s: float | None, comm_timeout_s: float | None) -> dict:
    import zero3
    from zero3.default_group import _group_timeout

    if user_timeout_s is not None:
        zero3.init_distributed(timeout=user_timeout_s)
    cfg = {**CFG, "comm_timeout_s": comm_timeout_s} if comm_timeout_s is not None else CFG
    engine, *_ = zero3.initialize(model=torch.nn.Linear(8, 8), config=cfg)
    comm = engine.comm
    groups = {"default": None, "reduce": comm.reduce_group, "control": comm.control_group,
              "checkpoint": comm.checkpoint_group()}
    seconds = {name: _group_timeout(group).total_seconds() for name, group in groups.items()}
    engine.destroy()
    return seconds


@pytest.mark.parametrize(
    ("user_timeout_s", "comm_timeout_s", "expected"),
    [
        # zero3.initialize made the default group: comm_timeout_s everywhere
        (None, 70.0, dict(default=70.0, reduce=70.0, control=70.0, checkpoint=70.0)),
        # the user made it: the engine's groups take its timeout
        (42.0, None, dict(default=42.0, reduce=42.0, control=42.0, checkpoint=42.0)),
        # both: the user's group keeps the user's timeout, the engine's have comm_timeout_s
        (42.0, 70.0, dict(default=42.0, reduce=70.0, control=70.0, checkpoint=70.0)),
    ],
)
def test_comm_timeout_s_reaches_every_group_the_engine_makes(
    user_timeout_s: float | None, comm_timeout_s: float | None, expected: dict
) -> None:
    from tests.distributed import run_ranks

    assert run_ranks(2, group_timeouts, user_timeout_s, comm_timeout_s) == [expected, expected]


@pytest.mark.timeout(60)
def test_an_attempt_agrees_on_a_fresh_token_over_a_dead_attempts_keys() -> None:
    """rank 0 of a new attempt first finds (and answers) the dead attempt's ask, then this attempt's."""
    import torch.distributed as dist

    from zero3.default_group import _attempt_token

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = datetime.timedelta(seconds=20)

    def attempt(delay_rank1: float) -> list[str]:
        tokens = ["", ""]

        def run(rank: int) -> None:
            if rank == 1:
                time.sleep(delay_rank1)
            client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
            tokens[rank] = _attempt_token(client, rank, 2, timeout)

        threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads)
        return tokens

    first = attempt(0.0)
    second = attempt(0.7)  # rank 0 answers the stale ask/1 for 0.7 s before rank 1 asks afresh
    assert first[0] == first[1] and second[0] == second[1] and first[0] != second[0]


# ---- kill and restart under torchrun -------------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    from tests.distributed import script_env

    return script_env(str(REPO), GLOO_SOCKET_IFNAME="lo", ZERO3_ACCELERATOR="cpu", **extra)


@pytest.mark.timeout(240)
def test_four_kill_and_restart_cycles_each_rendezvous_afresh(tmp_path: Path) -> None:
    kills = len(KILL_POINTS)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "--max-restarts", str(kills), str(Path(__file__)), "restart", str(tmp_path), str(kills),
    ]
    agent = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = agent.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        agent.terminate()  # the agent stops its workers on SIGTERM (a SIGKILL would leave them behind)
        _, stderr = agent.communicate(timeout=60)
        pytest.fail(f"the job hung (before the fix: a rendezvous on a dead attempt's keys)\n{stderr[-3000:]}")
    logs = {rank: (tmp_path / f"log.{rank}").read_text().splitlines() for rank in (0, 1)}
    assert agent.returncode == 0, stderr[-3000:]
    assert "connectFullMesh" not in stderr
    for attempt in range(kills):
        # Each attempt joined its groups (so no restart went to a failed rendezvous) and died as planned. The
        # rank that died wrote "init" once its all-reduce on the user's group returned, which its peer had
        # joined too; the peer's own note may be cut off when the kill comes right after (`after_init`).
        assert f"{attempt} init" in logs[attempt % 2], logs
        assert f"{attempt} die {KILL_POINTS[attempt]}" in logs[attempt % 2], logs
    assert all(f"{kills} complete" in logs[rank] for rank in (0, 1)), logs


# ---- a peer that hangs or dies: the survivor raises within comm_timeout_s ------------------------------------
def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as output:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)


# stopped@forward+users_group: the forward's first wait is on the engine's gloo control group, which has
# comm_timeout_s whoever made the default group. stopped@step+users_group: the step's first is the gradient
# norm's sum on the shard group, the engine's own when the default group (the user's) has another timeout.
# killed@step: the dead peer's sockets close, so gloo fails at once.
# The three jobs run side by side (their waits overlap).
HANG_SCENARIOS = ("stopped@forward+users_group", "stopped@step+users_group", "killed@step")


@pytest.mark.timeout(150)
def test_a_rank_blocked_on_a_lost_peer_raises_within_comm_timeout_s(tmp_path: Path) -> None:
    from tests.distributed import free_port

    timeout_s = 5.0
    jobs = {}
    for index, scenario in enumerate(HANG_SCENARIOS):
        out = tmp_path / str(index)
        out.mkdir()
        env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
        command = [sys.executable, str(Path(__file__)), "hang", str(out), scenario, str(timeout_s)]
        jobs[scenario] = (out, [_start(command, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}, out / f"output.{r}")
                                for r in (0, 1)])
    exited_at: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 100
        while len(exited_at) < len(jobs) and time.monotonic() < deadline:
            for scenario, (_, ranks) in jobs.items():
                if scenario not in exited_at and ranks[0].poll() is not None:
                    exited_at[scenario] = time.time()
            time.sleep(0.05)
    finally:
        for _, ranks in jobs.values():
            for rank in ranks:
                rank.kill()  # a stopped rank too
                rank.wait()
    assert len(exited_at) == len(jobs), f"rank 0 still ran after 100 s in {set(jobs) - set(exited_at)}"
    for scenario, (out, _) in jobs.items():
        seen = json.loads((out / "seen.json").read_text()) if (out / "seen.json").exists() else {}
        assert "error" in seen, (scenario, seen, (out / "output.0").read_text()[-2000:])
        if scenario.startswith("stopped"):
            # it waited for the peer until the timeout and no longer (a hung peer leaves its sockets open)
            assert timeout_s * 0.8 <= seen["waited"] <= 2 * timeout_s + 5, (scenario, seen)
            assert "Timed out" in seen["error"], (scenario, seen)
        else:
            assert seen["waited"] <= timeout_s, (scenario, seen)
        # and its process then ends
        assert exited_at[scenario] - seen["raised_at"] < 15, (scenario, "the process did not end after the error")


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "restart":
        restart(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        hang(Path(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
