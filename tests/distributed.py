"""Run a test function on N ranks: N fresh processes on the gloo backend.

`run_ranks(world_size, fn, *args)` calls `fn(rank, world_size, *args)` in each
rank (fn must be a module-level function) and returns the ranks' return
values, in rank order. A failing rank fails the test with its traceback.

Ranks are forked from a forkserver that has imported torch, zero3 and the Hugging Face trainers once
(a spawned rank spent most of its start-up importing them, and the suite
starts hundreds): each rank is still a new process with nothing of an earlier
test's. A forked rank would inherit the server's environment, from when it
started, so each rank is handed the test's own `os.environ` explicitly.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import random
import socket
import sys
import tempfile
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# Ports handed to tests lie below the kernel's ephemeral range (32768 up, Linux's default), which outgoing
# connections take from, and each pytest-xdist worker has a range of its own: a port found free here is not
# taken by another test's process before the test binds it.
_PORTS_PER_WORKER = 4000


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = 10000 + (int(worker) if worker.isdigit() else 0) % 5 * _PORTS_PER_WORKER
    for port in random.sample(range(base, base + _PORTS_PER_WORKER), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}..{base + _PORTS_PER_WORKER}")


# Hugging Face's Trainer and TRL's trainers too: the ranks of the tests that use them spent about 6 s each
# importing them (a module that is not installed is skipped by the server).
multiprocessing.set_forkserver_preload([
    "torch", "torch.distributed", "zero3", "tests.models", "transformers.trainer",
    "transformers.models.llama.modeling_llama", "trl.trainer.sft_trainer", "trl.trainer.dpo_trainer",
    "trl.trainer.grpo_trainer",
])


def _worker(
    rank: int, world_size: int, port: int, out_dir: str, environ: dict[str, str], fn: Callable[..., Any], args: tuple
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if dist.is_initialized():
        # Tear down together: rank 0 hosts the rendezvous store, and a rank
        # leaving while another still talks to it can abort the process.
        dist.barrier()
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    if world_size == 1 and os.environ.get("ZERO3_TEST_INPROCESS_WORLD1") == "1":
        return [fn(0, 1, *args)]
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as out_dir:
            try:
                mp.start_processes(
                    _worker, args=(world_size, free_port(), out_dir, dict(os.environ), fn, args), nprocs=world_size,
                    join=True, start_method="forkserver",
                )
            except mp.ProcessRaisedException as error:
                # The free port was taken between free_port() and the rendezvous (pytest-xdist workers
                # pick ports at the same time): nothing of the test ran past its rendezvous; run it again.
                if "EADDRINUSE" in str(error) and attempt < 2:
                    continue
                raise
            return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    raise AssertionError("unreachable")


# What a rank of a world (or an in-process world of one, via zero3.init_distributed) leaves in
# os.environ: a script started from a test must not inherit it (it would rendezvous on a used port).
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def script_env(repo: str, **extra: str) -> dict[str, str]:
    """The environment for a script a test runs as a subprocess: this one, minus any rendezvous
    variables, with the repository importable."""
    env = {key: value for key, value in os.environ.items() if key not in RENDEZVOUS_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def load_script(path: str | os.PathLike[str], name: str) -> ModuleType:
    """A script (examples/...) imported by path, once, as module `name`: no `examples` package is
    needed, or shadowed."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def children_of(pid: int, command_contains: bytes = b"") -> list[int]:
    """The processes whose parent is `pid` (read from /proc), optionally those whose command line holds
    `command_contains`: a launcher's workers, for a test to kill."""
    from pathlib import Path

    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid and command_contains in command:
            found.append(int(entry.name))
    return sorted(found)
