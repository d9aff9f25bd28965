#!/usr/bin/env python
"""By-hand recovery benchmark: seconds from a SIGKILL of one rank to the first optimizer step after the restart.

Not a test: nothing here asserts on timings. Each run is one job under
``python -m torch.distributed.run --standalone --nproc_per_node 2 --max-restarts 1``
(this file, run as a worker with ``--worker ENGINE``), on a fresh checkpoint
directory. The job builds the built-in GPT (``zero3.models.gpt``, default
4 layers x 256 wide; ``--n-layer 6 --n-embd 512`` for issue 39's size), trains
with a checkpoint every ``--interval`` steps, and on attempt 0, at step
``--kill-step`` (after its backward, before ``step()``), rank ``--kill-rank``
writes ``time.time()`` and SIGKILLs itself. torchrun stops the other rank and
restarts both; each restarted rank writes wall-clock times (``time.time()``) at:

* ``created``   -- the process's creation (Linux ``/proc/self/stat``, ~10 ms);
* ``script``    -- this file's first line, before any other import;
* ``imported``  -- torch and the engine (``zero3`` or ``deepspeed``) imported;
* ``joined``    -- ``zero3.init_distributed()`` / ``deepspeed.init_distributed()`` returned;
* ``built``     -- the engine built and the newest checkpoint loaded;
* ``stepped``   -- the first optimizer step after the restart returned.

A phase ends when its mark is reached by the slowest rank; the phases are
torchrun noticing the death and restarting the workers (kill -> created),
interpreter start, imports, rendezvous + process group, build + load, first step.
Their sum is kill -> first step. Below them, "(build, attempt 0)": the same build
on attempt 0, with no checkpoint to load (joined -> built), for how much of
"build + load" is the load. Engines, on the same model and config:

* ``zero3``     -- automatic checkpoints from the config (``checkpoint``: ``dir``,
                   ``interval_steps``, ``async_save: true``, ``keep_last: 2``,
                   ``resume: true``); ``zero3.initialize`` loads the newest complete
                   checkpoint. Its first step includes the blocking part of that
                   step's (async) checkpoint when the interval falls on it.
* ``deepspeed`` -- only if ``import deepspeed`` works; DeepSpeed's resume idiom written
                   by hand: ``deepspeed.init_distributed()``, ``deepspeed.zero.Init``,
                   ``deepspeed.initialize(model=..., model_parameters=..., config=...)``
                   (the same config without the ``checkpoint`` section),
                   ``path, client = engine.load_checkpoint(dir)``, and
                   ``engine.save_checkpoint(dir, client_state={"step": step})`` every
                   ``--interval`` steps, after ``step()`` (so not in its first step).
                   One workaround: a plain ``deepspeed.init_distributed()`` fails on
                   the restarted attempt (torchrun's store keeps the killed attempt's
                   gloo addresses: "Gloo connectFullMesh failed ... Connection refused"),
                   so the group is made first under a per-attempt prefix of that store
                   (``join_under_attempt_prefix``) and ``init_distributed()`` adopts it.
                   To make it importable: ``pip install deepspeed==0.19.8`` (no ops are
                   built; on a machine without a GPU set ``DS_ACCELERATOR=cpu``), or
                   ``PYTHONPATH=/path/to/deepspeed/site-packages``.

``--rounds`` alternates the engines (order rotated) and reports the median of
each phase and of the totals, each run's total, the step each run resumed from,
and zero3's total / DeepSpeed's. Results: a table and JSON at ``--json``.

    python benchmarks/recovery.py                     # 4 x 256, 3 rounds: ~2-3 min on a 2-core CPU
    python benchmarks/recovery.py --n-layer 6 --n-embd 512 --rounds 5
    PYTHONPATH=/tmp/dspkg DS_ACCELERATOR=cpu python benchmarks/recovery.py --rounds 1   # with DeepSpeed
"""

from __future__ import annotations

import time

STARTED = time.time()  # a restarted worker's "script" mark: before any other import

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent
_DEFAULT_OUT = _REPO / "benchmarks" / "results" / "recovery.json"
ENGINES = ("zero3", "deepspeed")
# (phase, the mark that ends it); the first phase starts at the kill.
PHASES = (
    ("torchrun restart", "created"),
    ("interpreter start", "script"),
    ("imports", "imported"),
    ("rendezvous + init", "joined"),
    ("build + load", "built"),
    ("first step", "stepped"),
)


# ------------------------------------------------------------------ worker (one rank, under torchrun)


def process_created() -> float | None:
    """Wall-clock time this process was created (Linux /proc, to ~10 ms); None where unknown."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in ticks since boot
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime_s - start_s)
    except (OSError, ValueError, IndexError):
        return None


def train_config(args: argparse.Namespace) -> dict[str, Any]:
    """The config both engines get; zero3's also has the `checkpoint` section (`zero3_config`)."""
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "bf16": {"enabled": args.precision == "bf16"},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 1_000_000,
    }


def zero3_config(args: argparse.Namespace, ckpt: Path) -> dict[str, Any]:
    return {**train_config(args), "checkpoint": {
        "dir": str(ckpt), "interval_steps": args.interval, "async_save": True, "keep_last": 2, "resume": True}}


def gpt_config(args: argparse.Namespace) -> dict[str, int]:
    return {"vocab_size": 256, "block_size": args.seq, "n_layer": args.n_layer, "n_head": args.n_embd // 64,
            "n_embd": args.n_embd}


def batch(args: argparse.Namespace, step: int, rank: int, device: Any) -> tuple[Any, Any]:
    """Step `step`'s micro-batch on `rank`: the same on every attempt and engine."""
    import torch

    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 256, (args.micro_batch, args.seq + 1), generator=generator).to(device)
    return tokens[:, :-1], tokens[:, 1:]


class Marks:
    """This rank's marks for this attempt, rewritten to `<out>/<engine>-a<attempt>-r<rank>.json` at each one."""

    def __init__(self, out: Path, engine: str) -> None:
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.rank = int(os.environ["RANK"])
        self.path = out / f"{engine}-a{self.attempt}-r{self.rank}.json"
        self.marks: dict[str, Any] = {"created": process_created(), "script": STARTED}

    def mark(self, name: str, value: Any = None) -> None:
        self.marks[name] = time.time() if value is None else value
        self.path.write_text(json.dumps(self.marks))


def train(args: argparse.Namespace, marks: Marks, step_fn: Callable[[int], None], start: int) -> None:
    """Steps start+1 .. args.steps; the kill on attempt 0; the `stepped` mark after the first step."""
    kill_here = marks.attempt == 0 and marks.rank == args.kill_rank
    for step in range(start + 1, args.steps + 1):
        step_fn(step)
        if step == start + 1:
            marks.mark("stepped")
    if kill_here:
        raise RuntimeError(f"rank {marks.rank} never reached step {args.kill_step} to be killed")


def kill_if_chosen(args: argparse.Namespace, marks: Marks, step: int) -> None:
    """Between the backward and the step of `--kill-step`, on attempt 0's `--kill-rank`."""
    if marks.attempt == 0 and marks.rank == args.kill_rank and step == args.kill_step:
        marks.mark("killed")
        os.kill(os.getpid(), signal.SIGKILL)


def run_zero3(args: argparse.Namespace, marks: Marks) -> None:
    import torch
    import torch.distributed as dist

    import zero3
    from zero3.models.gpt import GPT, GPTConfig

    marks.mark("imported")
    torch.set_num_threads(1)
    zero3.init_distributed()
    marks.mark("joined")
    cfg = zero3_config(args, Path(args.ckpt))
    torch.manual_seed(0)
    with zero3.Init(config=cfg):
        model = GPT(GPTConfig(**gpt_config(args)))
    engine, *_ = zero3.initialize(model=model, config=cfg)
    marks.mark("resumed_at", engine.global_steps)
    marks.mark("built")

    def step(number: int) -> None:
        x, y = batch(args, number, marks.rank, engine.device)
        engine.backward(engine(x, y)["loss"])
        kill_if_chosen(args, marks, number)
        engine.step()

    train(args, marks, step, engine.global_steps)
    engine.destroy()
    dist.destroy_process_group()


def join_under_attempt_prefix(backend: str) -> None:
    """The default group under a per-attempt prefix of torchrun's store (the DeepSpeed side's one workaround).

    torchrun's agent hosts the store that env:// joins (TORCHELASTIC_USE_AGENT_STORE) and keeps it
    across restarts, so a plain `deepspeed.init_distributed()` on a restarted attempt reads the killed
    attempt's gloo addresses ("default_pg/0/..." keys) and fails: "Gloo connectFullMesh failed ...
    Connection refused" (pytorch/pytorch#135712; zero3.default_group's [Note: one store namespace per attempt]).
    On one node every rank sees the same TORCHELASTIC_RESTART_COUNT, so it can scope the keys.
    """
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(minutes=5))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt{attempt}/", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def run_deepspeed(args: argparse.Namespace, marks: Marks) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    # The model file alone, so that DeepSpeed's imports do not include zero3's package.
    spec = importlib.util.spec_from_file_location("gpt", _REPO / "zero3" / "models" / "gpt.py")
    assert spec is not None and spec.loader is not None
    gpt = importlib.util.module_from_spec(spec)
    sys.modules["gpt"] = gpt  # dataclasses look their module up there
    spec.loader.exec_module(gpt)
    marks.mark("imported")
    torch.set_num_threads(1)
    join_under_attempt_prefix(deepspeed.get_accelerator().communication_backend_name())
    deepspeed.init_distributed()  # finds the group made above and uses it
    marks.mark("joined")
    cfg = train_config(args)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = gpt.GPT(gpt.GPTConfig(**gpt_config(args)))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    path, client = engine.load_checkpoint(args.ckpt)
    start = client["step"] if path is not None else 0
    marks.mark("resumed_at", start)
    marks.mark("built")

    def step(number: int) -> None:
        x, y = batch(args, number, marks.rank, engine.device)
        engine.backward(engine(x, y)["loss"])
        kill_if_chosen(args, marks, number)
        engine.step()
        if number % args.interval == 0:
            engine.save_checkpoint(args.ckpt, client_state={"step": number})

    train(args, marks, step, start)
    engine.destroy()
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver


def deepspeed_missing() -> str | None:
    """Why DeepSpeed's rows are skipped, or None when `import deepspeed` works."""
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (anything that stops the import skips the engine)
        return f"not importable ({type(exc).__name__}: {exc})"
    return None


def worker_args(args: argparse.Namespace) -> list[str]:
    return ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--seq", str(args.seq),
            "--micro-batch", str(args.micro_batch), "--precision", args.precision, "--steps", str(args.steps),
            "--interval", str(args.interval), "--kill-step", str(args.kill_step), "--kill-rank", str(args.kill_rank)]


def run_once(args: argparse.Namespace, engine: str, out: Path) -> dict[str, Any]:
    """One killed-and-restarted job; its phases (slowest rank) from the marks its ranks wrote."""
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--max-restarts", "1", str(Path(__file__).resolve()), "--worker", engine, "--out", str(out),
               "--ckpt", str(out / "ckpt"), *worker_args(args)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=_REPO, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} job failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    first = [json.loads((out / f"{engine}-a0-r{rank}.json").read_text()) for rank in range(2)]
    killed = first[args.kill_rank]["killed"]
    ranks = [json.loads((out / f"{engine}-a1-r{rank}.json").read_text()) for rank in range(2)]
    phases: dict[str, float] = {}
    previous = killed
    for phase, mark in PHASES:
        if any(rank.get(mark) is None for rank in ranks):  # no /proc: the restart and interpreter phases merge
            continue
        reached = max(rank[mark] for rank in ranks)
        phases[phase] = reached - previous
        previous = reached
    # Attempt 0's build, with no checkpoint to load: the reference for "build + load".
    build_only = max(rank["built"] for rank in first) - max(rank["joined"] for rank in first)
    return {"phases": phases, "total": previous - killed, "resumed_at": ranks[0]["resumed_at"],
            "build_without_load": build_only}


def print_table(engines: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    medians: dict[str, dict[str, float]] = {}
    names = list(engines)
    print(f"\n{'seconds (median)':<22}" + "".join(f"{name:>12}" for name in names))
    for phase, _ in PHASES + (("kill -> first step", ""),):
        row = {}
        for name, runs in engines.items():
            values = [run["total"] if phase == "kill -> first step" else run["phases"].get(phase) for run in runs]
            if all(value is not None for value in values):
                row[name] = statistics.median(values)
                medians.setdefault(name, {})[phase] = row[name]
        print(f"{phase:<22}" + "".join(f"{row[name]:>12.3f}" if name in row else f"{'-':>12}" for name in names))
    row = {name: statistics.median(run["build_without_load"] for run in runs) for name, runs in engines.items()}
    for name, value in row.items():
        medians[name]["build, nothing to load"] = value
    print(f"{'(build, attempt 0)':<22}" + "".join(f"{row[name]:>12.3f}" for name in names))
    for name, runs in engines.items():
        print(f"{name}: runs (s) " + ", ".join(f"{run['total']:.2f}" for run in runs)
              + "; resumed from step " + ", ".join(str(run["resumed_at"]) for run in runs))
    return medians


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, of: " + ", ".join(ENGINES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256, help="a multiple of 64 (heads of 64)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--interval", type=int, default=1, help="checkpoint every N steps")
    parser.add_argument("--kill-step", type=int, default=3)
    parser.add_argument("--kill-rank", type=int, choices=(0, 1), default=1)
    parser.add_argument("--steps", type=int, default=0, help="steps of the whole job (default: --kill-step + 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.add_argument("--dir", default=None, help="where jobs write (default: a temp dir, removed)")
    parser.add_argument("--json", type=Path, default=_DEFAULT_OUT)
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.steps = args.steps or args.kill_step + 1
    if args.worker:
        marks = Marks(Path(args.out), args.worker)
        (run_zero3 if args.worker == "zero3" else run_deepspeed)(args, marks)
        return 0
    if args.n_embd % 64 or args.kill_step > args.steps or args.kill_step <= args.interval:
        raise SystemExit("need --n-embd a multiple of 64 and --interval < --kill-step <= --steps "
                         "(a checkpoint to resume from before the kill)")
    chosen = [name for name in args.engines.split(",") if name]
    skipped: dict[str, str] = {}
    if "deepspeed" in chosen and (reason := deepspeed_missing()):
        print(f"deepspeed: {reason}; skipped (see this file's docstring to make it importable)")
        skipped["deepspeed"] = reason
        chosen.remove("deepspeed")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="zero3-recovery-"))
    import torch

    from zero3.models.gpt import GPTConfig

    params = GPTConfig(**gpt_config(args)).num_parameters()
    print(f"GPT {args.n_layer} x {args.n_embd}: {params / 1e6:.1f}M params, {args.precision}, 2 ranks, "
          f"checkpoint every {args.interval} step(s), rank {args.kill_rank} SIGKILLed in step {args.kill_step} "
          f"of attempt 0; {args.rounds} round(s) of {', '.join(chosen)}; in {root}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    for round_ in range(args.rounds):
        for name in chosen[round_ % len(chosen):] + chosen[:round_ % len(chosen)]:
            run = run_once(args, name, root / f"{name}-{round_}")
            runs[name].append(run)
            print(f"round {round_ + 1}: {name} kill -> first step {run['total']:.2f} s "
                  f"(resumed from step {run['resumed_at']})", flush=True)
            shutil.rmtree(root / f"{name}-{round_}" / "ckpt", ignore_errors=True)
    medians = print_table(runs)
    ratio = None
    if "zero3" in medians and "deepspeed" in medians:
        ratio = medians["zero3"]["kill -> first step"] / medians["deepspeed"]["kill -> first step"]
        print(f"zero3 / DeepSpeed, kill -> first step (medians): {ratio:.2f}")
    versions = {"torch": torch.__version__}
    if "deepspeed" in runs:
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    from provenance import provenance  # benchmarks/provenance.py, beside this script

    out = {"benchmark": "recovery", "provenance": provenance(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "cpus": os.cpu_count(), **versions, "parameters": params, "runs": runs,
           "medians": medians, "zero3_over_deepspeed": ratio, "skipped": skipped,
           "args": {k: str(v) for k, v in vars(args).items() if k not in ("worker", "out", "ckpt")}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
