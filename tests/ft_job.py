"""One replica group of a torchft job: `torchrun ... tests/ft_job.py OUT --group G --steps N ...`.

Each group trains the same small model (tests/restart_job.py's, with dropout)
on data of its own (drawn from the group and the step), with
`fault_tolerance` on, under a lighthouse the test runs (TORCHFT_LIGHTHOUSE).
`--kill ATTEMPT:STEP:POINT` makes every rank of this group SIGKILL itself in
torchrun attempt ATTEMPT at optimizer step STEP: `mid_step` (after the
backward, before `engine.step()`), `quorum` (right after the step's first
forward started its quorum) or `recovery` (STEP is ignored: as this rank
starts applying a peer's state). `--alone-sleep S` makes a group that trains
alone wait S seconds per step (so that a peer starting later, or killed, has
time to join before the job ends). `--wait-for-group G` holds the first
attempt's training until group G's ranks have built their engines (two groups
that wait for each other ask for their first quorum together), and when G
leaves (this group trains alone after a step shared with G's newest attempt),
holds this group's next step until G's ranks have built again in a later
attempt (up to a minute), so that a restart slowed by a loaded machine still
finds this group training;
`--join-after-group G` holds the first attempt, before it builds anything,
until group G has recorded a step (this group joins behind it, by recovery). Each rank writes, per step, a
JSON line to OUT/g<G>_r<rank>.jsonl: the step, the attempt, the loss, the
number of groups in the step's quorum, whether it committed, whether this
rank took its state from a peer, and a digest of its whole state after the
step (every flat buffer, the optimizer's scalars, the counters, the lr, a
registered object counting the batches drawn, and with `--sync-quorum`
torch's generator, which then continues exactly too).
At the end rank 0 writes the whole parameters to OUT/final_g<G>.pt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.restart_job import SEQ, VOCAB, DropoutLM, die  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill", action="append", default=[], metavar="ATTEMPT:STEP:POINT")
    parser.add_argument("--alone-sleep", type=float, default=0.0)
    parser.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"), default="none")
    parser.add_argument("--nvme-path", default=None)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--sync-quorum", action="store_true")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--no-dropout", action="store_true", help="for a comparison with plain torch")
    parser.add_argument("--no-init-sync", action="store_true")
    parser.add_argument("--optimizer", choices=("AdamW", "Lion"), default="AdamW")
    parser.add_argument("--wait-for-group", type=int, default=None,
                        help="in the first attempt, start training once that group's ranks have built their engines")
    parser.add_argument("--join-after-group", type=int, default=None,
                        help="in the first attempt, build the engine once that group's rank 0 has recorded a step")
    return parser.parse_args(argv)


def config(args: argparse.Namespace) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if args.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": args.offload_optimizer, "nvme_path": args.nvme_path}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": args.optimizer, "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4,
                                                     "warmup_type": "linear"}},
        "zero_optimization": zero,
        "fault_tolerance": {"enabled": True, "replica_id": f"group{args.group}", "min_replicas": args.min_replicas,
                            "timeout_s": 20, "quorum_timeout_s": 60, "async_quorum": not args.sync_quorum, "init_sync": not args.no_init_sync},
        "steps_per_print": None,
    }
    if args.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def batch(group: int, step: int, rank: int, world: int, micro: int) -> torch.Tensor:
    """This rank's rows of the group's batch for `step`: each group reads data of its own."""
    rows = torch.randint(0, VOCAB, (world * micro, SEQ + 1), generator=torch.Generator().manual_seed(1000 * group + step))
    return rows[rank * micro : (rank + 1) * micro]


class Drawn:
    """A registered state object: the batches this rank drew (a data loader's position, in small)."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = int(state["count"])


def digest(engine: Any, drawn: Drawn, generators: bool) -> str:
    """This rank's whole state after a step, hashed: what a recovering peer would receive from it, the
    registered object, and (`generators`) torch's generator."""
    state = engine.fault_tolerance.peer_state.state_dict()
    sums = hashlib.sha256()
    sums.update(f"drawn={drawn.count}".encode())
    if generators:
        sums.update(torch.get_rng_state().numpy().tobytes())
    for key in sorted(state["buffers"]):
        values = state["buffers"][key].detach().cpu().contiguous()
        sums.update(key.encode())
        sums.update(values.view(torch.uint8).numpy().tobytes())
    for name in sorted(state["scalars"]):
        for scalar, value in sorted(state["scalars"][name].items()):
            sums.update(f"{name}.{scalar}={value.item()!r}".encode())
    sums.update(repr((state["counters"], [group["lr"] for group in state["param_groups"]])).encode())
    return sums.hexdigest()


def wait_until(ready: Callable[[], bool], what: str, deadline_s: float = 120.0) -> None:
    until = time.monotonic() + deadline_s
    while not ready():
        if time.monotonic() > until:
            raise TimeoutError(f"{what} did not happen within {deadline_s} s")
        time.sleep(0.05)


def built(out: Path, group: int, world: int) -> bool:
    """Every rank of `group` has built its engine. Two groups that wait for this of each other ask for their
    first quorum together, so a kill keyed to a step lands in a step both train (a group starting seconds
    later on a loaded machine would otherwise join by recovery, past the step its kill names)."""
    return built_attempt(out, group, world) >= 0


def built_attempt(out: Path, group: int, world: int) -> int:
    """The newest torchrun attempt in which every rank of `group` has built its engine (-1: none yet)."""
    attempts = []
    for rank in range(world):
        marker = out / f"built_g{group}_r{rank}"
        text = marker.read_text().strip() if marker.exists() else ""
        attempts.append(int(text) if text else -1)  # (empty: being written)
    return min(attempts)


def stepped(out: Path, group: int) -> bool:
    """`group`'s rank 0 has recorded a step: a group that joins after it is behind, and takes its state."""
    log = out / f"g{group}_r0.jsonl"
    return log.exists() and bool(log.read_text().strip())


def train(argv: list[str]) -> None:
    import zero3

    args = parse(argv)
    out = Path(args.out)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.join_after_group is not None and attempt == 0:
        # Before this group builds its engine: a built engine's torchft Manager heartbeats to the lighthouse,
        # which then held the other group's first quorum for this one (60 s, to its timeout, in a CI run).
        wait_until(lambda: stepped(out, args.join_after_group), f"group {args.join_after_group}'s first step")
    torch.set_num_threads(1)
    zero3.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    kills = {(int(step), point) for a, step, point in (item.split(":") for item in args.kill) if int(a) == attempt}
    torch.manual_seed(1)  # the same initial weights in every group (a recovery overwrites them anyway)
    cfg = config(args)
    with zero3.Init(config=cfg):
        model = DropoutLM()
    if args.no_dropout:
        model.drop.p = 0.0
    engine, *_ = zero3.initialize(model=model, config=cfg)
    replicas = engine.fault_tolerance.replicas
    drawn = Drawn()
    engine.register_checkpoint_state("drawn", drawn)
    if any(point == "recovery" for _, point in kills):
        peer_state = engine.fault_tolerance.peer_state
        real_load = peer_state.load_state_dict

        def load_or_die(state: Any) -> None:
            die()
            real_load(state)

        peer_state.load_state_dict = load_or_die  # type: ignore[method-assign]
        # (torchft holds the bound method it was given: replace it there too)
        engine.fault_tolerance.replicas.manager._load_state_dict_fns["zero3"] = load_or_die
    (out / f"built_g{args.group}_r{rank}").write_text(str(attempt))
    peer_attempt_seen = -1  # the awaited group's newest attempt when a step last had company
    if args.wait_for_group is not None and attempt == 0:
        wait_until(lambda: built(out, args.wait_for_group, world), f"group {args.wait_for_group}'s build")
    log = (out / f"g{args.group}_r{rank}.jsonl").open("a")
    micro = engine.train_micro_batch_size_per_gpu()
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        rows = batch(args.group, step, rank, world, micro)
        drawn.count += 1
        started = time.perf_counter()
        before = engine.fault_tolerance.recoveries  # (before the forward: a quorum there may recover)
        loss = engine(rows[:, :-1], rows[:, 1:])
        step = engine.global_steps + 1  # (a recovery in the forward's quorum moves it to the peers' step)
        if (step, "quorum") in kills:
            die()
        engine.backward(loss)
        if (step, "mid_step") in kills:
            die()
        engine.step()
        participants = replicas.participants()
        committed = not engine.optimizer.dropped
        record = {
            "step": engine.global_steps, "attempt": attempt, "loss": float(loss), "participants": participants,
            "committed": committed, "seconds": time.perf_counter() - started, "digest": digest(engine, drawn, generators=args.sync_quorum),
            "recoveries": engine.fault_tolerance.recoveries - before, "grad_norm": engine.last_grad_norm,
        }
        log.write(json.dumps(record) + "\n")
        log.flush()
        if args.wait_for_group is not None:
            peer_attempt = built_attempt(out, args.wait_for_group, world)
            if participants > 1:
                peer_attempt_seen = peer_attempt
            elif peer_attempt == peer_attempt_seen >= 0:
                # The attempt that trained with this group is gone: hold until its restart has built (the
                # ranks agree on this wait, as on `participants`). A minute at most, then train on alone.
                try:
                    wait_until(lambda: built_attempt(out, args.wait_for_group, world) > peer_attempt_seen,
                               f"group {args.wait_for_group}'s restart", deadline_s=60.0)
                except TimeoutError:
                    pass
                peer_attempt_seen = -1
        if participants == 1 and args.alone_sleep:
            time.sleep(args.alone_sleep)  # the peer is away: give it time to come
    log.close()
    full = engine.consolidated_16bit_state_dict()
    if rank == 0:
        torch.save(full, out / f"final_g{args.group}.pt")
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    train(sys.argv[1:])
