"""`deepspeed.ops`: DeepSpeed's optimizer classes, on torch's own fused and foreach kernels."""

from zero3.deepspeed.ops import adam, lion

__all__ = ["adam", "lion"]
