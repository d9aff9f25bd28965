"""`deepspeed.runtime.zero.offload_states`."""

from zero3 import get_state_devices

__all__ = ["get_state_devices"]
