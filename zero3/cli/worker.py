"""The training loop each spawned `zero3 train` process runs."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from rich.console import Console

from zero3.cli.config import _deep_merge
from zero3.cli.job import TrainJob
from zero3.cli.reporting import _print_summary, _progress, _state_table
from zero3.data import CharTokenizer, load_corpus, sample_global_batch
from zero3.models.gpt import GPT


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
