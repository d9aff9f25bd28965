"""`deepspeed.runtime.zero.offload_config`: the enums of `offload_states` under DeepSpeed's names."""

from zero3.enums import OffloadDevice as OffloadDeviceEnum
from zero3.enums import OffloadStateType as OffloadStateTypeEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
