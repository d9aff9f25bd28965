"""The built-in corpus, the char tokenizer and deterministic batch sampling."""

from __future__ import annotations

import pytest
import torch

from zero3.data import CharTokenizer, batch_iterator, load_corpus, sample_global_batch


@pytest.fixture(scope="module")
def corpus() -> str:
    return load_corpus()


def test_corpus_is_real_varied_text(corpus: str) -> None:
    size = len(corpus.encode("utf-8"))
    assert 100_000 <= size <= 300_000
    lines = [line for line in corpus.splitlines() if line.strip()]
    assert len(lines) > 300
    # Written prose, not a few lines repeated.
    assert len(set(lines)) == len(lines)
    words = corpus.split()
    assert len(words) > 15_000
    assert len({w.strip('.,;:!?"\'').lower() for w in words}) > 3_000
    for common in (" the ", " and ", " of ", " river", " bread"):
        assert common in corpus
    assert all(ch == "\n" or ch.isprintable() for ch in corpus)


def test_tokenizer_vocabulary(corpus: str) -> None:
    tok = CharTokenizer(corpus)
    assert tok.vocab_size == len(set(corpus))
    assert tok.chars == sorted(tok.chars)
    # Built from the same text, two tokenizers agree (each rank builds its own).
    assert CharTokenizer.from_corpus().chars == tok.chars


def test_tokenizer_round_trip(corpus: str) -> None:
    tok = CharTokenizer(corpus)
    ids = tok.encode(corpus)
    assert ids.dtype == torch.int64 and ids.shape == (len(corpus),)
    assert int(ids.min()) >= 0 and int(ids.max()) < tok.vocab_size
    assert tok.decode(ids) == corpus
    assert tok.decode(ids[:20].tolist()) == corpus[:20]


def test_tokenizer_rejects_unknown_characters(corpus: str) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        CharTokenizer(corpus).encode("snow \u2603")
    with pytest.raises(ValueError):
        CharTokenizer("")


def test_batches_are_windows_of_the_corpus(corpus: str) -> None:
    tok = CharTokenizer(corpus)
    tokens = tok.encode(corpus)
    x, y = sample_global_batch(tokens, 24, 6, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (6, 24)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    for row_x, row_y in zip(x, y):
        assert tok.decode(row_x) + tok.decode(row_y[-1:]) in corpus


def test_batches_are_deterministic_per_seed(corpus: str) -> None:
    tokens = CharTokenizer(corpus).encode(corpus)
    a = sample_global_batch(tokens, 16, 8, torch.Generator().manual_seed(5))
    b = sample_global_batch(tokens, 16, 8, torch.Generator().manual_seed(5))
    c = sample_global_batch(tokens, 16, 8, torch.Generator().manual_seed(6))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_ranks_slice_one_global_batch(corpus: str) -> None:
    """Each rank draws the same global batch and keeps its rows; together they are the batch."""
    tokens = CharTokenizer(corpus).encode(corpus)
    world, micro = 4, 3
    per_rank = []
    for rank in range(world):
        x, _ = sample_global_batch(tokens, 16, world * micro, torch.Generator().manual_seed(11))
        per_rank.append(x[rank * micro : (rank + 1) * micro])
    whole, _ = sample_global_batch(tokens, 16, world * micro, torch.Generator().manual_seed(11))
    assert torch.equal(torch.cat(per_rank), whole)


def test_batch_iterator_continues_the_generator(corpus: str) -> None:
    tokens = CharTokenizer(corpus).encode(corpus)
    it = batch_iterator(tokens, 8, 4, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = next(it)
        ex, ey = sample_global_batch(tokens, 8, 4, gen)
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_sampling_rejects_bad_shapes() -> None:
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="more than block_size"):
        sample_global_batch(torch.arange(8), 8, 2, gen)
    with pytest.raises(ValueError, match="1-D"):
        sample_global_batch(torch.zeros(4, 40, dtype=torch.long), 8, 2, gen)
