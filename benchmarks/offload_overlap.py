#!/usr/bin/env python
"""By-hand benchmark: ZeRO-Offload's host step after the backward against the overlapped one.

Not a test: nothing here asserts on timings. Two ranks (gloo, one process
each, launched with torch's elastic launcher) train the same GPT (seed 0,
the same batches) with `offload_optimizer: cpu`, once without and once with
`super_offload: true` (zero3.step.early_step's Note), alternating
`--rounds` times. Per step, after a barrier, each rank times its backward
(`engine.backward`) and its step (`engine.step`); a phase's time is the
slowest rank's, a figure the median over the run's steps, then over the runs.
For the overlapped runs it also reports how many sub-groups were stepped
early and kept, and rank 0's timeline of its last step: when each early step
ran against the backward's end (the overlap itself). Results: a table, and
JSON at --json.

    python benchmarks/offload_overlap.py                       # 6 x 512, fp32: about 3 minutes here
    python benchmarks/offload_overlap.py --n-layer 2 --n-embd 128 --steps 4 --rounds 1   # a smoke run
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zero3.models.gpt import GPT, GPTConfig

_REPO = Path(__file__).resolve().parent.parent
_DEFAULT_OUT = _REPO / "benchmarks" / "results" / "offload_overlap.json"


def zero3_config(args: dict[str, Any], overlapped: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args["micro_batch"],
        "gradient_clipping": args["clip"],
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "sub_group_size": args["sub_group_size"],
                              "reduce_bucket_size": args["reduce_bucket_size"],
                              "offload_optimizer": {"device": "cpu", "super_offload": overlapped}},
    }
    if args["precision"] == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def worker(args: dict[str, Any]) -> dict[str, Any]:
    import zero3

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**args["model"])
    config = zero3_config(args, args["overlapped"])
    torch.manual_seed(0)
    with zero3.Init(config=config, device="cpu"):
        model = GPT(cfg)
    engine = zero3.initialize(model=model, config=config, device="cpu")[0]
    rows: dict[str, list[float]] = {"backward": [], "step": [], "total": []}
    for index in range(args["warmup"] + args["steps"]):
        tokens = torch.randint(0, cfg.vocab_size, (args["micro_batch"] * world, cfg.block_size + 1),
                               generator=torch.Generator().manual_seed(index))[rank::world]
        dist.barrier()
        began = time.perf_counter()
        loss = engine(tokens[:, :-1], tokens[:, 1:])["loss"]
        forward_done = time.perf_counter()
        engine.backward(loss)
        backward_done = time.perf_counter()
        engine.step()
        step_done = time.perf_counter()
        times = torch.tensor([backward_done - forward_done, step_done - backward_done, step_done - began])
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        if index >= args["warmup"]:
            for key, value in zip(rows, times.tolist()):
                rows[key].append(value)
    early = engine.optimizer.early
    out: dict[str, Any] = {"rows": rows, "sub_groups": len(engine.optimizer.sub_groups)}
    if early is not None:
        stats = early.stats
        out["early"] = {"kept": stats.kept, "undone": stats.undone, "undone_reasons": dict(stats.undone_reasons),
                        "skipped": stats.skipped, "timeline": stats.last_timeline, "backward_s": stats.last_backward_s}
    engine.destroy()
    dist.destroy_process_group()
    return out


def last_step_overlap(run: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's last overlapped step, from a run's early-step timeline: how many sub-groups stepped early, how
    many began inside the backward's computation, and the host-step seconds that ran inside it."""
    early = run["early"]
    timeline, backward_s = early["timeline"], early["backward_s"]
    during = [(start, end) for start, end in timeline if start < backward_s]
    return {"sub_groups": run["sub_groups"], "early": len(timeline), "begun_inside": len(during),
            "backward_s": backward_s, "inside_s": sum(min(end, backward_s) - start for start, end in during),
            "kept": early["kept"], "undone": early["undone"], "undone_reasons": early["undone_reasons"],
            "skipped": early["skipped"]}


def launch(args: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=args["nproc"], rdzv_backend="c10d", rdzv_endpoint="localhost:0",
        run_id=f"overlap-{uuid.uuid4().hex[:8]}", max_restarts=0, monitor_interval=0.2,
        logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(prefix="zero3-overlap-bench-"), redirects={1: Std.ALL}),
    )
    return elastic_launch(config, worker)(args)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--clip", type=float, default=1e6, help="gradient_clipping (the default never clips)")
    parser.add_argument("--sub-group-size", type=int, default=2_000_000)
    parser.add_argument("--reduce-bucket-size", type=int, default=2_000_000)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=_DEFAULT_OUT)
    args = parser.parse_args(argv)
    model = {"vocab_size": 65, "block_size": args.block_size, "n_layer": args.n_layer, "n_head": args.n_head,
             "n_embd": args.n_embd}
    job = {"model": model, "micro_batch": args.micro_batch, "precision": args.precision, "clip": args.clip,
           "sub_group_size": args.sub_group_size, "reduce_bucket_size": args.reduce_bucket_size,
           "nproc": args.nproc, "steps": args.steps, "warmup": args.warmup}
    params = GPTConfig(**model).num_parameters()
    print(f"GPT {args.n_layer} x {args.n_embd} ({params / 1e6:.1f}M params), {args.precision}, {args.nproc} ranks, "
          f"gloo, offload_optimizer cpu; {args.steps} steps after {args.warmup}, {args.rounds} alternated rounds",
          flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"after the backward": [], "overlapped (super_offload)": []}
    for _ in range(args.rounds):
        for name in runs:
            runs[name].append(launch({**job, "overlapped": name.startswith("overlapped")}))
    medians = {name: {key: statistics.median(statistics.median(run["rows"][key]) for run in results)
                      for key in ("backward", "step", "total")} for name, results in runs.items()}
    print(f"\n{'':<28}{'backward ms':>12}{'step ms':>10}{'total ms':>10}   runs (total ms)")
    for name, figures in medians.items():
        totals = ", ".join(f"{statistics.median(run['rows']['total']) * 1e3:.0f}" for run in runs[name])
        print(f"{name:<28}{figures['backward'] * 1e3:>12.1f}{figures['step'] * 1e3:>10.1f}"
              f"{figures['total'] * 1e3:>10.1f}   {totals}")
    plain, overlapped = medians["after the backward"], medians["overlapped (super_offload)"]
    print(f"\noverlapped / after: step {overlapped['step'] / plain['step']:.2f}, "
          f"whole step {overlapped['total'] / plain['total']:.2f}")
    last = runs["overlapped (super_offload)"][-1]
    overlap = last_step_overlap(last)
    timeline, backward_s = last["early"]["timeline"], overlap["backward_s"]
    print(f"sub-groups stepped early and kept, over the last run: {overlap['kept']} "
          f"(of {overlap['sub_groups']} a step x {args.warmup + args.steps} steps); undone: {overlap['undone']} "
          f"{overlap['undone_reasons'] or ''}; backwards that stepped nothing early (the step before was clipped or "
          f"not finite): {overlap['skipped']}")
    print(f"rank 0's last step: {overlap['early']} of {overlap['sub_groups']} sub-groups stepped early, "
          f"{overlap['begun_inside']} of them begun before its backward's computation ended ({backward_s * 1e3:.0f} "
          f"ms); {overlap['inside_s'] * 1e3:.0f} ms of host step ran inside it")
    for start, end in timeline:
        print(f"  early step {start * 1e3:8.1f} -> {end * 1e3:8.1f} ms after the backward began"
              + ("" if start < backward_s else "  (after it)"))
    from provenance import provenance  # benchmarks/provenance.py, beside this script

    out = {"benchmark": "offload_overlap", "provenance": provenance(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
           "torch": torch.__version__, "parameters": params, "args": {k: str(v) for k, v in vars(args).items()},
           "medians_s": medians, "last_overlapped_step": overlap, "runs": runs}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
