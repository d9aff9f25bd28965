"""The `zero3` command: train the built-in GPT on the built-in corpus with ZeRO-3.

`zero3 train` starts N local worker processes with torch's elastic launcher (the
machinery behind torchrun), so a single command shows the engine end to end:
parameters partitioned at construction, sharded optimizer, mixed precision, and
the per-rank model-state bytes set beside ZeRO-3's 16P/N expectation.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from zero3 import estimate as estimates
from zero3.config import ConfigError, load_config
from zero3.data import CharTokenizer, load_corpus, sample_global_batch
from zero3.models.gpt import GPT, GPTConfig

_PRECISIONS = ("fp32", "bf16", "fp16")
_PRECISION_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# Order of the model-state columns; keys the engine adds beyond these are shown too.
_STATE_KEYS = ("lp_params", "hp_params", "lp_grads", "optim_states", "persistent_params")


# ----------------------------------------------------------------------- options


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zero3",
        # Keep the epilog's one-option-per-line layout.
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="zero3: a ZeRO stage-3 training engine for PyTorch. "
        "`zero3 train` runs its built-in demo; `zero3 export` writes a checkpoint's weights as safetensors; "
        "`zero3 import-deepspeed` makes a DeepSpeed ZeRO-3 checkpoint a zero3 one.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    train = commands.add_parser(
        "train",
        help="train a small character-level GPT on the built-in corpus with ZeRO-3",
        description="Train a small character-level GPT on the built-in English corpus "
        "with ZeRO stage 3 across N local processes, then print each rank's "
        "model-state bytes beside the 16P/N expectation.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = train.add_argument_group("run")
    run.add_argument("--nproc", type=positive_int, default=2, metavar="N",
                     help="number of local ranks (worker processes) to launch on this node")
    nodes = train.add_argument_group(
        "several nodes", "run the same command on every node (torchrun's options of the same names)")
    nodes.add_argument("--nnodes", type=positive_int, default=1, metavar="N",
                       help="nodes in the job, each running --nproc ranks")
    nodes.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="where the nodes meet: a c10d rendezvous hosted by the first node to arrive "
                       "(needed with --nnodes above 1)")
    nodes.add_argument("--rdzv-id", default="zero3-train", metavar="ID",
                       help="the job's name at the rendezvous (the same on every node)")
    nodes.add_argument("--node-rank", type=non_negative_int, default=None, metavar="R",
                       help="this node's index, for a static rendezvous at --rdzv-endpoint (rank 0's node "
                       "hosts it); without it the c10d rendezvous numbers the nodes")
    run.add_argument("--steps", type=positive_int, default=200,
                     help="optimizer steps to train")
    run.add_argument("--micro-batch", type=positive_int, default=8,
                     help="sequences per rank per forward/backward (train_micro_batch_size_per_gpu)")
    run.add_argument("--grad-accum", type=positive_int, default=1,
                     help="micro-batches accumulated per optimizer step (gradient_accumulation_steps)")
    run.add_argument("--lr", type=positive_float, default=1e-3,
                     help="peak AdamW learning rate, reached by a linear warmup over "
                     "min(100, steps/10) steps (at least 1)")
    run.add_argument("--precision", choices=("auto", *_PRECISIONS), default="auto",
                     help="compute precision: fp32, bf16, or fp16 with dynamic loss scaling; auto is bf16, "
                     "or fp32 on a CPU without bf16 units (where bf16 is emulated at a large cost)")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="where the ranks compute: auto follows ZERO3_ACCELERATOR, then CUDA "
                     "when this machine has a GPU per rank, else the CPU")
    run.add_argument("--seed", type=non_negative_int, default=0,
                     help="seed of the model init and of the batch sampling")
    run.add_argument("--log-every", type=positive_int, default=10, metavar="STEPS",
                     help="average the loss across ranks and show it every this many steps")
    ckpt = train.add_argument_group("checkpoints")
    ckpt.add_argument("--save-dir", type=Path, default=None, metavar="DIR",
                      help="save a sharded checkpoint here after the last step (and every --save-every steps)")
    ckpt.add_argument("--save-every", type=positive_int, default=None, metavar="STEPS",
                      help="also save every this many steps (needs --save-dir)")
    ckpt.add_argument("--resume", action="store_true",
                      help="continue from the checkpoint `latest` names in --save-dir (from step 0 if there is "
                      "none); the run then ends at --steps, as if it had never stopped")
    ckpt.add_argument("--max-restarts", type=non_negative_int, default=0, metavar="N",
                      help="when a worker dies, restart the workers up to N times (torch's elastic launcher); "
                      "each restart resumes from the newest checkpoint in --save-dir")
    model = train.add_argument_group("model")
    model.add_argument("--block-size", type=positive_int, default=64,
                       help="context length in characters")
    model.add_argument("--n-layer", type=positive_int, default=4, help="transformer blocks")
    model.add_argument("--n-head", type=positive_int, default=4,
                       help="attention heads (must divide --n-embd)")
    model.add_argument("--n-embd", type=positive_int, default=128, help="embedding width")
    zero = train.add_argument_group("ZeRO")
    zero.add_argument("--persistence-threshold", type=non_negative_int, default=0,
                      metavar="NUMEL",
                      help="stage3_param_persistence_threshold: parameters with at most this "
                      "many elements stay whole on every rank (0 partitions all of them)")
    zero.add_argument("--lean-memory", action=argparse.BooleanOptionalAction, default=None,
                      help="lean_memory: no 16-bit shards for the trained parameters (default: off)")
    zero.add_argument("--config", type=Path, default=None, metavar="PATH",
                      help="DeepSpeed-style JSON config merged over the one built from these "
                      "options (its values win; if it sets any batch-size key or bf16/fp16, "
                      "it owns all of them)")
    train.set_defaults(handler=_cmd_train)
    export = commands.add_parser(
        "export",
        help="write a checkpoint's weights as safetensors (one process, no GPU)",
        description="Write the weights of a zero3 checkpoint (saved at any world size) as safetensors: "
        "one file, or Hugging Face's sharded layout above --max-shard-size. Memory holds one shard's worth "
        "of tensors at a time.",
    )
    export.add_argument("checkpoint_dir", help="the save_checkpoint directory (its `latest` tag unless --tag)")
    export.add_argument("out_dir", help="where the safetensors files go")
    export.add_argument("--tag", default=None, help="the tag to export (default: the one `latest` names)")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="dtype of the floating-point weights")
    export.add_argument("--max-shard-size", default="5GB", help="largest file before sharding, e.g. 5GB, 500MB")
    export.add_argument("--trust-checkpoint", action="store_true",
                        help="read the checkpoint's pickled files without the weights-only guard (only for "
                             "files you trust: they could run code)")
    export.set_defaults(handler=_cmd_export)
    imported = commands.add_parser(
        "import-deepspeed",
        help="make a DeepSpeed ZeRO-3 checkpoint a zero3 one (one process, no GPU)",
        description="Read a DeepSpeed ZeRO-3 checkpoint (saved at any world size: fp32 masters, Adam's moments "
        "and steps, the LR schedule, the counters and the client state) and write it as a zero3 checkpoint "
        "that loads at any world size. DeepSpeed's files are pickles: --trust-checkpoint is required.",
    )
    imported.add_argument("checkpoint_dir", help="DeepSpeed's save_checkpoint directory (its `latest` tag unless --tag)")
    imported.add_argument("out_dir", help="the zero3 checkpoint directory to write (new, or empty)")
    imported.add_argument("--tag", default=None, help="the DeepSpeed tag to import (default: the one `latest` names)")
    imported.add_argument("--trust-checkpoint", action="store_true",
                          help="you trust DeepSpeed's pickled files (they are still read under an allowlist of "
                               "what DeepSpeed writes where that suffices)")
    imported.set_defaults(handler=_cmd_import_deepspeed)
    _add_estimate_parser(commands)
    parser.epilog = _options_summary(train)
    return parser


def _options_summary(sub: argparse.ArgumentParser) -> str:
    """One line per option of `sub`, so the top-level help names them all too."""
    lines = [f"options of `{sub.prog}` (details: {sub.prog} --help):"]
    for action in sub._actions:  # argparse has no public accessor for these
        if action.option_strings and action.help is not argparse.SUPPRESS and action.dest != "help":
            names = ", ".join(action.option_strings)
            lines.append(textwrap.fill(
                f"{names:<24} {action.help}", width=100,
                initial_indent="  ", subsequent_indent=" " * 27,
            ))
    return "\n".join(lines)


def _cmd_import_deepspeed(args: argparse.Namespace) -> int:
    from zero3.checkpoint.deepspeed_import import import_deepspeed_checkpoint
    from zero3.checkpoint.tags import CheckpointError

    try:
        written = import_deepspeed_checkpoint(args.checkpoint_dir, args.out_dir, args.trust_checkpoint, args.tag)
    except (CheckpointError, ValueError) as error:
        print(f"zero3 import-deepspeed: {error}", file=sys.stderr)
        return 2
    print(written)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from zero3.checkpoint.export import export
    from zero3.checkpoint.tags import CheckpointError
    from zero3.checkpoint.weights import parse_size

    try:
        written = export(args.checkpoint_dir, args.out_dir, args.dtype, parse_size(args.max_shard_size), args.tag,
                         trust_checkpoint=args.trust_checkpoint)
    except (CheckpointError, ValueError) as error:
        print(f"zero3 export: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


# ------------------------------------------------------------------- zero3 estimate


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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


# ------------------------------------------------------------------- the config


def build_config(args: argparse.Namespace) -> dict[str, Any]:
    """The DeepSpeed-style config the options describe."""
    if args.precision == "auto":
        args.precision = _default_precision(args.device)
    # A zero-length warmup would divide by zero in a WarmupLR-style schedule.
    warmup = max(1, min(100, args.steps // 10))
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": args.lr,
                "warmup_num_steps": warmup,
                "warmup_type": "linear",
            },
        },
        "bf16": {"enabled": args.precision == "bf16"},
        "fp16": {"enabled": args.precision == "fp16"},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": args.persistence_threshold,
        },
    }


# Keys that only make sense together: a user file that sets one of a group takes
# the whole group, so "fp16": {"enabled": true} does not collide with our bf16, and
# a train_batch_size does not contradict our micro-batch and accumulation.
_OWNED_TOGETHER = (
    ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
    ("bf16", "fp16"),
)


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def merge_user_config(built: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    base = dict(built)
    for group in _OWNED_TOGETHER:
        if any(key in user for key in group):
            for key in group:
                base.pop(key, None)
    return _deep_merge(base, user)


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


# ------------------------------------------------------------------- the launch


@dataclass(frozen=True)
class TrainJob:
    """Everything a worker needs; pickled to each spawned process."""

    model: GPTConfig
    ds_config: dict[str, Any]
    steps: int
    seed: int
    log_every: int
    precision: str
    micro_batch: int
    grad_accum: int
    device: str | None = None  # None: zero3's own rule (zero3.accelerator.resolve_device)
    save_dir: str | None = None
    save_every: int | None = None
    resume: bool = False
    max_restarts: int = 0


def _cmd_train(args: argparse.Namespace) -> int:
    tokenizer = CharTokenizer(load_corpus())
    try:
        gpt = GPTConfig(
            vocab_size=tokenizer.vocab_size,
            block_size=args.block_size,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
        )
        cfg = build_config(args)
        if args.config is not None:
            cfg = merge_user_config(cfg, _read_json_object(args.config))
        # Validate here, once, so a bad option fails before N processes start.
        parsed = load_config(cfg)
        batch = parsed.resolve_batch(args.nproc * args.nnodes)
        if args.save_dir is None and (args.save_every is not None or args.resume or args.max_restarts):
            raise ValueError("--save-every, --resume and --max-restarts need --save-dir DIR")
        if args.nnodes > 1 and args.rdzv_endpoint is None:
            raise ValueError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, where the nodes meet")
        if args.node_rank is not None and args.node_rank >= args.nnodes:
            raise ValueError(f"--node-rank {args.node_rank}: expected 0..{args.nnodes - 1} (--nnodes {args.nnodes})")
    except (ValueError, ConfigError) as exc:
        # Plain print, here and below: rich would re-wrap messages and file paths.
        print(f"zero3 train: {exc}", file=sys.stderr)
        return 2
    job = TrainJob(
        model=gpt,
        ds_config=cfg,
        steps=args.steps,
        seed=args.seed,
        log_every=args.log_every,
        # From the validated config, which a --config file may have changed.
        precision=_PRECISION_NAMES[parsed.compute_dtype],
        micro_batch=batch.micro_batch_per_gpu,
        grad_accum=batch.gradient_accumulation_steps,
        device=None if args.device == "auto" else args.device,
        save_dir=str(args.save_dir) if args.save_dir is not None else None,
        save_every=args.save_every,
        resume=args.resume,
        max_restarts=args.max_restarts,
    )
    return _launch(job, args.nproc, Rendezvous(args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.node_rank))


def _default_precision(device_choice: str) -> str:
    """bf16, unless the ranks will compute on a CPU without bf16 units (said in one line)."""
    from zero3 import accelerator

    device = accelerator.resolve_device(None if device_choice == "auto" else device_choice)
    if device.type == "cuda" or accelerator.computes_bf16_natively(device):
        return "bf16"
    print(f"zero3 train: this CPU ({accelerator.cpu_capability()}) would emulate bf16 at about 170x the "
          "cost of fp32, so it trains in fp32 (--precision bf16 to insist)")
    return "fp32"


@dataclass(frozen=True)
class Rendezvous:
    """Where the job's nodes meet (torchrun's --nnodes, --rdzv-endpoint, --rdzv-id, --node-rank)."""

    nnodes: int = 1
    endpoint: str | None = None  # None: this node alone, on a free local port
    run_id: str = "zero3-train"
    node_rank: int | None = None  # given: a static rendezvous (rank 0's node hosts the store)

    def launch_options(self) -> dict[str, Any]:
        if self.endpoint is None:
            return {"rdzv_backend": "c10d", "rdzv_endpoint": "localhost:0",  # the c10d store picks a free port
                    "run_id": f"zero3-train-{uuid.uuid4().hex[:8]}"}
        if self.node_rank is not None:
            return {"rdzv_backend": "static", "rdzv_endpoint": self.endpoint, "run_id": self.run_id,
                    "rdzv_configs": {"rank": self.node_rank}}
        return {"rdzv_backend": "c10d", "rdzv_endpoint": self.endpoint, "run_id": self.run_id}


def _launch(job: TrainJob, nproc: int, rendezvous: Rendezvous = Rendezvous()) -> int:
    # Imported here: the elastic machinery is only needed by the launching process.
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    log_dir = tempfile.mkdtemp(prefix="zero3-train-")
    config = LaunchConfig(
        min_nodes=rendezvous.nnodes,
        max_nodes=rendezvous.nnodes,
        nproc_per_node=nproc,
        **rendezvous.launch_options(),
        max_restarts=job.max_restarts,
        monitor_interval=0.2,
        # Only rank 0 talks to the terminal; the others' output goes to files that
        # are kept (and named) if the run fails.
        logs_specs=DefaultLogsSpecs(
            log_dir=log_dir, redirects={r: Std.ALL for r in range(1, nproc)}
        ),
    )
    # One thread per rank unless the user chose: N ranks each using every core
    # oversubscribe the CPU (torchrun makes the same choice).
    saved_omp = os.environ.get("OMP_NUM_THREADS")
    if saved_omp is None:
        os.environ["OMP_NUM_THREADS"] = "1"
    # The agent logs a failed worker's traceback itself; we print the same
    # traceback once, in ChildFailedError's summary, so mute the agent's copy.
    agent_log = logging.getLogger("torch.distributed.elastic")
    saved_level = agent_log.level
    agent_log.setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, _train_worker)(job)
    except ChildFailedError as exc:
        _report_failure(exc, log_dir)
        return 1
    finally:
        agent_log.setLevel(saved_level)
        if saved_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _report_failure(exc: Any, log_dir: str) -> None:
    """Say what went wrong on the workers: the first failure's traceback, then one line per rank."""
    _, first = exc.get_first_failure()
    traceback_text = _failure_text(first).strip()
    if "\n" in traceback_text:  # a whole traceback, not just the exception's line
        print(traceback_text, file=sys.stderr)
    for rank, failure in sorted(exc.failures.items()):
        print(f"zero3 train: rank {rank} failed: {_failure_line(failure, log_dir)}", file=sys.stderr)
    print(f"zero3 train: the workers' logs are in {log_dir}", file=sys.stderr)


def _failure_text(failure: Any) -> str:
    """The traceback a worker recorded in its error file ('' if it left none: killed, or died in C++)."""
    message = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return message if isinstance(message, str) else ""


def _failure_line(failure: Any, log_dir: str) -> str:
    text = _failure_text(failure)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines:
        return lines[-1]  # "ExceptionType: message"
    cause = (
        f"killed by signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    )
    tail = _log_tail(log_dir, failure.local_rank)
    return f"{cause}; {tail}" if tail else f"{cause} (its output is above)"


def _log_tail(log_dir: str, local_rank: int, lines: int = 5) -> str:
    """The last lines of a redirected worker's stderr log (rank 0 writes to the terminal instead)."""
    for path in sorted(Path(log_dir).glob(f"**/attempt_*/{local_rank}/stderr.log")):
        tail = [line for line in path.read_text(errors="replace").splitlines() if line.strip()][-lines:]
        if tail:
            return "last lines of its stderr: " + " | ".join(tail)
    return ""


# ------------------------------------------------------------------- the worker


def _batch_seed(seed: int, step: int) -> int:
    # Not seed + step: that would make run (seed=1) replay run (seed=0)'s batches
    # shifted by one step. Spreading the seeds apart keeps runs independent.
    return seed * 1_000_003 + step


def _init_process_group(device_choice: str | None) -> None:
    """Join the elastic launcher's rendezvous before the engine looks for a group.

    The engine joins an existing default group, and this command needs that same
    group itself (loss averaging, gathering the memory table).
    """
    from zero3 import comm

    comm.join_world(device_choice)


def _train_worker(job: TrainJob) -> dict[str, float]:
    """Runs in every spawned process (module level, so it can be pickled)."""
    import zero3  # the engine is only needed by the workers

    _init_process_group(job.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(job.seed)

    corpus = load_corpus()
    tokenizer = CharTokenizer(corpus)
    if tokenizer.vocab_size != job.model.vocab_size:
        raise RuntimeError("the corpus changed between launch and worker start")
    tokens = tokenizer.encode(corpus)

    cfg = job.ds_config
    # A restarted attempt (the launcher's --max-restarts) always goes on from the newest checkpoint.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if job.save_dir is not None:
        cfg = _deep_merge({"checkpoint": {"dir": job.save_dir, "interval_steps": job.save_every,
                                          "resume": job.resume or restarted}}, cfg)
    with zero3.Init(config=cfg, device=job.device):
        model = GPT(job.model)
    engine, _, _, _ = zero3.initialize(
        model=model, model_parameters=model.parameters(), config=cfg, device=job.device
    )

    console = Console()
    if not console.is_terminal:
        # Piped or captured output defaults to 80 columns, too narrow for the table.
        console = Console(width=160)
    # One optimizer step per step of this loop: the engine's step count is where a resumed run goes on.
    start_step = engine.global_steps
    if start_step and rank == 0:
        attempt = f" (restart {os.environ['TORCHELASTIC_RESTART_COUNT']})" if restarted else ""
        console.print(f"resumed from {job.save_dir} at step {start_step}{attempt}")
    elif (job.resume or restarted) and rank == 0:
        console.print(f"no checkpoint in {job.save_dir}: starting at step 0")
    micro, accum = job.micro_batch, job.grad_accum
    # The global batch of a step is every rank's every micro-step, laid out as
    # [micro-step][rank][row], so its contents do not depend on how it is split
    # between ranks and accumulation.
    global_rows = micro * accum * world
    generator = torch.Generator()
    first_loss = last_loss = float("nan")

    with _progress(console, disable=rank != 0) as progress:
        task = progress.add_task("train", total=job.steps, loss="-", completed=start_step)
        start = time.perf_counter()
        for step in range(start_step, job.steps):
            generator.manual_seed(_batch_seed(job.seed, step))
            x_all, y_all = sample_global_batch(tokens, job.model.block_size, global_rows, generator)
            loss_sum = torch.zeros((), device=engine.device)
            for k in range(accum):
                lo = (k * world + rank) * micro
                x = x_all[lo : lo + micro].to(engine.device)
                y = y_all[lo : lo + micro].to(engine.device)
                loss = engine(x, y)["loss"]
                engine.backward(loss)
                engine.step()
                loss_sum += loss.detach().float()
            last_step = step == job.steps - 1
            # Averaging needs a collective, so only on steps every rank agrees on.
            if step == start_step or (step + 1) % job.log_every == 0 or last_step:
                dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
                last_loss = loss_sum.item() / (accum * world)
                if step == start_step:
                    first_loss = last_loss
                progress.update(task, loss=f"{last_loss:.4f}")
            progress.advance(task)
            # Every --save-every steps the engine saved by itself (its config's checkpoint section); the
            # batches come from (seed, step), so the step count is all a resume needs.
            saved = job.save_every is not None and (step + 1) % job.save_every == 0
            if job.save_dir is not None and last_step and not saved:
                engine.save_checkpoint(job.save_dir)
        elapsed = time.perf_counter() - start
        trained = job.steps - start_step

    states: list[dict[str, int] | None] = [None] * world
    dist.all_gather_object(states, engine.model_state_bytes())
    skipped = int(engine.skipped_steps)
    if rank == 0:
        tokens_per_s = trained * global_rows * job.model.block_size / max(elapsed, 1e-9)
        console.print(_state_table(states, job.model.num_parameters(), world))
        _print_summary(console, job, world, first_loss, last_loss, elapsed, tokens_per_s, skipped, start_step)
    engine.destroy()
    dist.barrier()  # rank 0 hosts the store: leave together
    dist.destroy_process_group()
    return {"first_loss": first_loss, "final_loss": last_loss, "elapsed_s": elapsed}


# ------------------------------------------------------------------- reporting


class _StepsPerSecond(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("? steps/s" if speed is None else f"{speed:.2f} steps/s")


def _progress(console: Console, disable: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        _StepsPerSecond(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        disable=disable,
    )


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _state_table(states: Sequence[dict[str, int] | None], num_params: int, world: int) -> Table:
    expected = 16 * num_params / world
    present = [s for s in states if s is not None]
    extra = sorted({k for s in present for k in s} - set(_STATE_KEYS) - {"total"})
    keys = [*_STATE_KEYS, *extra]
    table = Table(
        title=f"Model-state bytes per rank: P = {num_params:,} parameters, N = {world} ranks",
        caption="16P/N: 2 (16-bit params) + 2 (16-bit grads) + 4 (fp32 master) + 8 (Adam "
        "moments) bytes per parameter, split over N ranks",
    )
    table.add_column("rank", justify="right")
    for key in keys:
        table.add_column(key, justify="right")
    table.add_column("total", justify="right", style="bold")
    table.add_column("16P/N", justify="right", no_wrap=True)
    table.add_column("total / (16P/N)", justify="right", no_wrap=True)
    for rank, state in enumerate(states):
        state = state or {}
        total = state.get("total", 0)
        table.add_row(
            str(rank),
            *(_human_bytes(state[k]) if k in state else "-" for k in keys),
            _human_bytes(total),
            _human_bytes(expected),
            f"{total / expected:.3f}",
        )
    return table


def _print_summary(
    console: Console,
    job: TrainJob,
    world: int,
    first_loss: float,
    final_loss: float,
    elapsed: float,
    tokens_per_s: float,
    skipped: int,
    start_step: int = 0,
) -> None:
    resumed = f", resumed at step {start_step}" if start_step else ""
    rows = [
        ("precision", job.precision),
        ("steps", f"{job.steps} (skipped by fp16 overflow: {skipped}{resumed})"),
        ("global batch", f"{job.micro_batch * job.grad_accum * world} sequences of "
         f"{job.model.block_size} characters"),
        ("first loss", f"{first_loss:.4f}"),
        ("final loss", f"{final_loss:.4f}"),
        ("elapsed", f"{elapsed:.1f} s (training loop)"),
        ("throughput", f"{tokens_per_s:,.0f} tokens/s ({(job.steps - start_step) / max(elapsed, 1e-9):.2f} steps/s)"),
    ]
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    for name, value in rows:
        summary.add_row(name, value)
    console.print(summary)


if __name__ == "__main__":
    sys.exit(main())
