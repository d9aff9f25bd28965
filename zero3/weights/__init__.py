"""Weights to a generator (an RLHF job's rollouts need the policy's latest weights): every parameter of a
training engine, whole, delivered to an inference model in-process (`load_into`), to another process on this
machine through shared memory (`SharedMemorySender` / `SharedMemoryReceiver`), or to generator ranks anywhere
by a broadcast over a group of their own (`sync_group`, `BroadcastSender` / `BroadcastReceiver`). Each is
collective on the training ranks and streams the engine's weight buckets (zero3.weights.buckets), so
the next bucket is gathered while one is delivered.
"""

from zero3.weights.broadcast import BroadcastReceiver, BroadcastSender, sync_group
from zero3.weights.in_process import NameMap, load_into
from zero3.weights.shared_memory import SharedMemoryReceiver, SharedMemorySender

__all__ = ["BroadcastReceiver", "BroadcastSender", "NameMap", "SharedMemoryReceiver", "SharedMemorySender",
           "load_into", "sync_group"]
