"""The built-in demo data: a small English corpus and a character-level tokenizer.

Batches are drawn from a `torch.Generator` so that every rank can reproduce the
same *global* batch from a shared seed and take only its own rows of it: no rank
needs to communicate to agree on the data, and the global batch of a step does
not depend on how it is split across ranks and accumulation micro-steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from importlib import resources

import torch

__all__ = [
    "CharTokenizer",
    "batch_iterator",
    "load_corpus",
    "sample_global_batch",
]

_CORPUS_FILE = "corpus.txt"


def load_corpus() -> str:
    """The packaged corpus (read through importlib.resources, so it works from a wheel)."""
    return resources.files(__package__).joinpath(_CORPUS_FILE).read_text(encoding="utf-8")


class CharTokenizer:
    """One token per distinct character of the text it is built from.

    The vocabulary is the *sorted* set of characters, so every process that builds
    it from the same text gets the same ids without exchanging anything.
    """

    def __init__(self, text: str) -> None:
        if not text:
            raise ValueError("cannot build a tokenizer from empty text")
        self.chars: list[str] = sorted(set(text))
        self._stoi: dict[str, int] = {ch: i for i, ch in enumerate(self.chars)}

    @classmethod
    def from_corpus(cls) -> CharTokenizer:
        return cls(load_corpus())

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of `text` as a 1-D int64 tensor."""
        try:
            ids = [self._stoi[ch] for ch in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the vocabulary") from None
        return torch.tensor(ids, dtype=torch.int64)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return "".join(self.chars[i] for i in ids)


def sample_global_batch(
    tokens: torch.Tensor, block_size: int, global_batch: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw `global_batch` random windows of `tokens`; returns (x, y), y shifted by one.

    Both are int64 of shape (global_batch, block_size). The result depends only on
    the arguments and the generator's state, so ranks that seed identical
    generators get identical batches and can each slice out their own rows.
    """
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if block_size < 1 or global_batch < 1:
        raise ValueError(f"block_size and global_batch must be >= 1, got {block_size}, {global_batch}")
    if tokens.numel() <= block_size:
        raise ValueError(
            f"need more than block_size={block_size} tokens, got {tokens.numel()}"
        )
    # A window of block_size + 1 tokens gives both the input and its next-token target.
    starts = torch.randint(
        0, tokens.numel() - block_size, (global_batch,), generator=generator
    )
    windows = tokens[starts.unsqueeze(1) + torch.arange(block_size + 1)].to(torch.int64)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def batch_iterator(
    tokens: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless stream of `sample_global_batch(tokens, block_size, batch_size, generator)`."""
    while True:
        yield sample_global_batch(tokens, block_size, batch_size, generator)
