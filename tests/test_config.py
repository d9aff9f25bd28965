from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from zero3.config import (
    BatchSizes,
    ConfigError,
    LionConfig,
    TorchOptimizerConfig,
    WarmupCosineLRConfig,
    WarmupLRConfig,
    Zero3Config,
    load_config,
)

# A realistic DeepSpeed stage-3 config, the kind users bring along.
DS_CONFIG: dict[str, Any] = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": 5000, "warmup_num_steps": 100, "warmup_type": "linear"},
    },
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "sub_group_size": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 6},
    },
}


def error_of(config: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config)
    return str(info.value)


def test_defaults_when_empty() -> None:
    cfg = load_config({})
    assert cfg.gradient_clipping == 0.0
    assert cfg.steps_per_print == 10
    assert cfg.wall_clock_breakdown is False
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.bf16.enabled is False and cfg.fp16.enabled is False
    assert cfg.fp16.loss_scale == 0.0 and cfg.fp16.initial_scale_power == 16
    assert cfg.fp16.loss_scale_window == 1000 and cfg.fp16.hysteresis == 2
    assert cfg.fp16.min_loss_scale == 1.0 and cfg.fp16.consecutive_hysteresis is False
    z = cfg.zero_optimization
    assert z.stage == 3
    assert z.stage3_param_persistence_threshold == 100_000
    assert z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_max_live_parameters == 1_000_000_000
    assert z.stage3_max_reuse_distance == 1_000_000_000
    assert z.reduce_bucket_size == 500_000_000
    assert z.overlap_comm is True and z.contiguous_gradients is True
    assert z.sub_group_size == 1_000_000_000
    assert z.stage3_gather_16bit_weights_on_model_save is False
    assert z.offload_param.device == "none" and z.offload_param.buffer_count == 5
    assert z.offload_optimizer.device == "none" and z.offload_optimizer.buffer_count == 4
    assert cfg.compute_dtype == torch.float32


def test_deepspeed_config_loads_with_whole_float_sizes() -> None:
    cfg = load_config(DS_CONFIG)
    z = cfg.zero_optimization
    assert z.reduce_bucket_size == 500_000_000 and type(z.reduce_bucket_size) is int
    assert z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_param_persistence_threshold == 100_000
    assert z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory is True
    assert z.offload_param.nvme_path == "/local_nvme" and z.offload_param.buffer_count == 6
    assert cfg.optimizer is not None and cfg.optimizer.params.betas == (0.9, 0.95)
    assert isinstance(cfg.scheduler, WarmupCosineLRConfig)
    assert cfg.scheduler.params.total_num_steps == 5000
    assert cfg.scheduler.params.warmup_type == "linear"
    assert cfg.scheduler.params.cos_min_ratio == 0.0001
    assert cfg.compute_dtype == torch.bfloat16


def test_input_dict_is_not_mutated() -> None:
    original = copy.deepcopy(DS_CONFIG)
    config = copy.deepcopy(DS_CONFIG)
    del config["optimizer"]["params"]["weight_decay"]  # exercise the AdamW default path
    del config["scheduler"]["params"]
    config["scheduler"] = {"type": "WarmupLR"}
    snapshot = copy.deepcopy(config)
    load_config(config)
    assert config == snapshot
    load_config(DS_CONFIG)
    assert DS_CONFIG == original


def test_built_config_is_returned_as_is() -> None:
    cfg = load_config({"fp16": {"enabled": True}})
    assert load_config(cfg) is cfg


def test_models_are_frozen() -> None:
    cfg = load_config({})
    with pytest.raises(pydantic.ValidationError):
        cfg.gradient_clipping = 2.0  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        cfg.zero_optimization.stage = 1  # type: ignore[misc]


def test_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DS_CONFIG))
    assert load_config(path) == load_config(DS_CONFIG)
    assert load_config(str(path)).train_batch_size == 32


def test_missing_file_names_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    message = error_of(path)
    assert str(path) in message


def test_bad_json_names_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": 8,,}')
    message = error_of(str(path))
    assert str(path) in message and "JSON" in message


def test_json_root_must_be_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert "JSON object" in error_of(path)


def test_wrong_argument_type() -> None:
    assert "list" in error_of([1, 2])


def test_config_error_is_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    ("config", "key", "got"),
    [
        ({"gradient_clipping": "big"}, "gradient_clipping", '"big"'),
        ({"gradient_clipping": -1.0}, "gradient_clipping", "-1.0"),
        ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu", "0"),
        ({"train_batch_size": "8"}, "train_batch_size", '"8"'),
        ({"train_batch_size": True}, "train_batch_size", "true"),
        ({"gradient_accumulation_steps": 2.0}, "gradient_accumulation_steps", "2.0"),
        ({"steps_per_print": 0}, "steps_per_print", "0"),
        ({"wall_clock_breakdown": 1}, "wall_clock_breakdown", "1"),
        ({"bf16": {"enabled": "yes"}}, "bf16.enabled", '"yes"'),
        ({"fp16": {"initial_scale_power": 65}}, "fp16.initial_scale_power", "65"),
        ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale", "-1"),
        ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale", "0"),
        ({"fp16": {"hysteresis": True}}, "fp16.hysteresis", "true"),
        ({"zero_optimization": {"reduce_bucket_size": 1.5}}, "zero_optimization.reduce_bucket_size", "1.5"),
        ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size", "0"),
        ({"zero_optimization": {"sub_group_size": "1e9"}}, "zero_optimization.sub_group_size", '"1e9"'),
        ({"zero_optimization": {"overlap_comm": "true"}}, "zero_optimization.overlap_comm", '"true"'),
        (
            {"zero_optimization": {"offload_param": {"device": "gpu"}}},
            "zero_optimization.offload_param.device",
            '"gpu"',
        ),
        ({"optimizer": {"type": "Adam", "params": {"lr": 0}}}, "optimizer.params.lr", "0"),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}},
            "optimizer.params.betas",
            "[0.9, 1.0]",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9, "0.99"]}}},
            "optimizer.params.betas[1]",
            '"0.99"',
        ),
    ],
)
def test_bad_value_names_key_and_value(config: dict[str, Any], key: str, got: str) -> None:
    message = error_of(config)
    assert f"{key}: " in message
    assert f"(got {got})" in message


def test_steps_per_print_infinity_means_never() -> None:
    # accelerate writes float("inf") to turn DeepSpeed's progress line off; JSON spells it Infinity.
    assert load_config({"steps_per_print": float("inf")}).steps_per_print is None
    assert load_config(json.loads('{"steps_per_print": Infinity}')).steps_per_print is None
    assert load_config({"steps_per_print": 5.0}).steps_per_print == 5
    assert "steps_per_print: expected a whole number (got 2.5)" in error_of({"steps_per_print": 2.5})
    assert "steps_per_print" in error_of({"steps_per_print": float("-inf")})


def test_nan_rejected() -> None:
    assert "gradient_clipping" in error_of({"gradient_clipping": float("nan")})


def test_all_errors_reported_at_once() -> None:
    message = error_of({"gradient_clipping": "big", "steps_per_print": 0})
    assert "2 errors" in message
    assert "gradient_clipping" in message and "steps_per_print" in message


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"seed": 1}, "seed"),
        ({"zero_optimization": {"stage3_prefetch_bucket": 1}}, "zero_optimization.stage3_prefetch_bucket"),
        ({"fp16": {"enabled": True, "autocast": True}}, "fp16.autocast"),
        ({"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}}, "optimizer.params.momentum"),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratios": 0.5}}},
            "zero_optimization.offload_optimizer.ratios",
        ),
        ({"aio": {"block": 4096}}, "aio.block"),
    ],
)
def test_unknown_key_is_named(config: dict[str, Any], key: str) -> None:
    message = error_of(config)
    assert f"{key}: unknown key" in message


def test_stage_other_than_3_rejected() -> None:
    for stage in (0, 1, 2):
        message = error_of({"zero_optimization": {"stage": stage}})
        assert "zero_optimization.stage" in message
        assert "zero3 implements ZeRO stage 3 only" in message
        assert f"(got {stage})" in message


def test_zero_optimization_null_offload_means_none() -> None:
    cfg = load_config({"zero_optimization": {"offload_param": None, "offload_optimizer": None}})
    assert cfg.zero_optimization.offload_param.device == "none"
    assert cfg.zero_optimization.offload_optimizer.device == "none"


def test_nvme_offload_requires_path() -> None:
    message = error_of({"zero_optimization": {"offload_param": {"device": "nvme"}}})
    assert "zero_optimization.offload_param.nvme_path" in message
    message = error_of({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})
    assert "zero_optimization.offload_optimizer.nvme_path" in message


def test_bf16_and_fp16_together_rejected() -> None:
    message = error_of({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    assert "bf16.enabled" in message and "fp16.enabled" in message


def test_compute_dtype() -> None:
    assert load_config({"fp16": {"enabled": True}}).compute_dtype == torch.float16
    assert load_config({"bf16": {"enabled": True}}).compute_dtype == torch.bfloat16
    assert load_config({"fp16": {"enabled": False}}).compute_dtype == torch.float32


def test_fp16_fields() -> None:
    cfg = load_config(
        {
            "fp16": {
                "enabled": True,
                "loss_scale": 128,
                "initial_scale_power": 12,
                "loss_scale_window": 500,
                "hysteresis": 3,
                "min_loss_scale": 0.5,
                "consecutive_hysteresis": True,
            }
        }
    )
    assert cfg.fp16.loss_scale == 128.0 and isinstance(cfg.fp16.loss_scale, float)
    assert cfg.fp16.initial_scale_power == 12
    assert cfg.fp16.loss_scale_window == 500
    assert cfg.fp16.hysteresis == 3
    assert cfg.fp16.min_loss_scale == 0.5
    assert cfg.fp16.consecutive_hysteresis is True


# ----------------------------------------------------------------- optimizer


@pytest.mark.parametrize(("written", "canonical"), [("adam", "Adam"), ("ADAMW", "AdamW"), ("AdamW", "AdamW")])
def test_optimizer_type_case_insensitive(written: str, canonical: str) -> None:
    cfg = load_config({"optimizer": {"type": written}})
    assert cfg.optimizer is not None and cfg.optimizer.type == canonical


def test_optimizer_defaults_follow_torch() -> None:
    adam = load_config({"optimizer": {"type": "Adam"}}).optimizer
    adamw = load_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}).optimizer
    assert adam is not None and adamw is not None
    assert adam.params.lr == 1e-3 and adam.params.betas == (0.9, 0.999) and adam.params.eps == 1e-8
    assert adam.params.weight_decay == 0.0
    assert adamw.params.weight_decay == 0.01 and adamw.params.lr == 0.1
    explicit = load_config({"optimizer": {"type": "adamw", "params": {"weight_decay": 0.0}}}).optimizer
    assert explicit is not None and explicit.params.weight_decay == 0.0


def test_optimizer_deepspeed_flags() -> None:
    opt = load_config(
        {"optimizer": {"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}}
    ).optimizer
    assert opt is not None and opt.params.torch_adam is True
    assert opt.decoupled_weight_decay is False
    # DeepSpeed's "Adam" is AdamW-style unless adam_w_mode is false.
    default = load_config({"optimizer": {"type": "Adam"}}).optimizer
    assert default is not None and default.decoupled_weight_decay is True
    adamw = load_config({"optimizer": {"type": "AdamW"}}).optimizer
    assert adamw is not None and adamw.decoupled_weight_decay is True
    message = error_of({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    assert "optimizer.params.adam_w_mode" in message


def test_unknown_optimizer_type_lists_supported() -> None:
    message = error_of({"optimizer": {"type": "OneBitAdam"}})
    assert "optimizer.type" in message and '"OneBitAdam"' in message
    assert "Adam, AdamW, Lion, Muon" in message and "torch.optim" in message


@pytest.mark.parametrize(("written", "canonical"), [("sgd", "SGD"), ("Adagrad", "Adagrad"), ("rmsprop", "RMSprop"),
                                                    ("NAdam", "NAdam"), ("radam", "RAdam"), ("Adamax", "Adamax")])
def test_other_types_are_torch_optimizers(written: str, canonical: str) -> None:
    cfg = load_config({"optimizer": {"type": written, "params": {"lr": 0.01}}})
    assert isinstance(cfg.optimizer, TorchOptimizerConfig)
    assert cfg.optimizer.type == canonical and cfg.optimizer.params == {"lr": 0.01}


def test_torch_optimizer_arguments_are_checked_against_its_constructor() -> None:
    message = error_of({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}}})
    assert "optimizer.params.betas: not an argument of torch.optim.SGD" in message and "momentum" in message
    message = error_of({"optimizer": {"type": "SGD", "params": {"lr": -1.0}}})
    assert "optimizer.params: torch.optim.SGD refuses them: Invalid learning rate: -1.0" in message


@pytest.mark.parametrize("kind", ["LBFGS", "SparseAdam", "Adafactor"])
def test_torch_optimizers_that_are_not_elementwise_are_refused(kind: str) -> None:
    message = error_of({"optimizer": {"type": kind}})
    assert f"optimizer.type: torch.optim.{kind} is not elementwise" in message


def test_lion_type_and_defaults() -> None:
    cfg = load_config({"optimizer": {"type": "lion", "params": {"lr": 3e-4}}})
    assert isinstance(cfg.optimizer, LionConfig) and cfg.optimizer.type == "Lion"
    assert cfg.optimizer.params.betas == (0.9, 0.99) and cfg.optimizer.params.weight_decay == 0.0
    assert "optimizer.params.eps: unknown key" in error_of({"optimizer": {"type": "Lion", "params": {"eps": 1e-8}}})


def test_optimizer_type_required() -> None:
    assert "optimizer.type: required" in error_of({"optimizer": {"params": {"lr": 0.1}}})


# ----------------------------------------------------------------- scheduler


def test_warmup_lr_defaults() -> None:
    cfg = load_config({"scheduler": {"type": "WarmupLR"}})
    assert isinstance(cfg.scheduler, WarmupLRConfig)
    p = cfg.scheduler.params
    # warmup_max_lr None: each param group's own lr, as DeepSpeed (0.17.2 on)
    assert (p.warmup_min_lr, p.warmup_max_lr, p.warmup_num_steps, p.warmup_type) == (
        0.0,
        None,
        1000,
        "log",
    )


def test_warmup_cosine_defaults() -> None:
    cfg = load_config({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 2000}}})
    assert isinstance(cfg.scheduler, WarmupCosineLRConfig)
    p = cfg.scheduler.params
    assert p.total_num_steps == 2000 and p.warmup_min_ratio == 0.0 and p.warmup_num_steps == 1000
    assert p.cos_min_ratio == 0.0001 and p.warmup_type == "log"


def test_scheduler_params_validated_per_type() -> None:
    message = error_of(
        {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_max_lr": 0.1}}}
    )
    assert "scheduler.params.warmup_max_lr: unknown key" in message
    message = error_of({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}})
    assert "scheduler.params.total_num_steps: unknown key" in message


def test_scheduler_missing_total_num_steps() -> None:
    assert "scheduler.params.total_num_steps: required" in error_of({"scheduler": {"type": "WarmupCosineLR"}})


def test_scheduler_bad_params() -> None:
    message = error_of(
        {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 0, "warmup_type": "exp"}}}
    )
    assert "scheduler.params.total_num_steps" in message
    assert "scheduler.params.warmup_type" in message and '"exp"' in message
    message = error_of(
        {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 20}}}
    )
    assert "scheduler.params.warmup_num_steps" in message and "(got 20)" in message


def test_unknown_scheduler_type() -> None:
    message = error_of({"scheduler": {"type": "OneCycleLR"}})
    assert "scheduler.type" in message and '"OneCycleLR"' in message
    assert "WarmupLR" in message and "WarmupCosineLR" in message and "WarmupDecayLR" in message
    assert "scheduler.type: required" in error_of({"scheduler": {"params": {}}})


# --------------------------------------------------------------- batch sizes


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2, (30, 3, 5)),
        ({"train_batch_size": 12}, 3, (12, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 6}, 4, (24, 6, 1)),
        ({}, 8, (8, 1, 1)),
    ],
)
def test_resolve_batch(given: dict[str, int], world: int, expected: tuple[int, int, int]) -> None:
    assert load_config(given).resolve_batch(world) == BatchSizes(*expected)


def test_resolve_batch_inconsistent_names_everything() -> None:
    cfg = load_config(
        {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    )
    with pytest.raises(ConfigError) as info:
        cfg.resolve_batch(4)
    message = str(info.value)
    for piece in (
        "train_batch_size=30",
        "train_micro_batch_size_per_gpu=4",
        "gradient_accumulation_steps=2",
        "world_size=4",
    ):
        assert piece in message


@pytest.mark.parametrize(
    ("given", "world"),
    [
        ({"train_batch_size": 10}, 4),
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2),
        ({"train_batch_size": 30, "gradient_accumulation_steps": 4}, 2),
        ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4}, 2),
    ],
)
def test_resolve_batch_not_divisible(given: dict[str, int], world: int) -> None:
    with pytest.raises(ConfigError, match="not divisible"):
        load_config(given).resolve_batch(world)


def test_resolve_batch_gas_alone_is_an_error() -> None:
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu or train_batch_size"):
        load_config({"gradient_accumulation_steps": 4}).resolve_batch(2)


def test_resolve_batch_bad_world_size() -> None:
    with pytest.raises(ConfigError, match="world_size"):
        load_config({}).resolve_batch(0)


def test_zero3_config_is_a_pydantic_model() -> None:
    # The engine may build one directly; extra keys must still be rejected there.
    with pytest.raises(pydantic.ValidationError):
        Zero3Config.model_validate({"nonsense": 1})


def test_offload_tier_and_aio_keys_take_deepspeed_meanings() -> None:
    cfg = load_config({
        "zero_optimization": {
            "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "pin_memory": True, "buffer_count": 6,
                                  "ratio": 0.25},
            "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 3, "buffer_size": 1e7,
                              "max_in_cpu": 5e8},
        },
        "aio": {"block_size": 262144, "queue_depth": 16, "thread_count": 2},
    })
    zc = cfg.zero_optimization
    assert (zc.offload_optimizer.buffer_count, zc.offload_optimizer.ratio) == (6, 0.25)
    assert (zc.offload_param.buffer_size, zc.offload_param.max_in_cpu) == (10_000_000, 500_000_000)
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.thread_count) == (262144, 16, 2)
    defaults = load_config({}).aio
    assert (defaults.block_size, defaults.queue_depth, defaults.thread_count) == (1048576, 8, 1)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 1.5}}},
         "zero_optimization.offload_optimizer.ratio"),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0}}},
         "zero_optimization.offload_optimizer.ratio"),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "buffer_count": 1}}},
         "zero_optimization.offload_optimizer.buffer_count"),
        ({"zero_optimization": {"offload_param": {"device": "cpu", "max_in_cpu": -1}}},
         "zero_optimization.offload_param.max_in_cpu"),
        ({"zero_optimization": {"offload_param": {"device": "disk"}}}, "zero_optimization.offload_param.device"),
        ({"aio": {"block_size": 1000}}, "aio.block_size"),
        ({"aio": {"queue_depth": 0}}, "aio.queue_depth"),
        ({"aio": {"thread_count": "4"}}, "aio.thread_count"),
    ],
)
def test_bad_tier_and_aio_values_name_the_key(config: dict[str, Any], key: str) -> None:
    assert key in error_of(config)
