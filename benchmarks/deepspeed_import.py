"""How long `zero3 import-deepspeed` takes, beside DeepSpeed's own load of the same checkpoint.

DeepSpeed 0.19.8 (on the CPU, DS_ACCELERATOR=cpu) trains the 6 x 512 GPT one step at 2 ranks and saves a
ZeRO-3 checkpoint; then, per repeat: DeepSpeed's `load_checkpoint` of it at 2 ranks (the slower rank's
time), zero3's import of it (one process, the command's work: read every rank's file, write the zero3
tag), and one zero3 `save_checkpoint` of the same model at 2 ranks. The goal: the import takes at most
DeepSpeed's load plus one zero3 save. Prints medians and writes JSON.

    python benchmarks/deepspeed_import.py --repeats 5 --json /tmp/ds_import.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint import launch  # noqa: E402 - benchmarks/checkpoint.py: two ranks under torch's launcher
import provenance  # noqa: E402

from zero3.models.gpt import GPT, GPTConfig  # noqa: E402

CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 10**6,
}


def gpt() -> GPTConfig:
    return GPTConfig(vocab_size=4096, block_size=128, n_layer=6, n_head=8, n_embd=512)


def one_step(engine: Any, rank: int) -> None:
    cfg = gpt()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(idx, idx)["loss"])
    engine.step()


def deepspeed_side(args: dict[str, Any]) -> dict[str, Any]:
    """Rank's work: DeepSpeed builds, steps, saves once, then loads `repeats` times."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    torch.set_num_threads(1)
    import zero3

    zero3.init_distributed()  # on the launcher's store (DeepSpeed's own init would try to open a second one)
    deepspeed.init_distributed(dist_backend="gloo")  # sees the group: DeepSpeed's comm bound to it
    rank = dist.get_rank()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = GPT(gpt())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    one_step(engine, rank)
    engine.save_checkpoint(args["ckpt"])
    loads = []
    for _ in range(args["repeats"]):
        dist.barrier()
        started = time.perf_counter()
        engine.load_checkpoint(args["ckpt"])
        seconds = torch.tensor([time.perf_counter() - started])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        loads.append(seconds.item())
    engine.destroy()
    return {"loads": loads}


def zero3_side(args: dict[str, Any]) -> dict[str, Any]:
    """Rank's work: zero3 builds the same model, steps, and saves `repeats` times."""
    import torch.distributed as dist

    import zero3

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with zero3.Init(config=CONFIG, device="cpu"):
        model = GPT(gpt())
    engine, *_ = zero3.initialize(model=model, config=CONFIG, device="cpu")
    one_step(engine, dist.get_rank())
    saves = []
    for index in range(args["repeats"]):
        dist.barrier()
        started = time.perf_counter()
        engine.save_checkpoint(args["dir"], tag=f"t{index}")
        seconds = torch.tensor([time.perf_counter() - started])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        saves.append(seconds.item())
    engine.destroy()
    return {"saves": saves}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from zero3.import_deepspeed import import_deepspeed_checkpoint

    root = Path(args.dir or tempfile.mkdtemp(prefix="zero3-ds-import-"))
    root.mkdir(parents=True, exist_ok=True)
    ds_ckpt = root / "deepspeed"
    loads = launch({"ckpt": str(ds_ckpt), "repeats": args.repeats}, deepspeed_side, "ds-load")[0]["loads"]
    saves = launch({"dir": str(root / "zero3-saves"), "repeats": args.repeats}, zero3_side, "z3-save")[0]["saves"]
    imports = []
    for index in range(args.repeats):
        out = root / f"imported-{index}"
        started = time.perf_counter()
        import_deepspeed_checkpoint(ds_ckpt, out, trust_checkpoint=True)
        imports.append(time.perf_counter() - started)
        shutil.rmtree(out)
    median = {name: statistics.median(values) for name, values in
              (("deepspeed_load_s", loads), ("zero3_save_s", saves), ("import_s", imports))}
    goal = median["deepspeed_load_s"] + median["zero3_save_s"]
    params = gpt().num_parameters()
    print(f"6 x 512 GPT ({params:,} parameters), DeepSpeed ZeRO-3 checkpoint of 2 ranks, {args.repeats} repeats "
          "(medians)")
    print(f"  DeepSpeed's own load_checkpoint (2 ranks) {median['deepspeed_load_s']:8.3f} s")
    print(f"  one zero3 save_checkpoint (2 ranks)       {median['zero3_save_s']:8.3f} s")
    print(f"  zero3 import-deepspeed (one process)      {median['import_s']:8.3f} s")
    print(f"  import / (DeepSpeed load + zero3 save)    {median['import_s'] / goal:8.2f}x (goal: at most 1.00x)")
    if args.json is not None:
        provenance.write_run(args.json, "deepspeed_import", args, params=params, medians=median,
                             runs={"deepspeed_load_s": loads, "zero3_save_s": saves, "import_s": imports},
                             ratio_to_goal=median["import_s"] / goal)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
