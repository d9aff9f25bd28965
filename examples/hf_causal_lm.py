"""Fine-tune a Hugging Face causal LM (a small Llama) with zero3's ZeRO stage 3.

The model is built from a `LlamaConfig` (nothing is downloaded) inside
`zero3.Init`, so each module's parameters are partitioned across the ranks as
its constructor returns; Hugging Face's own weight init (`post_init`) still
lands, as in a single process with the same seed. Training runs on the built-in
character corpus (`zero3.data`) or on random tokens. At the end the script
saves a sharded checkpoint (`engine.save_checkpoint`, resumable at any world
size) and the consolidated 16-bit weights (`engine.save_16bit_model`) next to
the model's `config.json`, so the output directory loads with
`LlamaForCausalLM.from_pretrained`; it loads it and prints the loss on a batch
beside the engine's, to show the weights round-trip.

    python examples/hf_causal_lm.py                                   # a world of one
    torchrun --nproc_per_node 2 examples/hf_causal_lm.py --steps 20 --out /tmp/run

Run it after `pip install -e .` (so `zero3` imports). The device follows
zero3's rule (README, "Which device"): a GPU per rank if the machine has one for
every local rank, else the CPU; `--device cpu` forces the CPU (ranks talk over
gloo), e.g. for more ranks than GPUs.

Every rank draws the same *global* batch of a step from a generator seeded by
(seed, step) and takes its own rows, so the global batch, and the loss printed
for it (the mean over every rank's rows), do not depend on the world size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

import zero3
from zero3 import accelerator, comm
from zero3.cli import non_negative_float, non_negative_int, positive_int
from zero3.data import CharTokenizer, load_corpus, sample_global_batch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_RANDOM_VOCAB = 256


# ----------------------------------------------------------------------- options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Fine-tune a small LlamaForCausalLM with zero3 (ZeRO-3); run plainly or under torchrun.",
    )
    model = parser.add_argument_group("model (a LlamaConfig; nothing is downloaded)")
    model.add_argument("--hidden", type=positive_int, default=64, help="hidden size (default: %(default)s)")
    model.add_argument("--intermediate", type=positive_int, default=None, help="MLP size (default: 4 x hidden)")
    model.add_argument("--layers", type=positive_int, default=2, help="decoder layers (default: %(default)s)")
    model.add_argument("--heads", type=positive_int, default=4, help="attention heads (default: %(default)s)")
    model.add_argument("--kv-heads", type=positive_int, default=None,
                       help="key/value heads, grouped-query attention (default: --heads)")
    model.add_argument("--vocab", type=positive_int, default=None,
                       help=f"vocabulary size (default: the corpus's characters; {_RANDOM_VOCAB} with --data random)")
    model.add_argument("--tie-embeddings", action="store_true",
                       help="share the input embedding with the output head")
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=positive_int, default=20, help="optimizer steps (default: %(default)s)")
    train.add_argument("--micro-batch", type=positive_int, default=4,
                       help="sequences per rank per step (default: %(default)s)")
    train.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence (default: %(default)s)")
    train.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    train.add_argument("--weight-decay", type=non_negative_float, default=0.01,
                       help="AdamW weight decay (default: %(default)s)")
    train.add_argument("--clip", type=non_negative_float, default=1.0,
                       help="clip gradients to this global norm; 0: no clipping (default: %(default)s)")
    train.add_argument("--precision", choices=("auto", *sorted(_DTYPES)), default="auto",
                       help="compute dtype; fp32 masters and Adam moments either way; auto is bf16, or fp32 on "
                            "a CPU without bf16 units, where bf16 is emulated at a large cost (default: %(default)s)")
    train.add_argument("--data", choices=("corpus", "random"), default="corpus",
                       help="the built-in character corpus (zero3.data), or uniform random tokens "
                            "(default: %(default)s)")
    train.add_argument("--persistence-threshold", type=non_negative_int, default=0,
                       help="stage3_param_persistence_threshold: parameters of at most this many elements stay "
                            "whole on every rank (DeepSpeed's default is 100000, which would keep every weight of "
                            "the small default model whole; 0 partitions them all; default: %(default)s)")
    train.add_argument("--seed", type=int, default=0, help="seeds the weights and the batches (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("hf_causal_lm_out"),
                        help="output directory: config.json + model.safetensors, and checkpoint/ "
                             "(default: %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where every rank computes (default: zero3's rule: ZERO3_ACCELERATOR, else cuda if "
                             "there is a GPU per local rank, else cpu)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {kv_heads}")
    corpus_vocab = CharTokenizer.from_corpus().vocab_size if args.data == "corpus" else 0
    if args.vocab is None:
        args.vocab = corpus_vocab if args.data == "corpus" else _RANDOM_VOCAB
    elif args.vocab < corpus_vocab:
        parser.error(f"--vocab {args.vocab} is smaller than the corpus's {corpus_vocab} characters")
    return args


# ------------------------------------------------------------------ the pieces


def model_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=args.tie_embeddings,
    )


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    """The DeepSpeed-style config (a JSON file's contents would do as well)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": args.weight_decay}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": args.persistence_threshold},
    }
    if args.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def init_distributed(args: argparse.Namespace) -> None:
    """Join torchrun's rendezvous (env://), or become a world of one under plain `python`.

    The same device rule as the engine's (`zero3 train` does this too), so the
    backend fits the device: gloo on the CPU, nccl on CUDA.
    """
    comm.join_world(args.device)


def num_parameters(args: argparse.Namespace) -> int:
    """The model's size, from a copy on the meta device (a partitioned parameter's `.numel()`
    counts only its released placeholder)."""
    with torch.device("meta"):
        return LlamaForCausalLM(model_config(args)).num_parameters()


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    """The Llama, partitioned across the ranks as it is built (the same weights as a plain
    `torch.manual_seed(args.seed); LlamaForCausalLM(model_config(args))`)."""
    torch.manual_seed(args.seed)
    with zero3.Init(config=engine_config(args), device=args.device):
        return LlamaForCausalLM(model_config(args))


def build_engine(args: argparse.Namespace) -> zero3.ZeroEngine:
    model = build_model(args)
    cfg = engine_config(args)
    engine, _, _, _ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                       device=args.device)
    return engine


def global_batch(args: argparse.Namespace, step: int, world: int, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Step `step`'s token ids, shape (world * micro_batch, seq_len); rank r trains on rows
    [r * micro_batch, (r + 1) * micro_batch). Labels are the ids themselves (the model shifts them)."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    rows = world * args.micro_batch
    if args.data == "random":
        return torch.randint(0, args.vocab, (rows, args.seq_len), generator=generator)
    if tokens is None:
        tokens = corpus_tokens()
    ids, _ = sample_global_batch(tokens, args.seq_len, rows, generator)  # random windows of the corpus
    return ids


def corpus_tokens() -> torch.Tensor:
    corpus = load_corpus()
    return CharTokenizer(corpus).encode(corpus)


def rank_rows(args: argparse.Namespace, batch: torch.Tensor, rank: int) -> torch.Tensor:
    return batch[rank * args.micro_batch : (rank + 1) * args.micro_batch]


def train(engine: zero3.ZeroEngine, args: argparse.Namespace, log: bool = True) -> list[float]:
    """`args.steps` optimizer steps; returns each step's loss, the mean over every rank's rows."""
    rank, world = engine.global_rank, engine.world_size
    tokens = corpus_tokens() if args.data == "corpus" else None
    losses: list[float] = []
    for step in range(args.steps):
        ids = rank_rows(args, global_batch(args, step, world, tokens), rank).to(engine.device)
        loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        # Every rank has as many tokens, so the mean of the ranks' means is the global mean.
        mean = loss.detach().float().reshape(1)
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if log and rank == 0:
            print(f"step {step + 1}/{args.steps} loss {losses[-1]:.4f}", flush=True)
    return losses


def save(engine: zero3.ZeroEngine, args: argparse.Namespace) -> None:
    """The sharded checkpoint (out/checkpoint/<tag>, resumable at any world size) and the
    Hugging Face directory (out/config.json + out/model.safetensors); collective."""
    out = Path(args.out)
    engine.save_checkpoint(out / "checkpoint")
    if engine.global_rank == 0:
        model_config(args).save_pretrained(out)
    engine.save_16bit_model(out, "model.safetensors")  # ends in a barrier: every file is written


def check_round_trip(engine: zero3.ZeroEngine, args: argparse.Namespace) -> dict[str, float] | None:
    """Load out/ with `from_pretrained` and compare it with the engine on a batch it never trained on.

    Every rank runs the engine's forward (a collective) on the same rows; rank 0
    loads the saved model and returns both losses and the largest logit
    difference (the other ranks return None).
    """
    ids = rank_rows(args, global_batch(args, args.steps, engine.world_size), 0).to(engine.device)
    with torch.no_grad():
        ours = engine(input_ids=ids, labels=ids, use_cache=False)
    if engine.global_rank != 0:
        return None
    # .to() rather than from_pretrained's dtype argument (torch_dtype before transformers 4.56).
    loaded = LlamaForCausalLM.from_pretrained(args.out).to(engine.device, _DTYPES[args.precision])
    with torch.no_grad():
        theirs = loaded(input_ids=ids, labels=ids, use_cache=False)
    return {
        "engine_loss": ours.loss.float().item(),
        "loaded_loss": theirs.loss.float().item(),
        "max_logit_diff": (ours.logits.float() - theirs.logits.float()).abs().max().item(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()  # the weight-loading bar, in the middle of our lines
    init_distributed(args)
    if args.precision == "auto":
        device = accelerator.resolve_device(args.device)
        args.precision = "bf16" if device.type == "cuda" or accelerator.computes_bf16_natively(device) else "fp32"
        if args.precision == "fp32" and dist.get_rank() == 0:
            print(f"this CPU ({accelerator.cpu_capability()}) would emulate bf16 at about 170x the cost of "
                  "fp32: training in fp32 (--precision bf16 to insist)", flush=True)
    engine = build_engine(args)
    rank = engine.global_rank
    if rank == 0:
        print(f"LlamaForCausalLM: {num_parameters(args):,} parameters, {engine.world_size} rank(s) on {engine.device}, "
              f"{args.precision}, {args.data} data", flush=True)
    train(engine, args)
    save(engine, args)
    if rank == 0:
        print(f"saved {args.out / 'checkpoint'} and {args.out / 'model.safetensors'}", flush=True)
    report = check_round_trip(engine, args)
    if report is not None:  # rank 0
        print(f"from_pretrained({str(args.out)!r}): loss {report['loaded_loss']:.4f} "
              f"(engine {report['engine_loss']:.4f}), max |logit diff| {report['max_logit_diff']:.2e}", flush=True)
    engine.destroy()
    dist.barrier()  # rank 0 hosts the rendezvous store: leave together
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
