"""`zero3 estimate`: its options, and the table and summary it prints (the numbers are zero3.estimate's)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from zero3 import estimate as estimates
from zero3.cli.config import _read_json_object
from zero3.cli.options import non_negative_int, positive_int
from zero3.cli.reporting import _human_bytes
from zero3.config import ConfigError, load_config


def _argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a zero3.estimate parser: its ValueError becomes argparse's error, with its message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


def _add_estimate_parser(commands: Any) -> None:
    defaults = estimates.EstimateSettings()
    sub = commands.add_parser(
        "estimate",
        help="memory per rank for each state on the device, the host and disk, and the largest model that fits",
        description="Estimate one rank's bytes of each ZeRO-3 state (lp_params, hp_params, lp_grads, "
        "optim_states, persistent_params, and the contiguous_grad_buffer scratch) on the device, in host "
        "memory and on disk, for the chosen precision and offload tiers, and the largest parameter count "
        "whose estimate fits --device-memory. With a model (--hf-config or --gpt) the estimate is the "
        "engine's layout to the byte (per-parameter padding, persistent parameters, reduce buckets); "
        "with --params it is ZeRO-3's formula. Model state only: activations and the gathered layers in "
        "flight come on top.",
    )
    model = sub.add_argument_group("the model (one of)").add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=_argument(estimates.parse_count), metavar="COUNT",
                       help="parameter count, e.g. 1.3e9, 1300000000 or 1.3B (ZeRO-3's formula)")
    model.add_argument("--hf-config", metavar="PATH",
                       help="a Hugging Face config.json (or its directory): the model is built on the meta "
                       "device with transformers, nothing is downloaded (exact)")
    model.add_argument("--gpt", type=_argument(estimates.parse_gpt_shape), metavar="LAYERS,EMBD,VOCAB,BLOCK",
                       help="the built-in GPT (zero3.models) of this shape: blocks, embedding width, "
                       "vocabulary, context length (exact)")
    where = sub.add_argument_group("ranks and memory")
    where.add_argument("--ranks-per-node", type=positive_int, default=1, metavar="N",
                       help="data-parallel ranks (GPUs) per node (default: 1)")
    where.add_argument("--nodes", type=positive_int, default=1, metavar="N", help="nodes (default: 1)")
    where.add_argument("--device-memory", type=_argument(estimates.parse_bytes), default="80GiB", metavar="SIZE",
                       help="one device's memory, for the fit and the largest model: 80GiB, 80GB (10^9 "
                       "bytes) or a byte count (default: 80GiB)")
    where.add_argument("--accelerator", choices=estimates.ACCELERATORS, default=None,
                       help="the engine's device; with cpu the device is host memory (default: cuda)")
    zero = sub.add_argument_group("engine settings (default: --config's, else the engine's defaults)")
    zero.add_argument("--precision", choices=tuple(estimates.PRECISIONS), default=None,
                      help=f"compute precision, the dtype of the parameter shards (default: {defaults.precision})")
    zero.add_argument("--offload-optimizer", choices=estimates.TIERS, default=None,
                      help="where the fp32 masters and Adam moments live, offload_optimizer.device (default: none)")
    zero.add_argument("--offload-param", choices=estimates.TIERS, default=None,
                      help="where the parameter shards live, offload_param.device (default: none)")
    zero.add_argument("--reduce-bucket-size", type=_argument(estimates.parse_count), default=None, metavar="NUMEL",
                      help="elements per gradient reduce bucket, which sizes the contiguous_grad_buffer "
                      f"scratch (default: {defaults.reduce_bucket_size:.0e})")
    zero.add_argument("--persistence-threshold", type=_argument(estimates.parse_numel), default=None,
                      metavar="NUMEL", help="stage3_param_persistence_threshold: parameters this small stay "
                      f"whole on every rank (default: {defaults.persistence_threshold})")
    zero.add_argument("--max-in-cpu", type=_argument(estimates.parse_numel), default=None, metavar="NUMEL",
                      help="with --offload-param nvme: shard elements kept in host memory "
                      f"(default: {defaults.max_in_cpu:.0e})")
    zero.add_argument("--overlap-comm", action=argparse.BooleanOptionalAction, default=None,
                      help="a second reduce bucket in flight when there is more than one (default: on)")
    zero.add_argument("--grad-accum-dtype", choices=tuple(estimates.PRECISIONS), default=None,
                      help="dtype of the reduced gradients, lp_grads (default: the precision)")
    zero.add_argument("--communication-dtype", choices=tuple(estimates.PRECISIONS), default=None,
                      help="dtype of the reduce bucket (default: the precision)")
    zero.add_argument("--mics-shard-size", type=int, default=None, metavar="S",
                      help="MiCS: ranks each state is sharded over, replicated across the groups (default: -1, all)")
    zero.add_argument("--hpz-partition-size", type=non_negative_int, default=None, metavar="K",
                      help="hpZ: ranks of a secondary group, within a node (default: 1, off)")
    zero.add_argument("--lean-memory", action=argparse.BooleanOptionalAction, default=None,
                      help="lean_memory: no 16-bit shards for the trained parameters (default: off)")
    zero.add_argument("--config", type=Path, default=None, metavar="PATH",
                      help="a DeepSpeed-style JSON config to take these settings from; the options above win")
    sub.add_argument("--json", action="store_true", help="print the numbers as JSON instead of a table")
    sub.set_defaults(handler=_cmd_estimate)


def _estimate_settings(args: argparse.Namespace) -> estimates.EstimateSettings:
    base = estimates.EstimateSettings()
    if args.config is not None:
        base = estimates.EstimateSettings.from_config(load_config(_read_json_object(args.config)))
    names = ("precision", "offload_optimizer", "offload_param", "reduce_bucket_size", "persistence_threshold",
             "max_in_cpu", "overlap_comm", "grad_accum_dtype", "communication_dtype", "accelerator",
             "mics_shard_size", "hpz_partition_size", "lean_memory")
    return replace(base, **{name: getattr(args, name) for name in names if getattr(args, name) is not None})


def _cmd_estimate(args: argparse.Namespace) -> int:
    try:
        settings = _estimate_settings(args)
        if args.params is not None:
            model, params = None, args.params
        else:
            model = estimates.meta_hf_model(args.hf_config) if args.hf_config else estimates.meta_gpt(*args.gpt)
            params = None
        result = estimates.estimate(
            params=params, model=model, ranks_per_node=args.ranks_per_node, nodes=args.nodes, settings=settings
        )
    except (ValueError, ConfigError) as exc:
        print(f"zero3 estimate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(result.to_json(args.device_memory))
        return 0
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # as `zero3 train`: captured output would wrap at 80 columns
    console.print(_estimate_table(result))
    console.print(_estimate_summary(result, args.device_memory))
    return 0


def _estimate_table(result: estimates.Estimate) -> Table:
    settings = result.settings
    how = "exact (the engine's layout)" if result.exact else "ZeRO-3's formula (no padding, no persistent params)"
    table = Table(
        title=f"Bytes per rank: P = {result.params:,} parameters, N = {result.world_size} ranks "
        f"({result.ranks_per_node} per node x {result.nodes} node{'s' if result.nodes != 1 else ''}), "
        f"{settings.precision}, "
        f"optimizer on {settings.offload_optimizer}, parameters on {settings.offload_param}",
        caption=f"{how}; model state and the reduce bucket only (activations and gathered layers come on top)"
        + ("; the device is host memory (--accelerator cpu)" if settings.accelerator == "cpu" else ""),
    )
    table.add_column("state")
    for place in estimates.PLACES:
        table.add_column(place, justify="right")
    table.add_column("bytes", justify="right")
    for state, places in result.states.items():
        label = state if state in estimates.MODEL_STATES else f"{state} (scratch)"
        table.add_row(label, *(_human_bytes(places[p]) if places[p] else "-" for p in estimates.PLACES),
                      f"{sum(places.values()):,}")
    totals = [result.on(place) for place in estimates.PLACES]
    table.add_row("total", *(_human_bytes(t) for t in totals), f"{sum(totals):,}", style="bold")
    return table


def _estimate_summary(result: estimates.Estimate, device_bytes: int) -> Table:
    largest = estimates.largest_fitting_params(device_bytes, result.ranks_per_node, result.nodes, result.settings)
    device = result.on("device")
    rows = [
        ("device memory", f"{_human_bytes(device_bytes)} ({device_bytes:,} bytes)"),
        ("fits", f"{'yes' if result.fits(device_bytes) else 'NO'}: {_human_bytes(device)} per rank on the device"),
        ("largest model that fits", "no limit from the device (it holds only the scratch bucket)"
         if largest is None else f"{largest:,} parameters ({largest / 1e9:.2f}B; ZeRO-3's formula)"),
        ("per node", f"host {_human_bytes(result.on('host') * result.ranks_per_node)}, "
         f"disk {_human_bytes(result.on('disk') * result.ranks_per_node)} ({result.ranks_per_node} ranks)"),
    ]
    for place, nbytes in result.backward_bytes.items():
        rows.append(("during a backward", f"up to {_human_bytes(nbytes)} more per rank on the {place}: the gradient "
                     "shards, made as the backward reaches them and dropped at the step"))
    if result.disk_files() != result.on("disk"):
        rows.append(("disk files", f"{_human_bytes(result.disk_files())} per rank: the optimizer's files come in "
                     "two generations (a failed step loses nothing)"))
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    for name, value in rows:
        summary.add_row(name, value)
    return summary
