#!/usr/bin/env python
"""By-hand benchmark: the bytes each rank sends per step inside and across nodes (issue 41's target).

Not a test: nothing here asserts. Four ranks (gloo, one process each) run as 2 simulated nodes of 2
(`LOCAL_WORLD_SIZE=2`, `GROUP_RANK`), train the built-in GPT in bf16 for `--steps` steps after one
warmup step, and count every collective the engine issues, at the engine's `Communicator`: its kind,
the bytes of the whole tensor, and the ranks of its group. Per collective, each rank's sent bytes are
split by destination (a peer on its own node, or on another):

* all-gather, reduce-scatter of N bytes over g ranks: the rank sends N/g to each of the g - 1 others
  (an all-gather's N is the gathered wire buffer: int8 blocks and their scales under qwZ);
* all-to-all of the N bytes this rank sends (qgZ): N/g to each of the g - 1 others;
* all-reduce: a reduce-scatter then an all-gather, twice that.

(The volume an exchange's algorithm must move; a ring or tree moves the same total, routed differently.)
The same count, with the same collectives re-laid on 8 nodes of 8 (each group by its role: the shard
group, the replicas, the whole job), gives the 64-rank figures. Variants: plain ZeRO-3 (one shard group
of every rank), MiCS with a shard group per node (`mics_shard_size` = ranks per node), hpZ with a
secondary group per node (`zero_hpz_partition_size` = ranks per node: the backward gathers on the node),
and all three ZeRO++ parts (hpZ, qwZ's int8 weight gathers, qgZ's int4 all-to-all gradient reduction).
M is the model's 16-bit bytes; the paper counts ZeRO-3's cross-node volume per step as 3M (two weight
all-gathers and one gradient reduce-scatter), hpZ's as 2M, all three ZeRO++ parts' as 0.75M.
Also the median step time of each variant at 2 x 2 here.

    python benchmarks/comm_volume.py                    # ~1 min here
    python benchmarks/comm_volume.py --steps 1 --n-layer 1 --n-embd 64   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_REPO = Path(__file__).resolve().parent.parent
_DEFAULT_OUT = _REPO / "benchmarks" / "results" / "comm_volume.json"
MIB = 2**20
RANKS_PER_NODE, NODES = 2, 2
BIG_RANKS_PER_NODE, BIG_NODES = 8, 8
# Each variant's keys at 2 x 2, and at 8 x 8 (where a node is 8 ranks).
VARIANTS: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "plain ZeRO-3": ({}, {}),
    "MiCS, a shard group per node": ({"mics_shard_size": RANKS_PER_NODE}, {"mics_shard_size": BIG_RANKS_PER_NODE}),
    "hpZ, a secondary group per node": ({"zero_hpz_partition_size": RANKS_PER_NODE},
                                        {"zero_hpz_partition_size": BIG_RANKS_PER_NODE}),
    "hpZ + qwZ + qgZ (ZeRO++)": (
        {"zero_hpz_partition_size": RANKS_PER_NODE, "zero_quantized_weights": True, "zero_quantized_gradients": True},
        {"zero_hpz_partition_size": BIG_RANKS_PER_NODE, "zero_quantized_weights": True,
         "zero_quantized_gradients": True}),
}
PAPER_CROSS_NODE_M = {"plain ZeRO-3": 3.0, "hpZ": 2.0, "hpZ + qwZ + qgZ": 0.75}


@dataclass(frozen=True)
class Collective:
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all
    role: str  # shard | replicate | secondary | grads_inside | grads_across | job: the group, by its use
    nbytes: int  # the whole tensor (the gathered output, the reduced input, the summed tensor)
    per_shard: bool = False  # a tensor of this rank's shard (the replicas' gradient sum): 1/shard group size
    # qgZ's step across sends this rank's node-summed part of a bucket: 1/(the shard group's ranks per node)
    per_node: bool = False


def sent_bytes(kind: str, nbytes: float, group: list[int], rank: int, ranks_per_node: int) -> tuple[float, float]:
    """(to peers on this rank's node, to peers on other nodes) for one collective (see the docstring)."""
    g = len(group)
    if g == 1:
        return 0.0, 0.0
    per_peer = nbytes / g * (2 if kind == "all_reduce" else 1)
    node = rank // ranks_per_node
    same = sum(1 for peer in group if peer != rank and peer // ranks_per_node == node)
    return per_peer * same, per_peer * (g - 1 - same)


def group_of(role: str, rank: int, world: int, shard_size: int, secondary_size: int = 1,
             ranks_per_node: int = 1) -> list[int]:
    """The ranks of `rank`'s group of a role, in the engine's layout (shard groups, and hpZ's secondary
    groups, of consecutive ranks; qgZ's groups cut the shard group by node: zero3.topology)."""
    if role in ("grads_inside", "grads_across"):
        from zero3.shard_mesh import qgz_inside_size

        inside = qgz_inside_size(shard_size, ranks_per_node)
        start = rank // shard_size * shard_size
        if role == "grads_inside":
            first = rank // inside * inside
            return list(range(first, first + inside))
        return list(range(start + (rank - start) % inside, start + shard_size, inside))
    if role in ("shard", "secondary"):
        size = shard_size if role == "shard" else secondary_size
        start = rank // size * size
        return list(range(start, start + size))
    if role == "replicate":
        return list(range(rank % shard_size, world, shard_size))
    return list(range(world))


def volumes(collectives: list[Collective], world: int, ranks_per_node: int, shard_size: int,
            recorded_shard_size: int, secondary_size: int = 1, recorded_inside: int = 1) -> dict[str, float]:
    """Rank 0's bytes sent per step inside and across nodes (the mean over ranks is the same here), the
    collectives recorded at `recorded_shard_size` re-laid on `world` ranks in shard groups of `shard_size`
    (and hpZ's secondary groups of `secondary_size`; qgZ's were `recorded_inside` ranks per node)."""
    from zero3.shard_mesh import qgz_inside_size

    inside = across = 0.0
    for c in collectives:
        nbytes = c.nbytes * recorded_shard_size / shard_size if c.per_shard else c.nbytes
        if c.per_node:
            nbytes = nbytes * recorded_inside / qgz_inside_size(shard_size, ranks_per_node)
        group = group_of(c.role, 0, world, shard_size, secondary_size, ranks_per_node)
        a, b = sent_bytes(c.kind, nbytes, group, 0, ranks_per_node)
        inside, across = inside + a, across + b
    return {"inside_bytes": inside, "across_bytes": across}


# ---- the ranks ----------------------------------------------------------------------------------------
def _record(collectives: list[Collective], recording: list[bool]) -> None:
    """Count at the Communicator: every parameter gather, gradient reduction and replica sum."""
    from zero3.comm import Communicator

    def size(tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    originals = {name: getattr(Communicator, name) for name in ("all_gather_flat", "all_gather_secondary",
                                                                 "reduce_scatter_flat", "all_reduce_replicas",
                                                                 "all_reduce_sum", "all_to_all_grads")}

    def all_gather_flat(self, output, shard, async_op=False):  # type: ignore[no-untyped-def]
        if recording[0] and not self.alone:
            collectives.append(Collective("all_gather", "shard", size(output)))
        return originals["all_gather_flat"](self, output, shard, async_op)

    def all_gather_secondary(self, output, shard, async_op=False):  # type: ignore[no-untyped-def]
        if recording[0]:
            collectives.append(Collective("all_gather", "secondary", size(output)))
        return originals["all_gather_secondary"](self, output, shard, async_op)

    def all_to_all_grads(self, output, sent, across):  # type: ignore[no-untyped-def]
        if recording[0]:
            collectives.append(Collective("all_to_all", "grads_across" if across else "grads_inside", size(sent),
                                          per_node=across))
        return originals["all_to_all_grads"](self, output, sent, across)

    def reduce_scatter_flat(self, output, full, async_op=False):  # type: ignore[no-untyped-def]
        if recording[0] and not self.alone:
            collectives.append(Collective("reduce_scatter", "shard", size(full)))
        return originals["reduce_scatter_flat"](self, output, full, async_op)

    def all_reduce_replicas(self, tensor):  # type: ignore[no-untyped-def]
        if recording[0] and self.topology is not None and self.topology.shard.replicate_size > 1:
            collectives.append(Collective("all_reduce", "replicate", size(tensor), per_shard=True))
        return originals["all_reduce_replicas"](self, tensor)

    def all_reduce_sum(self, tensor):  # type: ignore[no-untyped-def]
        if recording[0] and not self.alone:
            collectives.append(Collective("all_reduce", "shard", size(tensor)))
        return originals["all_reduce_sum"](self, tensor)

    Communicator.all_gather_flat = all_gather_flat  # type: ignore[method-assign]
    Communicator.all_gather_secondary = all_gather_secondary  # type: ignore[method-assign]
    Communicator.reduce_scatter_flat = reduce_scatter_flat  # type: ignore[method-assign]
    Communicator.all_to_all_grads = all_to_all_grads  # type: ignore[method-assign]
    Communicator.all_reduce_replicas = all_reduce_replicas  # type: ignore[method-assign]
    Communicator.all_reduce_sum = all_reduce_sum  # type: ignore[method-assign]


def _worker(args: argparse.Namespace, zero: dict[str, Any], out_dir: str) -> None:
    import zero3
    from zero3.models.gpt import GPT, GPTConfig

    rank = int(os.environ["RANK"])
    os.environ.update(LOCAL_WORLD_SIZE=str(RANKS_PER_NODE), GROUP_RANK=str(rank // RANKS_PER_NODE))
    torch.set_num_threads(1)
    zero3.init_distributed()
    collectives: list[Collective] = []
    recording = [False]
    _record(collectives, recording)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    engine, *_ = zero3.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    })
    generator = torch.Generator().manual_seed(rank)
    times = []
    for step in range(1 + args.steps):
        tokens = torch.randint(0, 256, (args.micro_batch, args.block_size + 1), generator=generator)
        recording[0] = step > 0
        dist.barrier()
        start = time.perf_counter()
        loss = engine(tokens[:, :-1], tokens[:, 1:])["loss"]
        engine.backward(loss)
        engine.step()
        dist.barrier()
        if step > 0:
            times.append(time.perf_counter() - start)
    recording[0] = False
    result = {"collectives": [c.__dict__ for c in collectives], "times": times, "params": params,
              "shard_size": engine.mesh.shard_size, "replicas": engine.mesh.replicate_size}
    engine.destroy()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def _run(args: argparse.Namespace, zero: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory() as out_dir:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=RANKS_PER_NODE * NODES, rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", run_id=f"comm-volume-{uuid.uuid4().hex[:8]}",
                              monitor_interval=0.2)
        elastic_launch(config, _worker)(args, zero, out_dir)
        return torch.load(Path(out_dir) / "rank0.pt", weights_only=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="counted steps, after one warmup step")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--json", type=Path, default=_DEFAULT_OUT)
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from provenance import write_run  # benchmarks/provenance.py, beside this script

    rows: dict[str, Any] = {}
    for name, (zero, big_zero) in VARIANTS.items():
        print(f"running {name} ...", flush=True)
        found = _run(args, zero)
        collectives = [Collective(**c) for c in found["collectives"]]
        per_step = [Collective(c.kind, c.role, c.nbytes // args.steps, c.per_shard, c.per_node) for c in collectives]
        model_16bit = found["params"] * 2
        shard = found["shard_size"]
        small = volumes(per_step, RANKS_PER_NODE * NODES, RANKS_PER_NODE, shard, shard,
                        zero.get("zero_hpz_partition_size", 1))
        big_shard = big_zero.get("mics_shard_size", BIG_RANKS_PER_NODE * BIG_NODES)
        big = volumes(per_step, BIG_RANKS_PER_NODE * BIG_NODES, BIG_RANKS_PER_NODE, big_shard, shard,
                      big_zero.get("zero_hpz_partition_size", 1), min(shard, RANKS_PER_NODE))
        rows[name] = {
            "measured_2x2": small, "computed_8x8": big, "model_16bit_bytes": model_16bit,
            "across_8x8_in_M": big["across_bytes"] / model_16bit,
            "median_step_ms": statistics.median(found["times"]) * 1000,
            "collectives_per_step": len(collectives) // args.steps,
        }
    plain = rows["plain ZeRO-3"]
    for row in rows.values():
        row["across_8x8_vs_plain"] = row["computed_8x8"]["across_bytes"] / plain["computed_8x8"]["across_bytes"]
        row["step_vs_plain"] = row["median_step_ms"] / plain["median_step_ms"]

    header = (f"{'variant':36} {'2x2 inside':>11} {'2x2 across':>11} {'8x8 inside':>11} {'8x8 across':>11} "
              f"{'across/M':>9} {'vs plain':>9} {'step ms':>8}")
    print(f"\nbytes each rank sends per step (MiB), GPT {args.n_layer} x {args.n_embd}, "
          f"{plain['model_16bit_bytes'] / MIB:.1f} MiB of 16-bit weights (M)")
    print(header)
    for name, row in rows.items():
        s, b = row["measured_2x2"], row["computed_8x8"]
        print(f"{name:36} {s['inside_bytes'] / MIB:11.2f} {s['across_bytes'] / MIB:11.2f} {b['inside_bytes'] / MIB:11.2f} "
              f"{b['across_bytes'] / MIB:11.2f} {row['across_8x8_in_M']:9.2f} {row['across_8x8_vs_plain']:9.2f} "
              f"{row['median_step_ms']:8.1f}")
    print("the ZeRO++ paper's cross-node volume per step, in M: " + ", ".join(
        f"{name} {value}M" for name, value in PAPER_CROSS_NODE_M.items()))
    write_run(args.json, "comm_volume", args, variants=rows, paper_cross_node_M=PAPER_CROSS_NODE_M)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
