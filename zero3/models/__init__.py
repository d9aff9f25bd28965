"""Built-in demo models."""

from zero3.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
