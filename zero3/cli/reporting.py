"""What `zero3 train` shows: the progress bar, the per-rank model-state table and the summary."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from zero3.cli.job import TrainJob

# Order of the model-state columns; keys the engine adds beyond these are shown too.
_STATE_KEYS = ("lp_params", "hp_params", "lp_grads", "optim_states", "persistent_params")


class _StepsPerSecond(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("? steps/s" if speed is None else f"{speed:.2f} steps/s")


def _progress(console: Console, disable: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        _StepsPerSecond(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        disable=disable,
    )


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _state_table(states: Sequence[dict[str, int] | None], num_params: int, world: int) -> Table:
    expected = 16 * num_params / world
    present = [s for s in states if s is not None]
    extra = sorted({k for s in present for k in s} - set(_STATE_KEYS) - {"total"})
    keys = [*_STATE_KEYS, *extra]
    table = Table(
        title=f"Model-state bytes per rank: P = {num_params:,} parameters, N = {world} ranks",
        caption="16P/N: 2 (16-bit params) + 2 (16-bit grads) + 4 (fp32 master) + 8 (Adam "
        "moments) bytes per parameter, split over N ranks",
    )
    table.add_column("rank", justify="right")
    for key in keys:
        table.add_column(key, justify="right")
    table.add_column("total", justify="right", style="bold")
    table.add_column("16P/N", justify="right", no_wrap=True)
    table.add_column("total / (16P/N)", justify="right", no_wrap=True)
    for rank, state in enumerate(states):
        state = state or {}
        total = state.get("total", 0)
        table.add_row(
            str(rank),
            *(_human_bytes(state[k]) if k in state else "-" for k in keys),
            _human_bytes(total),
            _human_bytes(expected),
            f"{total / expected:.3f}",
        )
    return table


def _print_summary(
    console: Console,
    job: TrainJob,
    world: int,
    first_loss: float,
    final_loss: float,
    elapsed: float,
    tokens_per_s: float,
    skipped: int,
    start_step: int = 0,
) -> None:
    resumed = f", resumed at step {start_step}" if start_step else ""
    rows = [
        ("precision", job.precision),
        ("steps", f"{job.steps} (skipped by fp16 overflow: {skipped}{resumed})"),
        ("global batch", f"{job.micro_batch * job.grad_accum * world} sequences of "
         f"{job.model.block_size} characters"),
        ("first loss", f"{first_loss:.4f}"),
        ("final loss", f"{final_loss:.4f}"),
        ("elapsed", f"{elapsed:.1f} s (training loop)"),
        ("throughput", f"{tokens_per_s:,.0f} tokens/s ({(job.steps - start_step) / max(elapsed, 1e-9):.2f} steps/s)"),
    ]
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    for name, value in rows:
        summary.add_row(name, value)
    console.print(summary)
