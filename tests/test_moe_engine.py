"""zero3.initialize with `expert_parallel` on tiny Hugging Face MoE models (Qwen3-MoE, Mixtral, gpt-oss's expert
biases, DeepSeek-V3's shared experts) at 2, 4 and 8 ranks, with every tier, hpZ and MiCS: the same losses
and weights, step after step, as a plain single-process run on the same global batch; a size that cannot lay
the experts out and a model without experts refused on every rank before the model changes; combinations the
expert shares are not laid out for yet refused by the config."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed as dist

import zero3
from tests.distributed import run_ranks
from tests.test_moe_expert_parallel import EXPERTS, VOCAB, moe_model
from zero3.moe import expert_share
from zero3.shard_mesh import TopologyError, expert_group_size

STEPS, LR = 3, 1e-2


def config(autoep_size: int, **zero: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500,
                                  **zero},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "expert_parallel": {"enabled": True, "autoep_size": autoep_size}}


def batch(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (1, 6), generator=generator)


def trained_rank(rank: int, world: int, autoep_size: int, family: str, save_dir: str,
                 zero: dict | None = None, under_init: bool = False) -> dict:
    """`zero`: more zero_optimization keys; with them, the states are also parked on disk after the second
    step (offload_states) and brought back before the third. `under_init`: the model built under zero3.Init."""
    dist.init_process_group("gloo", rank=rank, world_size=world)
    settings = config(autoep_size, **(zero or {}))
    if under_init:
        with zero3.Init(config_dict_or_path=settings):
            model = moe_model(seed=rank, family=family)
        experts = model.model.layers[0].mlp.experts.gate_up_proj
        assert experts.numel() == 0 and experts.ds_shape[0] == EXPERTS  # partitioned over every rank
    else:
        model = moe_model(seed=rank, family=family)  # seeded apart: rank 0's weights are everyone's
    engine, *_ = zero3.initialize(model=model, config=settings)
    losses, parked = [], {}
    for step in range(STEPS):
        if zero is not None and step == 2:
            parked["before"] = {state: zero3.get_state_devices(engine, state) for state in PARKED}
            engine.offload_states(device="nvme", nvme_path=str(Path(save_dir) / f"parked{rank}"))
            parked["offloaded"] = {state: zero3.get_state_devices(engine, state) for state in PARKED}
            engine.reload_states()
            parked["reloaded"] = {state: zero3.get_state_devices(engine, state) for state in PARKED}
        ids = batch(rank, step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = {}
    for name, p in engine.module.named_parameters():
        share = expert_share(p)
        weights[name] = (share.first if share else None, zero3.safe_get_full_fp32_param(p))
    # Whole weights, expert weights [E, ...] as the model has them: streamed, in buckets, and saved.
    streamed = {name: t.clone() for name, t in engine.iter_full_params()}
    bucketed = {name: t.clone() for name, t in engine.iter_full_params(bucket_bytes=2048)}
    engine.save_16bit_model(save_dir)
    state = {"losses": losses, "weights": weights, "report": engine.model_state_bytes(), "streamed": streamed,
             "bucketed": bucketed, "parked": parked}
    engine.destroy()
    return state


PARKED = ("lp_params", "hp_params", "optim_states", "lp_grads")


def assert_matches_a_plain_run(results: list[dict], world: int, autoep_size: int, family: str,
                               save_dir: Path) -> None:
    """Every rank's losses, its share of the trained weights, and the whole weights it streamed and saved
    are a plain single-process run's on the same global batch."""
    reference = moe_model(seed=0, family=family)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = [reference(input_ids=batch(rank, step), labels=batch(rank, step)).loss for rank in range(world)]
        for rank, loss in enumerate(losses):
            assert results[rank]["losses"][step] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6), (step, rank)
        (sum(losses) / world).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
    count = EXPERTS // autoep_size
    for rank, result in enumerate(results):
        for name, p in reference.named_parameters():
            first, got = result["weights"][name]
            expected = p.detach() if first is None else p.detach()[first:first + count]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    tied = {"lm_head.weight"} if reference.config.tie_word_embeddings else set()
    params, state = dict(reference.named_parameters()), reference.state_dict()  # (saved: the persistent buffers too)
    saved = safetensors.torch.load_file(save_dir / "model.safetensors")
    streams = [result["streamed"] for result in results] + [result["bucketed"] for result in results]
    for source, whole in [(stream, params) for stream in streams] + [(saved, state)]:
        assert set(source) == set(whole) - tied
        for name, got in source.items():
            torch.testing.assert_close(got, whole[name].detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world, autoep_size, family", [(2, 2, "qwen3_moe"), (4, 2, "mixtral"), (4, 4, "qwen3_moe"),
                                                       (2, 2, "gpt_oss"), (4, 2, "deepseek_v3")])
def test_expert_parallel_training_matches_a_plain_run(world: int, autoep_size: int, family: str,
                                                     tmp_path: Path) -> None:
    """Also: the trained weights streamed (one at a time and in buckets) and saved by save_16bit_model are the
    plain run's whole weights."""
    results = run_ranks(world, trained_rank, autoep_size, family, str(tmp_path))
    assert_matches_a_plain_run(results, world, autoep_size, family, tmp_path)


def test_a_model_built_under_zero3_init_has_its_experts_shared_out_from_its_partition(tmp_path: Path) -> None:
    """Each expert weight gathered whole from Init's shards, one at a time, and its share cut from it."""
    results = run_ranks(4, trained_rank, 2, "qwen3_moe", str(tmp_path), None, True)
    assert_matches_a_plain_run(results, 4, 2, "qwen3_moe", tmp_path)


@pytest.mark.parametrize("world, zero", [
    (4, {"offload_optimizer": {"device": "cpu"}}),
    (4, {"offload_optimizer": {"device": "nvme"}}),
    (4, {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}),
    (4, {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}}),
    (4, {"zero_hpz_partition_size": 2}),
    (4, {"mics_shard_size": 2}),  # each share whole on a rank, replicated across the MiCS replicas
    (8, {"mics_shard_size": 4, "zero_hpz_partition_size": 2}),  # each share sharded in a shard group, and replicated
], ids=["optimizer on the host", "optimizer on disk", "parameters on the host", "parameters on disk", "hpZ", "MiCS",
        "MiCS and hpZ at 8 ranks"])
def test_expert_parallel_matches_a_plain_run_with_every_tier_hpz_and_mics(world: int, zero: dict,
                                                                          tmp_path: Path) -> None:
    """autoep_size 2 beside each tier, hpZ's secondary shards (the dense part's) and MiCS's replicas (the
    experts' are the dense part's); the states parked on disk and brought back between two steps, each to
    where it was (a tier's states to their tier)."""
    for section in ("offload_optimizer", "offload_param"):
        if zero.get(section, {}).get("device") == "nvme":
            (tmp_path / section).mkdir()
            zero = {**zero, section: {"device": "nvme", "nvme_path": str(tmp_path / section)}}
    results = run_ranks(world, trained_rank, 2, "qwen3_moe", str(tmp_path), zero)
    assert_matches_a_plain_run(results, world, 2, "qwen3_moe", tmp_path)
    for result in results:
        assert result["parked"]["offloaded"] == {state: {torch.device("meta")} for state in PARKED}
        assert result["parked"]["reloaded"] == result["parked"]["before"]  # each state back in its tier


def resumed_rank(rank: int, world: int, autoep_size: int | None, save_dir: str, saving: bool,
                 zero: dict | None = None) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = moe_model(seed=rank)
    settings = config(autoep_size or 1, **(zero or {}))
    if autoep_size is None:
        del settings["expert_parallel"]  # a plain ZeRO-3 job resumes the expert-parallel one
    engine, *_ = zero3.initialize(model=model, config=settings)
    steps = range(2) if saving else range(2, 3)
    if not saving:
        engine.load_checkpoint(save_dir)
    losses = []
    for step in steps:
        ids = batch(rank, step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if saving:
        engine.save_checkpoint(save_dir)
    weights = {name: (share.first if (share := expert_share(p)) else None, zero3.safe_get_full_fp32_param(p))
               for name, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "weights": weights}


@pytest.fixture(scope="module")
def saved_at_autoep_2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A checkpoint of 2 steps at 4 ranks with autoep_size 2 (saved once for the module's tests)."""
    save_dir = str(tmp_path_factory.mktemp("moe_checkpoint"))
    run_ranks(4, resumed_rank, 2, save_dir, True)
    return save_dir


@pytest.mark.parametrize("world, autoep_size", [(2, 2), (4, 4), (2, None)])
def test_a_checkpoint_saved_at_autoep_2_resumes_at_another_layout(saved_at_autoep_2: str, world: int,
                                                                  autoep_size: int | None) -> None:
    results = run_ranks(world, resumed_rank, autoep_size, saved_at_autoep_2, False)
    assert_resumes_the_plain_run(results, world, autoep_size)


def test_a_checkpoint_saved_with_mics_replicas_resumes_without_them(tmp_path: Path) -> None:
    """MiCS's replicas of each expert share (4 ranks, shard groups of 2, autoep_size 2) write one checkpoint."""
    run_ranks(4, resumed_rank, 2, str(tmp_path), True, {"mics_shard_size": 2})
    assert_resumes_the_plain_run(run_ranks(2, resumed_rank, 2, str(tmp_path), False), 2, 2)


def assert_resumes_the_plain_run(results: list[dict], world: int, autoep_size: int | None) -> None:
    """Two steps at 4 ranks, then one at `world`: the resumed step's losses and the weights after it are a
    plain run's on the same global batches."""
    reference = moe_model(seed=0)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    for step, ranks in ((0, 4), (1, 4), (2, world)):
        optimizer.zero_grad()
        losses = [reference(input_ids=batch(rank, step), labels=batch(rank, step)).loss for rank in range(ranks)]
        if step == 2:
            for rank, loss in enumerate(losses):
                assert results[rank]["losses"][0] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6), rank
        (sum(losses) / ranks).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
    count = EXPERTS // (autoep_size or 1)
    for result in results:
        for name, p in reference.named_parameters():
            first, got = result["weights"][name]
            expected = p.detach() if first is None else p.detach()[first:first + count]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def refused_rank(rank: int, world: int, case: str) -> str:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = moe_model(seed=0)
    if case == "no experts":
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = {name: p.shape for name, p in model.named_parameters()}
    settings = config(4 if case == "autoep_size does not divide the world" else 2)
    if case == "autoep_size does not divide the experts":
        settings = config(2)
        model = moe_model(seed=0)
        for layer in model.model.layers:
            experts = layer.mlp.experts
            experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[:3].clone())
            experts.down_proj = torch.nn.Parameter(experts.down_proj.detach()[:3].clone())
            experts.num_experts = 3
        before = {name: p.shape for name, p in model.named_parameters()}
    groups = [{"params": [torch.zeros(3)]}] if case == "a tensor not of the model in model_parameters" else None
    try:
        engine, *_ = zero3.initialize(model=model, config=settings, model_parameters=groups)
    except (zero3.ConfigError, ValueError) as error:
        after = {name: p.shape for name, p in model.named_parameters()}
        assert after == before and not any(type(m).__name__.startswith("ExpertParallel") for m in model.modules())
        return str(error)
    experts = model.model.layers[0].mlp.experts
    try:
        with zero3.GatheredParameters([experts.gate_up_proj], modifier_rank=0):
            pass
    except ValueError as error:
        return str(error)
    finally:
        engine.destroy()
    return "accepted"


@pytest.mark.parametrize("case, message", [
    ("autoep_size does not divide the experts", r"expert_parallel.autoep_size=2 does not divide the number of experts"
                                                r" of every layer \(3\)"),
    ("no experts", "expert_parallel is enabled, but the model has no expert layers"),
    ("autoep_size does not divide the world", "expert_parallel.autoep_size=4 does not divide the world size 2"),
    ("a tensor not of the model in model_parameters", r"model_parameters holds a tensor of shape \(3,\)"),
    ("one rank's values for every rank's experts", r"GatheredParameters\(modifier_rank=0\) on shared-out expert "
                                                   r"weights \(model.layers.0.mlp.experts.gate_up_proj, ...\)"),
])
def test_bad_sizes_are_refused_on_every_rank_with_the_model_untouched(case: str, message: str) -> None:
    import re

    for got in run_ranks(2, refused_rank, case):
        assert re.search(message, got), got


def test_what_expert_shares_are_not_laid_out_for_is_refused_by_the_config() -> None:
    cases = ((config(4, mics_shard_size=2), "expert_parallel.autoep_size, zero_optimization.mics_shard_size"),
             ({**config(2), "fault_tolerance": {"enabled": True}}, "expert_parallel.autoep_size, fault_tolerance"))
    for settings, keys in cases:
        with pytest.raises(zero3.ConfigError, match=keys):
            zero3.load_config(settings)
    assert zero3.load_config(config(2, mics_shard_size=4)).expert_parallel.size == 2
    # A mesh's own shard dimension (HSDP) is held to the same: an expert-parallel group inside one shard group.
    with pytest.raises(TopologyError, match="autoep_size=4 does not divide the shard group's 2 ranks"):
        expert_group_size(4, 8, 8, shard_size=2)
    assert expert_group_size(2, 8, 8, shard_size=4) == 2
