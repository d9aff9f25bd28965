"""The `expert_parallel` section: DeepSpeed AutoEP's keys for expert parallelism under ZeRO-3."""

from __future__ import annotations

from pydantic import Field

from zero3.config.base import _Model


class ExpertParallelConfig(_Model):
    """The `expert_parallel` section: each expert layer's experts shared out over groups of `autoep_size`
    ranks (zero3.moe.expert_parallel's Note), each share ZeRO-3-sharded over the ranks holding it."""

    enabled: bool = False
    # Ranks that share a layer's experts out (inside a node, or over whole nodes); 1: every rank holds all.
    autoep_size: int = Field(default=1, ge=1)
    # DeepSpeed AutoEP's model family name: accepted, and not needed (the experts are found from the model).
    preset_model: str | None = None

    @property
    def size(self) -> int:
        """The expert-parallel group size in effect (1: off)."""
        return self.autoep_size if self.enabled else 1
