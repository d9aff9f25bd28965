"""The optimizer's layout: its sub-groups (each a window of the flat state buffers, stepped as one torch
step), how the shards are cut into them, where each sub-group's new 16-bit shards go, and the snapshot of
its scalar states that a failed or undone step puts back.

[Note: optimizer layout]
Trainable parameters are laid out in optimizer-group order in flat buffers
with one shared offset map: `hp_params` (fp32 master), `lp_grads` (the
reduced gradients, in `grad_accum_dtype`: zero3.step.grad_shards, built by
the engine and shared with the reducer), and one per elementwise state of the
optimizer (Adam: `exp_avg`, `exp_avg_sq`; together the `optim_states`; see
zero3.optim.spec). The fp32 buffers belong to a tier (zero3.offload's
optimizer tier): on the device, in host memory (ZeRO-Offload) or in files
(ZeRO-Infinity); `lp_grads` stays in memory in every tier (host memory with
ZeRO-Offload). Each group's range is cut into sub-groups of
`sub_group_size` elements (the last one shorter), splitting a
parameter's shard where a cut falls in it: the update is elementwise, so a
shard stepped in two pieces gets the same values as in one, and a disk
tier's windows stay `sub_group_size` however large one parameter is (a
50k-vocab embedding would otherwise size them all). A step walks the
sub-groups: the tier hands each one's window to `step_sub_group`, which
makes the sub-group's fp32 gradients from `lp_grads` (they exist only while
it steps), points torch's optimizer at the window (each piece's master a
view, its states views, in the optimizer state) and steps it. So a
parameter that got no gradient this step is skipped exactly as torch skips
it. A piece's state is created by torch itself at its first step (as the
class does it: SGD's momentum is the first gradient, Adagrad's sum starts at
`initial_accumulator_value`) and then moved into the flat buffers
(zero3.step.torch_state's `adopt`); from then on torch updates it in place there. The new 16-bit
shards are written from each sub-group's masters once it has stepped (or,
when they live on disk beside masters kept in memory, after the walk: see
`step`).

[Note: masters that are the shards]
An fp32 engine whose shards and masters share one memory (neither tier
offloaded: `masters_are_shards`) keeps one copy: each parameter's master
slot is its shard slot in `lp_params`, there is no `hp_params` buffer, and a
step updates the shards in place (nothing to write back). The optimizer
order still names each parameter's place in `lp_grads`, the moments and the
sub-groups (`order_offsets`); only the masters live in the shards' layout, so
each piece's master is bound to a view of its shard. Checkpoints, the
accessors and `offload_states` see the same masters through the slots; the
`hp_params` state holds no bytes, and moving `lp_params` moves the masters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn

from zero3.partition.flat_buffer import FlatBuffer
from zero3.partition.sharded_param import ShardedParam
from zero3.step.grad_shards import GradShards, Piece


@dataclass
class ScalarSnapshot:
    """Pieces without state (`fresh`), and the others' scalar state: 0-dim tensors stacked per name,
    anything else (`loose`) copied one by one."""

    fresh: list[nn.Parameter]
    stacked: dict[str, tuple[list[nn.Parameter], torch.Tensor]]
    loose: list[tuple[nn.Parameter, str, Any]]


@dataclass
class SubGroup:
    offset: int
    numel: int
    pieces: list[Piece]
    masters: list[nn.Parameter]  # one per piece
    group_index: int = 0  # its parameter group
    muon: bool = False  # its matrices step with Muon (zero3.optim.muon)
    # Its pieces' runs in the 16-bit shard buffers: (buffer, offset there, offset here, elements).
    lp_runs: list[tuple[FlatBuffer, int, int, int]] = field(default_factory=list)

    @cached_property
    def piece_numels(self) -> list[int]:
        """Each piece's elements, in order: how its gradients are cut, in one `split`, at every step."""
        return [piece.numel for piece in self.pieces]


def check_shard_is_master(sp: ShardedParam, step_device: torch.device) -> None:
    """A shard that is to serve as its fp32 master must be one in memory where the step runs."""
    buffer = sp.lp_slot.buffer  # type: ignore[union-attr]
    if buffer.dtype != torch.float32 or buffer.store is not None or buffer.device != step_device:
        raise ValueError(
            f"the fp32 masters cannot be the shards: {sp.name}'s shard is {buffer.dtype} in {buffer.home} "
            f"memory, the step runs in fp32 on {step_device}"
        )


def lp_runs(sub: SubGroup) -> list[tuple[FlatBuffer, int, int, int]]:
    """(shard buffer, offset in it, offset in the sub-group, elements) for each run of the sub-group's
    pieces that are contiguous in one 16-bit shard buffer (shard slots never move); a lean piece has none."""
    merged: list[tuple[FlatBuffer, int, int, int]] = []
    cursor = 0
    for piece in sub.pieces:
        lp = piece.sp.lp_slot
        if lp is None:
            cursor += piece.numel
            continue
        start = lp.offset + piece.start
        if merged and merged[-1][0] is lp.buffer and merged[-1][1] + merged[-1][3] == start:
            buffer, offset, first, numel = merged[-1]
            merged[-1] = (buffer, offset, first, numel + piece.numel)
        else:
            merged.append((lp.buffer, start, cursor, piece.numel))
        cursor += piece.numel
    return merged


def split(sps: list[ShardedParam], limit: int) -> list[list[Piece]]:
    """Cut the shards' concatenation into runs of `limit` elements (the last shorter); see the Note."""
    runs: list[list[Piece]] = []
    current: list[Piece] = []
    room = limit
    for sp in sps:
        start = 0
        while start < sp.shard_numel:
            take = min(room, sp.shard_numel - start)
            current.append(Piece(sp, start, take))
            start += take
            room -= take
            if room == 0:
                runs.append(current)
                current, room = [], limit
    if current:
        runs.append(current)
    return runs


def steps_on_its_gradients(grads: GradShards, step_device: torch.device, transactional: bool, muon: bool) -> bool:
    """Whether the step runs on views of the reduced gradients `grads`, scaled in place (zero_grad clears them
    after the step), instead of on an fp32 copy of each sub-group's: where they are fp32 in one flat buffer on
    the step's device. Not where a failed step can be retried (a transactional tier keeps the gradients for
    it) or Muon's exchange reads them."""
    return grads.steps_in_place(step_device) and not transactional and not muon
