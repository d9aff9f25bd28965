"""Every key of DeepSpeed's ZeRO config, under both its names, and DeepSpeed's top-level keys: each is
implemented, translated, accepted with no effect (one info line), or refused unless off, as
zero3.config.DEEPSPEED_KEYS says. docs/configuration.md's key tables are
zero3.config.config_reference()'s output, which covers every key of the config's models, zero3's own
included, with the models' defaults; `python -m tests.test_deepspeed_keys` rewrites them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import zero3
from tests import models
from tests.distributed import run_ranks
from zero3.config import CONFIG_KEYS, DEEPSPEED_KEYS, ConfigError, config_key_paths, config_reference, load_config

# DeepSpeed 0.19.8's DeepSpeedZeroConfig: (field name, its alias), as `model_fields` lists them.
DEEPSPEED_ZERO_FIELDS = [
    ("stage", None), ("contiguous_gradients", None), ("reduce_scatter", None), ("reduce_bucket_size", None),
    ("use_multi_rank_bucket_allreduce", None), ("allgather_partitions", None), ("allgather_bucket_size", None),
    ("overlap_comm", None), ("compute_grad_norm", None), ("load_from_fp32_weights", None),
    ("elastic_checkpoint", None), ("offload_param", None), ("offload_optimizer", None), ("zenflow", None),
    ("sub_group_size", None), ("cpu_offload_param", None), ("cpu_offload_use_pin_memory", None),
    ("cpu_offload", None), ("prefetch_bucket_size", "stage3_prefetch_bucket_size"),
    ("param_persistence_threshold", "stage3_param_persistence_threshold"),
    ("model_persistence_threshold", "stage3_model_persistence_threshold"),
    ("max_live_parameters", "stage3_max_live_parameters"), ("max_reuse_distance", "stage3_max_reuse_distance"),
    ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"),
    ("module_granularity_threshold", "stage3_module_granularity_threshold"),
    ("use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params"),
    ("allgather_sequential", "stage3_allgather_sequential"), ("stage3_gather_fp16_weights_on_model_save", None),
    ("ignore_unused_parameters", None), ("legacy_stage1", None), ("round_robin_gradients", None),
    ("parameter_alignment", None), ("zero_hpz_partition_size", None), ("zero_quantized_weights", None),
    ("zero_quantized_nontrainable_weights", None), ("zero_quantized_gradients", None),
    ("memory_efficient_linear", None), ("pipeline_loading_checkpoint", None), ("override_module_apply", None),
    ("log_trace_cache_warnings", None), ("enable_sanity_checks", None),
    ("save_muon_momentum_buffer_in_memory", None), ("leaf_module", None),
]
TOP_LEVEL = ["zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "activation_checkpointing", "checkpoint",
             "comms_logger", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "memory_breakdown",
             "dump_state", "amp"]

# A value of each key that leaves its feature as DeepSpeed's default does (what a ported config writes).
VALUES: dict[str, Any] = {
    "stage": 3, "contiguous_gradients": True, "reduce_scatter": True, "reduce_bucket_size": 5e8,
    "use_multi_rank_bucket_allreduce": True, "allgather_partitions": True, "allgather_bucket_size": 5e8,
    "overlap_comm": True, "compute_grad_norm": True, "load_from_fp32_weights": True, "elastic_checkpoint": False,
    "offload_param": None, "offload_optimizer": None, "zenflow": None, "sub_group_size": 1e9,
    "cpu_offload_param": False, "cpu_offload_use_pin_memory": False, "cpu_offload": False,
    "prefetch_bucket_size": 5e7, "param_persistence_threshold": 1e5, "model_persistence_threshold": 1e12,
    "max_live_parameters": 1e9, "max_reuse_distance": 1e9, "gather_16bit_weights_on_model_save": False,
    "module_granularity_threshold": 0, "use_all_reduce_for_fetch_params": False, "allgather_sequential": False,
    "stage3_gather_fp16_weights_on_model_save": False, "ignore_unused_parameters": True, "legacy_stage1": False,
    "round_robin_gradients": False, "parameter_alignment": False, "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False, "memory_efficient_linear": True, "pipeline_loading_checkpoint": False,
    "override_module_apply": True, "log_trace_cache_warnings": False, "enable_sanity_checks": False,
    "save_muon_momentum_buffer_in_memory": False, "leaf_module": {"classes": [], "names": [], "name_suffixes": []},
    "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
    "activation_checkpointing": {"partition_activations": False}, "checkpoint": {"use_node_local_storage": False},
    "comms_logger": {"enabled": False}, "flops_profiler": {"enabled": False}, "tensorboard": {"enabled": False},
    "wandb": {"enabled": False}, "csv_monitor": {"enabled": False}, "memory_breakdown": False,
    "dump_state": False, "amp": {"enabled": False},
}


def names_of(field: str, alias: str | None) -> list[str]:
    return [field] + ([alias] if alias else [])


@pytest.mark.parametrize(("field", "alias"), DEEPSPEED_ZERO_FIELDS)
def test_every_deepspeed_zero_key_loads_under_each_of_its_names(field: str, alias: str | None) -> None:
    for name in names_of(field, alias):
        load_config({"zero_optimization": {name: VALUES[field]}})


def test_every_deepspeed_zero_key_has_a_fate_in_the_table() -> None:
    fates = {path.removeprefix("zero_optimization."): fate for path, (fate, _) in DEEPSPEED_KEYS.items()}
    for field, alias in DEEPSPEED_ZERO_FIELDS:
        assert any(name in fates for name in names_of(field, alias)), field
    for key in TOP_LEVEL:
        assert key in fates or any(path.startswith(f"{key}.") for path in fates), key
    assert set(fate for fate in fates.values()) == {"implemented", "translated", "no effect", "off only"}


def test_top_level_deepspeed_keys_load_and_each_no_effect_key_gets_one_line() -> None:
    config = load_config({key: VALUES[key] for key in TOP_LEVEL})
    lines = config.inert_settings()
    assert len(lines) == len(TOP_LEVEL) - 2, lines  # amp is "off only", activation_checkpointing implemented
    assert any(line.startswith("config key wandb=") and "log from the training loop" in line for line in lines)


def test_a_key_under_both_names_misspellings_and_auto_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="both its names"):
        load_config({"zero_optimization": {"param_persistence_threshold": 1, "stage3_param_persistence_threshold": 1}})
    with pytest.raises(ConfigError, match="did you mean 'stage3_prefetch_bucket_size'"):
        load_config({"zero_optimization": {"stage3_prefetch_bucket_sise": 5}})
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu, optimizer.params.lr are \"auto\""):
        load_config({"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    for key, value in (("zenflow", {}),
                       ("compute_grad_norm", False)):
        with pytest.raises(ConfigError, match=f"zero_optimization.{key}"):
            load_config({"zero_optimization": {key: value}})
    with pytest.raises(ConfigError, match="amp"):
        load_config({"amp": {"enabled": True}})


def test_deprecated_keys_are_translated_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zero3"):
        config = load_config({"zero_optimization": {"cpu_offload": True, "cpu_offload_param": True,
                                                    "stage3_gather_fp16_weights_on_model_save": True}})
    zc = config.zero_optimization
    assert zc.offload_optimizer.device == "cpu" and zc.offload_param.device == "cpu"
    assert zc.stage3_gather_16bit_weights_on_model_save is True
    assert sum("deprecated" in record.message for record in caplog.records) == 3
    # The new key, given as well, stands.
    both = load_config({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "none"}}})
    assert both.zero_optimization.offload_optimizer.device == "none"


def test_short_names_set_the_same_settings() -> None:
    short = load_config({"zero_optimization": {"param_persistence_threshold": 7, "prefetch_bucket_size": 9,
                                               "max_live_parameters": 11, "model_persistence_threshold": 13}})
    zc = short.zero_optimization
    assert (zc.stage3_param_persistence_threshold, zc.stage3_prefetch_bucket_size, zc.stage3_max_live_parameters,
            zc.stage3_model_persistence_threshold) == (7, 9, 11, 13)


def persistence_and_unused(rank: int, world: int) -> dict[str, Any]:
    """model_persistence_threshold caps what stays gathered; ignore_unused_parameters=false refuses a step
    where a trained parameter got no gradient on any rank, on every rank, before anything changes."""
    out: dict[str, Any] = {}
    for model_threshold in (None, 100):
        zero = {"stage": 3, "param_persistence_threshold": 100}
        if model_threshold is not None:
            zero["model_persistence_threshold"] = model_threshold
        torch.manual_seed(0)
        engine = zero3.initialize(model=models.MLP(), config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": zero})[0]
        persistent = engine.persistent_unit
        out[f"persistent {model_threshold}"] = sorted(sp.name for sp in persistent.params) if persistent else []
        engine.destroy()

    torch.manual_seed(0)
    model = models.MLP()
    model.unused = torch.nn.Linear(4, 4)  # never called
    engine = zero3.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "ignore_unused_parameters": False}})[0]
    x, y = models.batches("x8", 1, 2 * world)[0]
    engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
    before = [zero3.safe_get_full_fp32_param(p).clone() for p in model.parameters()]
    try:
        engine.step()
        out["unused"] = None
    except RuntimeError as error:
        out["unused"] = str(error)
    out["unchanged"] = all(torch.equal(a, zero3.safe_get_full_fp32_param(p)) for a, p in zip(before, model.parameters()))
    engine.destroy()

    # reduce_scatter: DeepSpeed's false all-reduces and keeps the partition: the same shards as true
    for reduce_scatter in (True, False):
        torch.manual_seed(0)
        model = models.MLP()
        engine = zero3.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "reduce_scatter": reduce_scatter}})[0]
        for x, y in models.batches("x8", 3, 2 * world):
            engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
            engine.step()
        out[f"reduce_scatter {reduce_scatter}"] = [zero3.safe_get_local_fp32_param(p).clone()
                                                   for p in model.parameters()]
        out[f"inert {reduce_scatter}"] = engine.config.inert_settings()
        engine.destroy()
    return out


def test_model_persistence_threshold_ignore_unused_parameters_and_reduce_scatter_at_two_ranks() -> None:
    for out in run_ranks(2, persistence_and_unused):
        # fc1.bias (64), fc2.bias (64) and fc3.bias (8) are under 100 elements each, not 100 in all
        assert out["persistent None"] == ["fc1.bias", "fc2.bias", "fc3.bias"], out
        assert out["persistent 100"] == ["fc1.bias", "fc3.bias"], out  # in parameter order, while they fit
        assert out["unused"] is not None and "unused.weight" in out["unused"], out["unused"]
        assert "ignore_unused_parameters is false" in out["unused"] and "applied on no rank" in out["unused"]
        assert out["unchanged"]
        assert all(torch.equal(a, b) for a, b in zip(out["reduce_scatter True"], out["reduce_scatter False"]))
        assert [line for line in out["inert False"] if "reduce_scatter=false" in line.lower()], out["inert False"]


ROOT = Path(__file__).resolve().parents[1]
CONFIGURATION_PAGE = ROOT / "docs" / "configuration.md"
BEGIN, END = "<!-- config-reference: begin -->", "<!-- config-reference: end -->"


def reference_on_the_page(text: str) -> str:
    """What docs/configuration.md holds between its two markers."""
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"the page needs one {BEGIN} and one {END}"
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write_reference() -> None:
    """Rewrite the page's reference from the config models (`python -m tests.test_deepspeed_keys`)."""
    text = CONFIGURATION_PAGE.read_text()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    CONFIGURATION_PAGE.write_text(f"{head}{BEGIN}\n\n{config_reference()}\n{END}{tail}")


def test_the_configuration_page_is_the_generated_reference() -> None:
    assert reference_on_the_page(CONFIGURATION_PAGE.read_text()) == config_reference(), (
        "docs/configuration.md's key tables differ from zero3.config.config_reference(): run "
        "`python -m tests.test_deepspeed_keys` to rewrite them")


def test_every_config_key_has_one_row_and_every_row_names_a_key() -> None:
    paths = config_key_paths()
    assert len(paths) == len(set(paths))
    assert set(paths) == set(DEEPSPEED_KEYS) | set(CONFIG_KEYS)
    assert not set(DEEPSPEED_KEYS) & set(CONFIG_KEYS)
    reference = config_reference()
    for path in paths:
        assert f"| `{path}`" in reference or f"### `{path}`" in reference, path
    # zero3's own keys are there, beside DeepSpeed's
    own = {path for path, (fate, _) in CONFIG_KEYS.items() if fate == "zero3"}
    assert {"comm_timeout_s", "checkpoint.dir", "checkpoint.interval_steps", "checkpoint.async_save",
            "checkpoint.keep_last", "checkpoint.resume"} <= own


def test_the_defaults_are_the_models() -> None:
    reference = config_reference()
    assert "| `comm_timeout_s` | `null` |" in reference
    assert "| `checkpoint.async_save` | `false` |" in reference
    assert "(also `prefetch_bucket_size`) | `5e7` |" in reference  # 50_000_000, as DeepSpeed's docs write it
    assert "| `zero_optimization.offload_optimizer.buffer_count` | `4` |" in reference
    assert "`weight_decay` `0.01`" in reference  # AdamW's, filled in when the section names only the type
    assert "`total_num_steps` required" in reference


def test_the_porting_page_points_to_the_configuration_page() -> None:
    porting = (ROOT / "docs" / "porting.md").read_text()
    assert "(configuration.md)" in porting or "(configuration.md#" in porting
    assert "| key | fate |" not in porting and "| key | default | fate |" not in porting  # one copy of the table


if __name__ == "__main__":
    write_reference()
