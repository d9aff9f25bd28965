"""Starting `zero3 train`'s workers with torch's elastic launcher, and reporting the ones that failed."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zero3.cli.job import TrainJob
from zero3.cli.worker import _train_worker


@dataclass(frozen=True)
class Rendezvous:
    """Where the job's nodes meet (torchrun's --nnodes, --rdzv-endpoint, --rdzv-id, --node-rank)."""

    nnodes: int = 1
    endpoint: str | None = None  # None: this node alone, on a free local port
    run_id: str = "zero3-train"
    node_rank: int | None = None  # given: a static rendezvous (rank 0's node hosts the store)

    def launch_options(self) -> dict[str, Any]:
        if self.endpoint is None:
            return {"rdzv_backend": "c10d", "rdzv_endpoint": "localhost:0",  # the c10d store picks a free port
                    "run_id": f"zero3-train-{uuid.uuid4().hex[:8]}"}
        if self.node_rank is not None:
            return {"rdzv_backend": "static", "rdzv_endpoint": self.endpoint, "run_id": self.run_id,
                    "rdzv_configs": {"rank": self.node_rank}}
        return {"rdzv_backend": "c10d", "rdzv_endpoint": self.endpoint, "run_id": self.run_id}


def _launch(job: TrainJob, nproc: int, rendezvous: Rendezvous = Rendezvous()) -> int:
    # Imported here: the elastic machinery is only needed by the launching process.
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    log_dir = tempfile.mkdtemp(prefix="zero3-train-")
    config = LaunchConfig(
        min_nodes=rendezvous.nnodes,
        max_nodes=rendezvous.nnodes,
        nproc_per_node=nproc,
        **rendezvous.launch_options(),
        max_restarts=job.max_restarts,
        monitor_interval=0.2,
        # Only rank 0 talks to the terminal; the others' output goes to files that
        # are kept (and named) if the run fails.
        logs_specs=DefaultLogsSpecs(
            log_dir=log_dir, redirects={r: Std.ALL for r in range(1, nproc)}
        ),
    )
    # One thread per rank unless the user chose: N ranks each using every core
    # oversubscribe the CPU (torchrun makes the same choice).
    saved_omp = os.environ.get("OMP_NUM_THREADS")
    if saved_omp is None:
        os.environ["OMP_NUM_THREADS"] = "1"
    # The agent logs a failed worker's traceback itself; we print the same
    # traceback once, in ChildFailedError's summary, so mute the agent's copy.
    agent_log = logging.getLogger("torch.distributed.elastic")
    saved_level = agent_log.level
    agent_log.setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, _train_worker)(job)
    except ChildFailedError as exc:
        _report_failure(exc, log_dir)
        return 1
    finally:
        agent_log.setLevel(saved_level)
        if saved_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _report_failure(exc: Any, log_dir: str) -> None:
    """Say what went wrong on the workers: the first failure's traceback, then one line per rank."""
    _, first = exc.get_first_failure()
    traceback_text = _failure_text(first).strip()
    if "\n" in traceback_text:  # a whole traceback, not just the exception's line
        print(traceback_text, file=sys.stderr)
    for rank, failure in sorted(exc.failures.items()):
        print(f"zero3 train: rank {rank} failed: {_failure_line(failure, log_dir)}", file=sys.stderr)
    print(f"zero3 train: the workers' logs are in {log_dir}", file=sys.stderr)


def _failure_text(failure: Any) -> str:
    """The traceback a worker recorded in its error file ('' if it left none: killed, or died in C++)."""
    message = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return message if isinstance(message, str) else ""


def _failure_line(failure: Any, log_dir: str) -> str:
    text = _failure_text(failure)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines:
        return lines[-1]  # "ExceptionType: message"
    cause = (
        f"killed by signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    )
    tail = _log_tail(log_dir, failure.local_rank)
    return f"{cause}; {tail}" if tail else f"{cause} (its output is above)"


def _log_tail(log_dir: str, local_rank: int, lines: int = 5) -> str:
    """The last lines of a redirected worker's stderr log (rank 0 writes to the terminal instead)."""
    for path in sorted(Path(log_dir).glob(f"**/attempt_*/{local_rank}/stderr.log")):
        tail = [line for line in path.read_text(errors="replace").splitlines() if line.strip()][-lines:]
        if tail:
            return "last lines of its stderr: " + " | ".join(tail)
    return ""
