"""ZeRO++'s quantized collectives at 4 ranks as 2 simulated nodes of 2: qwZ (`zero_quantized_weights`,
`zero_quantized_nontrainable_weights`) and qgZ (`zero_quantized_gradients`), alone, together, and with hpZ
(qgZ within MiCS groups: the reduction test's layouts).

Judged against plain ZeRO-3 on the built-in GPT and a fixed batch: each quantized run is not
bit-identical (the keys act) and its loss ends within 10% of the plain run's; every path that keeps
weights (GatheredParameters between steps, iter_full_params, save_16bit_model) reads the shards' exact
values, never a quantized gather's. qgZ's reduction is also judged alone, against the exact sum, on
each way a shard group can sit on nodes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zero3
from tests import models
from tests.distributed import run_ranks
from zero3.models.gpt import GPT, GPTConfig

STEPS, MICRO = 20, 4


def gpt_config(zero: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 6e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


def _fixed_batch_runs(rank: int, world: int, variants: dict[str, dict], save_dir: str) -> dict:
    """Each variant trains the same GPT on the same fixed batch; the last one's kept weights are read back."""
    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2))
    zero3.init_distributed()
    tokens = torch.randint(0, 64, (MICRO * world, 33), generator=torch.Generator().manual_seed(7))[rank::world]
    out: dict = {}
    for name, zero in variants.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64))
        engine, *_ = zero3.initialize(model=model, config=gpt_config(zero))
        losses = []
        for _ in range(STEPS):
            loss = engine(tokens[:, :-1], tokens[:, 1:])["loss"]
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float().clone())
        out[name] = {"losses": losses, "codecs": sum(unit.gather.codec is not None for unit in engine.parts.units)}
        # What every path that keeps weights reads: the 16-bit shards, which are the masters rounded once.
        masters = {n: zero3.safe_get_full_fp32_param(p).to(torch.bfloat16) for n, p in model.named_parameters()}
        with zero3.GatheredParameters(list(model.parameters())):
            gathered = {n: p.detach().clone() for n, p in model.named_parameters()}
        streamed = {n: t.clone() for n, t in engine.iter_full_params()}
        engine.save_16bit_model(save_dir, f"{name}.safetensors")
        out[name]["exact"] = {
            "gathered": all(torch.equal(gathered[n], m) for n, m in masters.items()),
            "streamed": all(torch.equal(streamed[n], m) for n, m in masters.items()),
        }
        if rank == 0:
            saved = load_file(str(Path(save_dir) / f"{name}.safetensors"))
            out[name]["exact"]["saved"] = all(torch.equal(saved[n], m) for n, m in masters.items() if n in saved)
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def fixed_batch(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    variants = {
        "plain": {},
        "qwZ": {"zero_quantized_weights": True},
        "hpZ + qwZ": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2},
        "qgZ": {"zero_quantized_gradients": True},
        "hpZ + qwZ + qgZ": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                            "zero_quantized_gradients": True},
    }
    return run_ranks(4, _fixed_batch_runs, variants, str(tmp_path_factory.mktemp("saved")))


@pytest.mark.parametrize("variant", ["qwZ", "qgZ", "hpZ + qwZ + qgZ"])
def test_quantized_collectives_converge_within_ten_percent_of_plain_zero3(fixed_batch: list[dict], variant: str) -> None:
    for result in fixed_batch:
        plain, quantized = result["plain"], result[variant]
        assert plain["codecs"] == 0 and (quantized["codecs"] > 0) == ("qwZ" in variant)
        assert any(not torch.equal(a, b) for a, b in zip(quantized["losses"], plain["losses"]))  # the keys act
        first, last, reference = quantized["losses"][0].item(), quantized["losses"][-1].item(), plain["losses"][-1].item()
        assert last < 0.5 * first  # it learns the batch
        assert abs(last - reference) <= 0.10 * reference, (variant, last, reference)


def test_hpz_with_quantized_gathers_trains_as_quantized_gathers_alone(fixed_batch: list[dict]) -> None:
    """The backward gathers from the secondary shards, which hold what the forward's quantized gather
    decoded: the very values the backward would decode again from a quantized gather."""
    for result in fixed_batch:
        for a, b in zip(result["hpZ + qwZ"]["losses"], result["qwZ"]["losses"]):
            assert torch.equal(a, b)


def test_every_path_that_keeps_weights_reads_them_exactly(fixed_batch: list[dict]) -> None:
    for result in fixed_batch:
        for name in ("qwZ", "hpZ + qwZ", "hpZ + qwZ + qgZ"):
            assert result[name]["exact"]["gathered"] and result[name]["exact"]["streamed"]
            assert fixed_batch[0][name]["exact"]["saved"]


def _modifier_inside_forward(rank: int, world: int) -> dict:
    zero3.init_distributed()
    torch.manual_seed(0)
    model = models.MLP()
    engine, *_ = zero3.initialize(model=model, config=gpt_config({"zero_quantized_weights": True}))
    x, y = models.batches("x8", 1, MICRO * world)[0]

    def edit_fc1(*_: object) -> None:
        with zero3.GatheredParameters(model.fc1.weight, modifier_rank=0):
            model.fc1.weight.data.zero_()

    handle = model.fc2.register_forward_pre_hook(edit_fc1)
    before = zero3.safe_get_full_fp32_param(model.fc1.weight).clone()
    try:
        engine(x.chunk(world)[rank].bfloat16(), y.chunk(world)[rank].bfloat16())
        error = "no error"
    except RuntimeError as raised:
        error = str(raised)
    engine.zero_grad()
    handle.remove()
    unchanged = torch.equal(zero3.safe_get_full_fp32_param(model.fc1.weight), before)
    # between steps the same block gathers exactly, and its edit is kept as written
    with zero3.GatheredParameters(model.fc1.weight, modifier_rank=0):
        model.fc1.weight.data.add_(1.0)
    edited = zero3.safe_get_full_fp32_param(model.fc1.weight)
    kept = torch.equal(edited, (before.to(torch.bfloat16) + 1.0).float())
    engine.destroy()
    return {"error": error, "unchanged": unchanged, "kept": kept}


def test_a_modifier_inside_a_quantized_forward_is_refused_and_between_steps_writes_exact_values() -> None:
    for result in run_ranks(2, _modifier_inside_forward):
        assert "inside a forward or backward under zero_quantized_weights" in result["error"], result["error"]
        assert result["unchanged"] and result["kept"]


def _frozen_units(rank: int, world: int) -> dict:
    zero3.init_distributed()
    torch.manual_seed(0)
    model = models.FrozenFirstLayer()
    engine, *_ = zero3.initialize(model=model, config=gpt_config({"zero_quantized_nontrainable_weights": True}))
    quantized = sorted(sp.name for unit in engine.parts.units if unit.gather.codec is not None for sp in unit.params)
    losses = []
    for x, y in models.batches("x8", 4, MICRO * world):
        loss = engine(x.chunk(world)[rank].bfloat16(), y.chunk(world)[rank].bfloat16())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return {"quantized": quantized, "losses": losses}


def test_quantized_nontrainable_weights_quantize_the_frozen_units_gathers_only() -> None:
    for result in run_ranks(2, _frozen_units):
        assert result["quantized"] == ["frozen.bias", "frozen.weight"]
        assert all(torch.isfinite(torch.tensor(result["losses"])))


def _reduce_alone(rank: int, world: int, local_world: int, mics: int, bits: int) -> dict:
    """qgZ's reduction of one bucket, against the exact sum of every rank's chunk for this rank."""
    from zero3.comm import Communicator
    from zero3.partition.collectives import QuantizedGradReduce
    from zero3.partition.quantize import BlockQuantizer
    from zero3.topology import Topology

    os.environ.update(LOCAL_WORLD_SIZE=str(local_world), GROUP_RANK=str(rank // local_world))
    zero3.init_distributed()
    topology = Topology.build(torch.device("cpu"), mics_shard_size=mics, quantized_gradients=True)
    comm = Communicator(topology)
    assert topology.grads_inside is not None and topology.grads_across is not None
    inside, across = topology.grads_inside.shard_size, topology.grads_across.shard_size
    shard, size = topology.shard, topology.shard.shard_size
    numel = 700  # three blocks and a part, per chunk

    def bucket(job_rank: int) -> torch.Tensor:
        return torch.randn(size * numel, generator=torch.Generator().manual_seed(job_rank)) * (1 + job_rank)

    full = bucket(rank).bfloat16()
    reduce = QuantizedGradReduce(shard, comm, inside, across, BlockQuantizer(bits=bits))
    output = reduce.own_chunk(full, numel)
    reduce.start(output, full).wait()
    group_ranks = [rank - shard.shard_rank + r for r in range(size)]  # the shard group's job ranks
    exact = sum(bucket(r).bfloat16().float().narrow(0, shard.shard_rank * numel, numel) for r in group_ranks)
    reduce.close()
    comm.close()
    return {"inside": inside, "across": across, "error": ((output.float() - exact).norm() / exact.norm()).item()}


@pytest.mark.parametrize(("local_world", "mics", "layout"), [
    (2, -1, (2, 2)),  # two nodes of two: inside, then across
    (1, -1, (1, 4)),  # a rank per node: across only
    (4, -1, (4, 1)),  # one node: inside only
    (2, 2, (2, 1)),  # MiCS groups of a node each: inside only, per group
])
def test_qgz_reduction_is_the_sum_within_its_quantization_error(local_world: int, mics: int, layout: tuple) -> None:
    int4 = run_ranks(4, _reduce_alone, local_world, mics, 4)
    for coarse in int4:
        assert (coarse["inside"], coarse["across"]) == layout
        # quantized (int4 rounds gaussian data to ~12% rms error at each of two steps)
        assert 0 < coarse["error"] < 0.3, coarse
    if layout == (2, 2):  # and by the bits asked (the suite's time: one layout)
        for coarse, fine in zip(int4, run_ranks(4, _reduce_alone, local_world, mics, 8)):
            assert 0 < fine["error"] < 0.02 and fine["error"] < coarse["error"], (fine, coarse)


def _quantized_with_tiers(rank: int, world: int, nvme: str) -> dict:
    """All of ZeRO++, with and without every state on disk (and parked there once, between two steps)."""
    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2))
    zero3.init_distributed()
    zeropp = {"zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2}
    on_disk = {"offload_optimizer": {"device": "nvme", "nvme_path": nvme},
               "offload_param": {"device": "nvme", "nvme_path": nvme}}
    out: dict = {}
    for name, zero in (("in memory", zeropp), ("on disk", {**zeropp, **on_disk})):
        torch.manual_seed(0)
        model = models.MLP()
        engine, *_ = zero3.initialize(model=model, config=gpt_config(zero))
        losses, parked_exactly = [], None
        for step, (x, y) in enumerate(models.batches("x8", 4, MICRO * world)):
            if step == 2 and name == "on disk":
                before = {n: zero3.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
                engine.offload_states(device="nvme", nvme_path=nvme)
                engine.reload_states()
                parked_exactly = all(torch.equal(zero3.safe_get_full_fp32_param(p), before[n])
                                     for n, p in model.named_parameters())
            loss = engine(x.chunk(world)[rank].bfloat16(), y.chunk(world)[rank].bfloat16())
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float().clone())
        out[name] = {"losses": losses, "parked_exactly": parked_exactly,
                     "params": {n: zero3.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}}
        engine.destroy()
    return out


def test_all_of_zeropp_with_every_state_on_disk_trains_as_in_memory_and_parks_exactly(tmp_path: Path) -> None:
    """A tier moves the states, not the arithmetic: the quantized run with its parameters and optimizer on
    disk (its shards quantized as they come in from the file) is the in-memory quantized run, bit for bit."""
    for result in run_ranks(4, _quantized_with_tiers, str(tmp_path)):
        assert result["on disk"]["parked_exactly"] is True
        for a, b in zip(result["on disk"]["losses"], result["in memory"]["losses"]):
            assert torch.equal(a, b)
        for name, value in result["in memory"]["params"].items():
            assert torch.equal(result["on disk"]["params"][name], value), name
