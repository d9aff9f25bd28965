"""Hand a zero3 engine's weights to a generator (vLLM or SGLang) in an RLHF loop.

`engine.iter_full_params()` yields `(name, tensor)` for every parameter,
whole, gathering one at a time: the memory it adds is one parameter's, never
the model's. A yielded tensor is valid only until the next one is asked for,
so the consumer copies it. vLLM's `load_weights` does (each weight is copied
into the generator's own parameter), so the stream is handed to it directly.
SGLang's `update_weights_from_tensor` takes a list, so the tensors are copied
into buckets of at most `bucket_bytes` and sent a bucket at a time (memory:
one bucket, plus the parameter being gathered).

The stream is collective: call these on every training rank, with the same
arguments, each rank loading its own generator (colocated, in this process).
Where the generator lives in other processes, its own transport is used
instead; the stream is the same.

Typical use, on every rank, between training steps::

    from generator_weights import load_into_vllm   # this file, copied or on sys.path

    engine.offload_states(include=["optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer"])
    load_into_vllm(llm, engine)            # parked states stay parked; lp_params may be parked too
    outputs = llm.generate(prompts, sampling_params)
    engine.reload_states()                 # then train on the outputs

Nothing here imports vllm or sglang: this file imports (and its test runs)
without either installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

# Where an in-process vLLM keeps its model, newest layout first: the V1 engine's worker wraps the
# model runner one level deeper than the V0 engine's.
_VLLM_MODEL_PATHS = (
    ("llm_engine", "model_executor", "driver_worker", "worker", "model_runner", "model"),
    ("llm_engine", "model_executor", "driver_worker", "model_runner", "model"),
)


def vllm_model(llm: Any) -> Any:
    """The torch model inside an in-process `vllm.LLM` (anything with `load_weights` is returned as is)."""
    if hasattr(llm, "load_weights"):
        return llm
    for path in _VLLM_MODEL_PATHS:
        target = llm
        for attribute in path:
            target = getattr(target, attribute, None)
            if target is None:
                break
        if target is not None and hasattr(target, "load_weights"):
            return target
    raise TypeError(
        f"cannot find the model inside {type(llm).__name__}: expected a vllm.LLM running in this process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0 for the V1 engine), or a model with load_weights"
    )


def load_into_vllm(llm: Any, engine: Any, dtype: torch.dtype | None = None) -> int:
    """Stream every parameter of `engine` into vLLM's model; returns how many tensors were sent.

    `llm` is a `vllm.LLM` in this process (or its model). The stream goes straight to
    `model.load_weights(weights=...)`, which copies each tensor before it asks for the next.
    The prefix cache is cleared afterwards: its entries were computed with the old weights.
    """
    sent = 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal sent
        for name, tensor in engine.iter_full_params(dtype=dtype):
            sent += 1
            yield name, tensor

    vllm_model(llm).load_weights(weights=counted())
    if hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()
    return sent


def buckets(
    stream: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Copies of the stream's tensors, in lists of at most `bucket_bytes` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    held = 0
    for name, tensor in stream:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and held + nbytes > bucket_bytes:
            yield bucket
            bucket, held = [], 0
        bucket.append((name, tensor.clone()))  # the stream's tensor is valid only until the next one
        held += nbytes
    if bucket:
        yield bucket


def load_into_sglang(
    sglang_engine: Any, engine: Any, dtype: torch.dtype | None = None, bucket_bytes: int = 1 << 30,
) -> int:
    """Send every parameter of `engine` to an `sglang.Engine` with `update_weights_from_tensor`,
    a bucket of at most `bucket_bytes` at a time; returns how many tensors were sent.

    The cache is flushed once, at the end (flushing after each bucket would redo the work).
    """
    sent = 0
    for bucket in buckets(engine.iter_full_params(dtype=dtype), bucket_bytes):
        sglang_engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False)
        sent += len(bucket)
    sglang_engine.flush_cache()
    return sent
