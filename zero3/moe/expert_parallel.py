"""A model's expert layers shared out over an expert-parallel group (the model side of expert parallelism).

[Note: an experts module shared out]
`share_out_experts` turns each expert layer of a model (zero3.moe.experts' `find_experts`) into this
rank's share of it, in place: the module keeps its place and its parameter names, but each expert weight
holds only the experts this rank owns (rank r of an expert-parallel group of N the experts
[r * E/N, (r + 1) * E/N), the share the module's `num_experts` now counts), cut from rank 0's values so
every rank holds one model whatever its seed; each expert weight stays the same parameter object (an
optimizer's groups or a `model_parameters` list still hold it), with its share's values in place of the
whole. The module's class becomes a subclass of its own whose forward sends the tokens to their experts'
owners and back (zero3.moe.dispatch) and runs the original forward on the tokens it receives: the way
FSDP2's `fully_shard` swaps a module's class, so hooks on the module (the engine's gathers) still run once
around the whole call, and a deepcopy or a pickle of the model keeps working. Each expert weight carries
its `ExpertShare` (which experts of how many it holds), for whatever must see the whole `[E, ...]` tensor
again.

A model built under `zero3.Init` holds its expert weights as shards over every rank: the engine gathers
each whole, in fp32, one weight at a time (`whole_values`), and its share is cut from that; the weight
leaves Init's partition, and the engine shards its share as any other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zero3.moe.dispatch import dispatch
from zero3.moe.experts import ExpertLayer

SHARE = "ds_expert_share"  # an expert weight's ExpertShare, on the parameter


@dataclass(frozen=True)
class ExpertShare:
    """The experts one rank's module holds: [first, first + count) of `total`, owned by rank `ep_rank` of an
    expert-parallel group of `ep_size` ranks (`group`; None: the default group)."""

    total: int
    ep_rank: int
    ep_size: int
    group: dist.ProcessGroup | None = None

    @property
    def count(self) -> int:
        return self.total // self.ep_size

    @property
    def first(self) -> int:
        return self.ep_rank * self.count

    def __deepcopy__(self, memo: dict[int, Any]) -> ExpertShare:
        return self  # a process group is a handle on the job's group, not a value to copy

    def __reduce__(self) -> tuple[Any, ...]:
        return (ExpertShare, (self.total, self.ep_rank, self.ep_size, None))  # a pickle carries no group


class _ExpertParallelForward:
    """The forward of a shared-out experts module: Hugging Face's `experts(hidden, top_k_index,
    top_k_weights)`, its tokens computed by the ranks that own their experts."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        share: ExpertShare = getattr(self, SHARE)
        compute = super().forward  # type: ignore[misc]  (the original class's forward, on local experts)
        return dispatch(compute, hidden_states, top_k_index, top_k_weights, share.count, share.group)


_SUBCLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    if issubclass(cls, _ExpertParallelForward):
        return cls
    if cls not in _SUBCLASSES:
        # Defined at module level under its own name, so a pickle of the model finds the class again.
        name = f"ExpertParallel{cls.__name__}"
        subclass = type(name, (_ExpertParallelForward, cls), {"__module__": __name__})
        globals()[name] = subclass
        _SUBCLASSES[cls] = subclass
    return _SUBCLASSES[cls]


def expert_share(param: torch.Tensor) -> ExpertShare | None:
    """The experts `param` holds, where it is an expert weight of a shared-out layer; else None."""
    return getattr(param, SHARE, None)


# The whole, agreed values of an expert weight that holds none itself (partitioned by zero3.Init: the engine
# gathers them, and takes the weight out of its partition), or None for a weight that holds its values.
WholeValues = Callable[[nn.Parameter], "torch.Tensor | None"]


def share_out_experts(layers: list[ExpertLayer], ep_rank: int, ep_size: int,
                      group: dist.ProcessGroup | None = None,
                      whole_values: WholeValues | None = None) -> list[ExpertShare]:
    """Each of `layers` (zero3.moe.experts' `find_experts`, already checked by `check_autoep_size`) made
    rank `ep_rank`'s share of it, in place ([Note: an experts module shared out]). Collective over the
    default group (rank 0's values are every rank's) when the job has more than one rank. `whole_values`:
    where the weights partitioned by zero3.Init get their values (one weight at a time)."""
    for layer in layers:  # every layer checked before any is changed
        for name in layer.weights:
            whole = getattr(layer.module, name)
            if whole.is_meta or (hasattr(whole, "ds_shape") and whole_values is None):
                raise ValueError(f"expert layer {layer.name!r}: {name} holds no values here (on the meta device, or "
                                 "partitioned by zero3.Init); its experts are shared out from whole weights")
    shares = []
    spread = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    for layer in layers:
        share = ExpertShare(layer.num_experts, ep_rank, ep_size, group)
        module = layer.module
        for name in layer.weights:
            whole: nn.Parameter = getattr(module, name)
            values = whole_values(whole) if whole_values is not None else None
            if values is None:
                values = whole.detach()
                if spread:
                    values = values.contiguous().clone()
                    dist.broadcast(values, src=0)
            with torch.no_grad():  # the same parameter (an optimizer's groups still hold it), its share's values
                whole.data = values[share.first:share.first + share.count].clone()
            setattr(whole, SHARE, share)
        if hasattr(module, "num_experts"):
            module.num_experts = share.count
        setattr(module, SHARE, share)
        module.__class__ = _expert_parallel_class(type(module))
        shares.append(share)
    return shares
