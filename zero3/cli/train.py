"""`zero3 train`: the options checked and turned into a TrainJob, then launched."""

from __future__ import annotations

import argparse
import sys

from zero3.cli.config import _read_json_object, build_config, merge_user_config
from zero3.cli.job import TrainJob
from zero3.cli.launch import Rendezvous, _launch
from zero3.cli.options import _PRECISION_NAMES
from zero3.config import ConfigError, load_config
from zero3.data import CharTokenizer, load_corpus
from zero3.models.gpt import GPTConfig


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
