"""`deepspeed.runtime.zero.partition_parameters`."""

from zero3 import GatheredParameters, Init, MiCS_Init, ZeroParamStatus, register_external_parameter
from zero3 import unregister_external_parameter

__all__ = ["GatheredParameters", "Init", "MiCS_Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]
