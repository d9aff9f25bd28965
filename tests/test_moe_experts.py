"""A model's expert layers are found from the model: Hugging Face's expert-parallel plan for every family that
has one (Qwen3-MoE, Mixtral, gpt-oss with its biases, DeepSeek-V3 with dense first layers and shared experts),
`zero3.moe.mark_experts` for a model of one's own, and each expert-parallel size that cannot lay them out is
refused with the key and the numbers."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import zero3
from zero3.config import ConfigError
from zero3.moe import check_autoep_size, find_experts, mark_experts

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, num_experts_per_tok=2)


def hf_model(family: str) -> nn.Module:
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**SMALL, intermediate_size=64, moe_intermediate_size=16, num_experts=8)
        return transformers.Qwen3MoeForCausalLM(config)
    if family == "mixtral":
        config = transformers.MixtralConfig(**SMALL, intermediate_size=16, num_local_experts=4)
        return transformers.MixtralForCausalLM(config)
    if family == "gpt_oss":
        config = transformers.GptOssConfig(**SMALL, intermediate_size=16, num_local_experts=4)
        return transformers.GptOssForCausalLM(config)
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8)
    return transformers.DeepseekV3ForCausalLM(config)


@pytest.mark.parametrize("family, layers, experts, weights", [
    ("qwen3_moe", [0, 1, 2], 8, ("gate_up_proj", "down_proj")),
    ("mixtral", [0, 1, 2], 4, ("gate_up_proj", "down_proj")),
    ("gpt_oss", [0, 1, 2], 4, ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")),
    ("deepseek_v3", [1, 2], 8, ("gate_up_proj", "down_proj")),  # layer 0 dense; shared experts stay dense
])
def test_every_family_with_an_expert_parallel_plan_is_found_from_it(family, layers, experts, weights) -> None:
    model = hf_model(family)
    found = find_experts(model)
    assert [layer.name for layer in found] == [f"model.layers.{i}.mlp.experts" for i in layers]
    for layer in found:
        assert layer.module is model.get_submodule(layer.name)
        assert layer.num_experts == experts and layer.weights == weights
        assert all(getattr(layer.module, w).shape[0] == experts for w in weights)
    # The base model alone (no ...ForCausalLM around it) is found the same, its names one level up.
    assert [layer.name for layer in find_experts(model.model)] == [f"layers.{i}.mlp.experts" for i in layers]


def test_a_dense_model_has_no_expert_layers() -> None:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    assert find_experts(transformers.LlamaForCausalLM(config)) == []


class Experts(nn.Module):
    def __init__(self, experts: int, down_experts: int | None = None) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, 8, 16))
        self.down = nn.Parameter(torch.randn(down_experts or experts, 16, 8))


def test_a_model_of_ones_own_marks_its_experts_module() -> None:
    model = nn.Sequential(nn.Linear(8, 8), mark_experts(Experts(6)), nn.Linear(8, 8))
    (layer,) = find_experts(model)
    assert (layer.name, layer.num_experts, layer.weights) == ("1", 6, ("up", "down"))
    with pytest.raises(ValueError, match=r"'0'.*up \[6, 8, 16\], down \[3, 16, 8\]"):
        find_experts(nn.Sequential(mark_experts(Experts(6, down_experts=3))))
    with pytest.raises(ValueError, match="no parameter 'gate'"):
        mark_experts(Experts(6), weights=("gate",))


def test_experts_partitioned_by_init_are_found_at_their_whole_shape() -> None:
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with zero3.Init(config=config):
        model = hf_model("qwen3_moe")
    found = find_experts(model)
    assert len(found) == 3 and all(layer.num_experts == 8 for layer in found)
    assert found[0].module.gate_up_proj.numel() == 0  # (released: the whole shape is the record's)


@pytest.mark.parametrize("size, world, local, message", [
    (3, 6, 6, r"autoep_size=3 does not divide the number of experts of every layer \(4\)"),
    (2, 3, 3, r"autoep_size=2 does not divide the world size 3"),
    (4, 8, 2, None),  # two whole nodes of 2
    (4, 12, 6, r"autoep_size=4 neither divides a node's 6 ranks nor spans whole nodes"),
    (0, 4, 4, r"autoep_size=0: expected a positive number"),
])
def test_an_expert_parallel_size_that_cannot_lay_the_experts_out_is_refused(size, world, local, message) -> None:
    layers = find_experts(hf_model("mixtral"))  # 4 experts a layer
    if message is None:
        check_autoep_size(layers, size, world, local)
    else:
        with pytest.raises(ConfigError, match=message):
            check_autoep_size(layers, size, world, local)


def test_expert_parallelism_on_a_model_without_experts_is_refused() -> None:
    with pytest.raises(ConfigError, match="no expert layers.*base_model_ep_plan.*mark_experts"):
        check_autoep_size([], 2, 4, 4)
