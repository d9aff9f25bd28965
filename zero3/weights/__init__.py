"""Weights to a generator (issue 44): every parameter of a training engine, whole, delivered to an inference
model in-process (`load_into`), or to another process on this machine through shared memory
(`SharedMemorySender` / `SharedMemoryReceiver`). Each is collective on the training ranks and streams the
engine's weight buckets (zero3.runtime.weight_buckets), so the next bucket is gathered while one is delivered.
"""

from zero3.weights.in_process import NameMap, load_into
from zero3.weights.shared_memory import SharedMemoryReceiver, SharedMemorySender

__all__ = ["NameMap", "SharedMemoryReceiver", "SharedMemorySender", "load_into"]
