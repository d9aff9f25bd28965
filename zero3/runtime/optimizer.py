"""The sharded optimizer: fp32 master shards, flat moments, clipping, loss scaling.

[Note: optimizer layout]
Trainable parameters are laid out in optimizer-group order in four flat
buffers with one shared offset map: `hp_params` (fp32 master), `lp_grads`
(16-bit reduced gradients), and `exp_avg` / `exp_avg_sq` (the
`optim_states`). Torch's own Adam/AdamW (fused on CUDA, foreach on CPU) steps
one master per parameter: a view of `hp_params`, whose moments are views of
the moment buffers placed in the optimizer state before the first step. So
every state is one flat buffer (one copy to move it), and a parameter that
got no gradient this step is skipped exactly as torch skips it (no decay, no
moment update, no step count). Groups are cut into sub-groups of at most
`sub_group_size` elements at parameter boundaries; a sub-group's fp32
gradients exist only while it steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zero3.comm import Communicator
from zero3.config import OptimizerConfig
from zero3.partition.flat_buffer import FlatBuffer, Slot
from zero3.partition.sharded_param import ShardedParam
from zero3.runtime.loss_scaler import DynamicLossScaler, LossScaler

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class SubGroup:
    offset: int
    numel: int
    params: list[ShardedParam]
    masters: list[nn.Parameter]


class ZeroOptimizer:
    """Steps this rank's shards. `param_groups` are torch's, so schedulers work."""

    def __init__(
        self,
        groups: list[tuple[list[ShardedParam], dict[str, Any]]],
        config: OptimizerConfig,
        comm: Communicator,
        device: torch.device,
        grad_dtype: torch.dtype,
        sub_group_size: int,
        gradient_clipping: float,
        loss_scaler: LossScaler | DynamicLossScaler,
    ) -> None:
        self.comm = comm
        self.device = device
        self.gradient_clipping = gradient_clipping
        self.loss_scaler = loss_scaler
        self.params = [sp for sps, _ in groups for sp in sps]
        total = sum(sp.shard_numel for sp in self.params)
        self.hp_params = FlatBuffer.zeros("hp_params", total, torch.float32, device)
        # The reduced gradients, accumulated across micro-steps in grad_accum_dtype (the
        # state keeps DeepSpeed's name `lp_grads` whatever that dtype is).
        self.lp_grads = FlatBuffer.zeros("lp_grads", total, grad_dtype, device)
        self.moments = {
            name: FlatBuffer.zeros(name, total, torch.float32, device, state="optim_states") for name in MOMENTS
        }

        self.sub_groups: list[SubGroup] = []
        torch_groups: list[dict[str, Any]] = []
        cursor = 0
        for sps, options in groups:
            group_masters: list[nn.Parameter] = []
            for run in _split(sps, sub_group_size):
                start = cursor
                masters = []
                for sp in run:
                    sp.hp_slot = Slot(self.hp_params, cursor, sp.shard_numel)
                    sp.grad_slot = Slot(self.lp_grads, cursor, sp.shard_numel)
                    sp.optim_slots = {name: Slot(buf, cursor, sp.shard_numel) for name, buf in self.moments.items()}
                    sp.hp_slot.view().copy_(sp.hp_seed if sp.hp_seed is not None else sp.lp_shard())
                    sp.hp_seed = None
                    masters.append(nn.Parameter(torch.empty(0, device=device)))
                    cursor += sp.shard_numel
                self.sub_groups.append(SubGroup(start, cursor - start, run, masters))
                group_masters.extend(masters)
            torch_groups.append({"params": group_masters, **options})

        fused = device.type == "cuda"
        cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        p = config.params
        self.optimizer = cls(
            torch_groups, lr=p.lr, betas=tuple(p.betas), eps=p.eps, weight_decay=p.weight_decay,
            fused=fused or None, foreach=None if fused else True,
        )
        for sub in self.sub_groups:
            for master in sub.masters:
                self.optimizer.state[master] = {
                    "step": torch.zeros((), dtype=torch.float32, device=device if fused else "cpu")
                }
        self.bind_views()

    # [Note: master views]
    # Torch's optimizer holds tensors, not slots: each master is a view of
    # `hp_params` and its moments are views of the moment buffers. Those views
    # would pin the old storage when a state is offloaded, so `unbind_views`
    # drops them (the offload tier calls it before moving `hp_params` or
    # `optim_states`) and `step` binds them again from the current buffers.
    def bind_views(self) -> None:
        for sub in self.sub_groups:
            for sp, master in zip(sub.params, sub.masters):
                assert sp.hp_slot is not None
                master.data = sp.hp_slot.view()
                self.optimizer.state[master].update({name: slot.view() for name, slot in sp.optim_slots.items()})

    def unbind_views(self) -> None:
        for sub in self.sub_groups:
            for master in sub.masters:
                master.data = torch.empty(0, device=self.device)
                state = self.optimizer.state[master]
                for name in MOMENTS:
                    state[name] = torch.empty(0, device=self.device)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    # ---- gradients -----------------------------------------------------------
    def zero_grad(self) -> None:
        self.lp_grads.tensor.zero_()
        for sp in self.params:
            sp.has_grad = False

    def agree_on_gradients(self) -> float:
        """One all-reduce: the global grad norm (still loss-scaled; inf/nan on overflow) and which
        parameters got a gradient on ANY rank.

        A parameter some rank did not use still has a gradient (zero there, the
        others' elsewhere), and each rank steps only its own shard of it: all
        ranks must step it, or none, or one parameter's shards drift apart.
        """
        values = torch.zeros(1 + len(self.params), dtype=torch.float32, device=self.device)
        values[0] = torch.linalg.vector_norm(self.lp_grads.tensor, 2, dtype=torch.float32).pow(2)
        if self.params:
            values[1:] = torch.tensor([sp.has_grad for sp in self.params], dtype=torch.float32)
        summed = self.comm.all_reduce_sum(values).cpu()
        for sp, flag in zip(self.params, summed[1:].tolist()):
            sp.has_grad = flag > 0
        return math.sqrt(summed[0].item())

    # ---- step ------------------------------------------------------------------
    def step(self) -> tuple[bool, float]:
        """Unscale, clip and step. Returns (stepped, grad_norm); skips on overflow."""
        scale = self.loss_scaler.loss_scale
        norm = self.agree_on_gradients()
        overflow = not math.isfinite(norm)
        self.loss_scaler.update(overflow)
        if overflow:
            self.zero_grad()
            return False, norm
        self.bind_views()
        norm /= scale
        coefficient = 1.0 / scale
        if self.gradient_clipping > 0:
            coefficient *= min(1.0, self.gradient_clipping / (norm + 1e-6))
        for sub in self.sub_groups:
            if not any(sp.has_grad for sp in sub.params):
                continue
            grad = self.lp_grads.view(sub.offset, sub.numel).to(torch.float32, copy=True)
            if coefficient != 1.0:
                grad.mul_(coefficient)
            cursor = 0
            for sp, master in zip(sub.params, sub.masters):
                master.grad = grad[cursor : cursor + sp.shard_numel] if sp.has_grad else None
                cursor += sp.shard_numel
            self.optimizer.step()
            for master in sub.masters:
                master.grad = None
        lp = [sp.lp_shard() for sp in self.params]
        hp = [sp.hp_slot.view() for sp in self.params]  # type: ignore[union-attr]
        if lp:
            torch._foreach_copy_(lp, hp)
        self.zero_grad()
        return True, norm

    def state_bytes(self) -> dict[str, int]:
        return {
            "hp_params": self.hp_params.nbytes,
            "lp_grads": self.lp_grads.nbytes,
            "optim_states": sum(buf.nbytes for buf in self.moments.values()),
        }


def _split(sps: list[ShardedParam], limit: int) -> list[list[ShardedParam]]:
    runs: list[list[ShardedParam]] = []
    current: list[ShardedParam] = []
    size = 0
    for sp in sps:
        if current and size + sp.shard_numel > limit:
            runs.append(current)
            current, size = [], 0
        current.append(sp)
        size += sp.shard_numel
    if current:
        runs.append(current)
    return runs
