"""Jobs that end the way most scripts do: train, then `dist.destroy_process_group()` and exit.

No barrier and no `engine.destroy()` first. A collective's tensors must
never be left for a gloo worker thread to free while the interpreter shuts
down: that thread would need the GIL, CPython kills it, and the process
aborts with "terminate called without an active exception" (see the Note in
zero3/comm.py). It happened in about 1 of 20 such jobs; this runs 3 (CI's time), ZERO3_EXIT_JOBS=30 more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_launch import TRAIN

REPO = Path(__file__).resolve().parents[1]
JOBS = int(os.environ.get("ZERO3_EXIT_JOBS", "3"))

SCRIPT = TRAIN + "dist.destroy_process_group()\n"

# Most of a job's time was importing torch and zero3 (about 3 s of 4.6 on this machine), so each rank is
# forked from a parent that imported them once. The child runs the script as __main__ and then leaves
# through the interpreter's own shutdown (SystemExit unwinds to the top), which is what is under test.
LAUNCHER = textwrap.dedent(
    """
    import json, os, runpy, sys
    import torch, torch.distributed, zero3, tests.models
    from tests.distributed import free_port

    script, jobs, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    outcomes = []
    for job in range(jobs):
        port = free_port()
        children = []
        for rank in range(2):
            err_path = os.path.join(out_dir, f"job{job}-rank{rank}.err")
            pid = os.fork()
            if pid == 0:
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                                  LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
                err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(err, 2)
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                torch.set_num_threads(1)
                runpy.run_path(script, run_name="__main__")
                raise SystemExit(0)  # the interpreter's normal shutdown, in this child
            children.append((pid, err_path))
        for rank, (pid, err_path) in enumerate(children):
            _, status = os.waitpid(pid, 0)
            outcomes.append({"job": job, "rank": rank, "status": status, "stderr": open(err_path).read()[-2000:]})
    print(json.dumps(outcomes))
    """
)


@pytest.mark.timeout(900)
def test_jobs_ending_in_destroy_process_group_exit_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(launcher), str(script), str(JOBS), str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(outcomes) == 2 * JOBS
    failures = [f"job {o['job']} rank {o['rank']}: wait status {o['status']}\n{o['stderr']}" for o in outcomes
                if o["status"] != 0 or "terminate called" in o["stderr"]]
    assert not failures, "\n".join(failures)
