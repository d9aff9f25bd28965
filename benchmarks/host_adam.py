#!/usr/bin/env python
"""By-hand benchmark of the host (CPU) Adam(W) step: params/s of torch's CPU kernels vs DeepSpeedCPUAdam.

Not a test: nothing here asserts on timings or on numerics; it reports both.

What it measures is the ZeRO-Offload optimizer step on one sub-group: N fp32
parameters as ONE flat, 1-D, contiguous master tensor with its fp32 grad and
its two fp32 moments (``exp_avg``, ``exp_avg_sq``), all in host memory, and one
``optimizer.step()`` over them. Per size (``--sizes``), each variant gets a
fresh copy of the same inputs (master ~ N(0, 0.02^2), grad ~ N(0, 0.01^2),
seeded; moments zero and allocated up front, as zero3 binds them), then one
untimed warm-up step and ``--repeats`` timed steps (``time.perf_counter``
around ``step()``; the same grad every step). Variants:

* ``fused``     -- ``torch.optim.AdamW(fused=True)``: torch's fused CPU kernel;
* ``foreach``   -- ``torch.optim.AdamW(foreach=True)``;
* ``single``    -- ``torch.optim.AdamW(foreach=False, fused=False)`` (single-tensor);
* ``deepspeed`` -- ``deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)``, if
  ``import deepspeed`` works and its ``cpu_adam`` op builds/loads (a first JIT
  build takes minutes; it is cached under ``~/.cache/torch_extensions``). If not,
  a line says why it was skipped.

All with lr ``--lr`` (1e-3), weight_decay ``--weight-decay`` (0.01), betas
(0.9, 0.999), eps 1e-8, bias correction on, ``torch.set_num_threads(--threads)``
(default ``os.cpu_count()``; DeepSpeed's OpenMP loop shares torch's libgomp, so
the same count). Reported per size and variant: median (and min) seconds per
step, params/s = N / median, the effective memory traffic at 28 bytes/param
(reads master, grad, both moments; writes master and both moments), and the
throughput ratio to DeepSpeedCPUAdam (> 1: faster than DeepSpeed).

Numerics: every variant took the same steps (warm-up + repeats) from the same
inputs, so afterwards the masters and moments are compared with ``torch.equal``,
pairwise; the table says which pairs are bit-identical and, where not, which
fraction of elements differ, the largest absolute difference and the median
distance in fp32 ULPs. (Does switching zero3's host step between foreach and
fused change the numbers?)

    python benchmarks/host_adam.py                            # sizes 1e6 1e7 1e8: ~3.5 min on 2 cores
    python benchmarks/host_adam.py --sizes 1e6 1e7 --repeats 9 --threads 1
    python benchmarks/host_adam.py --variants fused,foreach   # a subset

The final states of every variant are kept until the comparison, and foreach /
single-tensor allocate temporaries of the full size: peak RSS was ~11 GB for
1e8 with all four variants. Results: a rich table and JSON at ``--json``
(default ``benchmarks/results/host_adam.json``, git-ignored) with every step's
time. Timings on a shared 2-core VM move by 10-30% between runs (DeepSpeed at
1e8: 0.25-0.34 s/step); compare variants within one run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from zero3.cli import non_negative_int, positive_int

_REPO = Path(__file__).resolve().parent.parent
_DEFAULT_JSON = _REPO / "benchmarks" / "results" / "host_adam.json"

VARIANTS = ("fused", "foreach", "single", "deepspeed")
LABELS = {
    "fused": "torch AdamW fused=True",
    "foreach": "torch AdamW foreach=True",
    "single": "torch AdamW single-tensor",
    "deepspeed": "DeepSpeedCPUAdam adamw_mode",
}
BETAS = (0.9, 0.999)
EPS = 1e-8
BYTES_PER_PARAM = 28  # reads master, grad, exp_avg, exp_avg_sq (16); writes master, exp_avg, exp_avg_sq (12)
STATE_NAMES = ("param", "exp_avg", "exp_avg_sq")


def element_count(text: str) -> int:
    """A size for --sizes: an integer, in plain or float notation ("1e6", "2.5e7")."""
    try:
        value = int(text)
    except ValueError:
        number = float(text)
        if not number.is_integer():
            raise argparse.ArgumentTypeError(f"not a whole number of elements: {text}") from None
        value = int(number)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


# --------------------------------------------------------------------- DeepSpeed


@dataclass
class DeepSpeedStatus:
    """Whether DeepSpeedCPUAdam can run here, and if not, why."""

    cls: type | None = None
    version: str | None = None
    error: str | None = None
    load_s: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"available": self.cls is not None, "version": self.version, "error": self.error,
                "op_load_s": self.load_s, **self.info}


def load_deepspeed(console: Any) -> DeepSpeedStatus:
    """Import DeepSpeed and build/load its cpu_adam op (a JIT build the first time), once."""
    status = DeepSpeedStatus()
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # ImportError, or a broken install
        status.error = f"import failed ({type(exc).__name__}: {exc})"
        return status
    status.version = getattr(deepspeed, "__version__", "?")
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        builder = CPUAdamBuilder()
        status.info = {"cpu_adam_simd": builder.simd_width(), "cpu_adam_cxx_args": builder.cxx_args()}
    except Exception as exc:  # informative only
        status.info = {"cpu_adam_builder_error": f"{type(exc).__name__}: {exc}"}
    console.print(f"DeepSpeed {status.version}: loading the cpu_adam op (the first JIT build takes minutes) ...")
    t0 = time.perf_counter()
    try:
        probe = nn.Parameter(torch.zeros(8))
        DeepSpeedCPUAdam([probe], lr=1e-3, adamw_mode=True)  # its __init__ builds/loads the op
    except Exception as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        status.error = f"cpu_adam op did not build/load ({type(cause).__name__}: {str(cause).strip()[:500]})"
        return status
    status.load_s = time.perf_counter() - t0
    status.cls = DeepSpeedCPUAdam
    return status


# ------------------------------------------------------------------ the variants


@dataclass
class SubGroup:
    """One flat fp32 sub-group and the optimizer that steps it."""

    master: nn.Parameter
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: Callable[[], Any]

    def state(self) -> dict[str, torch.Tensor]:
        return {"param": self.master.detach(), "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


def build(variant: str, master0: torch.Tensor, grad: torch.Tensor, args: argparse.Namespace,
          ds: DeepSpeedStatus) -> SubGroup:
    """A fresh copy of the inputs, moments allocated (and touched) up front, the optimizer around them."""
    master = nn.Parameter(master0.clone())
    master.grad = grad.clone()
    exp_avg = torch.zeros_like(master0)
    exp_avg_sq = torch.zeros_like(master0)
    opt: torch.optim.Optimizer
    if variant == "deepspeed":
        assert ds.cls is not None
        opt = ds.cls([master], lr=args.lr, betas=BETAS, eps=EPS, weight_decay=args.weight_decay,
                     bias_correction=True, adamw_mode=True)
        opt.state[master] = {"step": 0, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    else:
        if variant not in ("fused", "foreach", "single"):
            raise ValueError(variant)
        opt = torch.optim.AdamW([master], lr=args.lr, betas=BETAS, eps=EPS, weight_decay=args.weight_decay,
                                fused=variant == "fused", foreach=variant == "foreach")
        # As torch would create it lazily (fp32 0-dim step on the host for all three on CPU).
        opt.state[master] = {"step": torch.zeros((), dtype=torch.float32),
                             "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    return SubGroup(master, exp_avg, exp_avg_sq, opt.step)


def timed_steps(sub: SubGroup, repeats: int) -> tuple[float, list[float]]:
    """(warm-up step seconds, timed step seconds)."""

    def one() -> float:
        t0 = time.perf_counter()
        sub.step()
        return time.perf_counter() - t0  # CPU: the step has finished when it returns

    warmup = one()
    return warmup, [one() for _ in range(repeats)]


def summarize(numel: int, warmup: float, times: list[float]) -> dict[str, Any]:
    med = statistics.median(times)
    return {
        "warmup_s": warmup,
        "step_s": times,
        "median_s": med,
        "min_s": min(times),
        "params_per_s": numel / med,
        "effective_gbps": BYTES_PER_PARAM * numel / med / 1e9,
    }


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns as int64 in the order of the floats, so a difference counts ULPs (-0 == +0)."""
    bits = t.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """torch.equal per state tensor; where not equal, how many elements differ and by how much at most."""
    out: dict[str, Any] = {}
    for name in STATE_NAMES:
        x, y = a[name], b[name]
        if torch.equal(x, y):
            out[name] = {"equal": True}
            continue
        differ = x != y
        xs, ys = x[differ], y[differ]
        diff = (xs - ys).abs_()
        out[name] = {
            "equal": False,
            "differing": xs.numel(),
            "differing_fraction": xs.numel() / x.numel(),
            "max_abs_diff": float(diff.max()),
            "max_rel_diff": float((diff / ys.abs().clamp_min(torch.finfo(torch.float32).tiny)).max()),
        }
        # ULP distances of the differing elements; the max is dominated by values near 0 (tiny ULPs), so the
        # median says more about a typical difference.
        ulps = (_ordered(xs) - _ordered(ys)).abs_()
        out[name].update(median_ulp_diff=int(ulps.median()), max_ulp_diff=int(ulps.max()))
    out["bit_identical"] = all(out[name]["equal"] for name in STATE_NAMES)
    return out


def run_size(numel: int, variants: list[str], args: argparse.Namespace, ds: DeepSpeedStatus,
             console: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(args.seed)
    master0 = torch.randn(numel, generator=gen).mul_(0.02)
    grad = torch.randn(numel, generator=gen).mul_(0.01)
    rows: dict[str, Any] = {}
    finals: dict[str, dict[str, torch.Tensor]] = {}
    for variant in variants:
        if variant == "deepspeed" and ds.cls is None:
            rows[variant] = {"skipped": ds.error}
            continue
        console.print(f"  {numel:,} params: {LABELS[variant]} ...")
        try:
            sub = build(variant, master0, grad, args, ds)
            warmup, times = timed_steps(sub, args.repeats)
        except Exception as exc:
            msg = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            console.print(f"  [red]{variant} failed[/red]: {msg}", highlight=False)
            rows[variant] = {"error": msg}
            continue
        rows[variant] = summarize(numel, warmup, times)
        finals[variant] = sub.state()
        sub.master.grad = None
        del sub  # drops the optimizer and the grad copy; the final state stays for the comparison
    base = rows.get("deepspeed", {}).get("params_per_s")
    for row in rows.values():
        if base and "params_per_s" in row:
            row["vs_deepspeed"] = row["params_per_s"] / base
    numerics = {f"{a} vs {b}": compare(finals[a], finals[b]) for a, b in itertools.combinations(finals, 2)}
    return {"numel": numel, "steps_compared": 1 + args.repeats, "variants": rows, "numerics": numerics}


# --------------------------------------------------------------------- reporting


def _params(value: float) -> str:
    return f"{value / 1e6:,.1f} M"


def _diff_cell(c: dict[str, Any]) -> str:
    if c["equal"]:
        return "equal"
    return f"{c['differing_fraction']:.1%} differ, max {c['max_abs_diff']:.1e}, median {c['median_ulp_diff']} ulp"


def print_report(results: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    s = results["setup"]
    table = Table(
        title=(f"Host AdamW step over one flat fp32 sub-group: lr {s['lr']}, weight_decay {s['weight_decay']}, "
               f"{s['threads']} threads, median of {s['repeats']} steps (+1 warm-up)"),
        caption=f"params/s = N / median s; GB/s = {BYTES_PER_PARAM} bytes/param / median s; "
        "vs DS = params/s / DeepSpeedCPUAdam's (> 1: faster)",
    )
    for name in ("params", "variant", "median s/step", "min s/step", "params/s", "GB/s", "vs DS"):
        table.add_column(name, justify="left" if name == "variant" else "right")
    for res in results["sizes"]:
        for i, (variant, row) in enumerate(res["variants"].items()):
            size = f"{res['numel']:,}" if i == 0 else ""
            if "median_s" not in row:
                table.add_row(size, LABELS[variant], "skipped" if "skipped" in row else "failed", "-", "-", "-", "-")
                continue
            ratio = row.get("vs_deepspeed")
            table.add_row(size, LABELS[variant], f"{row['median_s']:.4f}", f"{row['min_s']:.4f}",
                          _params(row["params_per_s"]), f"{row['effective_gbps']:.2f}",
                          f"{ratio:.2f}" if ratio is not None else "-")
        table.add_section()
    console.print(table)

    num = Table(title="Bit-identity after the same steps from the same inputs (torch.equal)",
                caption="per tensor: 'equal' (torch.equal), or the fraction of elements that differ, the max |diff| "
                "and the median distance in fp32 ULPs among the differing elements")
    for name in ("params", "steps", "pair", "bit-identical", *STATE_NAMES):
        num.add_column(name, justify="left" if name == "pair" else "right")
    for res in results["sizes"]:
        for i, (pair, cmp) in enumerate(res["numerics"].items()):
            cells = [_diff_cell(cmp[name]) for name in STATE_NAMES]
            num.add_row(f"{res['numel']:,}" if i == 0 else "", str(res["steps_compared"]) if i == 0 else "",
                        pair, "[green]yes[/green]" if cmp["bit_identical"] else "[red]no[/red]", *cells)
        num.add_section()
    console.print(num)

    ds = results["deepspeed"]
    if ds["available"]:
        console.print(f"DeepSpeedCPUAdam: DeepSpeed {ds['version']}, cpu_adam op loaded in {ds['op_load_s']:.1f} s "
                      f"({ds.get('cpu_adam_simd', '?')})", highlight=False)
    elif "deepspeed" in results["setup"]["variants"]:
        console.print(f"DeepSpeedCPUAdam SKIPPED: {ds['error']}", highlight=False)
    for res in results["sizes"]:
        for variant, row in res["variants"].items():
            if "error" in row:
                console.print(f"{res['numel']:,} params, {variant} FAILED: {row['error']}", highlight=False)


# ------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Host Adam(W) step benchmark over one flat fp32 sub-group: torch AdamW fused / foreach / "
        "single-tensor on CPU vs DeepSpeedCPUAdam (if importable); params/s and bit-identity.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--sizes", type=element_count, nargs="+", default=[10**6, 10**7, 10**8],
                   help="parameters per sub-group, one run each (1e6 notation accepted)")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed steps per variant and size (after 1 warm-up)")
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1, help="torch.set_num_threads")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--json", type=Path, default=_DEFAULT_JSON, help="JSON results file")
    return p


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = build_parser().parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        print(f"unknown variant(s): {', '.join(unknown)}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)

    ds = load_deepspeed(console) if "deepspeed" in variants else DeepSpeedStatus(error="not requested")
    if "deepspeed" in variants and ds.cls is None:
        console.print(f"DeepSpeedCPUAdam SKIPPED: {ds.error}", highlight=False)

    results: dict[str, Any] = {
        "setup": {
            **{k: v for k, v in vars(args).items() if k not in ("json", "variants")},
            "variants": variants,
            "betas": list(BETAS),
            "eps": EPS,
            "dtype": "float32",
            "torch_num_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
        },
        "deepspeed": ds.to_json(),
        "sizes": [],
    }
    started = time.perf_counter()
    for numel in args.sizes:
        results["sizes"].append(run_size(numel, variants, args, ds, console))
    results["wall_s"] = time.perf_counter() - started

    print_report(results, console)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    console.print(f"{results['wall_s']:.0f} s; results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
