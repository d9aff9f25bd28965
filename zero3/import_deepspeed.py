"""`zero3 import-deepspeed SRC OUT --trust-checkpoint`: a DeepSpeed ZeRO-3 checkpoint as a zero3 one.

The DeepSpeed tag is read (zero3.checkpoint.deepspeed_files), then written by zero3's own save: a module
of the checkpoint's parameter names and shapes (on the meta device: it never runs) is made an engine of
one rank with the run's config; DeepSpeed's pieces of each master and Adam moment are written straight
into the engine's buffers, its step counts, schedule, loss scale and counters are set to DeepSpeed's, and
`save_checkpoint` writes the tag. The result is an ordinary zero3 checkpoint: it loads at any world size
into the real model, which checks the names and shapes as any load does. The output is written beside
OUT and moved into place once complete: a refusal or a failure leaves nothing.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zero3.checkpoint import deepspeed_files
from zero3.checkpoint.tags import CheckpointError
from zero3.partition.flat_buffer import Slot
from zero3.engine.initialize import initialize

# Keys of DeepSpeed's config that describe its own machinery, not the run: left out of the importing engine.
_NOT_THE_RUN = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "checkpoint")


class _Parameters(nn.Module):
    """The checkpoint's parameters (on the meta device: shapes, no values) and buffers under their names:
    the model's structure, nothing else."""

    def __init__(self, state: deepspeed_files.DeepSpeedState) -> None:
        super().__init__()
        for name in [name for group in state.groups for name in group]:
            owner, leaf = self._owner(name)
            owner.register_parameter(leaf, nn.Parameter(torch.empty(state.shapes[name], device="meta")))
        for name, value in state.buffers.items():
            owner, leaf = self._owner(name)
            owner.register_buffer(leaf, value.clone())

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        module: nn.Module = self
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        return module, leaf


def _batch(state: deepspeed_files.DeepSpeedState) -> dict[str, int]:
    """DeepSpeed's global batch, at a world of one (the import's engine): the same train_batch_size."""
    cfg = state.ds_config
    micro = int(cfg.get("train_micro_batch_size_per_gpu") or 1)
    total = cfg.get("train_batch_size") or micro * int(cfg.get("gradient_accumulation_steps") or 1) * state.world_size
    return {"train_batch_size": int(total), "train_micro_batch_size_per_gpu": micro}


def import_deepspeed_checkpoint(
    src: str | os.PathLike[str], out: str | os.PathLike[str], trust_checkpoint: bool = False, tag: str | None = None,
) -> Path:
    """Read DeepSpeed ZeRO-3 checkpoint `src` (its `latest`, or `tag`) and write it as zero3 checkpoint `out`
    (the same tag name, `latest` naming it); returns the tag's path. One process, outside any job's
    process group: the CLI is the way to run it."""
    if not trust_checkpoint:
        raise CheckpointError(f"import of {str(src)!r} refused: {deepspeed_files.TRUST_NEEDED}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise CheckpointError("import_deepspeed_checkpoint runs in one process (the `zero3 import-deepspeed` "
                              "command), not inside a job of several ranks")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{str(out)!r} exists and is not empty: the import writes a new directory")
    state = deepspeed_files.read(src, tag, trusted=trust_checkpoint)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent if out.parent.exists() else None))
    try:
        _save(state, staging)
        if out.exists():
            out.rmdir()
        shutil.move(str(staging), out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out / state.path.name


def _save(state: deepspeed_files.DeepSpeedState, directory: Path) -> None:
    from zero3.checkpoint.data_files import saves_without_crc  # (DCP: imported by the first save)

    cfg: dict[str, Any] = {k: copy.deepcopy(v) for k, v in state.ds_config.items() if k not in _NOT_THE_RUN}
    cfg |= _batch(state)
    cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    created_group = not dist.is_initialized()
    if created_group:  # a world of its own, whatever rendezvous variables the environment holds
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = _Parameters(state)
    named = dict(model.named_parameters())
    groups = [{"params": [named[name] for name in names],
               **{k: v for k, v in options.items() if k in ("weight_decay", "betas", "eps", "amsgrad")}}
              for names, options in zip(state.groups, state.group_options)]
    engine, optimizer, _, scheduler = initialize(model=model, model_parameters=groups, config=cfg,
                                                        device="cpu")
    try:
        if optimizer is None:
            raise CheckpointError(f"{str(state.path)!r}: its config has no optimizer section; zero3 imports a "
                                  "training checkpoint (masters and optimizer states)")
        sharded = {sp.name: sp for sp in engine.sharded_params}
        optimizer.set_states({sharded[name]: {"step": torch.tensor(state.steps[name])} for name in named})
        for name in named:
            slots = optimizer.masters[sharded[name]]
            _write(slots.hp, state.masters[name])
            for key, pieces in state.moments[name].items():
                _write(slots.moments[key], pieces)
        optimizer.lp_stale = True  # the 16-bit shards are written from the masters before any use
        for group, options in zip(optimizer.param_groups, state.group_options):
            group["lr"] = options["lr"]
        if scheduler is not None and state.lr_scheduler is not None:
            position = int(state.lr_scheduler["last_batch_iteration"]) + 1  # DeepSpeed counts from -1
            scheduler.load_state_dict({**scheduler.state_dict(), "last_epoch": position, "_step_count": position + 1})
        if state.loss_scaler is not None:
            engine.loss_scaler.load_state_dict(state.loss_scaler)
        engine.global_steps = state.global_steps
        engine.micro_steps = state.global_steps * engine.gradient_accumulation_steps()
        engine.skipped_steps = state.skipped_steps
        # DeepSpeed saves no random generators: the importing process's are nobody's, so none are written.
        engine._rank_state = lambda: None  # type: ignore[method-assign]
        with saves_without_crc():
            engine.save_checkpoint(directory, tag=state.path.name, client_state=state.client_state)
    finally:
        engine.destroy()
        if created_group and dist.is_initialized():
            dist.destroy_process_group()


def _write(slot: Slot, pieces: deepspeed_files.Pieces) -> None:
    """A parameter's whole tensor into its slot (the engine is of one rank: its shard is the whole), each
    rank's piece copied once from the mapped file."""
    if slot.numel < pieces.numel:
        raise CheckpointError(f"a slot of {slot.numel} elements for a tensor of {pieces.numel}")
    for start, piece in pieces.ranges():
        slot.buffer.write_range(slot.offset + start, piece)
