"""A Hugging Face MoE model with its experts shared out over an expert-parallel group (zero3.moe.expert_parallel),
at 2 and 4 ranks: each rank's logits and dense gradients are the whole model's on that rank's tokens, each expert's
gradient summed over the ranks holding it is the whole model's summed over every rank's tokens, ranks seeded
differently hold rank 0's experts, and a router that sends every token to two experts leaves the other ranks'
experts idle without a hang."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh

from tests.distributed import run_ranks
from zero3.moe import find_experts
from zero3.moe.expert_parallel import expert_share, share_out_experts

EXPERTS, HIDDEN, TOP_K, VOCAB = 8, 16, 2, 64


def moe_model(seed: int, family: str = "qwen3_moe") -> torch.nn.Module:
    torch.manual_seed(seed)
    if family == "mixtral":
        config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=8,
                                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                            head_dim=8, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
        model = transformers.MixtralForCausalLM(config)
    elif family == "gpt_oss":  # biases on the experts' weights
        config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=8,
                                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                           head_dim=8, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
        model = transformers.GptOssForCausalLM(config)
    elif family == "deepseek_v3":  # a dense first layer, shared experts beside the routed ones
        config = transformers.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=EXPERTS, n_shared_experts=1,
            num_experts_per_tok=TOP_K, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=8,
            kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
        model = transformers.DeepseekV3ForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                                             moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                                             num_key_value_heads=1, head_dim=8, num_experts=EXPERTS,
                                             num_experts_per_tok=TOP_K)
        model = transformers.Qwen3MoeForCausalLM(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)  # (HF leaves 3-D expert weights uninitialized until _init_weights)
    return model.float()


def to_two(router: torch.nn.Module, inputs: tuple, output: tuple) -> tuple:
    logits, weights, index = output
    return logits, weights, torch.tensor([0, 1]).expand_as(index)


def route_to_two(model: torch.nn.Module) -> None:
    """A frozen router that sends every token to experts 0 and 1 (the others get none)."""
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.weight.requires_grad_(False)
            module.register_forward_hook(to_two)


def tokens_of(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 + rank)
    return torch.randint(0, VOCAB, (1, 3 + 2 * rank), generator=generator)  # each rank its own length


def expert_parallel_rank(rank: int, world: int, ep_size: int, family: str, case: str) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = moe_model(seed=rank, family=family)  # ranks seeded differently: rank 0's experts are taken
    if case == "two experts take every token":
        route_to_two(model)
    mesh = init_device_mesh("cpu", (world // ep_size, ep_size), mesh_dim_names=("expert_data", "expert"))
    shares = share_out_experts(find_experts(model), mesh.get_local_rank("expert"), ep_size, mesh.get_group("expert"))
    for p in model.parameters():
        if expert_share(p) is None:
            dist.broadcast(p.data, src=0)  # the dense part agreed as the engine's partitioner agrees it
    ids = tokens_of(rank)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    expert_grads, dense_grads = {}, {}
    for name, p in model.named_parameters():
        share = expert_share(p)
        if share is None:
            dense_grads[name] = p.grad
            continue
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=mesh.get_group("expert_data"))  # the ranks holding these experts
        expert_grads[name] = (share.first, share.count, grad)
    copied = copy.deepcopy(model)
    return {"logits": out.logits.detach(), "expert_grads": expert_grads, "dense_grads": dense_grads,
            "counts": [share.count for share in shares],
            "class": type(copied.model.layers[0].mlp.experts).__name__,
            "pickled": type(pickle.loads(pickle.dumps(copied)).model.layers[1].mlp.experts).__name__}


@pytest.mark.parametrize("world, ep_size, family, case", [
    (2, 2, "qwen3_moe", "routed"),
    (4, 2, "qwen3_moe", "routed"),
    (4, 4, "mixtral", "routed"),
    (4, 4, "qwen3_moe", "two experts take every token"),
])
def test_shared_out_experts_give_the_whole_models_outputs_and_gradients(world: int, ep_size: int, family: str,
                                                                       case: str) -> None:
    results = run_ranks(world, expert_parallel_rank, ep_size, family, case)
    reference = moe_model(seed=0, family=family)
    if case == "two experts take every token":
        route_to_two(reference)
    summed: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(results):
        assert result["counts"] == [EXPERTS // ep_size] * 2
        assert result["class"] == result["pickled"] and result["class"].startswith("ExpertParallel")
        reference.zero_grad()
        ids = tokens_of(rank)
        out = reference(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.testing.assert_close(result["logits"], out.logits.detach(), rtol=1e-5, atol=1e-5)
        for name, p in reference.named_parameters():
            if name in result["dense_grads"]:
                got = result["dense_grads"][name]
                if p.grad is None:
                    assert got is None or not got.any(), name
                else:
                    torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-5)
            else:
                summed[name] = summed.get(name, 0) + (p.grad if p.grad is not None else torch.zeros_like(p))
    for result in results:
        for name, (first, count, grad) in result["expert_grads"].items():
            torch.testing.assert_close(grad, summed[name][first:first + count], rtol=1e-5, atol=1e-5)
    if case == "two experts take every token":
        for result in results[1:]:  # experts 2..7 (ranks 1..3 hold them): no token reached them
            assert not any(grad.any() for _, _, grad in result["expert_grads"].values())


def test_experts_without_values_are_refused_with_their_layer_named() -> None:
    with torch.device("meta"):
        model = moe_model(seed=0)
    layers = find_experts(model)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts': gate_up_proj holds no values"):
        share_out_experts(layers, 0, 2)
    assert type(layers[0].module).__name__ == "Qwen3MoeExperts"  # nothing changed


def partitioned_rank(rank: int, world: int, ep_size: int, quantized: bool) -> dict:
    from zero3.comm import Communicator
    from zero3.config import ZeroConfig
    from zero3.partition.collectives import GradReduce, ParamGather, gather_full_fp32
    from zero3.passes.grad_reducer import GradientReducer
    from zero3.step.grad_shards import GradShards
    from zero3.partition.partitioner import partition_model
    from zero3.partition.sharded_param import sharded
    from zero3.shard_mesh import ShardMesh

    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = moe_model(seed=rank)
    mesh = init_device_mesh("cpu", (world // ep_size, ep_size), mesh_dim_names=("expert_data", "expert"))
    share_out_experts(find_experts(model), mesh.get_local_rank("expert"), ep_size, mesh.get_group("expert"))
    comm = Communicator()
    expert_data = ShardMesh(shard_size=mesh.size(0), shard_rank=mesh.get_local_rank("expert_data"),
                            shard_group=mesh.get_group("expert_data"))
    zc = ZeroConfig(stage3_param_persistence_threshold=0, zero_quantized_weights=quantized)
    parted = partition_model(model, ParamGather(ShardMesh.of_group(), comm), torch.device("cpu"), torch.float32,
                             {}, zc, ParamGather(expert_data, comm, own_group=True))
    units = {unit.label: (unit.gather.mesh.shard_size, [sp.name for sp in unit.params]) for unit in parted.all_units}
    whole = {name: gather_full_fp32(sharded(p), sharded(p).unit.gather, torch.device("cpu"))
             for name, p in model.named_parameters()}
    shard_numel = {name: sharded(p).shard_numel for name, p in model.named_parameters()}
    # Every rank hands the reducer its own gradient of each parameter (rank + 1 times a pattern) in one pass.
    sps = parted.sharded_params
    grads = GradShards(sps, torch.float32, torch.device("cpu"))
    reducer = GradientReducer(GradReduce(ShardMesh.of_group(), comm), sps, torch.float32, torch.device("cpu"),
                              bucket_numel=64, overlap=True, grads=grads,
                              expert_reduce=GradReduce(expert_data, comm, own_group=True))
    reducer.begin()
    for sp in sps:
        reducer.add(sp, gradient_of(sp.name, sp.shape, rank))
    reducer.finish()
    reduced = {sp.name: (sp.shard_range(), grads.read(sp).clone()) for sp in sps}
    reducer.close()
    return {"units": units, "whole": whole, "shard_numel": shard_numel, "reduced": reduced,
            "quantized": sorted({type(unit.gather.codec).__name__ for unit in parted.units})}


def gradient_of(name: str, shape: torch.Size, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=generator) * (rank + 1)


@pytest.mark.parametrize("quantized", [False, True])
def test_shared_out_experts_are_sharded_over_their_expert_data_group(quantized: bool) -> None:
    world, ep_size = 4, 2
    results = run_ranks(world, partitioned_rank, ep_size, quantized)
    reference = dict(moe_model(seed=0).named_parameters())
    count = EXPERTS // ep_size
    for rank, result in enumerate(results):
        ep_rank = rank % ep_size
        for layer in range(2):
            label = f"model.layers.{layer}.mlp.experts"
            assert result["units"][label] == (world // ep_size, [f"{label}.gate_up_proj", f"{label}.down_proj"])
        for name, value in result["whole"].items():
            expected = reference[name].detach()
            if name.endswith(("gate_up_proj", "down_proj")):
                expected = expected[ep_rank * count:(ep_rank + 1) * count]  # the share, rank 0's values
                assert result["shard_numel"][name] == -(-expected.numel() // (world // ep_size))
            else:
                assert result["shard_numel"][name] == -(-expected.numel() // world)
            torch.testing.assert_close(value, expected, rtol=0, atol=0)
        assert result["quantized"] == (["QuantizedShards"] if quantized else ["NoneType"])
        # Gradients: the mean over every rank's; an expert's sums only the ranks holding the same share.
        holders = [other for other in range(world) if other % ep_size == ep_rank]
        for name, ((start, end), got) in result["reduced"].items():
            expert = name.endswith(("gate_up_proj", "down_proj"))
            shape = result["whole"][name].shape
            summed = sum(gradient_of(name, shape, other) for other in (holders if expert else range(world)))
            torch.testing.assert_close(got.reshape(-1)[: end - start], (summed / world).reshape(-1)[start:end],
                                       rtol=1e-6, atol=1e-6)
