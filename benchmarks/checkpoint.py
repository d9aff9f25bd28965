#!/usr/bin/env python
"""By-hand checkpoint benchmark: zero3's save/load beside plain torch.save and FSDP2 + DCP, same run.

Not a test: nothing here asserts on timings. Two ranks (gloo, one process
each, launched with torch's elastic launcher) build the same fp32 GPT (seed
0), sized so that the checkpointed state (fp32 master + two Adam moments,
12 bytes per parameter) is about ``--state-mib`` MiB (default 512), and take
one AdamW step so the moments exist. Then, ``--repeats`` times, interleaved:

* ``zero3 save``   -- ``engine.save_checkpoint(dir, tag)`` (DCP files fsynced,
                      checksums, the ``latest`` marker);
* ``zero3 async``  -- ``save_checkpoint(..., async_save=True)``: the time it
                      blocks the caller, and the time until ``wait_for_checkpoint()``;
* ``zero3 load``   -- ``engine.load_checkpoint(dir, tag)`` (each item checked
                      against its checksum as it is read; at the saved world
                      size each rank reads its own items, without DCP's
                      planning), the files dropped from the page cache before;
* ``plain``        -- each rank ``torch.save``s its own flat master and moment
                      shards (the same bytes) into one file and fsyncs it; its
                      load is ``torch.load`` of that file, the cache dropped;
* ``fsdp2 + dcp``  -- ``fully_shard`` per block and the root, AdamW, one step;
                      ``dcp.save`` / ``dcp.load`` of ``get_state_dict`` (model
                      and optimizer), the cache dropped before the load.

A time is the slowest rank's (a barrier before each). Bandwidth = the
checkpoint's bytes on disk (all ranks) / time; ratios are against plain.
Below the table, zero3's load against plain ``torch.load`` of the same state
by time alone: plain's time / zero3's, per repeat (the two run back to back)
and of the medians (issue 39's goal: at least 0.8).
Results: a table and JSON at ``--json``.

    python benchmarks/checkpoint.py                 # 512 MiB of state, 3 repeats: ~3-5 min here
    python benchmarks/checkpoint.py --state-mib 64 --repeats 1 --dir /tmp/ck   # a smoke run

``--overhead`` measures something else: the step time of training with
automatic checkpoints after every step (``checkpoint.interval_steps: 1``,
``async_save: true``) against training without, GPT 6 x 512 at 2 ranks, fp32,
3 alternated rounds (issue 39's goal: at most 5% slower). It runs
``benchmarks/step_time.py --engines zero3,zero3-ckpt``; later arguments go to it:

    python benchmarks/checkpoint.py --overhead                  # ~5 min here
    python benchmarks/checkpoint.py --overhead --rounds 1 --n-layer 2 --n-embd 128 --steps 4   # a smoke run
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from offload import evict  # benchmarks/offload.py, beside this script
from zero3.models.gpt import GPT, GPTConfig

_REPO = Path(__file__).resolve().parent.parent
_DEFAULT_OUT = _REPO / "benchmarks" / "results" / "checkpoint.json"
MIB = 2**20


def model_config(state_mib: float) -> GPTConfig:
    """A GPT whose 12 bytes/parameter come to about `state_mib` MiB (width grows, 8 layers)."""
    target = state_mib * MIB / 12
    n_embd = 64
    while True:
        cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=8, n_embd=n_embd + 64)
        if cfg.num_parameters() > target:
            return GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=8, n_embd=n_embd)
        n_embd += 64


def drop_cache(paths: list[Path]) -> None:
    """Every file under these paths out of the page cache (benchmarks/offload.py's evict)."""
    evict([file for path in paths for file in ([path] if path.is_file() else sorted(path.rglob("*"))) if file.is_file()])


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def timed(fn: Callable[[], Any], cpu: list[float] | None = None) -> float:
    """Seconds of `fn` on the slowest rank; with `cpu`, its CPU seconds on the busiest rank appended there
    (this machine's other work slows the wall clock more than it does that)."""
    dist.barrier()
    started, started_cpu = time.perf_counter(), time.process_time()
    fn()
    seconds = torch.tensor([time.perf_counter() - started, time.process_time() - started_cpu])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if cpu is not None:
        cpu.append(float(seconds[1]))
    return float(seconds[0])


def batch(cfg: GPTConfig, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(rank))
    return idx, idx


def stepped_engine(cfg: GPTConfig, rank: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """zero3's engine of `cfg` after one AdamW step (seed 0), and this rank's checkpointed state as plain
    tensors: the masters (the fp32 shards themselves where there is no hp_params buffer:
    zero3.step.layout's [Note: masters that are the shards]) and both moments, the same bytes."""
    import zero3

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3}}
    torch.manual_seed(0)
    with zero3.Init(config=config, device="cpu"):
        model = GPT(cfg)
    engine, *_ = zero3.initialize(model=model, config=config, device="cpu")
    x, y = batch(cfg, rank)
    engine.backward(engine(x, y)["loss"])
    engine.step()
    opt = engine.optimizer
    assert opt is not None
    masters = opt.hp_params if opt.hp_params is not None else next(iter(opt.masters.values())).hp.buffer
    return engine, {"hp": masters.tensor, **{k: v.tensor for k, v in opt.moments.items()}}


def worker(args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = Path(args["dir"])
    cfg = GPTConfig(**args["model"])
    rows: dict[str, list[float]] = {k: [] for k in (
        "zero3 save", "zero3 async (blocked)", "zero3 async (until written)", "zero3 load",
        "plain save", "plain load", "fsdp2 + dcp save", "fsdp2 + dcp load")}
    sizes: dict[str, int] = {}
    cpu: dict[str, list[float]] = {"zero3 load": [], "plain load": []}

    engine, flat = stepped_engine(cfg, rank)
    x, y = batch(cfg, rank)

    torch.manual_seed(0)
    fsdp_model = GPT(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in fsdp_model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp_model, mesh=mesh)
    fsdp_opt = torch.optim.AdamW(fsdp_model.parameters(), lr=1e-4)
    fsdp_model(x, y)["loss"].backward()
    fsdp_opt.step()

    for repeat in range(args["repeats"]):
        tag = f"r{repeat}"
        zero3_dir = root / "zero3"
        rows["zero3 save"].append(timed(lambda: engine.save_checkpoint(zero3_dir, tag=tag)))
        sizes["zero3"] = du(zero3_dir / tag)

        blocked = timed(lambda: engine.save_checkpoint(zero3_dir, tag=f"{tag}-async", async_save=True))
        started = time.perf_counter()
        engine.wait_for_checkpoint()
        until = torch.tensor([time.perf_counter() - started + blocked])
        dist.all_reduce(until, op=dist.ReduceOp.MAX)
        rows["zero3 async (blocked)"].append(blocked)
        rows["zero3 async (until written)"].append(float(until))

        if rank == 0:
            drop_cache([zero3_dir / tag])
        rows["zero3 load"].append(timed(lambda: engine.load_checkpoint(zero3_dir, tag=tag), cpu["zero3 load"]))

        plain = root / "plain" / f"{tag}-rank{rank}.pt"
        plain.parent.mkdir(parents=True, exist_ok=True)

        def plain_save() -> None:
            with open(plain, "wb") as out:
                torch.save(flat, out)
                out.flush()
                os.fsync(out.fileno())

        rows["plain save"].append(timed(plain_save))
        sizes["plain"] = int(torch.tensor([du(plain)]).item())
        drop_cache([plain])
        rows["plain load"].append(timed(lambda: torch.load(plain, weights_only=True), cpu["plain load"]))

        fsdp_dir = root / "fsdp2" / tag

        def fsdp_save() -> None:
            model_sd, optim_sd = get_state_dict(fsdp_model, fsdp_opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(fsdp_dir))

        def fsdp_load() -> None:
            model_sd, optim_sd = get_state_dict(fsdp_model, fsdp_opt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=str(fsdp_dir))
            set_state_dict(fsdp_model, fsdp_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

        rows["fsdp2 + dcp save"].append(timed(fsdp_save))
        sizes["fsdp2"] = du(fsdp_dir)
        if rank == 0:
            drop_cache([fsdp_dir])
        rows["fsdp2 + dcp load"].append(timed(fsdp_load))
        dist.barrier()
        if rank == 0:
            for path in (zero3_dir / tag, zero3_dir / f"{tag}-async", root / "fsdp2" / tag):
                shutil.rmtree(path, ignore_errors=True)
        plain.unlink()
    plain_total = torch.tensor([sizes["plain"]])
    dist.all_reduce(plain_total)
    sizes["plain"] = int(plain_total.item())
    engine.destroy()
    dist.barrier()
    dist.destroy_process_group()
    return {"rows": rows, "bytes": sizes, "cpu": cpu}


def launch(args: dict[str, Any], entry: Callable[[dict[str, Any]], dict[str, Any]] = worker,
           name: str = "ckpt") -> dict[int, dict[str, Any]]:
    """`entry(args)` on two ranks (torch's elastic launcher, gloo); each rank's result, by rank."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d", rdzv_endpoint="localhost:0",
        run_id=f"{name}-{uuid.uuid4().hex[:8]}", max_restarts=0, monitor_interval=0.2,
        logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(prefix=f"zero3-{name}-bench-"), redirects={1: Std.ALL}),
    )
    return elastic_launch(config, entry)(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mib", type=float, default=512.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=_DEFAULT_OUT)
    parser.add_argument("--overhead", action="store_true",
                        help="instead: the step time of automatic async checkpoints every step against none "
                        "(benchmarks/step_time.py --engines zero3,zero3-ckpt; extra arguments go to it)")
    args, rest = parser.parse_known_args(argv)
    if args.overhead:
        import step_time  # benchmarks/step_time.py, beside this script

        defaults = ["--n-layer", "6", "--n-embd", "512", "--rounds", "3", "--precision", "fp32",
                    "--out", str(_DEFAULT_OUT.with_name("checkpoint_overhead.json"))]
        return step_time.main(["--engines", "zero3,zero3-ckpt", *defaults, *rest])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="zero3-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    cfg = model_config(args.state_mib)
    params = cfg.num_parameters()
    print(f"GPT {cfg.n_layer} x {cfg.n_embd}: {params / 1e6:.1f}M params, {12 * params / MIB:.0f} MiB of "
          f"checkpointed state (fp32 master + 2 moments), 2 ranks, gloo; in {root}", flush=True)
    job = {"dir": str(root), "repeats": args.repeats, "model": {
        "vocab_size": cfg.vocab_size, "block_size": cfg.block_size, "n_layer": cfg.n_layer,
        "n_head": cfg.n_head, "n_embd": cfg.n_embd}}
    result = launch(job)[0]
    rows, sizes, cpu = result["rows"], result["bytes"], result["cpu"]

    def bandwidth(row: str) -> float:
        key = "zero3" if row.startswith("zero3") else "plain" if row.startswith("plain") else "fsdp2"
        return sizes[key] / statistics.median(rows[row]) / 1e9

    plain = {"save": bandwidth("plain save"), "load": bandwidth("plain load")}
    print(f"\n{'what':<28}{'median s':>10}{'GB/s':>8}{'x plain':>9}   runs (s)")
    for row, values in rows.items():
        kind = "load" if row.endswith("load") else "save"
        gbps = bandwidth(row)
        print(f"{row:<28}{statistics.median(values):>10.3f}{gbps:>8.2f}{gbps / plain[kind]:>9.2f}   "
              + ", ".join(f"{v:.3f}" for v in values))
    print(f"\nbytes on disk: zero3 {sizes['zero3'] / MIB:.1f} MiB, plain {sizes['plain'] / MIB:.1f} MiB, "
          f"fsdp2 + dcp {sizes['fsdp2'] / MIB:.1f} MiB (GB/s uses each one's own bytes)")
    per_repeat = [plain_s / zero3_s for plain_s, zero3_s in zip(rows["plain load"], rows["zero3 load"])]
    load_ratio = statistics.median(rows["plain load"]) / statistics.median(rows["zero3 load"])
    print(f"zero3 load against plain torch.load, by time (plain s / zero3 s): {load_ratio:.2f} of the medians; "
          f"per repeat {', '.join(f'{r:.2f}' for r in per_repeat)} (median {statistics.median(per_repeat):.2f})")
    print(f"CPU seconds of the loads, busiest rank, median: zero3 {statistics.median(cpu['zero3 load']):.3f}, plain "
          f"{statistics.median(cpu['plain load']):.3f}")
    from provenance import provenance  # benchmarks/provenance.py, beside this script

    out = {"benchmark": "checkpoint", "provenance": provenance(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "torch": torch.__version__, "parameters": params, "rows": rows, "bytes": sizes,
           "plain_GBps": plain, "load_time_ratio": {"of_medians": load_ratio, "per_repeat": per_repeat},
           "load_cpu_s": cpu,
           "args": {k: str(v) for k, v in vars(args).items()}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
