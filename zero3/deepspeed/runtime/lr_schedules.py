"""`deepspeed.runtime.lr_schedules`: DeepSpeed's schedules, zero3's implementations (same names and arguments)."""

from zero3.step.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
