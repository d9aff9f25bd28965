"""Run a world-of-one test on the CPU and, where torch sees a GPU, on CUDA too.

`@ON_DEVICES` adds a `device` argument: "cpu" always, and "cuda" carrying the
`cuda` marker, so tests/conftest.py leaves the accelerator unpinned for it (the
engine and any rank run_ranks spawns then pick CUDA) or skips it, saying why,
without a GPU. Only a world of one can go on CUDA here: two ranks cannot share
one GPU under nccl. A test body or rank function puts its data where the
engine is (`engine.device`) and brings values back with `.cpu()` to compare
them with a CPU reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_map

ON_DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])


def to_device(tree: Any, device: torch.device | str) -> Any:
    """Every tensor in a nested structure, moved to `device`."""
    return tree_map(lambda value: value.to(device) if isinstance(value, torch.Tensor) else value, tree)


def on_host(tree: Any) -> Any:
    """Every tensor in a nested structure, copied to the host (to compare with a CPU reference)."""
    return tree_map(lambda value: value.detach().cpu() if isinstance(value, torch.Tensor) else value, tree)


def worlds_on_devices(*sizes: int) -> pytest.MarkDecorator:
    """`world, device`: each size on the CPU, and the world of one on CUDA as well."""
    cases = [pytest.param(size, "cpu", id=f"{size}-cpu") for size in sizes]
    if 1 in sizes:
        cases.append(pytest.param(1, "cuda", id="1-cuda", marks=pytest.mark.cuda))
    return pytest.mark.parametrize(("world", "device"), cases)


def cpu_ranks_or_one_gpu(world: int = 2) -> pytest.MarkDecorator:
    """`world, device`: `world` ranks on the CPU, and a world of one on CUDA (two nccl ranks cannot share
    one GPU), for a test whose point needs several ranks where they can run."""
    return pytest.mark.parametrize(("world", "device"), [
        pytest.param(world, "cpu", id=f"{world}-cpu"),
        pytest.param(1, "cuda", id="1-cuda", marks=pytest.mark.cuda),
    ])
