"""Expert parallelism's dispatch (zero3.moe.dispatch) at 2 and 4 ranks: each rank owns a share of a Hugging
Face MoE layer's experts, tokens travel to their experts' owners and back, and the outputs and every gradient
are the plain module's on the same tokens; no rank hangs when one has no tokens or an expert gets none."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers

from tests.distributed import run_ranks
from zero3.moe import find_experts
from zero3.moe.dispatch import dispatch, local_experts

EXPERTS, HIDDEN, TOP_K = 8, 16, 2


def experts_layer():
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=HIDDEN, intermediate_size=32,
                                         moe_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=8, num_experts=EXPERTS,
                                         num_experts_per_tok=TOP_K)
    model = transformers.Qwen3MoeForCausalLM(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)  # (HF leaves 3-D expert weights uninitialized until _init_weights)
    return find_experts(model)[0]


def tokens_of(rank: int, case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rank's tokens, top-k experts, weights and the gradient its loss sends back; each rank its own count."""
    generator = torch.Generator().manual_seed(100 + rank)
    count = 0 if case == "a rank with no tokens" and rank == 1 else 3 + 2 * rank
    hidden = torch.randn(count, HIDDEN, generator=generator)
    if case == "two experts take every token":
        index = torch.tensor([[0, 1]]).repeat(count, 1)  # a frozen router: every other expert gets nothing
    else:
        index = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(count)]) \
            if count else torch.empty(0, TOP_K, dtype=torch.long)
    weights = torch.rand(count, TOP_K, generator=generator).softmax(-1)
    return hidden, index, weights, torch.randn(count, HIDDEN, generator=generator)


def dispatched(rank: int, world: int, case: str) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    layer = experts_layer()
    local = local_experts(layer, rank, world)
    hidden, index, weights, grad_out = tokens_of(rank, case)
    hidden.requires_grad_(True)
    out = dispatch(local, hidden, index, weights, EXPERTS // world, dist.group.WORLD)
    out.backward(grad_out)
    return {"out": out.detach(), "hidden_grad": hidden.grad,
            "weight_grads": {name: getattr(local, name).grad for name in layer.weights}}


@pytest.mark.parametrize("world, case", [
    (2, "routed"), (2, "a rank with no tokens"), (4, "routed"), (4, "two experts take every token")])
def test_dispatched_experts_compute_the_plain_modules_outputs_and_gradients(world: int, case: str) -> None:
    results = run_ranks(world, dispatched, case)
    layer = experts_layer()  # the reference: the whole module, in this process, on every rank's tokens
    per_rank = EXPERTS // world
    for rank, result in enumerate(results):
        hidden, index, weights, grad_out = tokens_of(rank, case)
        hidden.requires_grad_(True)
        out = layer.module(hidden, index, weights)
        out.backward(grad_out)
        torch.testing.assert_close(result["out"], out.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["hidden_grad"], hidden.grad, rtol=1e-5, atol=1e-5)
    for rank, result in enumerate(results):
        for name in layer.weights:
            whole = getattr(layer.module, name).grad
            expected = whole[rank * per_rank:(rank + 1) * per_rank] if whole is not None else None
            got = result["weight_grads"][name]
            if case == "two experts take every token" and rank > 0:  # experts 2..7: no token, no gradient
                assert got is None or not got.any(), (rank, name)
            else:
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
