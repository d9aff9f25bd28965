"""Muon under ZeRO-3, exactly as `torch.optim.Muon` steps a whole matrix.

[Note: Muon on shards]
Muon's update of a matrix is `orthogonalize(g.lerp(m, momentum))` (Newton-Schulz on the
whole nesterov direction, m the momentum buffer), which no rank can compute from its shard.
Everything around it is elementwise: the momentum update, the direction, the decay and the
step. So a step runs in three phases (zero3.step.optimizer drives them):
1. each rank computes its shard of every matrix's direction (`direction`), reading but not
   writing the momentum (a disk tier's failed step must leave the state as it was);
2. `MatrixExchange` brings each matrix's shards to its owner rank (owners balanced by size,
   bucket by bucket: one all-to-all per bucket, so no rank holds more than a bucket of whole
   matrices), the owner orthogonalizes it with torch's own Newton-Schulz, and a second
   all-to-all sends every rank its shard of the result;
3. the optimizer's step applies it (`MuonAdamW`): the momentum update, the decay and the step,
   on the shards, with the learning rate adjusted by the whole matrix's shape.
Every other parameter (embeddings, the output head, norms, biases) steps with AdamW. The two
kinds share the flat state buffers: a matrix's momentum buffer is its `exp_avg` (its
`exp_avg_sq` stays unused), so every parameter has the same two states.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.adam import adam

from zero3.config import MuonParams

# DeepSpeed's rule: parameters whose names say they are an embedding or the output head use AdamW.
ADAMW_NAMES = ("embed", "lm_head")


def uses_muon(names: Iterable[str], param: nn.Parameter, shape: torch.Size, embeddings: set[int]) -> bool:
    """Whether Muon steps this parameter: a 2-D hidden matrix (not an nn.Embedding's weight or tied to
    one, no name of it containing "embed" or "lm_head"); `param.use_muon` (DeepSpeed's) decides first."""
    chosen = getattr(param, "use_muon", None)
    if chosen is not None:
        if chosen and len(shape) != 2:
            names = list(names)
            raise ValueError(f"{names[0]} has use_muon=True but shape {tuple(shape)}: Muon steps 2-D matrices only")
        return bool(chosen)
    if len(shape) != 2 or id(param) in embeddings:
        return False
    return not any(part in name for name in names for part in ADAMW_NAMES)


def _shape(param: nn.Parameter) -> torch.Size:
    """A parameter's whole shape, also where zero3.Init has already released it."""
    record = getattr(param, "_zero3", None)
    return record.shape if record is not None else param.shape


def split_groups(
    groups: list[tuple[list[nn.Parameter], dict[str, Any]]], model: nn.Module, settings: MuonParams,
) -> list[tuple[list[nn.Parameter], dict[str, Any]]]:
    """Each group cut into its Muon matrices and the rest (the group's own options kept over the
    kind's), all Muon groups first: their masters then lie at the start of the flat buffers. First,
    `use_muon = True` on any parameter of the model that is not a matrix is refused (before anything
    is partitioned: zero3.optim.param_groups)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        uses_muon([name], param, _shape(param), set())  # the refusal
        names.setdefault(id(param), []).append(name)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    muon_groups, adam_groups = [], []
    for params, options in groups:
        muon = [p for p in params if uses_muon(names[id(p)], p, _shape(p), embeddings)]
        chosen = {id(p) for p in muon}
        rest = [p for p in params if id(p) not in chosen]
        if muon:
            muon_groups.append((muon, {**group_options(settings, True), **options}))
        if rest:
            adam_groups.append((rest, {**group_options(settings, False), **options}))
    return muon_groups + adam_groups


def group_options(settings: MuonParams, muon: bool) -> dict[str, Any]:
    """A group's hyperparameters: Muon's for matrices, torch's AdamW defaults (with adam_lr and the
    weight decay) for the rest."""
    if muon:
        return {
            "use_muon": True, "lr": settings.muon_lr or settings.lr, "weight_decay": settings.weight_decay,
            "momentum": settings.momentum, "nesterov": settings.nesterov,
        }
    return {
        "use_muon": False, "lr": settings.adam_lr or settings.lr, "weight_decay": settings.weight_decay,
        "betas": (0.9, 0.999), "eps": 1e-8,
    }


def direction(grad: torch.Tensor, momentum_buffer: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """The shard of what Newton-Schulz orthogonalizes, as torch.optim.Muon computes it (the buffer is
    read, not updated: `MuonAdamW.step` updates it with the same values)."""
    updated = momentum_buffer.lerp(grad, 1 - momentum)
    return grad.lerp(updated, momentum) if nesterov else updated


class MuonAdamW(torch.optim.Optimizer):
    """Steps the shards: AdamW for the groups with `use_muon: False`; for the others, the elementwise
    end of Muon's step, given each piece's orthogonalized update in `updates` and its whole
    matrix's shape in `shapes` (both set by zero3.step.optimizer before each step)."""

    def __init__(self, params: Iterable[dict[str, Any]], settings: MuonParams) -> None:
        # A group names its kind (`use_muon`); what it leaves out is AdamW's (see group_options).
        defaults = {**group_options(settings, False), "momentum": settings.momentum, "nesterov": settings.nesterov}
        super().__init__(params, defaults)
        self.settings = settings
        self.updates: dict[torch.Tensor, torch.Tensor] = {}
        self.shapes: dict[torch.Tensor, torch.Size] = {}

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("MuonAdamW takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state_of(p) for p in params]
            if group["use_muon"]:
                self._muon(group, params, states)
            else:
                beta1, beta2 = group["betas"]
                adam(
                    params, [p.grad for p in params], [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                    decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                    weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                )

    def _muon(self, group: dict[str, Any], params: list[torch.Tensor], states: list[dict[str, Any]]) -> None:
        lr, weight_decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
        for param, state in zip(params, states):
            state["step"] += 1
            state["exp_avg"].lerp_(param.grad, 1 - momentum)
            adjusted_lr = _adjust_lr(lr, self.settings.adjust_lr_fn, self.shapes[param])
            param.mul_(1 - lr * weight_decay)
            param.add_(self.updates[param], alpha=-adjusted_lr)


@dataclass
class Matrix:
    """One Muon matrix, as this rank holds it: its shard at `offset` of the flat direction buffer."""

    key: Any
    shape: torch.Size
    numel: int
    shard_numel: int
    offset: int
    owner: int = 0


class MatrixExchange:
    """Phase 2 of the Note: owners, buckets, and the two all-to-alls around Newton-Schulz."""

    def __init__(
        self, matrices: list[Matrix], rank: int, size: int, group: dist.ProcessGroup | None, bucket_numel: int,
        settings: MuonParams,
    ) -> None:
        self.rank, self.size, self.group = rank, size, group
        self.settings = settings
        self.matrices = matrices
        self.buckets: list[list[Matrix]] = []
        current: list[Matrix] = []
        filled = 0
        for matrix in matrices:
            if current and filled + matrix.numel > bucket_numel:
                self.buckets.append(current)
                current, filled = [], 0
            current.append(matrix)
            filled += matrix.numel
        if current:
            self.buckets.append(current)
        load = [0] * size
        for bucket in self.buckets:  # largest first to the least loaded rank, bucket by bucket
            for matrix in sorted(bucket, key=lambda m: -m.numel):
                matrix.owner = min(range(size), key=lambda r: (load[r], r))
                load[matrix.owner] += matrix.numel

    def orthogonalize(self, flat: torch.Tensor, active: set[Any]) -> None:
        """In place: each active matrix's shard of its direction becomes its shard of the orthogonalized
        update (bf16 values, as torch's Newton-Schulz returns them, held in `flat`'s dtype).

        If Newton-Schulz fails here (out of memory), this rank still sends and receives every bucket
        (garbage, from memory it already holds), so the other ranks' exchange completes; then it raises."""
        failure: Exception | None = None
        for bucket in self.buckets:
            live = [m for m in bucket if m.key in active]
            if live:
                failure = self._bucket(flat, live, failure)
        if failure is not None:
            raise failure

    def _bucket(self, flat: torch.Tensor, live: list[Matrix], failure: Exception | None) -> Exception | None:
        size, rank = self.size, self.rank
        by_owner = [[m for m in live if m.owner == r] for r in range(size)]
        sent_numel = [sum(m.shard_numel for m in owned) for owned in by_owner]
        mine = by_owner[rank]
        per_source = sent_numel[rank]
        if size == 1:
            gathered = flat.new_empty(per_source)
            torch.cat([flat[m.offset : m.offset + m.shard_numel] for m in mine], out=gathered)
        else:
            outgoing = torch.cat([flat[m.offset : m.offset + m.shard_numel] for owned in by_owner for m in owned])
            gathered = flat.new_empty(per_source * size)
            dist.all_to_all_single(gathered, outgoing, [per_source] * size, sent_numel, group=self.group)
            returned = flat.new_empty(sum(sent_numel), dtype=torch.bfloat16)
        # Newton-Schulz answers in bf16 on every rank: the result travels as it is.
        back = gathered.view(torch.bfloat16)[: per_source * size]  # what a rank that failed sends
        if failure is None:
            try:
                back = self._owned_updates(gathered, mine, per_source)
            except Exception as error:  # noqa: BLE001 - raised once every bucket is exchanged
                failure = error
        if size == 1:
            returned = back
        else:
            dist.all_to_all_single(returned, back, sent_numel, [per_source] * size, group=self.group)
        cursor = 0
        for owned in by_owner:
            for m in owned:
                flat[m.offset : m.offset + m.shard_numel].copy_(returned[cursor : cursor + m.shard_numel])
                cursor += m.shard_numel
        return failure

    def _owned_updates(self, gathered: torch.Tensor, mine: list[Matrix], per_source: int) -> torch.Tensor:
        """This rank's matrices, each whole from every rank's shard, orthogonalized; laid out for the
        return exchange (rank-major: each rank's shards of them in order)."""
        size = self.size
        sources = gathered.view(size, per_source)
        results = []
        cursor = 0
        for m in mine:
            # Each owned matrix whole: its shards from every rank, in rank order, the padding cut off.
            whole = sources[:, cursor : cursor + m.shard_numel].reshape(-1)[: m.numel].view(m.shape)
            update = _zeropower_via_newtonschulz(
                whole, self.settings.ns_coefficients, self.settings.ns_steps, self.settings.eps,
            )
            padded = update.new_zeros(size * m.shard_numel)
            padded[: m.numel] = update.reshape(-1)
            results.append(padded.view(size, m.shard_numel))
            cursor += m.shard_numel
        if not results:
            return gathered.new_empty(0, dtype=torch.bfloat16)
        if size == 1:
            return torch.cat([r[0] for r in results])
        return torch.cat([r[s] for s in range(size) for r in results])
