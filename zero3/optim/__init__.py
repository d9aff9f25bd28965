"""Optimizers zero3 adds to torch's (Lion), and which optimizer an engine steps its shards with."""

from zero3.optim.lion import Lion

__all__ = ["Lion"]
