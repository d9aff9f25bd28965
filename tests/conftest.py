"""Every test runs on the CPU (gloo) unless it is marked `cuda`.

A machine with a GPU would otherwise put each spawned rank on CUDA, and two
ranks on a one-GPU machine cannot share it. Spawned ranks, torchrun jobs and
CLI runs inherit the variable. A `cuda` test runs on the GPU at world size 1
and is skipped, with the reason, where torch sees no CUDA device.
"""

from __future__ import annotations

import os

import pytest
import torch

from zero3.accelerator import DEVICE_VARIABLES


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: runs on a CUDA device at world size 1 (skipped without one)")
    # Pinned for the whole session too, not only per test: module-scoped fixtures (which launch world-2
    # jobs) are set up before a test's own fixtures run.
    for variable in DEVICE_VARIABLES:
        os.environ.pop(variable, None)
    os.environ[DEVICE_VARIABLES[0]] = "cpu"


# The files that take longest, longest first (a local run's seconds, summed over a file's tests: 234, 218,
# 179, 125, 106, 96, 75, 52, 50, 43, 41, 38, 35; of 1,870 in all). pytest-xdist hands files to its workers
# in order (`--dist loadfile --no-loadscope-reorder`, pyproject.toml): started first, the slow ones leave the
# many short files to even out the two workers' ends (the run took 972 s, 37 s over half the sum). xdist's
# own order (most tests first) put these files, which have few tests each, last.
SLOWEST_FIRST = (
    "tests/test_fault_tolerance.py", "tests/test_restarts.py", "tests/test_deepspeed_import.py", "tests/test_cli.py",
    "tests/test_checkpoint.py", "tests/test_deepspeed_offload_states.py",
    "tests/test_hf_trainer.py", "tests/test_init_distributed.py", "tests/test_shared_state.py",
    "tests/test_zeropp.py", "tests/test_checkpoint_writer.py", "tests/test_example_train.py",
    "tests/test_helper_threads.py", "tests/test_rlhf_example.py", "tests/test_exit.py",
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    order = {path: index for index, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: order.get(item.nodeid.split("::", 1)[0], len(order)))  # (stable: the rest as collected)


@pytest.fixture(autouse=True)
def _pin_the_device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in DEVICE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv(DEVICE_VARIABLES[0], "cpu")
    elif not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch sees none on this machine)")
