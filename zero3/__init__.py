"""zero3: a ZeRO stage-3 training engine for PyTorch with first-class state offloading."""

from zero3.accessors import (
    param_status,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_lp_param,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from zero3.checkpoint import CheckpointError
from zero3.import_deepspeed import import_deepspeed_checkpoint
from zero3.default_group import init_distributed
from zero3.config import ConfigError, Zero3Config, load_config
from zero3.enums import OffloadDevice, OffloadStateType, ParamStatus
from zero3.enums import ParamStatus as ZeroParamStatus  # DeepSpeed's name
from zero3.offload import get_state_devices
from zero3.offload.disk import OffloadIOError, StepIOError
from zero3.offload.report import StateReport
from zero3.offload.tiers import TierConfigError
from zero3.partition.flat_buffer import StateOffloadedError
from zero3.partition.external import register_external_parameter, unregister_external_parameter
from zero3.partition.gathered import GatheredParameters, unwrap_model_for_generation
from zero3.partition.init_context import Init, MiCS_Init
from zero3.partition.leaf_modules import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from zero3.engine.engine import ZeroEngine
from zero3.engine.initialize import initialize
from zero3.rank_failure import RankFailedError
from zero3.weights.buckets import BucketEntry, WeightBucket
from zero3.shard_mesh import TopologyError
from zero3 import weights

__version__ = "0.1.0"

__all__ = [
    "BucketEntry",
    "CheckpointError",
    "ConfigError",
    "GatheredParameters",
    "Init",
    "MiCS_Init",
    "TopologyError",
    "OffloadIOError",
    "OffloadDevice",
    "OffloadStateType",
    "RankFailedError",
    "ParamStatus",
    "StateOffloadedError",
    "StateReport",
    "StepIOError",
    "TierConfigError",
    "WeightBucket",
    "Zero3Config",
    "ZeroEngine",
    "ZeroParamStatus",
    "get_state_devices",
    "import_deepspeed_checkpoint",
    "get_z3_leaf_modules",
    "init_distributed",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
    "register_external_parameter",
    "unregister_external_parameter",
    "unwrap_model_for_generation",
    "weights",
    "initialize",
    "load_config",
    "param_status",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_lp_param",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]
