"""Fault tolerance without restarts: replica groups on torchft (zero3.fault_tolerance.replicas' Note)."""

from zero3.fault_tolerance.replicas import FaultToleranceError

__all__ = ["FaultToleranceError"]
