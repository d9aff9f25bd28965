"""Mixtures of experts: finding a model's expert layers (and, as it lands, expert parallelism over them)."""

from zero3.moe.dispatch import dispatch, local_experts
from zero3.moe.experts import ExpertLayer, check_autoep_size, find_experts, mark_experts

__all__ = ["ExpertLayer", "check_autoep_size", "dispatch", "find_experts", "local_experts", "mark_experts"]
