"""Gradient memory is bounded by the configured bucket: the scratch is two buckets at most, and no
gradient outlives its arrival (each is copied into its bucket's slot and autograd's tensor is freed)."""

from __future__ import annotations

import threading
import weakref

import torch

import zero3
from tests import models
from tests.devices import ON_DEVICES, worlds_on_devices
from tests.distributed import run_ranks
from zero3.passes.grad_reducer import MIN_BUCKETS

BUCKET = 20_000  # elements: the model below has ~140k trainable elements, so several buckets


def cfg(bucket: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": bucket},
    }


def measure(rank: int, world: int, bucket: int) -> dict:
    torch.manual_seed(0)
    with zero3.Init(config=cfg(bucket)):
        model = models.TiedTransformer(vocab=256, dim=64, heads=4, layers=3)
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg(bucket))
    reducer = engine.parts.reducer
    arrived: list[weakref.ref] = []
    outlived = 0
    add = reducer.add

    def watched_add(sp, grad):  # every earlier gradient must be gone by the time the next one comes
        nonlocal outlived
        outlived += sum(ref() is not None for ref in arrived)
        arrived.append(weakref.ref(grad))
        add(sp, grad)

    reducer.add = watched_add
    for x, y in models.batches("tokens", 3, 4 * world):
        engine.backward(engine(x.chunk(world)[rank].to(engine.device), y.chunk(world)[rank].to(engine.device)))
        engine.step()
    element = torch.empty(0, dtype=reducer.dtype).element_size()
    largest = max(sp.padded_numel for sp in engine.sharded_params)
    result = {
        "scratch_bytes": engine.model_state_bytes()["contiguous_grad_buffer"],
        "bucket_bytes": -(-max(bucket, largest) // world) * world * element,
        "buckets": len(reducer.buckets),
        "slots": reducer.slots,
        "arrivals": len(arrived),
        "outlived": outlived,
        "fresh": reducer.fresh_buffers,
        "capacity_bytes": reducer.capacity * element,
        "trainable_numel": sum(sp.padded_numel for sp in engine.optimizer.params),
        "largest_bytes": largest * element,
        "largest_numel": largest,
    }
    engine.destroy()
    return result


@worlds_on_devices(1, 2)
def test_scratch_is_two_buckets_and_no_gradient_waits_for_its_bucket(world: int, device: str) -> None:
    for result in run_ranks(world, measure, BUCKET):
        assert result["buckets"] > 2 and result["slots"] == 2
        assert result["scratch_bytes"] == 2 * result["capacity_bytes"]
        assert result["capacity_bytes"] <= result["bucket_bytes"]  # never more than the configured bucket
        if world == 1:  # autograd adds each gradient into its lp_grads slot itself (zero3.passes.grad_hooks)
            assert result["arrivals"] == 0
        else:
            assert result["arrivals"] > result["buckets"]
        assert result["outlived"] == 0  # copied into the slot on arrival; autograd's tensor freed
        if world == 1:
            assert result["fresh"] == 0  # nothing in flight there: a slot is always free


@ON_DEVICES
def test_a_bucket_larger_than_the_model_still_cuts_it_in_several(device: str) -> None:
    # DeepSpeed's default bucket holds this model many times: buckets of a MIN_BUCKETS-th of it instead,
    # so reductions overlap the backward and the scratch is half the model's gradients, not all of them.
    (result,) = run_ranks(1, measure, 500_000_000)
    assert result["buckets"] >= min(MIN_BUCKETS, result["trainable_numel"] // result["largest_numel"])
    assert result["slots"] == 2
    assert result["scratch_bytes"] == 2 * result["capacity_bytes"]
    assert result["capacity_bytes"] <= -(-result["trainable_numel"] // MIN_BUCKETS) * 2 + result["largest_bytes"]
    assert result["outlived"] == 0


class _CountedWork:
    """A reduce-scatter's work that records each call of wait() (gloo's copies the reduced chunk out there)."""

    def __init__(self, work, calls: list[str]) -> None:
        self.work, self.calls = work, calls

    def wait(self, *args) -> bool:
        self.calls.append(threading.current_thread().name)
        return self.work.wait(*args)

    def is_completed(self) -> bool:
        return self.work.is_completed()


def count_waits(rank: int, world: int) -> list[list[str]]:
    torch.manual_seed(0)
    model = models.TiedTransformer(vocab=256, dim=64, heads=4, layers=3)
    engine, *_ = zero3.initialize(model=model, config=cfg(BUCKET))
    reduce = engine.parts.reducer.reduce
    start = reduce.start
    waits: list[list[str]] = []

    def counted_start(output, full):
        waits.append([])
        return _CountedWork(start(output, full), waits[-1])

    reduce.start = counted_start
    for x, y in models.batches("tokens", 2, 4 * world):
        engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
        engine.step()
    engine.destroy()
    return waits


def test_each_reduction_is_waited_on_by_one_thread() -> None:
    # gloo's reduce-scatter copies the reduced chunk into the bucket inside wait(): a second thread waiting
    # on it could still be writing into a slot already handed to the next bucket (wrong gradients, 1 run in 8).
    for waits in run_ranks(2, count_waits):
        assert len(waits) > 4
        assert all(len(calls) == 1 for calls in waits), waits


def in_place_or_copied(rank: int, world: int) -> dict:
    out = {}
    for name, extra in (("fp32", {}), ("bf16 gradients", {"data_types": {"grad_accum_dtype": "bf16"}})):
        torch.manual_seed(0)
        model = models.TiedTransformer(vocab=256, dim=64, heads=4, layers=3)
        config = {**cfg(BUCKET), "bf16": {"enabled": False}, **extra}
        engine = zero3.initialize(model=model, config=config)[0]
        taken: list[int] = []
        take = engine.optimizer._fp32_grads
        engine.optimizer._fp32_grads = lambda numel, device: taken.append(numel) or take(numel, device)
        x, y = models.batches("tokens", 1, 4 * world, seed=0)[0]
        engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
        engine.step()
        out[name] = {"in_place": engine.optimizer.grads_in_place, "sub_groups": len(engine.optimizer.sub_groups),
                     "taken": taken}
        engine.destroy()
    return out


def test_fp32_gradients_are_stepped_in_place_in_one_sub_group_other_dtypes_through_an_fp32_copy() -> None:
    # The bucket (20k elements) is smaller than the model: it capped the sub-groups when every step copied
    # its fp32 gradients into the idle bucket; stepping on the fp32 gradients themselves needs no bucket.
    for result in run_ranks(2, in_place_or_copied):
        assert result["fp32"] == {"in_place": True, "sub_groups": 1, "taken": []}, result
        copied = result["bf16 gradients"]
        assert not copied["in_place"] and copied["sub_groups"] > 1 and len(copied["taken"]) == 1, result
