#!/usr/bin/env python
"""By-hand fault-tolerance benchmark: replica groups on torchft against the same HSDP job without it, and a
group killed and rejoining while the other trains on (zero3.fault_tolerance).

Not a test: nothing here asserts on timings. The built-in GPT (``zero3.models.gpt``, 6 layers x 512 by
default), fp32, AdamW, on 4 ranks of this machine, laid out as 2 replicas x 2 shards in two ways:

* ``hsdp`` -- one ``torchrun`` job of 4 ranks with ``mics_shard_size: 2`` (the replicas' sum on a fixed
  process group);
* ``ft``   -- two ``torchrun`` jobs of 2 ranks (replica groups 0 and 1) with ``fault_tolerance`` on, under a
  torchft lighthouse this script runs (``--heartbeat-timeout-ms``: how long it waits before it counts a
  silent group as dead).

Each rank trains on data of its own replica (the same batches in both layouts), and rank 0 of each group
(``hsdp``: ranks 0 and 2) writes each step's wall time, loss and quorum to a JSON-lines file. Figures:

(a) overhead: the median step of ``ft`` over ``hsdp``'s, after ``--warmup`` steps, ``--rounds`` alternated runs;
(b) the surviving group's longest step while its peer dies (group 1 SIGKILLs every rank after the backward of
    its first step from ``--kill-step`` on; its torchrun restarts it), over its median step before the kill;
(c) seconds from the kill to the killed group's first step after it rejoined (torchrun's restart, the
    interpreter and imports, the build, the quorum and the transfer of its peer's state), beside a
    whole-job restart from the last checkpoint: ``benchmarks/recovery.py``'s zero3 run at the same size, run
    here (``--no-restart-reference`` skips it);
(d) a plot of both groups' losses against time across the kill and the rejoin (``--plot``, needs matplotlib).

    python benchmarks/fault_tolerance.py                  # ~6 min on a 2-core CPU
    python benchmarks/fault_tolerance.py --rounds 3 --json /tmp/ft.json --plot docs/plots/fault_tolerance.png
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
_DEFAULT_OUT = _REPO / "benchmarks" / "results" / "fault_tolerance.json"


# ------------------------------------------------------------------ worker (one rank, under torchrun)


def config(args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": None,
    }
    if args.worker == "hsdp":
        cfg["zero_optimization"]["mics_shard_size"] = 2
    else:
        cfg["fault_tolerance"] = {"enabled": True, "replica_id": f"group{args.group}", "min_replicas": 1,
                                  "init_sync": False}  # every group builds the same weights (seed 0)
    return cfg


def batch(args: argparse.Namespace, replica: int, shard: int, step: int) -> tuple[Any, Any]:
    """Replica `replica`'s shard rank `shard` rows of step `step`: the same in both layouts."""
    import torch

    generator = torch.Generator().manual_seed(100_000 * replica + 1000 * step + shard)
    tokens = torch.randint(0, 256, (args.micro_batch, args.seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def work(args: argparse.Namespace) -> None:
    from recovery import process_created  # benchmarks/recovery.py, beside this script

    created = process_created()
    import torch
    import torch.distributed as dist

    import zero3
    from zero3.models.gpt import GPT, GPTConfig

    imported = time.time()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    zero3.init_distributed()
    joined = time.time()
    rank = dist.get_rank()
    replica, shard = (rank // 2, rank % 2) if args.worker == "hsdp" else (args.group, rank)
    torch.manual_seed(0)
    cfg = config(args)
    with zero3.Init(config=cfg):
        model = GPT(GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_embd // 64,
                              n_embd=args.n_embd))
    engine, *_ = zero3.initialize(model=model, config=cfg)
    built = time.time()
    writer = shard == 0
    log = (Path(args.out) / f"{args.worker}-replica{replica}.jsonl").open("a") if writer else None
    if log is not None:
        log.write(json.dumps({"attempt": attempt, "created": created, "imported": imported, "joined": joined,
                              "built": built}) + "\n")
    ft = engine.fault_tolerance
    met = False  # whether this group has trained beside the other yet
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        x, y = batch(args, replica, shard, step)
        started = time.perf_counter()
        loss = engine(x, y)["loss"]
        engine.backward(loss)
        if ft is not None and args.group == 1 and attempt == 0 and args.kill_step and step >= args.kill_step:
            if log is not None:
                log.write(json.dumps({"killed": time.time()}) + "\n")
                log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        engine.step()
        seconds = time.perf_counter() - started
        if log is not None:
            log.write(json.dumps({
                "step": engine.global_steps, "ended": time.time(), "seconds": seconds, "loss": loss.item(),
                "dropped": bool(engine.optimizer.dropped), "attempt": attempt,
                "participants": ft.replicas.participants() if ft is not None else 2,
                "recovered": bool(ft is not None and ft.recoveries),
            }) + "\n")
            log.flush()
        if ft is not None:
            alone = ft.replicas.participants() == 1
            met = met or not alone
            if alone and (not met or args.alone_sleep):  # (outside the timed step) wait for the other group
                time.sleep(args.alone_sleep or 0.2)
    engine.destroy()
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver


def worker_command(args: argparse.Namespace, worker: str, out: Path, nproc: int, *extra: str,
                   restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "--max-restarts", str(restarts), "--monitor-interval", "0.1", str(Path(__file__).resolve()),
            "--worker", worker, "--out", str(out), "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
            "--seq", str(args.seq), "--micro-batch", str(args.micro_batch), "--alone-sleep", str(args.alone_sleep),
            *extra]


def launch(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=_REPO, env=env)


def wait_all(processes: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    deadline = time.time() + timeout
    try:
        for process in processes:
            process.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for process, log in zip(processes, logs):
        if process.returncode != 0:
            text = "\n".join(line for line in log.read_text().splitlines() if "torchft::" not in line)
            raise RuntimeError(f"{log.name} failed ({process.returncode}):\n{text[-6000:]}")


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def timed_steps(lines: list[dict[str, Any]], warmup: int) -> list[float]:
    """Steps after the warmup that both replicas took part in (a group that started first trains alone)."""
    return [line["seconds"] for line in lines
            if "step" in line and line["step"] > warmup and not line["dropped"] and line["participants"] == 2]


def run_hsdp(args: argparse.Namespace, out: Path, env: dict[str, str]) -> list[float]:
    out.mkdir(parents=True)
    log = out / "torchrun.log"
    wait_all([launch(worker_command(args, "hsdp", out, 4, "--steps", str(args.steps)), log, env)], [log], args.timeout)
    return timed_steps(read(out / "hsdp-replica0.jsonl"), args.warmup)


def run_ft(args: argparse.Namespace, out: Path, env: dict[str, str], kill: bool) -> dict[str, Any]:
    from torchft.coordination import LighthouseServer

    out.mkdir(parents=True)
    # The lighthouse logs every quorum on this process's stderr: into a file instead, while it runs.
    quiet = (out / "lighthouse.log").open("w")
    stderr = os.dup(2)
    os.dup2(quiet.fileno(), 2)
    try:
        # Without a kill both groups are in every quorum (they start together); with one, a group goes on alone.
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1 if kill else 2, join_timeout_ms=args.join_timeout_ms,
                                      heartbeat_timeout_ms=args.heartbeat_timeout_ms)
        env = {**env, "TORCHFT_LIGHTHOUSE": lighthouse.address()}
        steps = args.steps + (args.after_kill if kill else 0)
        logs = [out / f"torchrun_g{group}.log" for group in (0, 1)]
        try:
            processes = [
                launch(worker_command(args, "ft", out, 2, "--group", str(group), "--steps", str(steps),
                                      "--kill-step", str(args.kill_step if kill else 0), restarts=1 if kill else 0),
                       log, env)
                for group, log in zip((0, 1), logs)
            ]
            wait_all(processes, logs, args.timeout)
        finally:
            lighthouse.shutdown()
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
        quiet.close()
    groups = [read(out / f"ft-replica{group}.jsonl") for group in (0, 1)]
    return {"steps": [[line for line in lines if "step" in line] for lines in groups], "lines": groups}


def kill_figures(args: argparse.Namespace, run: dict[str, Any]) -> dict[str, Any]:
    survivor, killed = run["lines"]
    kill_time = next(line["killed"] for line in killed if "killed" in line)
    back = next(line for line in killed if line.get("attempt") == 1 and "created" in line)
    rejoined = next(line for line in killed if "step" in line and line["attempt"] == 1 and not line["dropped"])
    before = [line["seconds"] for line in survivor
              if "step" in line and line["step"] > args.warmup and line["ended"] < kill_time and not line["dropped"]]
    during = [line for line in survivor if "step" in line and kill_time - 5 <= line["ended"] and
              line["ended"] - line["seconds"] <= rejoined["ended"]]
    longest = max(during, key=lambda line: line["seconds"])
    alone = [line for line in survivor if "step" in line and line["participants"] == 1 and kill_time <= line["ended"]]
    return {
        "survivor_median_step_s": statistics.median(before),
        "survivor_longest_step_s": longest["seconds"],
        "survivor_longest_over_median": longest["seconds"] / statistics.median(before),
        "survivor_steps_alone": len(alone),
        "survivor_dropped": sum(line["dropped"] for line in survivor if "step" in line),
        "rejoin_phases_s": {
            "torchrun restart": (back["created"] or back["imported"]) - kill_time,
            "interpreter + imports": back["imported"] - (back["created"] or back["imported"]),
            "rendezvous + init": back["joined"] - back["imported"],
            "build (torchft's manager too)": back["built"] - back["joined"],
            "first step (quorum, the peer's state, the step)": rejoined["ended"] - back["built"],
        },
        "kill_to_first_step_s": rejoined["ended"] - kill_time,
        "rejoined_at_step": rejoined["step"],
    }


def restart_reference(args: argparse.Namespace, root: Path, env: dict[str, str]) -> dict[str, Any] | None:
    """benchmarks/recovery.py's zero3 job at this size: a whole-job restart from the last checkpoint."""
    out = root / "recovery.json"
    command = [sys.executable, str(_REPO / "benchmarks" / "recovery.py"), "--engines", "zero3", "--rounds", "1",
               "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--seq", str(args.seq),
               "--micro-batch", str(args.micro_batch), "--precision", "fp32", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=_REPO, env=env)
    if done.returncode != 0:
        print(f"recovery.py failed ({done.returncode}); no restart reference:\n{done.stderr[-2000:]}")
        return None
    result = json.loads(out.read_text())
    return {"kill_to_first_step_s": result["medians"]["zero3"]["kill -> first step"],
            "phases_s": result["medians"]["zero3"], "command": "python " + " ".join(
                [str(Path(command[1]).relative_to(_REPO)), *command[2:-2]])}


def plot(run: dict[str, Any], figures: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    survivor, killed = run["lines"]
    start = min(line["ended"] - line["seconds"] for lines in run["steps"] for line in lines)
    kill_time = next(line["killed"] for line in killed if "killed" in line)
    fig, ax = plt.subplots(figsize=(8, 4))
    for group, lines in enumerate(run["steps"]):
        for attempt in sorted({line["attempt"] for line in lines}):
            points = [(line["ended"] - start, line["loss"]) for line in lines
                      if line["attempt"] == attempt and not line["dropped"]]
            ax.plot(*zip(*points), marker=".", linewidth=1, label=f"group {group}" + (" (restarted)" if attempt else ""))
    ax.axvline(kill_time - start, color="red", linestyle="--", linewidth=1, label="group 1 killed")
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("training loss (each group's own batch)")
    ax.set_title(f"2 replica groups x 2 ranks on torchft: group 1 rejoins at step {figures['rejoined_at_step']}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="alternated hsdp / ft runs for (a)")
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=512, help="a multiple of 64 (heads of 64)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=25, help="steps of each (a) run")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    parser.add_argument("--kill-step", type=int, default=12)
    parser.add_argument("--after-kill", type=int, default=40, help="steps the killed run goes on past --steps")
    parser.add_argument("--alone-sleep", type=float, default=0.0,
                        help="seconds a group that lost its peer waits after each step (for tiny, fast models)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    parser.add_argument("--join-timeout-ms", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    parser.add_argument("--no-restart-reference", action="store_true")
    parser.add_argument("--dir", default=None, help="where the jobs write (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=_DEFAULT_OUT)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--worker", choices=("hsdp", "ft"), help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        work(args)
        return 0
    sys.path.insert(0, str(_REPO))
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="zero3-ft-"))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))}
    print(f"GPT {args.n_layer} x {args.n_embd}, fp32, 2 replicas x 2 shards; {args.rounds} round(s); in {root}", flush=True)
    medians: dict[str, list[float]] = {"hsdp": [], "ft": []}
    for round_ in range(args.rounds):
        for name in (("hsdp", "ft") if round_ % 2 == 0 else ("ft", "hsdp")):
            if name == "hsdp":
                steps = run_hsdp(args, root / f"hsdp-{round_}", env)
            else:
                run = run_ft(args, root / f"ft-{round_}", env, kill=False)
                steps = timed_steps(run["steps"][0], args.warmup)
            if not steps:
                raise SystemExit(f"{name}: no step after the {args.warmup} warmup steps had both replicas; "
                                 "raise --steps")
            medians[name].append(statistics.median(steps))
            print(f"round {round_ + 1}: {name} median step {medians[name][-1] * 1e3:.1f} ms", flush=True)
    overhead = statistics.median(medians["ft"]) / statistics.median(medians["hsdp"])
    print(f"(a) ft / hsdp median step: {overhead:.3f}", flush=True)
    killed_run = run_ft(args, root / "ft-kill", env, kill=True)
    figures = kill_figures(args, killed_run)
    print(f"(b) survivor's longest step {figures['survivor_longest_step_s']:.2f} s = "
          f"{figures['survivor_longest_over_median']:.2f}x its median {figures['survivor_median_step_s']:.2f} s; "
          f"{figures['survivor_steps_alone']} steps alone, {figures['survivor_dropped']} dropped", flush=True)
    print(f"(c) kill -> first step of the rejoined group: {figures['kill_to_first_step_s']:.2f} s "
          + ", ".join(f"{phase} {value:.2f}" for phase, value in figures["rejoin_phases_s"].items()), flush=True)
    reference = None if args.no_restart_reference else restart_reference(args, root, env)
    if reference is not None:
        print(f"    whole-job restart from the last checkpoint (recovery.py): {reference['kill_to_first_step_s']:.2f} s; "
              f"rejoin / restart {figures['kill_to_first_step_s'] / reference['kill_to_first_step_s']:.2f}", flush=True)
    if args.plot is not None:
        plot(killed_run, figures, args.plot)
    from importlib.metadata import version

    import torch
    from provenance import provenance  # benchmarks/provenance.py, beside this script

    out = {"benchmark": "fault_tolerance", "provenance": provenance(), "torchft": version("torchft"),
           "setup": {"n_layer": args.n_layer, "n_embd": args.n_embd, "seq": args.seq, "micro_batch": args.micro_batch,
                     "precision": "fp32", "replicas": 2, "shards": 2, "steps": args.steps, "warmup": args.warmup,
                     "rounds": args.rounds, "kill_step": args.kill_step,
                     "heartbeat_timeout_ms": args.heartbeat_timeout_ms, "torch": torch.__version__},
           "median_step_s": medians, "ft_over_hsdp": overhead, "kill": figures, "restart_reference": reference,
           "losses": [[[line["ended"], line["loss"], line["attempt"], line["dropped"]] for line in lines]
                      for lines in killed_run["steps"]]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
