"""Sharded checkpoints on torch.distributed.checkpoint: save, load at any world size, crash-safe tags."""

from zero3.checkpoint.tags import CheckpointError

__all__ = ["CheckpointError"]
