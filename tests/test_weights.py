"""Weights to a generator (`zero3.weights`): a receiver process on this machine gets every weight
bit-identical to `iter_full_params` over shared memory, at 1 and 2 training ranks, fp32 and bf16, from a
resident engine, a parked one and one with its parameters on disk, twice (training in between); a module in
the same process gets them through `load_into`, tied weights once, and a name that does not fit is refused on
every rank before anything is gathered; a Hugging Face model loaded that way generates the same tokens as one
loaded from `save_16bit_model`'s files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import zero3
from tests import models
from tests.distributed import run_ranks, script_env
from tests.test_full_params import build

REPO = str(Path(__file__).resolve().parent.parent)
AUTHKEY = b"zero3-test"
BUCKET_BYTES = 6000
RECEIVER = """
import sys
from safetensors.torch import save_file
from zero3.weights import SharedMemoryReceiver

host, port, out, deliveries = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
receiver = SharedMemoryReceiver((host, port), authkey=b"zero3-test")
for k in range(deliveries):
    save_file({name: tensor.clone() for name, tensor in receiver.receive()}, f"{out}.{k}")
receiver.close()
"""


def reference(engine: zero3.ZeroEngine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in engine.iter_full_params()}


def same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    """The same names, and each tensor equal in value and dtype."""
    return sorted(got) == sorted(expected) and all(
        torch.equal(got[n], expected[n]) and got[n].dtype == expected[n].dtype for n in expected)


def deliver(rank: int, world: int, root: str, precision: str, tier: str, park: bool) -> dict[str, Any]:
    """Two deliveries to a receiver process rank 0 starts, a training step between them."""
    from safetensors.torch import load_file

    engine, _ = build(precision, root, tier)
    sender = zero3.weights.SharedMemorySender(engine, ("127.0.0.1", 0), AUTHKEY, bucket_bytes=BUCKET_BYTES)
    out = os.path.join(root, f"received-{precision}-{tier}-{park}")
    receiver = None
    if rank == 0:
        host, port = sender.address
        receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, host, str(port), out, "2"], env=script_env(REPO))
    expected, sent = [], []
    for k in range(2):
        models.train_steps(engine, rank, world, models.batches("tokens", 1, 4 * world, seed=k))
        if park:
            engine.offload_states(device="nvme", nvme_path=root)
        expected.append(reference(engine))
        sent.append(sender.send())
        if park:
            engine.reload_states()
    sender.close()
    engine.destroy()
    if receiver is None:
        return {"sent": sent}
    code = receiver.wait(timeout=120)
    got = [load_file(f"{out}.{k}") for k in range(2)]
    return {
        "sent": sent,
        "code": code,
        "alike": [same_weights(g, e) for g, e in zip(got, expected)],
        "changed": not all(torch.equal(got[0][n], got[1][n]) for n in got[0]),
    }


@pytest.mark.parametrize("world, precision, tier, park", [
    (1, "fp32", "none", False),
    (2, "bf16", "none", False),
    (2, "bf16", "none", True),
    (2, "fp32", "params_nvme", False),
])
def test_a_receiver_process_gets_every_weight_over_shared_memory(
    world: int, precision: str, tier: str, park: bool, tmp_path: Path,
) -> None:
    results = run_ranks(world, deliver, str(tmp_path), precision, tier, park)
    first = results[0]
    assert first["code"] == 0
    assert first["alike"] == [True, True] and first["changed"]
    assert all(sent > 0 for sent in first["sent"])
    assert all(result["sent"] == [0, 0] for result in results[1:])  # only rank 0 sends


BROADCAST_RECEIVER = """
import sys
from safetensors.torch import save_file
from zero3.weights import BroadcastReceiver, sync_group

host, port, rank, size, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
receiver = BroadcastReceiver(sync_group(host, port, rank, size))
for k in range(2):
    save_file({name: tensor.clone() for name, tensor in receiver.receive()}, f"{out}.{k}")
closed = not list(receiver.receive()) and receiver.closed  # the sender closed
receiver.close()
sys.exit(0 if closed else 3)
"""


def broadcast(rank: int, world: int, root: str, precision: str) -> dict[str, Any]:
    """Two deliveries by broadcast to two generator processes (ranks 1 and 2 of a group with training rank 0)."""
    from safetensors.torch import load_file

    from tests.distributed import free_port

    engine, _ = build(precision, root)
    out = os.path.join(root, f"broadcast-{precision}")
    receivers, group = [], None
    if rank == 0:
        port = free_port()
        receivers = [subprocess.Popen([sys.executable, "-c", BROADCAST_RECEIVER, "127.0.0.1", str(port), str(r), "3",
                                       f"{out}-{r}"], env=script_env(REPO)) for r in (1, 2)]
        group = zero3.weights.sync_group("127.0.0.1", port, 0, 3)
    sender = zero3.weights.BroadcastSender(engine, group, bucket_bytes=BUCKET_BYTES)
    expected, sent = [], []
    for k in range(2):
        models.train_steps(engine, rank, world, models.batches("tokens", 1, 4 * world, seed=k))
        expected.append(reference(engine))
        sent.append(sender.send())
    sender.close()
    engine.destroy()
    if rank != 0:
        return {"sent": sent}
    codes = [receiver.wait(timeout=120) for receiver in receivers]
    got = [[load_file(f"{out}-{r}.{k}") for k in range(2)] for r in (1, 2)]
    return {
        "sent": sent, "codes": codes,
        "alike": [same_weights(g, e) for received in got for g, e in zip(received, expected)],
    }


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_generator_ranks_get_every_weight_by_broadcast(precision: str, tmp_path: Path) -> None:
    results = run_ranks(2, broadcast, str(tmp_path), precision)
    first = results[0]
    assert first["codes"] == [0, 0]
    assert first["alike"] == [True] * 4
    assert all(sent > 0 for sent in first["sent"]) and results[1]["sent"] == [0, 0]


def in_process(rank: int, world: int, root: str) -> dict[str, Any]:
    engine, _ = build("bf16", root)
    models.train_steps(engine, rank, world, models.batches("tokens", 2, 4 * world))
    torch.manual_seed(123)
    generator = models.TiedTransformer().to(torch.bfloat16)
    out: dict[str, Any] = {}
    copied = zero3.weights.load_into(engine, generator, bucket_bytes=BUCKET_BYTES)
    expected = reference(engine)
    theirs = dict(generator.named_parameters())
    out["copied"] = (copied, len(expected))
    out["alike"] = all(torch.equal(theirs[name], value) for name, value in expected.items())
    out["tied"] = generator.head.weight is generator.embed.weight
    # A rank without a generator only takes part in the gathers.
    out["none"] = zero3.weights.load_into(engine, generator if rank == 0 else None, bucket_bytes=BUCKET_BYTES)
    # A name the generator lacks, on one rank only: every rank raises before anything is gathered.
    before = {name: p.clone() for name, p in generator.named_parameters()}
    bad = {"pos": "position"} if rank == world - 1 else None
    try:
        zero3.weights.load_into(engine, generator, name_map=bad)
    except ValueError as error:
        out["refused"] = str(error)
    out["untouched"] = all(torch.equal(before[name], p) for name, p in generator.named_parameters())
    # A callable map that leaves a parameter out, with strict=False.
    out["partial"] = zero3.weights.load_into(engine, generator, name_map=lambda n: None if n == "pos" else n,
                                             strict=False)
    engine.destroy()
    return out


def test_load_into_a_module_in_process(tmp_path: Path) -> None:
    results = run_ranks(2, in_process, str(tmp_path))
    for rank, out in enumerate(results):
        copied, total = out["copied"]
        assert copied == total and out["alike"] and out["tied"]
        assert out["none"] == (total if rank == 0 else 0)
        assert "position" in out["refused"] and out["untouched"], out
        assert out["partial"] == total - 1


def generated_both_ways(rank: int, world: int, root: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    trained = LlamaForCausalLM(config)
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine = zero3.initialize(model=trained, config=cfg)[0]
    batch = torch.randint(0, 64, (2 * world, 16), generator=torch.Generator().manual_seed(3))
    mine = batch.chunk(world)[rank]
    for _ in range(3):
        engine.backward(engine(input_ids=mine, labels=mine).loss)
        engine.step()
    # The generator: a model of its own in this process (rank 0's), in the training dtype.
    generator = LlamaForCausalLM(config).to(torch.bfloat16).eval() if rank == 0 else None
    copied = zero3.weights.load_into(engine, generator, bucket_bytes=4000)
    engine.save_16bit_model(os.path.join(root, "saved"))
    if rank == 0:
        config.save_pretrained(os.path.join(root, "saved"))
    engine.comm.barrier()
    engine.destroy()
    if generator is None:
        return {}
    loaded = LlamaForCausalLM.from_pretrained(os.path.join(root, "saved"), dtype=torch.bfloat16).eval()
    prompt = batch[:2, :5]
    tokens = [model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0) for model in (generator, loaded)]
    weights_equal = all(torch.equal(a, b) for a, b in zip(generator.state_dict().values(), loaded.state_dict().values()))
    return {"copied": copied, "tokens": tokens, "weights_equal": weights_equal,
            "tied": generator.lm_head.weight is generator.model.embed_tokens.weight}


def test_a_hugging_face_model_loaded_in_process_generates_what_save_16bit_model_gives(tmp_path: Path) -> None:
    result = run_ranks(2, generated_both_ways, str(tmp_path))[0]
    assert result["tied"] and result["weights_equal"], result
    in_process, from_files = result["tokens"]
    assert in_process.shape == (2, 5 + 24) and torch.equal(in_process, from_files)
