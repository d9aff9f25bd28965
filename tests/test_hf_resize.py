"""zero3.integrations.hf.resize_token_embeddings on a partitioned Llama against transformers'
own `resize_token_embeddings` on the plain model: the same rows (kept and new), the same vocabulary size
in the config, tying kept, and an engine that trains the resized model as the plain model trains."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

import zero3
from tests.distributed import run_ranks

TRAIN_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}
NEW_TOKENS, PAD_TO = 70, 8  # 64 tokens become 72
BATCH = torch.tensor([[1, 5, 69, 71, 3, 66, 2, 70]])  # new tokens among them


def llama_config(tied: bool) -> Any:
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied,
    )


def train_one_step(model: Any, optimizer_step: Any) -> torch.Tensor:
    loss = model(input_ids=BATCH, labels=BATCH).loss
    optimizer_step(loss)
    return loss.detach()


def plain_run(tied: bool, mean_resizing: bool) -> dict:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(tied))
    torch.manual_seed(5)
    model.resize_token_embeddings(NEW_TOKENS, pad_to_multiple_of=PAD_TO, mean_resizing=mean_resizing)
    resized = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)

    def step(loss: torch.Tensor) -> None:
        loss.backward()
        optimizer.step()

    loss = train_one_step(model, step)
    return {"resized": resized, "loss": loss, "trained": {n: p.detach().clone() for n, p in model.named_parameters()},
            "vocab_size": model.config.vocab_size}


def zero3_run(rank: int, world: int, tied: bool, mean_resizing: bool) -> dict:
    from zero3.integrations.hf import resize_token_embeddings

    torch.manual_seed(0)
    with zero3.Init(config={"zero_optimization": {"stage": 3}}):
        model = transformers.LlamaForCausalLM(llama_config(tied))
    torch.manual_seed(5 if rank == 0 else 100 + rank)  # rank 0's draw of the new rows must win everywhere
    embeddings = resize_token_embeddings(model, NEW_TOKENS, pad_to_multiple_of=PAD_TO, mean_resizing=mean_resizing)
    out: dict[str, Any] = {"vocab_size": model.config.vocab_size, "num_embeddings": embeddings.num_embeddings,
                           "returned_input_embeddings": embeddings is model.get_input_embeddings(),
                           "tied": model.lm_head.weight is model.model.embed_tokens.weight}
    with zero3.GatheredParameters(list(model.parameters())):
        out["resized"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = zero3.initialize(model=model, config=TRAIN_CONFIG)[0]

    def step(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    out["loss"] = train_one_step(engine, step)
    with zero3.GatheredParameters(list(model.parameters())):
        out["trained"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        resize_token_embeddings(model, 80)
    except RuntimeError as error:
        out["in_engine_error"] = str(error)
    out["vocab_after_refusal"] = model.config.vocab_size
    engine.destroy()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tied, mean_resizing", [(False, True), (True, False)])
def test_resize_token_embeddings_on_a_partitioned_model_is_transformers_resize(tied: bool, mean_resizing: bool) -> None:
    expected = plain_run(tied, mean_resizing)
    results = run_ranks(2, zero3_run, tied, mean_resizing)
    for out in results:
        assert out["vocab_size"] == out["num_embeddings"] == expected["vocab_size"] == 72
        assert out["returned_input_embeddings"]
        assert out["tied"] == tied
        for name, value in expected["resized"].items():
            assert torch.equal(out["resized"][name], value), name  # kept rows, new rows, everything else
        torch.testing.assert_close(out["loss"], expected["loss"], rtol=1e-5, atol=0)
        for name, value in expected["trained"].items():
            torch.testing.assert_close(out["trained"][name], value, rtol=0, atol=1e-5, msg=name)
        assert "already belong to a zero3 engine" in out["in_engine_error"]
        assert out["vocab_after_refusal"] == 72  # refused before anything changed


def test_a_plain_model_gets_transformers_own_resize() -> None:
    from zero3.integrations.hf import resize_token_embeddings

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(tied=False))
    resize_token_embeddings(model, 80)
    assert model.get_input_embeddings().weight.shape == (80, 32)
    assert model.lm_head.weight.shape == (80, 32)
    assert model.config.vocab_size == 80
