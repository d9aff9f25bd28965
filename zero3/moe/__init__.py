"""Mixtures of experts: finding a model's expert layers (and, as it lands, expert parallelism over them)."""

from zero3.moe.dispatch import dispatch, local_experts
from zero3.moe.expert_parallel import ExpertShare, expert_share, share_out_experts
from zero3.moe.experts import ExpertLayer, check_autoep_size, find_experts, mark_experts

__all__ = ["ExpertLayer", "ExpertShare", "check_autoep_size", "dispatch", "expert_share", "find_experts", "local_experts",
           "mark_experts", "share_out_experts"]
