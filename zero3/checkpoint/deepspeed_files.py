"""A DeepSpeed ZeRO-3 checkpoint directory, read: every parameter's fp32 master and Adam moments as the
ranks' pieces of their flat partitions (`Pieces`: written where they go, or joined whole), with the step,
the schedule, the counters and the client's state. The files are mapped, not read into memory: a piece's
bytes are read once, by the copy that puts them where they go.

[Note: DeepSpeed's ZeRO-3 layout]
A tag holds, per data-parallel rank r, `zero_pp_rank_<r>_mp_rank_00_model_states.pt` (the module's
buffers, `param_shapes`: one ordered {name: shape} per sub-group, the schedule, the counters, the config,
and the client's keys at the top level) and `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt` (the
fp32 flat partition of each sub-group, `fp32_flat_groups`, and the torch optimizer's state of those flat
tensors: `exp_avg`, `exp_avg_sq`, `step`). Each parameter, in `param_shapes` order across the sub-groups,
takes ceil(numel / world) elements of every rank's concatenated flat partitions, the last rank's padded:
parameter p is the ranks' pieces at the same offset, joined and cut to its numel. Adam's moments follow
the same layout. (DeepSpeed's own zero_to_fp32.py reads the masters the same way.)

The files are pickles. They are read under torch's weights-only unpickler with the three DeepSpeed
classes they hold stood in by plain classes of the same names (`ZeroStageEnum`, `LossScaler`,
`DynamicLossScaler`): a file naming anything else is refused in words.
"""

from __future__ import annotations

import enum
import math
import pickle
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zero3.checkpoint.tags import CheckpointError

LATEST = "latest"
_MODEL_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
MOMENTS = ("exp_avg", "exp_avg_sq")
TRUST_NEEDED = (
    "DeepSpeed's checkpoint files are Python pickles, and unpickling a file can run code it carries: pass "
    "trust_checkpoint=True (the CLI's --trust-checkpoint) for a checkpoint you made or trust. Even then zero3 "
    "reads them under an allowlist of what DeepSpeed's files hold (tensors, containers, its enums). Nothing "
    "was written."
)


class _ZeroStageEnum(enum.IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _LossScaler:
    """DeepSpeed's static loss scaler, as data (its attributes)."""


class _DynamicLossScaler(_LossScaler):
    """DeepSpeed's dynamic loss scaler, as data."""


for _stand_in, _module, _name in ((_ZeroStageEnum, "deepspeed.runtime.zero.config", "ZeroStageEnum"),
                                  (_LossScaler, "deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                                  (_DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")):
    _stand_in.__module__, _stand_in.__qualname__, _stand_in.__name__ = _module, _name, _name


@dataclass(frozen=True)
class Pieces:
    """One parameter's fp32 tensor as DeepSpeed's ranks hold it: rank r's `piece` elements at `offset` of
    its flat partition are elements [r * piece, (r + 1) * piece) of the flattened tensor, the last rank's
    cut to `shape`'s numel."""

    parts: tuple[torch.Tensor, ...]  # each rank's flat partition
    offset: int
    piece: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def ranges(self) -> list[tuple[int, torch.Tensor]]:
        """(start in the flattened tensor, the rank's piece there), rank by rank, pieces of padding left out."""
        out = []
        for rank, part in enumerate(self.parts):
            start = rank * self.piece
            if start >= self.numel:
                break
            take = min(self.piece, self.numel - start)
            out.append((start, part[self.offset : self.offset + take]))
        return out

    def whole(self) -> torch.Tensor:
        """The tensor joined, in a tensor of its own (one copy)."""
        whole = torch.empty(self.numel, dtype=torch.float32)
        for start, piece in self.ranges():
            whole[start : start + piece.numel()].copy_(piece)
        return whole.view(self.shape)


@dataclass
class DeepSpeedState:
    """One DeepSpeed ZeRO-3 tag: the tensors as the ranks' pieces, the rest as read."""

    path: Path  # the tag's directory
    world_size: int
    groups: list[list[str]]  # parameter names per optimizer param group, in DeepSpeed's order
    group_options: list[dict[str, Any]]  # each group's hyperparameters (torch's param_groups, lr included)
    shapes: dict[str, torch.Size]
    masters: dict[str, Pieces]  # fp32
    moments: dict[str, dict[str, Pieces]]  # name -> {"exp_avg": ..., "exp_avg_sq": ...}
    steps: dict[str, float]  # name -> Adam's step count
    buffers: dict[str, torch.Tensor]
    lr_scheduler: dict[str, Any] | None
    loss_scaler: dict[str, Any] | None  # an fp16 run's dynamic scaler state
    global_steps: int
    global_samples: int
    skipped_steps: int
    ds_config: dict[str, Any]
    client_state: dict[str, Any] = field(default_factory=dict)
    shared_params: dict[str, str] = field(default_factory=dict)  # a tied parameter's name -> the saved one's


# What DeepSpeed itself puts at the top level of a model-states file; everything else is the client's.
_ENGINE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info", "ds_zero_partition_groups",
}


def read_file(path: Path, trusted: bool) -> dict[str, Any]:
    """One of DeepSpeed's files, mapped, under the allowlist (and, if `trusted` and the allowlist does not
    suffice, by plain unpickling, which needs DeepSpeed's classes installed)."""
    try:
        with torch.serialization.safe_globals([_ZeroStageEnum, _LossScaler, _DynamicLossScaler, OrderedDict,
                                               torch.Size]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        if not trusted:
            raise CheckpointError(f"{str(path)!r} holds more than DeepSpeed's tensors, containers and enums "
                                  f"({str(error).splitlines()[0]})") from error
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except FileNotFoundError as error:
        raise CheckpointError(f"{str(path)!r} is missing") from error


def resolve_tag(src: Path, tag: str | None) -> Path:
    if not src.is_dir():
        raise CheckpointError(f"DeepSpeed checkpoint directory {str(src)!r} does not exist")
    if tag is None:
        marker = src / LATEST
        if not marker.is_file():
            raise CheckpointError(f"{str(marker)!r} does not exist: pass the tag to import")
        tag = marker.read_text().strip()
    path = src / tag
    if not path.is_dir():
        raise CheckpointError(f"DeepSpeed tag {tag!r} not found in {str(src)!r}")
    return path


def holds_deepspeed_tag(src: str | Path, tag: str | None = None) -> bool:
    """Whether `src` is a DeepSpeed ZeRO checkpoint directory (its `latest`, or `tag`, names a directory of
    DeepSpeed's rank files) rather than a zero3 one."""
    try:
        path = resolve_tag(Path(src), tag)
    except CheckpointError:
        return False
    return any(_MODEL_FILE.fullmatch(f.name) or f.name.startswith("mp_rank_") for f in path.iterdir())


def whole_weights(state: DeepSpeedState) -> dict[str, torch.Tensor]:
    """The module's buffers as saved, every parameter's fp32 master joined, and each tied name beside the
    one it shares: DeepSpeed's own zero_to_fp32 script's dict, in its order."""
    weights = {name: value.clone() for name, value in state.buffers.items()}
    weights |= {name: state.masters[name].whole() for group in state.groups for name in group}
    for alias, source in state.shared_params.items():
        if source in weights:
            weights[alias] = weights[source]
    return weights


def _rank_files(path: Path) -> set[int]:
    """The data-parallel ranks whose model-states files the tag holds."""
    found: dict[int, set[int]] = {}
    for file in path.iterdir():
        match = _MODEL_FILE.fullmatch(file.name)
        if match:
            found.setdefault(int(match.group(2)), set()).add(int(match.group(1)))
    if not found:
        stage12 = sorted(file.name for file in path.glob("mp_rank_*_model_states.pt"))
        if stage12:
            raise CheckpointError(f"{str(path)!r} is not a ZeRO-3 checkpoint ({stage12[0]} holds the whole model: "
                                  "ZeRO stage 0, 1 or 2); expected zero_pp_rank_<r>_mp_rank_00_model_states.pt")
        raise CheckpointError(f"{str(path)!r} holds no zero_pp_rank_<r>_mp_rank_00_model_states.pt: not a "
                              "DeepSpeed ZeRO-3 tag")
    if set(found) != {0}:
        raise CheckpointError(f"{str(path)!r} was saved with model parallelism (mp ranks {sorted(found)}); "
                              "zero3 imports data-parallel ZeRO-3 checkpoints (mp_rank_00 only)")
    return found[0]


def _check_ranks(path: Path, ranks: set[int], world: int) -> None:
    missing = sorted(set(range(world)) - ranks)
    if missing:
        raise CheckpointError(f"{str(path / f'zero_pp_rank_{missing[0]}_mp_rank_00_model_states.pt')!r} is missing: "
                              f"the tag was saved by {world} ranks (ranks {sorted(ranks)} are there)")
    extra = sorted(ranks - set(range(world)))
    if extra:
        raise CheckpointError(f"{str(path)!r} holds files of ranks {extra}, but it was saved by {world} ranks")


def _optim_file(path: Path, rank: int, bf16: bool) -> Path:
    return path / f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def read(src: str | Path, tag: str | None = None, trusted: bool = False) -> DeepSpeedState:
    path = resolve_tag(Path(src), tag)
    ranks = _rank_files(path)
    if 0 not in ranks:
        raise CheckpointError(f"{str(path / 'zero_pp_rank_0_mp_rank_00_model_states.pt')!r} is missing")
    first = read_file(path / "zero_pp_rank_0_mp_rank_00_model_states.pt", trusted)
    world = int(first.get("dp_world_size", max(ranks) + 1))
    _check_ranks(path, ranks, world)
    models = [first] + [read_file(path / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", trusted)
                        for r in range(1, world)]
    ds_config = dict(first.get("ds_config") or {})
    stage = (ds_config.get("zero_optimization") or {}).get("stage")
    if stage != 3:
        raise CheckpointError(f"{str(path)!r} was saved with zero_optimization.stage={stage!r}; expected 3")
    bf16 = bool((ds_config.get("bf16") or {}).get("enabled")) or _optim_file(path, 0, True).is_file()
    optims = [read_file(_optim_file(path, r, bf16), trusted)["optimizer_state_dict"] for r in range(world)]
    for r, optim in enumerate(optims):
        if int(optim.get("zero_stage", 3)) != 3:
            raise CheckpointError(f"{str(_optim_file(path, r, bf16))!r} is a ZeRO stage {int(optim['zero_stage'])} "
                                  "optimizer state; expected 3")
        if models[r]["param_shapes"] != first["param_shapes"]:
            raise CheckpointError(f"rank {r}'s model states list other parameters than rank 0's in {str(path)!r}")
    sub_groups = [OrderedDict(group) for group in first["param_shapes"]]
    shapes = {name: torch.Size(shape) for group in sub_groups for name, shape in group.items()}
    inner = [optim["optimizer_state_dict"] for optim in optims]
    masters: dict[str, Pieces] = {}
    per_param: dict[str, dict[str, Pieces]] = {}
    steps: dict[str, float] = {}
    for index, group in enumerate(sub_groups):
        # Each rank's flat partition of this sub-group, and its moments: one tensor each.
        flats = tuple(optim["fp32_flat_groups"][index] for optim in optims)
        moments = {key: tuple(inner[r]["state"][index][key] for r in range(world)) for key in MOMENTS}
        step = float(torch.as_tensor(inner[0]["state"][index]["step"]))
        offset = 0
        for name, shape in group.items():
            numel = math.prod(shape)
            piece = -(-numel // world)
            masters[name] = Pieces(flats, offset, piece, torch.Size(shape))
            per_param[name] = {key: Pieces(moments[key], offset, piece, torch.Size(shape)) for key in MOMENTS}
            steps[name] = step
            offset += piece
        if any(flat.numel() != offset for flat in flats):
            raise CheckpointError(f"{str(path)!r}: the parameters of sub-group {index} take {offset} elements of "
                                  f"each rank's flat partition, which holds {flats[0].numel()}: a layout zero3 does "
                                  "not know")
    # DeepSpeed's sub-groups split torch param groups; each sub-group's torch group says which options it has.
    groups: list[list[str]] = []
    options: list[dict[str, Any]] = []
    for index, group in enumerate(sub_groups):
        group_options = {k: v for k, v in inner[0]["param_groups"][index].items() if k != "params"}
        if options and options[-1] == group_options:
            groups[-1].extend(group)
        else:
            groups.append(list(group))
            options.append(group_options)
    buffers = {name: first["module"][name] for name in first.get("buffer_names", [])}
    scaler = optims[0].get("loss_scaler")
    return DeepSpeedState(
        path=path, world_size=world, groups=groups, group_options=options, shapes=shapes, masters=masters,
        moments=per_param, steps=steps, buffers=buffers, lr_scheduler=first.get("lr_scheduler"),
        loss_scaler=dict(vars(scaler)) if isinstance(scaler, _DynamicLossScaler) else None,
        global_steps=int(first.get("global_steps", 0)), global_samples=int(first.get("global_samples", 0)),
        skipped_steps=int(first.get("skipped_steps", 0)), ds_config=ds_config,
        client_state={k: v for k, v in first.items() if k not in _ENGINE_KEYS},
        shared_params=dict(first.get("shared_params") or {}),
    )

