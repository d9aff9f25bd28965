"""The demo GPT in plain torch (no engine): shapes, tying, init, parameter count, learning."""

from __future__ import annotations

import math

import pytest
import torch

from zero3.data import CharTokenizer, load_corpus, sample_global_batch
from zero3.models import GPT, GPTConfig


def _small(vocab_size: int = 59, **overrides: int) -> GPTConfig:
    shape = dict(vocab_size=vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=32)
    shape.update(overrides)
    return GPTConfig(**shape)


def test_forward_shapes_and_loss() -> None:
    torch.manual_seed(0)
    cfg = _small()
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.block_size))

    out = model(idx)
    assert out["logits"].shape == (3, cfg.block_size, cfg.vocab_size)
    assert out["loss"] is None

    out = model(idx, torch.randint(0, cfg.vocab_size, (3, cfg.block_size)))
    loss = out["loss"]
    assert loss is not None and loss.dim() == 0 and torch.isfinite(loss)
    # std-0.02 init makes every logit ~0: the prediction is ~uniform over the vocabulary.
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1


def test_shorter_sequences_and_too_long_ones() -> None:
    model = GPT(_small())
    assert model(torch.zeros(2, 5, dtype=torch.long))["logits"].shape == (2, 5, 59)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(_small()).eval()
    idx = torch.randint(0, 59, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 59
    # Changing tokens 10.. must not change the predictions at positions 0..9.
    torch.testing.assert_close(model(idx)["logits"][:, :10], model(changed)["logits"][:, :10])


def test_lm_head_is_tied_to_token_embedding() -> None:
    model = GPT(_small())
    assert model.lm_head.weight is model.tok_emb.weight
    params = list(model.parameters())
    assert sum(p is model.tok_emb.weight for p in params) == 1
    # One Parameter, so a gradient from either use lands in the same .grad.
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))["loss"].backward()
    assert model.lm_head.weight.grad is model.tok_emb.weight.grad


def test_parent_constructor_initialises_children() -> None:
    torch.manual_seed(0)
    model = GPT(_small(n_embd=128, n_head=4))
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            # nn.Linear's own default init is uniform with std 1/sqrt(3*fan_in) ~ 0.05;
            # GPT._init_weights must have replaced it with N(0, 0.02).
            assert abs(module.weight.std().item() - 0.02) < 0.002, name
            if module.bias is not None:
                assert torch.count_nonzero(module.bias) == 0, name
    assert abs(model.pos_emb.weight.std().item() - 0.02) < 0.002
    assert torch.equal(model.ln_f.weight, torch.ones_like(model.ln_f.weight))


@pytest.mark.parametrize(
    "shape",
    [
        dict(vocab_size=59, block_size=64, n_layer=4, n_head=4, n_embd=128),
        dict(vocab_size=59, block_size=16, n_layer=1, n_head=2, n_embd=32),
        dict(vocab_size=1000, block_size=7, n_layer=3, n_head=3, n_embd=48),
    ],
)
def test_analytic_parameter_count_matches_model(shape: dict[str, int]) -> None:
    cfg = GPTConfig(**shape)
    model = GPT(cfg)
    # Count by hand as well, deduplicating the tied weight by identity.
    unique = {id(p): p.numel() for _, p in model.named_parameters(remove_duplicate=False)}
    assert cfg.num_parameters() == model.num_parameters() == sum(unique.values())


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=3, n_embd=32)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(vocab_size=10, block_size=8, n_layer=0, n_head=2, n_embd=32)


def test_a_few_adamw_steps_reduce_loss_on_corpus() -> None:
    torch.manual_seed(0)
    corpus = load_corpus()
    tokenizer = CharTokenizer(corpus)
    tokens = tokenizer.encode(corpus)
    cfg = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=64)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1234)
    x_eval, y_eval = sample_global_batch(tokens, cfg.block_size, 64, gen)

    def eval_loss() -> float:
        with torch.no_grad():
            return model(x_eval, y_eval)["loss"].item()

    before = eval_loss()
    for _ in range(60):
        x, y = sample_global_batch(tokens, cfg.block_size, 16, gen)
        loss = model(x, y)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = eval_loss()
    # From uniform (~ln 59 = 4.08) a char model learns letter frequencies quickly.
    assert after < before - 0.8, (before, after)
