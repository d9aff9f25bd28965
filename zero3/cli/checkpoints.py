"""`zero3 export` and `zero3 import-deepspeed`: the commands that read or write checkpoints in one process."""

from __future__ import annotations

import argparse
import sys


def _cmd_import_deepspeed(args: argparse.Namespace) -> int:
    from zero3.import_deepspeed import import_deepspeed_checkpoint
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
