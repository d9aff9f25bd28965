"""Activation checkpointing with DeepSpeed's API (`deepspeed.checkpointing`, which GPT-NeoX and
Megatron-DeepSpeed call) and the config's `activation_checkpointing` section (`zero3.initialize` applies it).

`checkpoint(function, *args)` runs torch's non-reentrant checkpoint: the forward keeps only the inputs,
and the backward runs `function` again, where zero3's hooks gather its parameters again as they do for any
forward. `configure(checkpoint_in_cpu=True)` (the config's `activation_checkpointing.cpu_checkpointing`)
keeps what the checkpoint saves in host memory until the backward (`torch.autograd.graph.save_on_cpu`,
pinned beside a CUDA device). The model-parallel RNG tracker (`get_cuda_rng_tracker`,
`model_parallel_cuda_manual_seed`) keeps named generator states and forks them, on the accelerator's
generator (the CPU's on the CPU).

DeepSpeed's `partition_activations` and `contiguous_memory_optimization` split activations across
model-parallel ranks; zero3 has no model parallelism, so asking for them is refused in words.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from zero3 import accelerator

__all__ = ["checkpoint", "configure", "get_cuda_rng_tracker", "is_configured", "model_parallel_cuda_manual_seed",
           "model_parallel_reconfigure_tp_seed", "reset", "CudaRNGStatesTracker"]

_MODEL_PARALLEL_RNG = "model-parallel-rng"


class _DeviceRandom:
    """The generator of the device zero3 computes on (the CPU's on the CPU)."""

    def __init__(self) -> None:
        self.cuda = accelerator.resolve_device().type == "cuda"

    def get_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state() if self.cuda else torch.get_rng_state()

    def set_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state) if self.cuda else torch.set_rng_state(state)

    def seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed) if self.cuda else torch.manual_seed(seed)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@dataclass
class _Settings:
    cpu_checkpointing: bool = False
    synchronize: bool = False
    profile: bool = False
    num_checkpoints: int | None = None


_settings: _Settings | None = None


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's `configure`: from the config's `activation_checkpointing` section (a dict, a JSON path or a
    loaded config), each argument given overriding it."""
    section: dict[str, Any] = {}
    if deepspeed_config is not None:
        from zero3.config import load_config

        loaded = deepspeed_config if hasattr(deepspeed_config, "activation_checkpointing") \
            else load_config(deepspeed_config)
        section = dict(loaded.activation_checkpointing or {})
    partition = partition_activations if partition_activations is not None \
        else section.get("partition_activations", False)
    contiguous = contiguous_checkpointing if contiguous_checkpointing is not None \
        else section.get("contiguous_memory_optimization", False)
    if mpu_ is not None or partition or contiguous:
        raise NotImplementedError(
            "activation checkpointing: partition_activations / contiguous_memory_optimization / mpu_ split "
            "activations across model-parallel ranks, and zero3 has none; leave them off (checkpoint() and "
            "cpu_checkpointing work without them)")
    global _settings
    _settings = _Settings(
        cpu_checkpointing=bool(checkpoint_in_cpu if checkpoint_in_cpu is not None
                               else section.get("cpu_checkpointing", False)),
        synchronize=bool(synchronize if synchronize is not None else section.get("synchronize_checkpoint_boundary",
                                                                                 False)),
        profile=bool(profile if profile is not None else section.get("profile", False)),
        num_checkpoints=num_checkpoints if num_checkpoints is not None else section.get("number_checkpoints"),
    )


def is_configured() -> bool:
    return _settings is not None


def reset() -> None:
    """DeepSpeed resets its per-iteration buffers here; zero3 keeps none between checkpoints."""


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)`, its activations recomputed in the backward instead of kept (non-reentrant)."""
    settings = _settings or _Settings()
    device = _DeviceRandom()
    if settings.synchronize:
        device.synchronize()
    keep = torch.autograd.graph.save_on_cpu(pin_memory=device.cuda) if settings.cpu_checkpointing \
        else contextlib.nullcontext()
    with keep:
        out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)
    if settings.synchronize:
        device.synchronize()
    return out


class CudaRNGStatesTracker:
    """Named generator states (Megatron's tracker): `add` a seeded state, `fork` it for a region (the
    default state is put back after, and the named one advanced)."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"rng state seed {seed} is already in use")
        if name in self.states_:
            raise ValueError(f"rng state {name!r} already exists")
        self.seeds_.add(seed)
        device = _DeviceRandom()
        before = device.get_state()
        device.seed(seed)
        self.states_[name] = device.get_state()
        device.set_state(before)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"rng state {name!r} is not added (tracker.add(name, seed) first)")
        device = _DeviceRandom()
        before = device.get_state()
        device.set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = device.get_state()
            device.set_state(before)


_tracker = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Megatron's seeding: the default generator gets `seed`, the tracker's model-parallel state
    `seed + 2718` (one tensor-parallel rank here, so every rank's is the same)."""
    _tracker.reset()
    _DeviceRandom().seed(seed)
    _tracker.add(_MODEL_PARALLEL_RNG, seed + 2718)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """DeepSpeed's: seeds the tracker's model-parallel state again."""
    _tracker.reset()
    _tracker.add(_MODEL_PARALLEL_RNG, seed + 2718)
