"""Tokens to the ranks that own their experts, and back (expert parallelism's forward).

Each rank of an expert-parallel group owns `experts_per_rank` whole experts of a layer
(rank r the experts [r * n, (r + 1) * n)). A layer's forward on a rank hands the experts
module its tokens, the router's top-k experts and weights (Hugging Face's
`experts(hidden_states, top_k_index, top_k_weights)`). Here every (token, expert)
assignment travels to the expert's owner in one `all_to_all_single` with per-rank
splits (the counts go first, in one of their own), the owner runs its local experts
on what it received with the module's own forward (each assignment a row of its own,
weight 1), and the outputs come back the same way, to be weighted and summed per
token on the rank they came from: the model's routing, weights and combination,
dropless (no capacity, nothing dropped). Both exchanges are differentiable, so the
backward sends the gradients the other way. A rank with no tokens, or an expert no
token chose, still takes part in both exchanges with empty splits: no rank waits on
another that skipped.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from zero3.moe.experts import ExpertLayer


def local_experts(layer: ExpertLayer, ep_rank: int, ep_size: int) -> nn.Module:
    """A copy of `layer`'s experts module holding only the experts rank `ep_rank` of `ep_size` owns (its
    own forward then runs on local expert indices)."""
    per_rank = layer.num_experts // ep_size
    local = copy.copy(layer.module)
    local._parameters = dict(layer.module._parameters)
    for name in layer.weights:
        whole = getattr(layer.module, name)
        setattr(local, name, nn.Parameter(whole.detach()[ep_rank * per_rank:(ep_rank + 1) * per_rank].clone(),
                                          requires_grad=whole.requires_grad))
    if hasattr(local, "num_experts"):
        local.num_experts = per_rank
    return local


LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dispatch(local: LocalExperts, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             experts_per_rank: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The experts' output for `hidden` ([tokens, hidden]), computed by the ranks of `group` that own each
    token's top-k experts (`local`: this rank's experts' forward, `local(hidden, index, weights)` on local expert
    indices, as `local_experts` gives it). Collective over `group`."""
    size = dist.get_world_size(group)
    k = top_k_index.shape[-1]
    expert = top_k_index.reshape(-1)
    token = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(k)
    owner = torch.div(expert, experts_per_rank, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)  # grouped by owner, in token order within each
    send_counts = torch.bincount(owner, minlength=size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()

    local_index = (expert[order] - owner[order] * experts_per_rank).contiguous()
    recv_index = torch.empty(sum(recv_splits), dtype=local_index.dtype, device=hidden.device)
    dist.all_to_all_single(recv_index, local_index, recv_splits, send_splits, group=group)
    sent = hidden[token[order]]
    received = _exchange(sent, recv_splits, send_splits, group)
    ones = torch.ones((received.shape[0], 1), dtype=top_k_weights.dtype, device=hidden.device)
    computed = local(received, recv_index.unsqueeze(1), ones)
    back = _exchange(computed, send_splits, recv_splits, group)
    weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(1)
    return torch.zeros_like(hidden).index_add(0, token[order], weighted.to(hidden.dtype))


def _exchange(rows: torch.Tensor, recv_splits: list[int], send_splits: list[int],
              group: dist.ProcessGroup | None) -> torch.Tensor:
    """`rows` sent `send_splits` to each rank of `group`, `recv_splits` received from each: differentiable
    (the backward sends the gradients the other way)."""
    received = funcol.all_to_all_single_autograd(rows.contiguous(), recv_splits, send_splits,
                                                 group if group is not None else dist.group.WORLD)
    return funcol.wait_tensor(received)
