#!/usr/bin/env python
"""By-hand benchmark: expert parallelism against plain ZeRO-3 on a Hugging Face Qwen3-MoE (issue 67's targets).

Not a test: nothing here asserts. A Qwen3-MoE built from a config (no download; by default 8 layers of 16
experts, top-2, experts about 90% of the parameters) trains in fp32 at 2 and 4 CPU ranks (gloo, one thread
each), one variant at a time in fresh processes, on the same global batches:

* `zero3 plain ZeRO-3`: every parameter sharded over every rank, every expert gathered in every forward
  and backward;
* `zero3 expert parallel`: `expert_parallel.autoep_size` = the world (each rank owns E/N experts whole);
* `DeepSpeed AutoEP` (DeepSpeed's own `expert_parallel`, ZeRO-3) where `import deepspeed` works and it runs
  on the CPU; a variant that fails says why in the table.

Per variant: the median step time over `--steps` steps after `--warmup`, tokens/s, and the bytes each rank
gathers and sends by all-to-all per step, counted at torch.distributed's collectives (an all-gather's
gathered output; an all-to-all's sent tensor, the backward's included). The same arithmetic
(`expected_bytes`: each weight gathered twice a step, forward and backward; the tokens' hidden states four
times a layer, out and back in the forward and the backward) is printed beside the counts and applied to
Qwen3-30B-A3B at 8 nodes x 8 ranks in bf16 with 4096 tokens per rank.

    python benchmarks/moe.py                          # ~3 min on 2 cores
    python benchmarks/moe.py --worlds 2 --steps 2 --layers 2     # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_REPO = Path(__file__).resolve().parent.parent
_DEFAULT_OUT = _REPO / "benchmarks" / "results" / "moe.json"
MIB = 2**20
VARIANTS = ("zero3 plain ZeRO-3", "zero3 expert parallel", "DeepSpeed AutoEP")


# ---- the model and its arithmetic ---------------------------------------------------------------------
def model_config(args: argparse.Namespace) -> Any:
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.expert_hidden, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, num_experts=args.experts, num_experts_per_tok=args.top_k,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)


def qwen3_30b_a3b() -> Any:
    """Qwen3-30B-A3B's published sizes (its config.json), for the computed figures."""
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)


def parameter_split(config: Any) -> tuple[int, int]:
    """(dense parameters, expert parameters) of the model `config` describes, counted on the meta device."""
    import transformers

    from zero3.moe import find_experts

    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    experts = sum(getattr(layer.module, name).numel() for layer in find_experts(model) for name in layer.weights)
    return sum(p.numel() for p in model.parameters()) - experts, experts


def expected_bytes(config: Any, ep_size: int, world: int, tokens_per_rank: int,
                   element_size: int) -> dict[str, float]:
    """Per rank and step: bytes gathered (every weight gathered whole twice, forward and backward; with expert
    parallelism an expert weight only its own share, over its expert-data group, and not at all where that
    group is one rank) and sent by all-to-all (each token's k hidden states out and back in the forward, and
    their gradients in the backward: four exchanges a layer, each sending (N-1)/N of its rows on balanced
    routing)."""
    dense, experts = parameter_split(config)
    expert_share = experts / ep_size if world > ep_size else 0.0
    gathered = 2 * (dense + (experts if ep_size == 1 else expert_share)) * element_size
    rows = tokens_per_rank * config.num_experts_per_tok
    sent = 4 * config.num_hidden_layers * rows * (ep_size - 1) / ep_size * config.hidden_size * element_size
    return {"gathered": float(gathered), "all_to_all": float(sent), "dense_params": dense, "expert_params": experts}


# ---- counting at torch.distributed ------------------------------------------------------------------------
class Counts:
    def __init__(self) -> None:
        self.on = False
        self.gathered = 0
        self.all_to_all = 0

    def install(self) -> None:
        """Count, while `on`, every all-gather's floating-point output (weights; the engines' flags and
        counts are integers) and every all-to-all's bytes to other ranks (its split to itself stays here)."""
        import torch.distributed._functional_collectives as funcol

        import zero3.comm

        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        def weights(group: Any, output: torch.Tensor) -> bool:
            return self.on and output.is_floating_point() and dist.get_world_size(group) > 1

        def to_others(tensor: torch.Tensor, splits: list[int] | None, group: Any) -> int:
            ranks = dist.get_world_size(group)
            if ranks == 1:
                return 0
            own = splits[dist.get_rank(group)] if splits else tensor.shape[0] // ranks
            row = size(tensor) // max(tensor.shape[0], 1) if tensor.dim() else 0
            return size(tensor) - own * row

        def counted_gather(gather: Any) -> Any:
            def all_gather_flat(output, input, group=None, async_op=False):  # type: ignore[no-untyped-def]
                if weights(group, output):
                    self.gathered += size(output)
                return gather(output, input, group=group, async_op=async_op)
            return all_gather_flat

        gather_list, to_all = dist.all_gather, dist.all_to_all_single
        autograd_to_all = funcol.all_to_all_single_autograd

        def all_gather(tensor_list, tensor, group=None, async_op=False):  # type: ignore[no-untyped-def]
            if weights(group, tensor):
                self.gathered += sum(size(t) for t in tensor_list)
            return gather_list(tensor_list, tensor, group=group, async_op=async_op)

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                              async_op=False):  # type: ignore[no-untyped-def]
            if self.on:
                self.all_to_all += to_others(input, input_split_sizes, group)
            return to_all(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        def all_to_all_single_autograd(input, output_split_sizes, input_split_sizes, group):  # type: ignore[no-untyped-def]
            if self.on:
                self.all_to_all += to_others(input, input_split_sizes, group)
            out = autograd_to_all(input, output_split_sizes, input_split_sizes, group)
            if out.requires_grad:  # its gradient is what the backward's exchange sends, split as it came
                out.register_hook(lambda grad: self._count_backward(to_others(grad, output_split_sizes, group)))
            return out

        for name in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"):
            if hasattr(dist, name):
                setattr(dist, name, counted_gather(getattr(dist, name)))
        zero3.comm._all_gather_flat = counted_gather(zero3.comm._all_gather_flat)  # (bound at its import)
        dist.all_gather = all_gather
        dist.all_to_all_single = all_to_all_single
        funcol.all_to_all_single_autograd = all_to_all_single_autograd

    def _count_backward(self, nbytes: int) -> None:
        if self.on:
            self.all_to_all += nbytes


# ---- the ranks ------------------------------------------------------------------------------------------
def _build(variant: str, model: torch.nn.Module, args: argparse.Namespace, world: int) -> Any:
    base = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if variant == "DeepSpeed AutoEP":
        import deepspeed

        config = {**base, "expert_parallel": {"enabled": True, "autoep_size": world, "preset_model": "qwen3_moe"}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return engine
    import zero3

    config = dict(base)
    if variant == "zero3 expert parallel":
        config["expert_parallel"] = {"enabled": True, "autoep_size": world}
    engine, *_ = zero3.initialize(model=model, config=config)
    return engine


def _worker(args: argparse.Namespace, variant: str, out_dir: str) -> None:
    import transformers

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    counts = Counts()
    counts.install()
    result: dict[str, Any]
    try:
        torch.manual_seed(0)
        model = transformers.Qwen3MoeForCausalLM(model_config(args)).float()
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)  # (3-D expert weights are left uninitialized by the class)
        engine = _build(variant, model, args, world)
        generator = torch.Generator().manual_seed(rank)
        times, losses = [], []
        for step in range(args.warmup + args.steps):
            ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=generator)
            counts.on = step >= args.warmup
            dist.barrier()
            start = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            dist.barrier()
            counts.on = False
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
            losses.append(loss.item())
        result = {"times": times, "losses": losses, "gathered": counts.gathered / args.steps,
                  "all_to_all": counts.all_to_all / args.steps}
    except Exception as error:  # a variant that cannot run here says why, the others still run
        result = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:160]}
        if rank == 0:
            print(traceback.format_exc(), file=sys.stderr, flush=True)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def _run(args: argparse.Namespace, variant: str, world: int) -> dict[str, Any]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory() as out_dir:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", run_id=f"moe-{uuid.uuid4().hex[:8]}", monitor_interval=0.2)
        try:
            elastic_launch(config, _worker)(args, variant, out_dir)
        except Exception as error:  # a rank that died (not one that raised: those write their error)
            return {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"[:160]}
        ranks = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
    failed = [r for r in ranks if "error" in r]
    if failed:
        return {"error": failed[0]["error"]}  # (the traceback: rerun with --variants and read the rank's output)
    times = [statistics.median(r["times"]) for r in ranks]
    return {"median_step_s": max(times), "losses": ranks[0]["losses"],
            "gathered": statistics.mean(r["gathered"] for r in ranks),
            "all_to_all": statistics.mean(r["all_to_all"] for r in ranks)}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--expert-hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path, default=_DEFAULT_OUT)
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(_REPO))
    from provenance import write_run  # benchmarks/provenance.py, beside this script

    config = model_config(args)
    dense, experts = parameter_split(config)
    tokens_per_rank = args.micro_batch * args.seq
    print(f"Qwen3-MoE {args.layers} layers x {args.experts} experts, top-{args.top_k}, hidden {args.hidden}: "
          f"{(dense + experts) / 1e6:.2f} M parameters, experts {experts / (dense + experts):.0%}; "
          f"{tokens_per_rank} tokens per rank and step, fp32")
    rows: dict[str, dict[str, Any]] = {}
    for world in args.worlds:
        for variant in args.variants:
            print(f"running {variant} at {world} ranks ...", flush=True)
            row = _run(args, variant, world)
            if "error" not in row:
                row["tokens_per_s"] = tokens_per_rank * world / row["median_step_s"]
                ep = 1 if variant == "zero3 plain ZeRO-3" else world
                row["expected"] = expected_bytes(config, ep, world, tokens_per_rank, 4)
            rows[f"{variant} @ {world}"] = {"variant": variant, "world": world, **row}

    header = (f"{'variant':32} {'ranks':>5} {'step ms':>8} {'tokens/s':>9} {'vs plain':>8} {'gathered MiB':>12} "
              f"{'(arithmetic)':>10} {'all-to-all MiB':>14} {'(arithmetic)':>10}")
    print("\nper rank and step; gathered: all-gathers' outputs; all-to-all: sent, forward and backward")
    print(header)
    for name, row in rows.items():
        if "error" in row:
            print(f"{row['variant']:32} {row['world']:5} did not run: {row['error']}")
            continue
        plain = rows.get(f"zero3 plain ZeRO-3 @ {row['world']}", {})
        ratio = row["tokens_per_s"] / plain["tokens_per_s"] if "tokens_per_s" in plain else float("nan")
        row["tokens_per_s_vs_plain"] = ratio
        expected = row["expected"]
        print(f"{row['variant']:32} {row['world']:5} {row['median_step_s'] * 1000:8.1f} {row['tokens_per_s']:9.0f} "
              f"{ratio:8.2f} {row['gathered'] / MIB:12.2f} {expected['gathered'] / MIB:10.2f} "
              f"{row['all_to_all'] / MIB:14.2f} {expected['all_to_all'] / MIB:10.2f}")
    big = qwen3_30b_a3b()
    computed = {f"autoep_size {ep}": expected_bytes(big, ep, 64, 4096, 2) for ep in (1, 8)}
    bound = computed["autoep_size 1"]
    print("\ncomputed for Qwen3-30B-A3B at 8 nodes x 8, bf16, 4096 tokens per rank and step (per rank and step):")
    for name, figures in computed.items():
        print(f"  {name:14} gathered {figures['gathered'] / 2**30:7.2f} GiB "
              f"({figures['gathered'] / bound['gathered']:.3f} of plain), all-to-all {figures['all_to_all'] / 2**30:6.2f} GiB")
    print(f"  (dense {bound['dense_params'] / 1e9:.2f} B, experts {bound['expert_params'] / 1e9:.2f} B parameters)")
    versions = {name: _version(name) for name in ("transformers", "deepspeed")}
    write_run(args.json, "moe", args, variants=rows, computed_qwen3_30b_a3b_8x8=computed, versions=versions,
              model={"dense_params": dense, "expert_params": experts}, tokens_per_rank=tokens_per_rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
