#!/usr/bin/env python
"""By-hand benchmark of weight delivery to a generator process (issue 44): seconds to hand every weight of a
model from the training ranks to a receiver process on this machine, per way, beside the lower bound.

Not a test: nothing here asserts on timings. `--nproc` training ranks (gloo, one process each, launched with
torch's elastic launcher) build the same GPT (seed 0, `--precision`), and rank 0 starts a receiver process
(`zero3.weights.SharedMemoryReceiver`) that iterates every delivered `(name, tensor)` (views of shared memory:
what a generator's `load_weights` copies from). Each way runs `--repeats` times, interleaved:

* ``buckets``        -- `SharedMemorySender(bucket_bytes=--bucket-mib)`: bucketed, two in flight;
* ``per parameter``  -- the same sender with one parameter per bucket: one all-gather per parameter, as
                        `iter_full_params()` streams today;
* ``broadcast``      -- `BroadcastSender` to one generator rank in another process (a `sync_group` of
                        training rank 0 and it, gloo over loopback), in the same buckets;
* ``in-process``     -- `iter_full_params(bucket_bytes=...)` iterated on the training ranks, no transport
                        (what `zero3.weights.load_into` costs before its copies).

The lower bound is the model's bytes over this machine's memory copy rate (one `copy_` of that many bytes,
measured in the same run): what one copy into shared memory costs. From more than one rank the weights
must be all-gathered first: the table also gives one all-gather of the whole model on these ranks (gloo
over loopback here) and the bucketed time over that plus the copy. Each model is run in turn (`--models`);
the table gives medians, the ratio to the lower bound and the per-parameter way's time over the bucketed one
(issue 44's goals: within 1.5x of the bound, and at least 5x faster than per-parameter streaming on a model
of a few hundred parameters).

    python benchmarks/weight_sync.py                        # ~3 min here
    python benchmarks/weight_sync.py --models 2x128 --repeats 1   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from provenance import write_run  # benchmarks/provenance.py, beside this script
from zero3.models.gpt import GPT, GPTConfig

_REPO = Path(__file__).resolve().parent.parent
_DEFAULT_OUT = _REPO / "benchmarks" / "results" / "weight_sync.json"
AUTHKEY = b"zero3-weight-sync-benchmark"
RECEIVER = """
import sys
from zero3.weights import SharedMemoryReceiver
receiver = SharedMemoryReceiver((sys.argv[1], int(sys.argv[2])), authkey=%r)
while not receiver.closed:
    for _ in receiver.receive():
        pass
receiver.close()
""" % AUTHKEY
# A generator rank reached by broadcast: rank 1 of a group with training rank 0.
BROADCAST_RECEIVER = """
import sys
from zero3.weights import BroadcastReceiver, sync_group
receiver = BroadcastReceiver(sync_group(sys.argv[1], int(sys.argv[2]), 1, 2))
while not receiver.closed:
    for _ in receiver.receive():
        pass
receiver.close()
"""


def shape(text: str) -> GPTConfig:
    layers, width = (int(part) for part in text.lower().split("x"))
    return GPTConfig(vocab_size=256, block_size=128, n_layer=layers, n_head=max(1, width // 64), n_embd=width)


def copy_rate(nbytes: int) -> float:
    """This machine's memory copy rate, bytes/s: the median of 5 copies of `nbytes`."""
    source, target = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times)


def gather_time(nbytes: int, world: int, dtype: torch.dtype) -> float:
    """Seconds of one all-gather of `nbytes` in all (each rank's 1/world of it), the median of 3."""
    if world == 1:
        return 0.0
    shard = torch.ones(-(-nbytes // (world * dtype.itemsize)), dtype=dtype)
    output = torch.empty(world * shard.numel(), dtype=dtype)
    times = [timed(lambda: dist.all_gather_single(output, shard)) for _ in range(3)]
    return statistics.median(times)


def timed(fn: Any) -> float:
    dist.barrier()
    started = time.perf_counter()
    fn()
    seconds = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def worker(args: dict[str, Any]) -> dict[str, Any]:
    import zero3
    from tests.distributed import free_port, script_env
    from zero3.partition.sharded_param import sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for text in args["models"]:
        cfg = shape(text)
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                  "bf16": {"enabled": args["precision"] == "bf16"}}
        torch.manual_seed(0)
        engine = zero3.initialize(model=GPT(cfg), config=config, device="cpu")[0]
        bucket = int(args["bucket_mib"] * 2**20)
        senders: dict[str, Any] = {
            "buckets": zero3.weights.SharedMemorySender(engine, ("127.0.0.1", 0), AUTHKEY, bucket_bytes=bucket),
            "per parameter": zero3.weights.SharedMemorySender(engine, ("127.0.0.1", 0), AUTHKEY, bucket_bytes=1),
        }
        receivers = []
        group = None
        if rank == 0:
            for sender in senders.values():
                host, port = sender.address
                receivers.append(subprocess.Popen([sys.executable, "-c", RECEIVER, host, str(port)],
                                                  env=script_env(str(_REPO))))
            port = free_port()
            receivers.append(subprocess.Popen([sys.executable, "-c", BROADCAST_RECEIVER, "127.0.0.1", str(port)],
                                              env=script_env(str(_REPO))))
            group = zero3.weights.sync_group("127.0.0.1", port, 0, 2)
        broadcaster = zero3.weights.BroadcastSender(engine, group, bucket_bytes=bucket)
        senders["broadcast"] = broadcaster
        rows: dict[str, list[float]] = {"buckets": [], "per parameter": [], "broadcast": [], "in-process": []}
        for sender in senders.values():  # untimed: the receiver connects, the segments are made
            sender.send()
        for _ in range(args["repeats"]):
            for way, sender in senders.items():
                rows[way].append(timed(sender.send))
            rows["in-process"].append(timed(lambda: sum(1 for _ in engine.iter_full_params(bucket_bytes=bucket))))
        # The whole model's bytes (a partitioned parameter's own tensor is a placeholder: count its full size).
        nbytes = sum(sharded(p).numel for p in engine.module.parameters()) * engine.compute_dtype.itemsize
        tensors = len(list(engine.module.parameters()))
        # The all-gather of the whole model in one collective, on these ranks: what any delivery from
        # sharded ranks pays before the copy (0 at one rank).
        gather_s = gather_time(nbytes, dist.get_world_size(), engine.compute_dtype)
        for sender in senders.values():
            sender.close()  # the receivers stop
        for receiver in receivers:
            receiver.wait(timeout=60)
        engine.destroy()
        results[text] = {"rows": rows, "bytes": nbytes, "tensors": tensors, "copy_rate": copy_rate(nbytes),
                         "gather_s": gather_s}
    dist.destroy_process_group()
    return results


def launch(args: dict[str, Any]) -> dict[int, dict[str, Any]]:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=args["nproc"], rdzv_backend="c10d", rdzv_endpoint="localhost:0",
        run_id=f"wsync-{uuid.uuid4().hex[:8]}", max_restarts=0, monitor_interval=0.2,
        logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(prefix="zero3-wsync-"), redirects={1: Std.ALL}),
    )
    return elastic_launch(config, worker)(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="24x64,6x512,12x1024",
                        help="GPT shapes, layers x width, comma-separated (24x64: 292 small tensors)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--bucket-mib", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=_DEFAULT_OUT)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(_REPO))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))
    job = {"models": args.models.split(","), "nproc": args.nproc, "precision": args.precision,
           "bucket_mib": args.bucket_mib, "repeats": args.repeats}
    results = launch(job)[0]
    print(f"{args.nproc} training ranks (gloo), {args.precision}, buckets of {args.bucket_mib:g} MiB; medians of "
          f"{args.repeats}; lower bound = bytes / this machine's copy rate")
    print(f"{'model':>9} {'tensors':>8} {'MiB':>8} {'copy s':>8} {'gather s':>9} {'buckets s':>10} {'x copy':>7} "
          f"{'x gather+copy':>14} {'per-param s':>12} {'per-param / buckets':>20} {'broadcast s':>12} "
          f"{'in-process s':>13}")
    figures = {}
    for model, found in results.items():
        medians = {way: statistics.median(times) for way, times in found["rows"].items()}
        bound = found["bytes"] / found["copy_rate"]
        with_gather = bound + found["gather_s"]
        figures[model] = {**found, "medians": medians, "bound_s": bound,
                          "buckets_over_bound": medians["buckets"] / bound,
                          "buckets_over_gather_and_copy": medians["buckets"] / with_gather,
                          "per_parameter_over_buckets": medians["per parameter"] / medians["buckets"]}
        print(f"{model:>9} {found['tensors']:>8} {found['bytes'] / 2**20:>8.1f} {bound:>8.4f} {found['gather_s']:>9.4f} "
              f"{medians['buckets']:>10.4f} {medians['buckets'] / bound:>7.2f} {medians['buckets'] / with_gather:>14.2f} "
              f"{medians['per parameter']:>12.4f} {medians['per parameter'] / medians['buckets']:>20.2f} "
              f"{medians['broadcast']:>12.4f} {medians['in-process']:>13.4f}")
    write_run(args.json, "weight_sync", args, models=figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
