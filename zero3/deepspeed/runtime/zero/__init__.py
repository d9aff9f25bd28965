"""`deepspeed.zero` / `deepspeed.runtime.zero`: partitioning at construction and whole parameters on demand."""

from zero3 import GatheredParameters, Init, MiCS_Init, register_external_parameter, unregister_external_parameter
from zero3.deepspeed.runtime.zero import offload_config, offload_states, partition_parameters

__all__ = [
    "GatheredParameters", "Init", "MiCS_Init", "offload_config", "offload_states", "partition_parameters",
    "register_external_parameter", "unregister_external_parameter",
]
