"""Helper threads: ThreadPoolExecutor's behaviour, and a process that exits although one of them never returns.

See zero3.helper_threads' [Note: helper threads and the exit]. The exit cases run in subprocesses with a
deadline: a process that does not exit is killed and the test fails, it never hangs the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.distributed import free_port, script_env
from zero3.helper_threads import HelperThreads

REPO = Path(__file__).resolve().parents[1]


def test_jobs_run_in_order_and_hand_back_results_and_errors() -> None:
    pool = HelperThreads(1, "zero3-test")
    ran: list[int] = []
    futures = [pool.submit(ran.append, index) for index in range(20)]
    failed = pool.submit(int, "not a number")
    assert [future.result(timeout=10) for future in futures] == [None] * 20
    assert ran == list(range(20))
    with pytest.raises(ValueError, match="not a number"):
        failed.result(timeout=10)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="zero3-test helper threads were shut down"):
        pool.submit(print)


def test_a_pool_runs_up_to_its_workers_at_once() -> None:
    pool = HelperThreads(3, "zero3-test")
    arrived = threading.Barrier(3, timeout=10)  # passes only if three jobs run at the same time
    futures = [pool.submit(arrived.wait) for _ in range(3)]
    assert sorted(future.result(timeout=10) for future in futures) == [0, 1, 2]
    assert len(pool._threads) == 3
    again = [pool.submit(time.sleep, 0) for _ in range(6)]  # idle threads take them: no fourth thread
    for future in again:
        future.result(timeout=10)
    assert len(pool._threads) == 3
    pool.shutdown()
    assert not any(thread.is_alive() for thread in pool._threads)


def test_shutdown_cancels_the_queued_jobs_when_asked() -> None:
    pool = HelperThreads(1, "zero3-test")
    release = threading.Event()
    running = pool.submit(release.wait, 10)
    queued = [pool.submit(time.sleep, 0) for _ in range(3)]
    threading.Timer(0.2, release.set).start()
    pool.shutdown(wait=True, cancel_futures=True)
    assert running.result() is True
    assert all(future.cancelled() for future in queued)
    assert pool.unfinished() == []


def test_zero_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 worker, not 0"):
        HelperThreads(0, "zero3-test")


EXITS = textwrap.dedent(
    """
    import sys, threading, time
    from zero3.helper_threads import HelperThreads

    case, marker = sys.argv[1], sys.argv[2]
    if case == "blocked":          # a job that never returns, nothing to finish at exit
        HelperThreads(1, "zero3-test").submit(threading.Event().wait)
    elif case == "finished":       # a job still running at exit, given time to finish: it does
        def write():
            time.sleep(1.0)
            open(marker, "w").write("written")
        HelperThreads(1, "zero3-test", finish_at_exit_s=60).submit(write)
    elif case == "bounded":        # a job that never returns, given 1 s at exit: the process still goes
        HelperThreads(1, "zero3-test", finish_at_exit_s=1).submit(threading.Event().wait)
    elif case == "error":          # the same job given 60 s, but the script failed: it leaves at once
        HelperThreads(1, "zero3-test", finish_at_exit_s=60).submit(threading.Event().wait)
        raise RuntimeError("the script failed")
    time.sleep(0.1)
    """
)


@pytest.mark.parametrize("case", ["blocked", "finished", "bounded", "error"])
def test_the_process_exits_with_a_job_still_running(tmp_path: Path, case: str) -> None:
    script, marker = tmp_path / "exits.py", tmp_path / "marker"
    script.write_text(EXITS)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script), case, str(marker)], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=script_env(str(REPO)))
    took = time.monotonic() - started
    assert done.returncode == (1 if case == "error" else 0), done.stderr[-3000:]
    if case == "finished":
        assert marker.read_text() == "written"
    if case == "bounded":
        assert "exits with 1 job(s) of the zero3-test helper threads unfinished after 1 s" in done.stderr
    assert took < 30


def test_no_helper_thread_of_the_engine_is_joined_at_exit() -> None:
    """Every helper pool of the engine is a HelperThreads: a ThreadPoolExecutor's workers are joined at exit."""
    users = [str(path.relative_to(REPO)) for path in (REPO / "zero3").rglob("*.py")
             if "ThreadPoolExecutor" in path.read_text() and path.name != "helper_threads.py"]
    assert users == []


# Two ranks; rank 0 hands its engine's gradient reducer a collective that rank 1 never joins (the default
# group waits 10 minutes for it), then fails and leaves, with or without destroying its engine first. Before
# the helper threads were daemon ones, the interpreter's exit joined the reducer's watcher, stuck in that
# wait; the engine's teardown joined it too; and the default group's teardown waited for the collective.
STUCK_REDUCTION = textwrap.dedent(
    """
    import datetime, json, os, sys, time
    import torch, torch.distributed as dist
    import zero3
    from tests.models import MLP

    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    engine, *_ = zero3.initialize(model=MLP(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3}})
    if rank == 1:
        open(os.path.join(out, "rank1-ready"), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(out, "rank0-left")) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    never_joined = dist.all_reduce(torch.ones(4), async_op=True)
    watched = engine.parts.reducer._watch(never_joined)
    assert watched is not None and not watched.done()
    try:
        raise RuntimeError("rank 0 gives up on a step its peer never reached")
    finally:
        if sys.argv[2] == "destroyed":  # a script's `finally: engine.destroy()`
            engine.destroy()
    """
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ending", ["raised", "destroyed"])
def test_a_rank_leaves_although_its_reducer_waits_on_a_collective_that_never_ends(tmp_path: Path, ending: str) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_REDUCTION)
    port = free_port()
    ranks = []
    for rank in (0, 1):
        env = script_env(str(REPO), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                         RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                         GLOO_SOCKET_IFNAME="lo")
        ranks.append(subprocess.Popen([sys.executable, str(script), str(tmp_path), ending], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        try:
            _, rank0_err = ranks[0].communicate(timeout=60)
            left = True
        except subprocess.TimeoutExpired:
            left = False
        (tmp_path / "rank0-left").touch()
        ranks[1].communicate(timeout=60)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert left, "rank 0 did not exit: its exit waited on the reducer's watcher"
    assert "rank 0 gives up" in rank0_err, rank0_err[-3000:]
    assert ranks[0].returncode == 1, json.dumps([ranks[0].returncode, rank0_err[-3000:]])
