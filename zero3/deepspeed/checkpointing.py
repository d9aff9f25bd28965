"""`deepspeed.checkpointing`: DeepSpeed's activation-checkpointing API, zero3's (zero3.activation_checkpointing)."""

from zero3.activation_checkpointing import (
    CudaRNGStatesTracker,
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed,
    reset,
)

__all__ = ["CudaRNGStatesTracker", "checkpoint", "configure", "get_cuda_rng_tracker", "is_configured",
           "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed", "reset"]
