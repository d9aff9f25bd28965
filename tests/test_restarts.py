"""Jobs under `torchrun --max-restarts` that lose ranks to SIGKILL and finish as if nothing happened.

Each job is tests/restart_job.py: automatic checkpoints every step, `resume`
from the config, a registered sampler and dropout. Ranks kill themselves at
chosen steps of chosen attempts (mid-step, mid-save, right after an async
save started); torchrun restarts the workers, and the finished job's losses,
fp32 masters and each rank's next random draw must equal an uninterrupted
run's, bit for bit (`check_ran_as_uninterrupted` says what a killed rank may
leave unwritten).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import children_of, run_ranks, script_env
from tests.test_resume import job, job_outputs

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "restart_job.py"
STEPS = 6


def torchrun(out: Path, ckpt: Path, *args: str, restarts: int, nproc: int = 2) -> subprocess.CompletedProcess:
    """The job under torchrun; a hang fails the test at the deadline instead of sticking."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "--max-restarts", str(restarts), "--monitor-interval", "0.1", str(JOB), str(out), "--ckpt", str(ckpt),
               "--steps", str(STEPS), *args]
    # A cluster user sets GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface between nodes.
    env = script_env(str(REPO), GLOO_SOCKET_IFNAME="lo")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "hooks"), env["PYTHONPATH"]])  # the writer's kill
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    (out / "torchrun.log").write_text(done.stdout + done.stderr)
    return done


def reference(root: Path, precision: str) -> dict[str, Any]:
    out = root / f"reference-{precision}"
    out.mkdir()
    run_ranks(2, job, [str(out), "--ckpt", str(root / f"reference-{precision}-ckpt"), "--steps", str(STEPS),
                       "--precision", precision])
    return job_outputs(out, 2)


def attempts(out: Path) -> dict[int, dict[str, Any]]:
    found = {}
    for path in out.glob("attempt*_r0.json"):
        found[int(path.name.removeprefix("attempt").split("_")[0])] = json.loads(path.read_text())
    return found


def check_ran_as_uninterrupted(out: Path, expected: dict[str, Any], started: dict[int, dict[str, Any]]) -> None:
    """The promise of a killed and restarted job: every attempt resumed from the newest tag whose save had
    completed (so a saved step is never run again), every step a rank ran has the uninterrupted run's loss,
    and the job ends with the uninterrupted run's masters and random draws.

    A loss file may be missing, but only where a rank died between a step's save and writing its loss, and
    the next attempt resumed from that very step: nobody was left to run it again."""
    for attempt, seen in started.items():
        assert seen["resumed_at"] == seen["published"], (attempt, seen)
    outputs = job_outputs(out, 2)
    assert outputs["draws"] == expected["draws"]
    assert all(torch.equal(outputs["final"][name], expected["final"][name]) for name in expected["final"])
    resumed_from = {seen["resumed_at"] for attempt, seen in started.items() if attempt > 0}
    for name, loss in expected["losses"].items():  # loss_<step>_r<rank>.txt
        if name in outputs["losses"]:
            assert outputs["losses"][name] == loss, name
        else:
            step = int(name.split("_")[1])
            assert step in resumed_from, f"{name} is missing, yet no attempt resumed from step {step}: {started}"
    assert set(outputs["losses"]) <= set(expected["losses"]), sorted(outputs["losses"])


@pytest.mark.timeout(600)
def test_three_kills_mid_step_mid_save_and_after_an_async_save_end_bit_identical(tmp_path: Path) -> None:
    expected = reference(tmp_path, "fp32")
    out, ckpt = tmp_path / "killed", tmp_path / "ckpt"
    done = torchrun(out, ckpt, "--async-save", "--kill", "0:1:2:mid_step", "--kill", "1:0:4:mid_save",
                    "--kill", "2:1:5:after_step", restarts=3)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    started = attempts(out)
    assert sorted(started) == [0, 1, 2, 3], (started, done.stderr[-6000:])
    assert started[1]["resumed_at"] in (0, 1)  # killed in step 2, while step 1's async save may still write
    assert started[2]["resumed_at"] == 3  # step 4's save was cut off: it never became latest
    assert started[3]["resumed_at"] in (4, 5)  # step 5's async save may or may not have finished
    assert all(attempt["sampler_restored"] for attempt in started.values())
    check_ran_as_uninterrupted(out, expected, started)


@pytest.mark.timeout(600)
def test_a_bf16_job_killed_mid_save_and_between_a_saved_step_and_its_loss_ends_bit_identical(tmp_path: Path) -> None:
    """The second kill is the ordering an async save leaves to chance (the first test's third kill): with a
    blocking save, step 5 is published when rank 1 dies before writing its loss, so the last attempt
    resumes at 5 and step 5's loss on rank 1 is never written."""
    expected = reference(tmp_path, "bf16")
    out, ckpt = tmp_path / "killed", tmp_path / "ckpt"
    done = torchrun(out, ckpt, "--precision", "bf16", "--kill", "0:0:3:mid_save", "--kill", "1:1:5:after_step",
                    restarts=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    started = attempts(out)
    assert sorted(started) == [0, 1, 2], (started, done.stderr[-6000:])
    assert started[1]["resumed_at"] == 2 and started[2]["resumed_at"] == 5
    assert not (out / "loss_5_r1.txt").exists()
    check_ran_as_uninterrupted(out, expected, started)


@pytest.mark.timeout(300)
def test_two_nodes_lose_one_and_the_survivor_resumes_at_half_the_world(tmp_path: Path) -> None:
    """Two torchrun agents of 2 ranks each (`--nnodes 1:2`, a c10d rendezvous on 127.0.0.1) train as a world
    of 4; one node dies (its agent and workers SIGKILLed); the other restarts, rendezvouses alone and
    finishes at world 2 from the last checkpoint, the global batch kept by the accumulation."""
    import os
    import signal
    import time

    from tests.distributed import free_port

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
               "--max-restarts", "2", "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "two-nodes", "--rdzv-conf"]
    job = [str(JOB), str(out), "--ckpt", str(ckpt), "--steps", "12"]
    # The rendezvous store dies with the agent that hosts it, so the survivor hosts it (`is_host`): left to
    # the agents, whichever binds the endpoint first hosts it, and the lost node won that race under CI's load.
    conf = "last_call_timeout=3,join_timeout=60,is_host={}"
    env = script_env(str(REPO), GLOO_SOCKET_IFNAME="lo")
    survivor = subprocess.Popen([*command, conf.format(1), *job], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    lost = subprocess.Popen([*command, conf.format(0), *job], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 150
        while not (ckpt / "latest").is_file() and survivor.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if survivor.poll() is not None:
            pytest.fail(f"the surviving node ended before the other was lost:\n{survivor.communicate()[0][-6000:]}")
        assert lost.poll() is None, "the node to be lost ended by itself"
        node = [lost.pid, *children_of(lost.pid)]
        for pid in node:  # the agent first, so it restarts nothing
            os.kill(pid, signal.SIGKILL)
        log, _ = survivor.communicate(timeout=200)
    finally:
        for process in (survivor, lost):
            if process.poll() is None:
                process.kill()
        lost.wait()
    assert survivor.returncode == 0, log[-6000:]
    started = attempts(out)
    assert started[0]["world"] == 4 and started[0]["gas"] == 1
    last = started[max(started)]
    assert last["world"] == 2 and last["gas"] == 2 and last["resumed_at"] >= 1  # train_batch_size 8 kept
    assert any("saved at world size 4, loaded at 2" in line for line in last["warnings"])
    final = [json.loads((out / f"final_r{rank}.json").read_text()) for rank in (0, 1)]
    assert all(result["steps"] == 12 for result in final)
