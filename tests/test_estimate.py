"""`zero3 estimate`: to the byte against live engines (world sizes 1, 2, 3), the CLI, the HF path, the fit."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import zero3
from tests.distributed import run_ranks
from zero3 import estimate as est
from zero3.cli import main
from zero3.config import load_config
from zero3.estimate import EstimateSettings, estimate, largest_fitting_params
from zero3.models import GPT, GPTConfig

# Odd sizes, so most parameters do not divide by 2 or 3 ranks and their shards are padded (65 x 31 embedding,
# 7 x 31 positions, 31-wide LayerNorms...); the LayerNorms and biases of 31 and 93 fall under a threshold of 100.
GPT_SHAPE = GPTConfig(vocab_size=65, block_size=7, n_layer=2, n_head=1, n_embd=31)


def gpt_config(precision: str, threshold: int = 100, **zero: Any) -> dict[str, Any]:
    nvme_path = zero.pop("nvme_path", None)
    extra = zero.pop("top", {})
    max_in_cpu = zero.pop("max_in_cpu", None)
    for key in ("offload_optimizer", "offload_param"):
        if key in zero:
            zero[key] = {"device": zero[key], **({"nvme_path": nvme_path} if zero[key] == "nvme" else {})}
    if max_in_cpu is not None:
        zero["offload_param"]["max_in_cpu"] = max_in_cpu
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold, **zero},
        **extra,
    }


# (name, config builder arguments): both precisions with and without ZeRO-Offload, then the other tiers,
# bucket sizes, dtypes and thresholds that change a state's size or place.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("bf16", {"precision": "bf16"}),
    ("bf16 optimizer on cpu", {"precision": "bf16", "offload_optimizer": "cpu", "reduce_bucket_size": 3000}),
    ("fp32", {"precision": "fp32", "threshold": 0, "reduce_bucket_size": 3000}),
    ("fp32 optimizer on cpu", {"precision": "fp32", "offload_optimizer": "cpu"}),
    ("fp16 params on cpu, fp32 grads", {
        "precision": "fp16", "offload_param": "cpu", "reduce_bucket_size": 2000, "overlap_comm": False,
        "top": {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"},
    }),
    ("bf16 both on nvme", {
        "precision": "bf16", "offload_optimizer": "nvme", "offload_param": "nvme", "max_in_cpu": 1500,
        "reduce_bucket_size": 2500,
    }),
    ("bf16 lean", {"precision": "bf16", "lean_memory": True}),
    ("fp32 lean, optimizer on cpu", {"precision": "fp32", "offload_optimizer": "cpu", "lean_memory": True}),
]


def engine_states(rank: int, world: int, nvme_root: str) -> list[dict[str, Any]]:
    """Each case's engine after one step (the scratch bucket exists from the first backward on)."""
    results = []
    for _, options in CASES:
        cfg = gpt_config(nvme_path=nvme_root, **options)
        torch.manual_seed(0)
        model = GPT(GPT_SHAPE)
        engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        tokens = torch.randint(0, GPT_SHAPE.vocab_size, (2, GPT_SHAPE.block_size + 1), device=engine.device)
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:])["loss"])
        engine.step()
        report = engine.state_report()
        files = [path for path in Path(nvme_root).glob(f"zero3-rank{rank}-*/*") if path.is_file()]
        results.append({
            "disk_files": sum(path.stat().st_size for path in files),
            "model_state_bytes": engine.model_state_bytes(),
            # Places with no bytes left out, but the place of gradient shards made on demand (0 bytes between
            # steps), which the estimate names too.
            "report": {state: {k: v for k, v in where.items() if v or state == "lp_grads"}
                       for state, where in report.items()},
            "homes": {state: {k: v for k, v in where.items() if v or state == "lp_grads"}
                      for state, where in report.homes.items()},
        })
        engine.destroy()
    return results


def meta_model() -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(GPT_SHAPE)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_estimate_matches_the_engine_to_the_byte(world: int, tmp_path: Path) -> None:
    per_rank = run_ranks(world, engine_states, str(tmp_path))
    for (name, options), *ranks in zip(CASES, *per_rank):
        config = load_config(gpt_config(nvme_path="/x", **options))
        expected = estimate(model=meta_model(), ranks_per_node=world,
                            settings=EstimateSettings.from_config(config, accelerator="cpu"))
        for rank, result in enumerate(ranks):
            where = f"{name}, world {world}, rank {rank}"
            assert result["model_state_bytes"] == expected.model_state_bytes(), where
            assert result["report"] == expected.report("cpu"), where
            assert result["homes"] == expected.report("cpu"), where
            assert result["disk_files"] == expected.disk_files(), where
    # The cases do reach what they are there for: persistent params gathered, shards both in memory and on disk.
    rank0 = dict(zip((name for name, _ in CASES), per_rank[0]))
    assert (rank0["bf16"]["model_state_bytes"]["persistent_params"] > 0) == (world > 1)
    assert rank0["bf16 both on nvme"]["report"]["lp_params"].keys() == {"cpu", "nvme"}
    assert rank0["bf16 both on nvme"]["disk_files"] > 0
    assert rank0["bf16 lean"]["model_state_bytes"]["lp_params"] == 0  # every parameter of the GPT is trained
    assert rank0["bf16"]["model_state_bytes"]["lp_params"] > 0


# Expert parallelism (tests/test_moe_engine.py's config: threshold 0, buckets of 500) beside what changes a
# share's layout: MiCS's replicas, hpZ's secondary shards of the dense part, the tiers, bf16.
MOE_CASES: list[tuple[str, int, dict[str, Any]]] = [
    ("autoep 2", 2, {}),
    ("autoep 4, bf16", 4, {"top": {"bf16": {"enabled": True}}}),
    ("autoep 2, MiCS 2", 2, {"mics_shard_size": 2}),
    ("autoep 2, hpZ 2, optimizer on cpu", 2, {"zero_hpz_partition_size": 2, "offload_optimizer": {"device": "cpu"}}),
    ("autoep 2, parameters and optimizer on cpu", 2, {"offload_param": {"device": "cpu"},
                                                     "offload_optimizer": {"device": "cpu"}}),
]


def moe_settings(autoep_size: int, zero: dict[str, Any]) -> dict[str, Any]:
    from tests.test_moe_engine import config

    zero = dict(zero)
    top = zero.pop("top", {})
    return {**config(autoep_size, **zero), **top}


def moe_engine_states(rank: int, world: int) -> list[dict[str, Any]]:
    from tests.test_moe_engine import batch
    from tests.test_moe_expert_parallel import moe_model

    results = []
    for _, autoep_size, zero in MOE_CASES:
        engine, *_ = zero3.initialize(model=moe_model(seed=0), config=moe_settings(autoep_size, zero))
        ids = batch(rank, 0)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        report = engine.state_report()
        results.append({"model_state_bytes": engine.model_state_bytes(),
                        "report": {state: {k: v for k, v in where.items() if v or state == "lp_grads"}
                                   for state, where in report.items()}})
        engine.destroy()
    return results


def test_estimate_matches_an_expert_parallel_engine_to_the_byte() -> None:
    from tests.test_moe_expert_parallel import moe_model

    per_rank = run_ranks(4, moe_engine_states)
    for (name, autoep_size, zero), *ranks in zip(MOE_CASES, *per_rank):
        with torch.device("meta"):
            meta = moe_model(seed=0)
        settings = EstimateSettings.from_config(load_config(moe_settings(autoep_size, zero)), accelerator="cpu")
        expected = estimate(model=meta, ranks_per_node=4, settings=settings)
        assert all(p.shape[0] == 8 for n, p in meta.named_parameters() if "experts" in n)  # left as it was
        for rank, result in enumerate(ranks):
            assert result["model_state_bytes"] == expected.model_state_bytes(), f"{name}, rank {rank}"
            assert result["report"] == expected.report("cpu"), f"{name}, rank {rank}"
    with pytest.raises(ValueError, match="autoep_size=3 does not divide the world size 4"):
        estimate(model=meta, ranks_per_node=4, settings=EstimateSettings(autoep_size=3))
    with pytest.raises(ValueError, match="give the model, not a parameter count"):
        estimate(params=10**6, ranks_per_node=4, settings=EstimateSettings(autoep_size=2))


def test_the_same_model_through_the_gpt_option_and_the_api() -> None:
    shape = GPT_SHAPE
    exact = estimate(model=est.meta_gpt(shape.n_layer, shape.n_embd, shape.vocab_size, shape.block_size),
                     ranks_per_node=3)
    assert exact.params == shape.num_parameters()
    assert exact.exact
    assert exact.model_state_bytes() == estimate(model=meta_model(), ranks_per_node=3).model_state_bytes()


def test_a_model_is_left_as_it_was() -> None:
    model = GPT(GPT_SHAPE)  # a real CPU model works too: nothing is allocated or changed
    before = {name: p.clone() for name, p in model.named_parameters()}
    estimate(model=model, ranks_per_node=2)
    assert not any(hasattr(p, "_zero3") for p in model.parameters())
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())


def test_the_formula_is_close_to_the_exact_layout() -> None:
    settings = EstimateSettings(persistence_threshold=0, reduce_bucket_size=10**9)
    exact = estimate(model=meta_model(), ranks_per_node=3, settings=settings).model_state_bytes()
    formula = estimate(params=GPT_SHAPE.num_parameters(), ranks_per_node=3, settings=settings).model_state_bytes()
    assert formula["total"] <= exact["total"] <= formula["total"] * 1.01  # the padding is all they differ by
    p = 1_300_000_000
    bf16 = estimate(params=p, ranks_per_node=8).model_state_bytes()
    assert bf16["total"] == 16 * p // 8  # ZeRO-3's 16P/N


# ---- the command line ------------------------------------------------------------------------------------------
def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["estimate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_table_shows_every_state_and_the_fit(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--params", "1.3e9", "--ranks-per-node", "4", "--nodes", "2",
                           "--offload-optimizer", "cpu")
    assert code == 0
    settings = EstimateSettings(offload_optimizer="cpu")
    expected = estimate(params=1_300_000_000, ranks_per_node=4, nodes=2, settings=settings)
    for state, places in expected.states.items():
        line = next(line for line in out.splitlines() if state in line)
        assert f"{sum(places.values()):,}" in line, line
    assert f"{sum(expected.on(p) for p in est.PLACES):,}" in next(l for l in out.splitlines() if "total" in l)
    largest = largest_fitting_params(80 * 2**30, 4, 2, settings)
    assert largest is not None and f"{largest:,} parameters" in out
    assert "8 ranks" in out and "formula" in out


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--gpt", "2,31,65,7", "--ranks-per-node", "3", "--precision", "fp32",
                           "--device-memory", "16GB", "--json")
    assert code == 0
    data = json.loads(out)
    expected = estimate(model=meta_model(), ranks_per_node=3, settings=EstimateSettings(precision="fp32"))
    assert data["exact"] is True and data["params"] == GPT_SHAPE.num_parameters()
    assert {k: v for k, v in data["per_rank"].items() if k != "total"} == expected.states
    assert data["per_rank"]["total"] == {p: expected.on(p) for p in est.PLACES}
    assert data["model_state_bytes"] == expected.model_state_bytes()
    assert data["device_memory"] == 16 * 10**9 and data["fits"] is True
    assert data["largest_params_that_fit"] == largest_fitting_params(16 * 10**9, 3, 1, expected.settings)


def test_cli_takes_settings_from_a_config_and_options_win(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(gpt_config("fp16", threshold=7, offload_optimizer="cpu", reduce_bucket_size=1000)))
    _, out, _ = run_cli(capsys, "--params", "1e6", "--config", str(path), "--json")
    settings = json.loads(out)["settings"]
    assert (settings["precision"], settings["offload_optimizer"], settings["persistence_threshold"],
            settings["reduce_bucket_size"]) == ("fp16", "cpu", 7, 1000)
    _, out, _ = run_cli(capsys, "--params", "1e6", "--config", str(path), "--offload-optimizer", "none",
                        "--precision", "bf16", "--json")
    settings = json.loads(out)["settings"]
    assert (settings["precision"], settings["offload_optimizer"], settings["persistence_threshold"]) == (
        "bf16", "none", 7)


def test_cli_lean_memory_drops_the_16_bit_shards(capsys: pytest.CaptureFixture[str]) -> None:
    """Lean memory mode: 12 bytes per parameter / N of model state in bf16 (fp32 master and Adam's two
    moments) between steps, no 16-bit shard and no gradient shard (a backward makes them: what must fit
    the device counts them); with fp32 shards on the device it changes nothing."""
    _, lean_out, _ = run_cli(capsys, "--params", "8e8", "--ranks-per-node", "8", "--lean-memory", "--json")
    lean = json.loads(lean_out)["model_state_bytes"]
    _, out, _ = run_cli(capsys, "--params", "8e8", "--ranks-per-node", "8", "--json")
    default = json.loads(out)["model_state_bytes"]
    assert lean["lp_params"] == 0 and default["lp_params"] == 2 * 800_000_000 // 8
    assert lean["hp_params"] + lean["optim_states"] == 12 * 800_000_000 // 8
    assert lean["lp_grads"] == 0 and default["lp_grads"] == 2 * 800_000_000 // 8
    assert lean["total"] == 12 * 800_000_000 // 8 and default["total"] - lean["total"] == 4 * 800_000_000 // 8
    fits = {}
    between = json.loads(lean_out)["per_rank"]["total"]["device"]
    for extra in (0, 2 * 800_000_000 // 8):  # a device that holds the state between steps, and the gradients too
        _, found, _ = run_cli(capsys, "--params", "8e8", "--ranks-per-node", "8", "--lean-memory", "--json",
                              "--device-memory", str(between + extra))
        fits[extra] = json.loads(found)
    assert fits[0]["backward_per_rank"]["device"] == 2 * 800_000_000 // 8
    assert not fits[0]["fits"] and fits[2 * 800_000_000 // 8]["fits"]
    _, out, _ = run_cli(capsys, "--params", "8e8", "--ranks-per-node", "8", "--precision", "fp32", "--lean-memory",
                        "--json")
    assert json.loads(out)["model_state_bytes"]["lp_params"] == 4 * 800_000_000 // 8  # the shards are the masters


def test_cli_takes_the_mics_and_hpz_group_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    """hpZ's secondary shards are 2P/K bytes on the device; MiCS shards over its group, not the world."""
    _, out, _ = run_cli(capsys, "--params", "8e8", "--ranks-per-node", "8", "--nodes", "4",
                        "--hpz-partition-size", "8", "--json")
    per_rank = json.loads(out)["model_state_bytes"]
    assert per_rank["hpz_secondary"] == 2 * 800_000_000 // 8  # bf16: 2 bytes of every 8th element
    assert per_rank["lp_params"] == 2 * 800_000_000 // 32
    _, out, _ = run_cli(capsys, "--params", "8e8", "--ranks-per-node", "8", "--nodes", "4",
                        "--mics-shard-size", "8", "--json")
    per_rank = json.loads(out)["model_state_bytes"]
    assert per_rank["lp_params"] == 2 * 800_000_000 // 8 and per_rank["hpz_secondary"] == 0
    code, _, err = run_cli(capsys, "--params", "8e8", "--ranks-per-node", "8", "--nodes", "4",
                           "--hpz-partition-size", "16")
    assert code == 2 and "zero_hpz_partition_size=16 does not divide the 8 ranks per node" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--params", "-5"], "'-5': expected a positive whole number"),
    (["--params", "1.5"], "'1.5': expected a positive whole number"),
    (["--params", "lots"], "'lots': expected a positive whole number"),
    (["--params", "1e9", "--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--params", "1e9", "--offload-param", "disk"], "invalid choice: 'disk'"),
    (["--params", "1e9", "--device-memory=-80GB"], "'-80GB': expected a positive size"),
    (["--params", "1e9", "--device-memory", "0GiB"], "'0GiB': expected a positive size"),
    (["--params", "1e9", "--ranks-per-node", "0"], "must be >= 1, got 0"),
    (["--gpt", "2,30,65"], "'2,30,65': expected four positive whole numbers"),
    (["--params", "1e9", "--gpt", "2,31,65,7"], "not allowed with argument"),
    ([], "one of the arguments --params --hf-config --gpt is required"),
])
def test_cli_bad_arguments_name_the_value(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_errors_in_files_name_the_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "config.json"
    code, _, err = run_cli(capsys, "--hf-config", str(missing))
    assert code == 2 and f"{str(missing)!r}: no such file" in err
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "tape"}}}))
    code, _, err = run_cli(capsys, "--params", "1e9", "--config", str(bad))
    assert code == 2 and "zero_optimization.offload_optimizer.device" in err and "tape" in err


def test_settings_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="precision 'fp8': expected one of fp32, bf16, fp16"):
        EstimateSettings(precision="fp8")
    with pytest.raises(ValueError, match="offload_param 'disk': expected one of none, cpu, nvme"):
        EstimateSettings(offload_param="disk")
    with pytest.raises(ValueError, match="reduce_bucket_size 0: expected a whole number >= 1"):
        EstimateSettings(reduce_bucket_size=0)
    with pytest.raises(ValueError, match="params -1"):
        estimate(params=-1)
    with pytest.raises(ValueError, match="exactly one of"):
        estimate()


def test_parsers() -> None:
    assert est.parse_count("1.3e9") == est.parse_count("1300000000") == est.parse_count("1.3B") == 1_300_000_000
    assert est.parse_count("350M") == est.parse_count("350_000_000") == 350_000_000
    assert est.parse_bytes("80GiB") == 80 * 2**30 and est.parse_bytes("80GB") == 80 * 10**9
    assert est.parse_bytes("81920 MiB") == 80 * 2**30 and est.parse_bytes("1024") == 1024
    assert est.parse_gpt_shape("12,768,50304,1024") == (12, 768, 50304, 1024)
    for bad in ("0", "1e-3", "nan", "inf", ""):
        with pytest.raises(ValueError, match="expected a positive whole number"):
            est.parse_count(bad)


# ---- Hugging Face configs -------------------------------------------------------------------------------------
def tiny_llama_config(tmp_path: Path) -> tuple[Path, Any]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=24, intermediate_size=50, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )
    config.save_pretrained(tmp_path)
    return tmp_path / "config.json", config


def test_hf_config_is_built_on_meta_and_estimated_exactly(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path, config = tiny_llama_config(tmp_path)
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_config(config)
    numels = [p.numel() for p in real.parameters()]
    for where in (path, tmp_path):  # the file, or its directory
        code, out, _ = run_cli(capsys, "--hf-config", str(where), "--ranks-per-node", "3",
                               "--persistence-threshold", "50", "--json")
        assert code == 0
        data = json.loads(out)
        assert data["exact"] is True and data["params"] == sum(numels)
        # Every parameter padded to a multiple of 3 on its own; those of at most 50 elements gathered whole.
        shards = sum(-(-n // 3) for n in numels)
        assert data["per_rank"]["lp_params"]["device"] == 2 * shards
        persistent_shards = sum(-(-n // 3) for n in numels if n <= 50)
        assert data["per_rank"]["persistent_params"]["device"] == 2 * 3 * persistent_shards
        from_real = estimate(model=real, ranks_per_node=3, settings=EstimateSettings(persistence_threshold=50))
        assert data["model_state_bytes"] == from_real.model_state_bytes()


def hf_engine_states(rank: int, world: int, config_path: str) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_path))
    cfg = gpt_config("bf16", threshold=50, offload_optimizer="cpu", reduce_bucket_size=3000)
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ids = torch.randint(0, 101, (2, 6))
    engine.backward(engine(input_ids=ids, labels=ids, use_cache=False).loss)
    engine.step()
    result = {"model_state_bytes": engine.model_state_bytes(), "report": dict(engine.state_report())}
    engine.destroy()
    return result


def test_hf_config_estimate_matches_the_engine(tmp_path: Path) -> None:
    path, _ = tiny_llama_config(tmp_path)
    settings = EstimateSettings.from_config(
        load_config(gpt_config("bf16", threshold=50, offload_optimizer="cpu", reduce_bucket_size=3000)),
        accelerator="cpu",
    )
    expected = estimate(model=est.meta_hf_model(path), ranks_per_node=2, settings=settings)
    for result in run_ranks(2, hf_engine_states, str(path)):
        assert result["model_state_bytes"] == expected.model_state_bytes()
        assert result["report"] == expected.report("cpu")


def test_hf_config_without_transformers_asks_for_the_count(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = tiny_llama_config(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # any import of it now fails
    code, _, err = run_cli(capsys, "--hf-config", str(path))
    assert code == 2
    assert "needs transformers" in err and "--params" in err


# ---- the largest model that fits ------------------------------------------------------------------------------
TIER_SETTINGS = [
    EstimateSettings(),
    EstimateSettings(precision="fp32"),
    EstimateSettings(offload_optimizer="cpu"),
    EstimateSettings(offload_optimizer="nvme"),
    EstimateSettings(offload_param="cpu"),
    EstimateSettings(offload_optimizer="nvme", offload_param="nvme"),
]


@pytest.mark.parametrize(
    "settings", TIER_SETTINGS, ids=lambda s: f"{s.precision}-{s.offload_optimizer}-{s.offload_param}"
)
def test_largest_model_fits_and_one_percent_more_does_not(settings: EstimateSettings) -> None:
    device = 80 * 2**30
    largest = largest_fitting_params(device, 8, 1, settings)
    assert largest is not None and largest > 10**9

    def fits(count: int) -> bool:
        return estimate(params=count, ranks_per_node=8, settings=settings).fits(device)

    assert fits(largest) and not fits(largest + 1) and not fits(int(largest * 1.01))
    # More memory, or more ranks, never fits a smaller model.
    sizes = [largest_fitting_params(gib * 2**30, 8, 1, settings) for gib in (16, 24, 40, 80, 141)]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    by_world = [largest_fitting_params(device, ranks, nodes, settings) for ranks, nodes in ((1, 1), (4, 1), (8, 4))]
    assert by_world == sorted(by_world) and len(set(by_world)) == len(by_world)


def test_offloading_fits_larger_models_until_the_device_holds_only_scratch() -> None:
    device, ranks = 80 * 2**30, 8
    none, optimizer_cpu = (largest_fitting_params(device, ranks, 1, TIER_SETTINGS[i]) for i in (0, 2))
    assert none is not None and optimizer_cpu is not None and optimizer_cpu > none
    everything_off = EstimateSettings(offload_optimizer="cpu", offload_param="cpu")
    assert largest_fitting_params(device, ranks, 1, everything_off) is None
    # ... unless the scratch bucket can outgrow the device: then it sets the limit.
    offloaded = EstimateSettings(offload_optimizer="cpu", offload_param="cpu", reduce_bucket_size=10**9)
    limited = largest_fitting_params(10**9, ranks, 1, offloaded)
    assert limited is not None
    assert estimate(params=limited, ranks_per_node=ranks, settings=offloaded).fits(10**9)
    assert not estimate(params=limited + 1, ranks_per_node=ranks, settings=offloaded).fits(10**9)


# ---- on a GPU (skipped without one) -----------------------------------------------------------------------------
@pytest.mark.cuda
def test_estimate_matches_a_cuda_engine(tmp_path: Path) -> None:
    # On a GPU the places differ (the device is not host memory) and a world of one with its shards on the
    # host gathers the persistent unit into device memory: the rule the CPU cases cannot reach.
    for (name, options), result in zip(CASES, engine_states(0, 1, str(tmp_path))):
        settings = EstimateSettings.from_config(load_config(gpt_config(nvme_path="/x", **options)))
        expected = estimate(model=meta_model(), ranks_per_node=1, settings=settings)
        assert result["model_state_bytes"] == expected.model_state_bytes(), name
        assert result["report"] == expected.report("cuda:0"), name
