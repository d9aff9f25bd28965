"""The `zero3` command line: every subcommand's options, and main."""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence
from pathlib import Path

from zero3.cli.checkpoints import _cmd_export, _cmd_import_deepspeed
from zero3.cli.estimate import _add_estimate_parser
from zero3.cli.options import _PRECISIONS, non_negative_int, positive_float, positive_int
from zero3.cli.train import _cmd_train


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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))
