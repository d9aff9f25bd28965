"""examples/train.py, the script the docs start users from, resumes where it stopped (world 1, plain python)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.distributed import script_env

ROOT = Path(__file__).resolve().parents[1]


def start(tmp: Path, ckpt: str, steps: int) -> subprocess.Popen:
    # A world of one under plain python: no rank variables an earlier test of this worker left behind (a stale
    # MASTER_PORT would send it to a port that is no longer free).
    env = script_env(str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(ROOT / "examples" / "train.py"), "--ckpt", ckpt, "--steps", str(steps),
                             "--save-every", "5", "--n-embd", "32"],
                            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(job: subprocess.Popen) -> str:
    out, err = job.communicate(timeout=180)
    assert job.returncode == 0, err[-4000:]
    return out


def test_a_stopped_run_started_again_goes_on_as_if_it_never_stopped(tmp_path: Path) -> None:
    straight_job = start(tmp_path, "straight", 10)  # beside the stopped run: independent, a checkpoint dir of its own
    first = finish(start(tmp_path, "stopped", 5))
    second = finish(start(tmp_path, "stopped", 10))
    straight = finish(straight_job)
    assert "resumed" not in first
    assert "resumed at step 5" in second
    loss_line = [line for line in straight.splitlines() if line.startswith("step 10:")]
    assert loss_line and loss_line[0] in second.splitlines()  # bit-exact: the same printed loss
    assert sorted(path.name for path in (tmp_path / "stopped").iterdir()) == ["global_step10", "global_step5", "latest"]
