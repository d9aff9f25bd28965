#!/usr/bin/env python
"""By-hand step-time benchmark: zero3 against PyTorch FSDP2 (and DeepSpeed, if importable).

Not a test: nothing here asserts on timings. It trains the built-in GPT
(`zero3.models.gpt`) on the built-in corpus (`zero3.data`) at world size N on the
gloo backend, one thread per rank, once per engine:

* ``zero3``          -- ``zero3.Init`` + ``zero3.initialize``, bf16 (``--precision``), AdamW, ZeRO-3 with the
                        default ``stage3_param_persistence_threshold``;
* ``zero3-persist0`` -- the same with ``stage3_param_persistence_threshold: 0``
                        (every parameter partitioned, gathered on use);
* ``fsdp2``          -- ``fully_shard`` on each transformer block, then on the root, with
                        ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``,
                        ``torch.optim.AdamW(foreach=True)`` and ``clip_grad_norm_(1.0)``;
* ``deepspeed``      -- the zero3 config handed to DeepSpeed, only if ``import deepspeed``
                        works (it is not a dependency; nothing installs it).

Every engine starts from the same init (same seed; ``zero3.Init`` reproduces the
single-process init) and sees the same global batches (a ``torch.Generator``
seeded per step draws the global batch, each rank takes its rows), so their
losses are comparable.

Each engine runs in its own freshly launched set of worker processes
(``torch.distributed.launcher.api.elastic_launch``, the machinery behind
torchrun), so each engine's peak RSS is its own. Per step: ``dist.barrier()``,
then the step is timed with ``time.perf_counter``; a step's time is the slowest
rank's. Results: a rich table, zero3/FSDP2 ratios, and JSON at ``--out``.

    python benchmarks/step_time.py                 # defaults: about 1-2 minutes
    python benchmarks/step_time.py --profile       # also cProfile rank 0 of zero3
    python benchmarks/step_time.py --engines zero3,deepspeed --offload-optimizer cpu --precision fp32 \
        --n-layer 8 --n-embd 512                   # ZeRO-Offload against DeepSpeed's (where it imports)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import platform
import pstats
import resource
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from zero3.cli import non_negative_int, positive_int
from zero3.data import CharTokenizer, load_corpus, sample_global_batch
from zero3.models.gpt import GPT, GPTConfig

ENGINES = ("zero3", "zero3-persist0", "fsdp2", "deepspeed")
_REPO = Path(__file__).resolve().parent.parent
_DEFAULT_OUT = _REPO / "benchmarks" / "results" / "step_time.json"


# ------------------------------------------------------------------------ the job


@dataclass(frozen=True)
class Job:
    """Everything a worker needs; pickled to each spawned process."""

    engine: str
    model: GPTConfig
    micro_batch: int
    steps: int
    warmup: int
    seed: int
    profile: bool = False
    profile_out: str = ""
    offload_optimizer: str = "none"
    precision: str = "bf16"
    reduce_bucket_size: int | None = None


def ds_config(
    micro_batch: int, persistence_threshold: int | None, offload_optimizer: str = "none", precision: str = "bf16",
    reduce_bucket_size: int | None = None,
) -> dict[str, Any]:
    """The DeepSpeed-style config used by zero3 (and by DeepSpeed, if present)."""
    zero: dict[str, Any] = {"stage": 3}
    if persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
    if reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = reduce_bucket_size
    if offload_optimizer != "none":
        # ZeRO-Offload: fp32 masters and moments on the host, the step there (DeepSpeedCPUAdam in DeepSpeed).
        zero["offload_optimizer"] = {"device": offload_optimizer}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": zero,
    }


def _batch_seed(seed: int, step: int) -> int:
    # The same spread as zero3/cli.py.
    return seed * 1_000_003 + step


def _tensor_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard
    return local.numel() * local.element_size()


# ------------------------------------------------------------------ the engines
#
# Each builder returns (step, state_bytes, close): step(x, y) -> loss (detached),
# state_bytes() -> {name: bytes on this rank}, close() tears the engine down.

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _engine_step(engine: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One training step through a DeepSpeed-shaped engine (zero3 and DeepSpeed share the API)."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = engine(x, y)
        engine.backward(out["loss"])
        engine.step()
        return out["loss"].detach()

    return step


def _build_zero3(job: Job, threshold: int | None):
    import zero3

    cfg = ds_config(job.micro_batch, threshold, job.offload_optimizer, job.precision, job.reduce_bucket_size)
    torch.manual_seed(job.seed)
    with zero3.Init(config=cfg):
        model = GPT(job.model)
    engine, _, _, _ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    step = _engine_step(engine)

    def state_bytes() -> dict[str, int]:
        return {k: int(v) for k, v in engine.model_state_bytes().items()}

    return step, state_bytes, engine.destroy


def _build_fsdp2(job: Job):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(job.seed)
    model = GPT(job.model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dtype = torch.bfloat16 if job.precision == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, foreach=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # zero_grad first, so the sharded grads are still there for state_bytes().
        opt.zero_grad(set_to_none=True)
        out = model(x, y)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return out["loss"].detach()

    def state_bytes() -> dict[str, int]:
        # This rank's shards (DTensor local tensors): fp32 params, their fp32 grads
        # (reduced in bf16, then cast back to the param dtype) and Adam's moments.
        params = list(model.parameters())
        p_bytes = sum(_tensor_bytes(p) for p in params)
        g_bytes = sum(_tensor_bytes(p.grad) for p in params)
        optim = 0
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    optim += _tensor_bytes(value)
        states = {"params": p_bytes, "grads": g_bytes, "optim_states": optim}
        states["total"] = sum(states.values())
        return states

    return step, state_bytes, lambda: None


def _build_deepspeed(job: Job):
    import deepspeed  # noqa: F401  (only reached when importable)

    cfg = ds_config(job.micro_batch, None, job.offload_optimizer, job.precision, job.reduce_bucket_size)
    torch.manual_seed(job.seed)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = GPT(job.model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    step = _engine_step(engine)

    def state_bytes() -> dict[str, int]:
        return {}  # DeepSpeed has no single accessor for this

    return step, state_bytes, getattr(engine, "destroy", lambda: None)


def _build(job: Job):
    if job.engine == "zero3":
        return _build_zero3(job, None)
    if job.engine == "zero3-persist0":
        return _build_zero3(job, 0)
    if job.engine == "fsdp2":
        return _build_fsdp2(job)
    if job.engine == "deepspeed":
        return _build_deepspeed(job)
    raise ValueError(job.engine)


# ------------------------------------------------------------------- the worker


def worker(job: Job) -> dict[str, Any]:
    """Runs in every spawned process (module level, so it can be pickled)."""
    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = CharTokenizer(load_corpus()).encode(load_corpus())
    step, state_bytes, close = _build(job)

    generator = torch.Generator()
    rows = job.micro_batch
    times: list[float] = []
    losses: list[float] = []
    profiler = cProfile.Profile() if job.profile and rank == 0 else None
    for i in range(job.warmup + job.steps):
        generator.manual_seed(_batch_seed(job.seed, i))
        x_all, y_all = sample_global_batch(tokens, job.model.block_size, rows * world, generator)
        x, y = x_all[rank * rows : (rank + 1) * rows], y_all[rank * rows : (rank + 1) * rows]
        timed = i >= job.warmup
        dist.barrier()
        if profiler is not None and timed:
            profiler.enable()
        t0 = time.perf_counter()
        loss = step(x, y)
        elapsed = time.perf_counter() - t0  # CPU: every op has finished when it returns
        if profiler is not None and timed:
            profiler.disable()
        losses.append(float(loss))
        if timed:
            times.append(elapsed)

    states = state_bytes()
    if profiler is not None:
        profiler.dump_stats(job.profile_out)
    close()
    dist.barrier()
    dist.destroy_process_group()
    return {
        "rank": rank,
        "step_times_s": times,
        "losses": losses,
        "model_state_bytes": states,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
    }


# ------------------------------------------------------------------- the launch


def launch(job: Job, nproc: int) -> dict[int, dict[str, Any]]:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    log_dir = tempfile.mkdtemp(prefix=f"zero3-bench-{job.engine}-")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id=f"bench-{uuid.uuid4().hex[:8]}",
        max_restarts=0,
        monitor_interval=0.2,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects={r: Std.ALL for r in range(1, nproc)}),
    )
    return elastic_launch(config, worker)(job)


# ------------------------------------------------------------------ reporting


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(per_rank: dict[int, dict[str, Any]], tokens_per_step: int) -> dict[str, Any]:
    ranks = [per_rank[r] for r in sorted(per_rank)]
    # A step takes as long as its slowest rank.
    step_s = [max(vals) for vals in zip(*(r["step_times_s"] for r in ranks))]
    losses = [statistics.fmean(vals) for vals in zip(*(r["losses"] for r in ranks))]
    return {
        "median_ms": statistics.median(step_s) * 1e3,
        "p90_ms": _percentile(step_s, 90) * 1e3,
        "mean_ms": statistics.fmean(step_s) * 1e3,
        "min_ms": min(step_s) * 1e3,
        "tokens_per_s": tokens_per_step * len(step_s) / sum(step_s),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "losses": losses,
        "step_times_ms": [t * 1e3 for t in step_s],
        "per_rank_step_times_ms": [[t * 1e3 for t in r["step_times_s"]] for r in ranks],
        "model_state_bytes": [r["model_state_bytes"] for r in ranks],
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def print_report(results: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    meta = results["setup"]
    table = Table(
        title=(
            f"Step time, GPT {meta['num_parameters']:,} params (n_layer {meta['n_layer']}, "
            f"n_embd {meta['n_embd']}, block {meta['block_size']}), micro batch {meta['micro_batch']} x "
            f"{meta['nproc']} ranks, gloo, 1 thread/rank, {meta['warmup']} warmup + {meta['steps']} timed steps"
        ),
        caption="step = slowest rank's wall time after a per-step barrier; tokens/s = timed tokens / summed "
        "step times; loss = mean over ranks; MiB per rank, listed rank 0, 1, ...",
    )
    for name, justify in [("engine", "left"), ("median ms", "right"), ("p90 ms", "right"),
                          ("tokens/s", "right"), ("first loss", "right"), ("last loss", "right"),
                          ("model state MiB", "right"), ("16P/N MiB", "right"), ("peak RSS MiB", "right")]:
        table.add_column(name, justify=justify)
    expected = 16 * meta["num_parameters"] / meta["nproc"]
    notes: list[str] = []
    for name, res in results["engines"].items():
        if "error" in res:
            table.add_row(name, *(["-"] * 8))
            notes.append(f"{name}: {res['error']}")
            continue
        totals = [s.get("total") for s in res["model_state_bytes"]]
        table.add_row(
            name,
            f"{res['median_ms']:.1f}",
            f"{res['p90_ms']:.1f}",
            f"{res['tokens_per_s']:,.0f}",
            f"{res['first_loss']:.4f}",
            f"{res['last_loss']:.4f}",
            " / ".join(_mib(t) if t is not None else "-" for t in totals),
            _mib(expected),
            " / ".join(_mib(b) for b in res["peak_rss_bytes"]),
        )
    console.print(table)
    for note in notes:
        console.print(note, markup=False, highlight=False)
    for key, ratio in results["ratios"].items():
        console.print(f"{key}: [bold]{ratio:.3f}[/bold]")


def ratios(engines: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    base = engines.get("fsdp2")
    if not base or "error" in base:
        return out
    base_bytes = statistics.fmean(s["total"] for s in base["model_state_bytes"])
    for name in ("zero3", "zero3-persist0"):
        res = engines.get(name)
        if not res or "error" in res:
            continue
        out[f"{name}/fsdp2 median step time"] = res["median_ms"] / base["median_ms"]
        out[f"{name}/fsdp2 model-state bytes"] = (
            statistics.fmean(s["total"] for s in res["model_state_bytes"]) / base_bytes
        )
    return out


def print_profile(path: str, console: Any, top: int) -> None:
    buf = io.StringIO()
    stats = pstats.Stats(path, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    console.print(f"[bold]cProfile of zero3 rank 0, timed steps, by own time (top {top}):[/bold]")
    console.print(buf.getvalue(), markup=False, highlight=False)
    buf = io.StringIO()
    stats = pstats.Stats(path, stream=buf)
    stats.sort_stats("cumulative").print_stats("zero3", top)
    console.print(f"[bold]... zero3's own functions by cumulative time (top {top}):[/bold]")
    console.print(buf.getvalue(), markup=False, highlight=False)


# ------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Step-time benchmark: zero3 vs PyTorch FSDP2 (vs DeepSpeed if importable) "
        "on the built-in GPT and corpus, gloo, one thread per rank.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=positive_int, default=20, help="timed steps")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed steps before them")
    p.add_argument("--n-layer", type=positive_int, default=4)
    p.add_argument("--n-head", type=positive_int, default=4)
    p.add_argument("--n-embd", type=positive_int, default=256)
    p.add_argument("--block-size", type=positive_int, default=128)
    p.add_argument("--micro-batch", type=positive_int, default=8, help="sequences per rank per step")
    p.add_argument("--nproc", type=positive_int, default=2, help="ranks (world size)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma-separated subset of {', '.join(ENGINES)}")
    p.add_argument("--offload-optimizer", choices=["none", "cpu"], default="none",
                   help="ZeRO-Offload for zero3 and DeepSpeed (fsdp2 has no optimizer offload: it is skipped)")
    p.add_argument("--reduce-bucket-size", type=positive_int, default=None,
                   help="zero_optimization.reduce_bucket_size for zero3 and DeepSpeed (default: DeepSpeed's 5e8)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="fp32 on a CPU without bf16 matmul units (bf16 backward is ~30x slower there)")
    p.add_argument("--out", type=Path, default=_DEFAULT_OUT, help="JSON results file")
    p.add_argument("--profile", action="store_true",
                   help="cProfile rank 0 of the 'zero3' run over its timed steps and print the "
                   "hotspots (its timings are then inflated by the profiler)")
    p.add_argument("--profile-top", type=positive_int, default=25)
    return p


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = build_parser().parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        print(f"unknown engine(s): {', '.join(unknown)}; choose from {', '.join(ENGINES)}", file=sys.stderr)
        return 2

    corpus = load_corpus()
    gpt = GPTConfig(vocab_size=CharTokenizer(corpus).vocab_size, block_size=args.block_size,
                    n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    tokens_per_step = args.micro_batch * args.nproc * args.block_size
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profile_path = str(args.out.with_suffix(".zero3-rank0.prof"))

    # One thread per rank (torchrun's choice): N ranks each using every core oversubscribe.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)

    results: dict[str, Any] = {
        "setup": {
            **{k: v for k, v in vars(args).items() if k not in ("out", "engines", "profile_top")},
            "vocab_size": gpt.vocab_size,
            "num_parameters": gpt.num_parameters(),
            "tokens_per_step": tokens_per_step,
            "launcher": "torch.distributed.launcher.api.elastic_launch",
            "backend": "gloo",
            "threads_per_rank": 1,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "zero3_config": ds_config(args.micro_batch, None, args.offload_optimizer, args.precision,
                                      args.reduce_bucket_size),
        },
        "engines": {},
    }
    for name in engines:
        if name == "fsdp2" and args.offload_optimizer != "none":
            console.print("fsdp2: no optimizer offload (its CPUOffloadPolicy moves parameters too); skipped")
            results["engines"][name] = {"error": "no optimizer-only offload"}
            continue
        if name == "deepspeed":
            try:
                import deepspeed  # noqa: F401
            except Exception as exc:  # ImportError, or a broken install
                msg = f"not importable ({type(exc).__name__}: {exc})"
                console.print(f"deepspeed: {msg}; skipped")
                results["engines"][name] = {"error": msg}
                continue
        job = Job(engine=name, model=gpt, micro_batch=args.micro_batch, steps=args.steps,
                  warmup=args.warmup, seed=args.seed,
                  profile=args.profile and name == "zero3", profile_out=profile_path,
                  offload_optimizer=args.offload_optimizer, precision=args.precision,
                  reduce_bucket_size=args.reduce_bucket_size)
        console.print(f"running {name} ...")
        t0 = time.perf_counter()
        try:
            per_rank = launch(job, args.nproc)
        except Exception as exc:
            msg = exc.format_msg() if hasattr(exc, "format_msg") else f"{type(exc).__name__}: {exc}"
            console.print(f"[red]{name} failed[/red]:\n{msg}", markup=True, highlight=False)
            results["engines"][name] = {"error": f"failed: {str(exc).splitlines()[0][:200]}"}
            continue
        results["engines"][name] = summarize(per_rank, tokens_per_step)
        results["engines"][name]["launch_wall_s"] = time.perf_counter() - t0
    results["ratios"] = ratios(results["engines"])

    print_report(results, console)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    console.print(f"results written to {args.out}")
    if args.profile and "zero3" in engines and Path(profile_path).exists():
        print_profile(profile_path, console, args.profile_top)
        console.print(f"profile written to {profile_path} (python -m pstats {profile_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
