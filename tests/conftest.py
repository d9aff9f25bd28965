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


@pytest.fixture(autouse=True)
def _pin_the_device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in DEVICE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv(DEVICE_VARIABLES[0], "cpu")
    elif not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch sees none on this machine)")
