"""Whole parameters in buckets (`engine.iter_weight_buckets`, `iter_full_params(bucket_bytes=)`):
bit-identical to the per-parameter stream for a resident engine, a parked one, parameters on disk
and lean memory mode, in the stored dtype and in fp32; one all-gather per bucket, the next one issued before
a bucket is handed out; a bucket the consumer holds keeps its values while the rest are gathered; on a world
of one a resident bucket is a view of the engine's own buffer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zero3
from tests import models
from tests.distributed import run_ranks
from tests.test_full_params import build
from zero3.comm import Communicator
from zero3.weights import full_params
from zero3.weights import buckets as weight_buckets

BUCKET_BYTES = 6000  # a few parameters of the small transformer per bucket, its embedding alone


def per_parameter(engine: zero3.ZeroEngine, dtype: torch.dtype | None) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.clone()) for name, tensor in engine.iter_full_params(dtype=dtype)]


def bucketed(engine: zero3.ZeroEngine, dtype: torch.dtype | None) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.clone()) for name, tensor in engine.iter_full_params(dtype=dtype, bucket_bytes=BUCKET_BYTES)]


def alike(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    """The same parameters, each once, with the same values (buckets come in storage order)."""
    x, y = dict(a), dict(b)
    return len(x) == len(a) == len(b) and x.keys() == y.keys() and all(
        x[n].dtype == y[n].dtype and x[n].shape == y[n].shape and torch.equal(x[n], y[n]) for n in x)


ALONE_FROM_BYTES = 1000  # in these ranks: the small transformer's matrices gathered alone, its vectors packed


def streams(rank: int, world: int, root: str) -> dict[str, Any]:
    weight_buckets.ALONE_FROM_BYTES = ALONE_FROM_BYTES  # (a forked rank of its own: nothing else sees it)
    out: dict[str, Any] = {}
    cases = [("fp32", "none", {}), ("bf16", "none", {}), ("bf16", "params_nvme", {}), ("bf16", "lean", {})]
    for precision, tier, _ in cases:
        if tier == "lean":
            engine, _ = build(precision, root)
            engine.destroy()
            torch.manual_seed(0)
            cfg = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                   "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
                   "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 64, "lean_memory": True}}
            engine = zero3.initialize(model=models.TiedTransformer(), config=cfg)[0]
        else:
            engine, _ = build(precision, root, tier)
        models.train_steps(engine, rank, world, models.batches("tokens", 2, 4 * world))
        for dtype in (None, torch.float32):
            out[f"{precision}/{tier}/{dtype}"] = alike(per_parameter(engine, dtype), bucketed(engine, dtype))
        if tier == "none" and precision == "bf16":
            engine.offload_states(device="nvme", nvme_path=root)  # parked: streamed from the files, left there
            out["parked"] = alike(per_parameter(engine, None), bucketed(engine, None))
            out["still parked"] = sorted(str(s.value) for s in engine.offloader.offloaded())
            engine.reload_states()
        if tier == "none" and precision == "fp32":
            out.update(bucket_behaviour(engine, world))
        engine.destroy()
    try:
        engine, _ = build("fp32", root)
        engine.iter_weight_buckets(0)
    except ValueError as error:
        out["bad size"] = str(error)
    engine.destroy()
    return out


def bucket_behaviour(engine: zero3.ZeroEngine, world: int) -> dict[str, Any]:
    """Collectives per bucket, the next gather issued before a bucket is handed out, a held bucket left
    alone, and (a world of one) no copies."""
    started = [0]
    sent: list[bool] = []  # per gather: whether this rank's shards went out as a view of the 16-bit buffer
    real = Communicator.all_gather_flat
    lp = engine.lp_buffers[0].tensor

    def counted(self: Communicator, output: torch.Tensor, shard: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        started[0] += 1
        sent.append(shard.untyped_storage().data_ptr() == lp.untyped_storage().data_ptr())
        return real(self, output, shard, *args, **kwargs)

    Communicator.all_gather_flat = counted  # type: ignore[method-assign]
    try:
        seen: list[int] = []
        buckets = []
        for index, bucket in enumerate(engine.iter_weight_buckets(BUCKET_BYTES)):
            seen.append(started[0])
            buckets.append((bucket, bucket.flat.clone()))
            if index > 0:
                bucket.release()  # all but the first, held to the end
    finally:
        Communicator.all_gather_flat = real  # type: ignore[method-assign]
    held, copy = buckets[0]
    names = [entry.name for bucket, _ in buckets for entry in bucket.entries]
    return {
        "buckets": len(buckets),
        "gathers": started[0],
        "issued ahead": seen,
        "held unchanged": torch.equal(held.flat, copy),
        "names": sorted(names) == sorted(name for name, _ in engine.iter_full_params()) and len(set(names)) == len(names),
        # Packed in storage order, every bucket's shards lie end to end in the 16-bit buffer: each sent as a
        # view of it (a world of one: each bucket is that view).
        "sent": sent,
        "events": {bucket.event for bucket, _ in buckets},
        # Buckets that are views of the engine's 16-bit buffer (a world of one, storage order: all of them).
        "views": sum(bucket.flat.untyped_storage().data_ptr() == lp.untyped_storage().data_ptr() for bucket, _ in buckets),
        "largest": max(bucket.nbytes for bucket, _ in buckets),
    }


def test_on_the_host_a_large_parameter_is_gathered_in_a_bucket_of_its_own() -> None:
    """A packed bucket's layout copy costs more than a gather of its own for a large parameter in host memory:
    one of at least `alone_from` bytes goes alone (its rank-major output is its value), the rest still packed,
    in storage order."""
    engine, _ = build("fp32", "unused")
    try:
        chosen = full_params.select(engine.module, None)  # what the stream would send, each parameter once
        sizes = {name: sp.padded_numel * 4 for name, sp in chosen}
        alone_from = max(sizes.values())  # the largest parameters go alone, the rest pack between them
        planned = weight_buckets.plan(chosen, torch.float32, 1 << 30, alone_from)
        bucket_of = {name: index for index, bucket in enumerate(planned) for name, _ in bucket}
        ordered = [name for name, _ in weight_buckets.storage_order(chosen)]
        assert [name for bucket in planned for name, _ in bucket] == ordered  # nothing reordered, none lost
        for bucket in planned:
            if any(sizes[name] >= alone_from for name, _ in bucket):
                assert len(bucket) == 1, bucket  # a large one alone
        small_pairs = [(a, b) for a, b in zip(ordered, ordered[1:]) if max(sizes[a], sizes[b]) < alone_from]
        assert small_pairs and all(bucket_of[a] == bucket_of[b] for a, b in small_pairs)  # the rest packed
        assert weight_buckets.plan(chosen, torch.float32, 1 << 30) == [weight_buckets.storage_order(chosen)]
    finally:
        engine.destroy()


@pytest.mark.parametrize("world", [1, 2])
def test_buckets_stream_the_same_weights_with_one_gather_each(world: int, tmp_path: Any) -> None:
    for out in run_ranks(world, streams, str(tmp_path)):
        for case in ("fp32/none", "bf16/none", "bf16/params_nvme", "bf16/lean"):
            for dtype in (None, torch.float32):
                assert out[f"{case}/{dtype}"] is True, (case, dtype)
        assert out["parked"] is True and "lp_params" in out["still parked"]
        assert "bucket_bytes=0" in out["bad size"]
        assert out["names"] and out["held unchanged"] and out["events"] == {None}
        count = out["buckets"]
        assert count > 2
        if world > 1:
            assert out["gathers"] == count  # one collective a bucket
            assert out["issued ahead"] == [min(k + 2, count) for k in range(count)]  # the next one in flight
            assert out["sent"] == [True] * count  # each bucket's shards sent from where they lie, uncopied
        else:
            assert out["gathers"] == 0 and out["views"] == count  # nothing to gather, nothing copied
