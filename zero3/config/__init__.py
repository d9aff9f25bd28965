"""The DeepSpeed-style JSON configuration, as frozen pydantic models.

Key names and defaults follow DeepSpeed so an existing ``ds_config.json`` for a
stage-3 run loads unchanged. Validation is deliberately strict (unknown keys and
wrong types are errors, never silently coerced) because a typo in a training
config otherwise costs a whole run. ``load_config`` is the entry point: it turns
every pydantic error into one readable ``ConfigError``.

One concept per file; a file imports only those above it in this list:

* ``base``: ``ConfigError``, the strict ``_Model`` base and the validators the sections share;
* ``optimizer``, ``scheduler``, ``precision``, ``zero`` (ZeRO stage 3, offload, aio, leaf modules),
  ``checkpoint``, ``fault_tolerance``: the sections' models;
* ``keys``: the key tables, as data (what each key does in zero3);
* ``batch``: the batch arithmetic (``BatchSizes``);
* ``messages``: the startup lines for keys that are accepted but do nothing;
* ``model``: ``Zero3Config``, the whole configuration;
* ``loading``: reading files, ``load_config`` and the error formatting;
* ``reference``: docs/configuration.md's key tables, generated from the models and the key tables.
"""

from zero3.config.base import ConfigError
from zero3.config.batch import BatchSizes
from zero3.config.checkpoint import CheckpointConfig
from zero3.config.fault_tolerance import FaultToleranceConfig
from zero3.config.keys import CONFIG_KEYS, DEEPSPEED_KEYS, OPTIMIZER_TYPES, SCHEDULER_TYPES
from zero3.config.loading import load_config, read_config_file
from zero3.config.model import Zero3Config
from zero3.config.optimizer import (
    TORCH_ELEMENTWISE,
    AdamConfig,
    LionConfig,
    LionParams,
    MuonConfig,
    MuonParams,
    OptimizerConfig,
    OptimizerParams,
    TorchOptimizerConfig,
)
from zero3.config.precision import BF16Config, DataTypesConfig, FP16Config
from zero3.config.reference import config_key_paths, config_reference
from zero3.config.scheduler import (
    LRRangeTestConfig,
    LRRangeTestParams,
    OneCycleConfig,
    OneCycleParams,
    SchedulerConfig,
    WarmupCosineLRConfig,
    WarmupCosineLRParams,
    WarmupDecayLRConfig,
    WarmupDecayLRParams,
    WarmupLRConfig,
    WarmupLRParams,
)
from zero3.config.zero import AioConfig, LeafModuleConfig, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

# The name users catch, and that a traceback prints, stays zero3.config.ConfigError.
ConfigError.__module__ = __name__

__all__ = [
    "BatchSizes",
    "BF16Config",
    "CheckpointConfig",
    "FaultToleranceConfig",
    "ConfigError",
    "DataTypesConfig",
    "FP16Config",
    "AdamConfig",
    "LionConfig",
    "MuonConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "OptimizerParams",
    "LRRangeTestConfig",
    "LRRangeTestParams",
    "OneCycleConfig",
    "OneCycleParams",
    "SchedulerConfig",
    "TorchOptimizerConfig",
    "WarmupCosineLRConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRConfig",
    "WarmupDecayLRParams",
    "WarmupLRConfig",
    "WarmupLRParams",
    "Zero3Config",
    "ZeroConfig",
    "load_config",
    # Public as well (zero3's modules and the tests import them):
    "AioConfig",
    "CONFIG_KEYS",
    "DEEPSPEED_KEYS",
    "LeafModuleConfig",
    "LionParams",
    "MuonParams",
    "OPTIMIZER_TYPES",
    "SCHEDULER_TYPES",
    "TORCH_ELEMENTWISE",
    "config_key_paths",
    "config_reference",
    "read_config_file",
]
