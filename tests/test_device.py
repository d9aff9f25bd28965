"""Where ranks compute: one rule for zero3.Init and zero3.initialize, and no two ranks on one GPU.

CUDA's presence is simulated (torch.cuda.is_available / device_count), so
every branch runs on this CPU-only machine.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero3
from tests.distributed import run_ranks
from zero3.accelerator import DeviceChoiceError, resolve_device


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Pretend this machine has `n` GPUs (and clear every device variable)."""

    def pretend(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    for variable in ("ZERO3_ACCELERATOR", "DS_ACCELERATOR", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    return pretend


def test_auto_gives_each_local_rank_its_own_gpu(gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_device() == torch.device("cuda", 3)


def test_auto_refuses_more_local_ranks_than_gpus(gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(DeviceChoiceError) as error:
        resolve_device()
    message = str(error.value)
    assert "2 local ranks" in message and "1 CUDA device" in message and "ZERO3_ACCELERATOR=cpu" in message
    monkeypatch.setenv("LOCAL_RANK", "0")  # rank 0 too: it must not take the GPU its peer cannot share
    with pytest.raises(DeviceChoiceError):
        resolve_device()


def test_an_indexed_cpu_is_the_cpu(gpus) -> None:
    # accelerate's TrainingArguments.device is cpu:0 in a rank; the engine and Init must agree on one CPU.
    gpus(0)
    assert resolve_device("cpu:0") == torch.device("cpu") == resolve_device(torch.device("cpu", 0))


def test_auto_without_cuda_is_the_cpu(gpus) -> None:
    gpus(0)
    assert resolve_device() == torch.device("cpu")


def test_variables_pick_the_device_and_deepspeeds_is_honoured(gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks, one GPU: the CPU must be choosable
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert resolve_device() == torch.device("cpu")
    monkeypatch.setenv("ZERO3_ACCELERATOR", "cuda")  # ours first
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert resolve_device() == torch.device("cuda", 0)


def test_explicit_device_beats_the_variables(gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(2)
    monkeypatch.setenv("ZERO3_ACCELERATOR", "cuda")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_bad_values_name_the_variable_and_the_value(gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(0)
    monkeypatch.setenv("ZERO3_ACCELERATOR", "tpu")
    with pytest.raises(DeviceChoiceError, match=r"ZERO3_ACCELERATOR='tpu'.*expected one of cpu, cuda"):
        resolve_device()
    monkeypatch.setenv("ZERO3_ACCELERATOR", "cuda")
    with pytest.raises(DeviceChoiceError, match="ZERO3_ACCELERATOR=cuda asks for CUDA, but torch sees no usable"):
        resolve_device()
    with pytest.raises(DeviceChoiceError, match=r"device='mps' is not a device zero3 runs on"):
        resolve_device("mps")
    gpus(2)
    with pytest.raises(DeviceChoiceError, match="names cuda:5, but this machine has 2"):
        resolve_device("cuda:5")


def existing_group_decides(rank: int, world: int) -> dict:
    import os

    import torch.distributed as dist

    os.environ.pop("ZERO3_ACCELERATOR", None)
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    torch.cuda.device_count = lambda: 8  # type: ignore[assignment]
    dist.init_process_group("gloo")
    by_group = str(resolve_device())
    try:
        resolve_device("cuda:0")
        mismatch = ""
    except DeviceChoiceError as error:
        mismatch = str(error)
    dist.destroy_process_group()
    return {"by_group": by_group, "mismatch": mismatch}


def test_an_existing_gloo_group_means_the_cpu_even_with_gpus() -> None:
    for result in run_ranks(2, existing_group_decides):
        assert result["by_group"] == "cpu"
        assert "backend 'gloo'" in result["mismatch"] and "cuda" in result["mismatch"]


def group_without_a_named_backend(rank: int, world: int) -> dict:
    import os

    import torch.distributed as dist

    os.environ.pop("ZERO3_ACCELERATOR", None)
    dist.init_process_group(backend=None)  # as accelerate makes it on a machine without a GPU
    out = {"named": dist.get_backend(), "by_group": str(resolve_device()), "explicit": str(resolve_device("cpu"))}
    dist.destroy_process_group()
    return out


def test_a_group_made_without_naming_its_backend_serves_the_cpu() -> None:
    for result in run_ranks(2, group_without_a_named_backend):
        assert result == {"named": "undefined", "by_group": "cpu", "explicit": "cpu"}


def init_and_initialize_agree(rank: int, world: int) -> dict:
    import os

    os.environ.pop("ZERO3_ACCELERATOR", None)
    cfg = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage3_param_persistence_threshold": 0}}
    with zero3.Init(config=cfg, device="cpu"):
        model = nn.Linear(4, 4)
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    torch.cuda.device_count = lambda: 8  # type: ignore[assignment]
    engine, *_ = zero3.initialize(model=model, config=cfg)  # no device: the group Init made decides
    device = str(engine.device)
    engine.destroy()
    return {"device": device}


def test_initialize_follows_the_device_init_chose() -> None:
    for result in run_ranks(2, init_and_initialize_agree):
        assert result["device"] == "cpu"
