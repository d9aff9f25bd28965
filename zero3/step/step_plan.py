"""The optimizer step, end to end: its phases, and what one step carries from phase to phase (`StepPlan`).

[Note: a step on every rank or on none]
Each rank steps its own shards, so a step that lands on some ranks and not
on others leaves every parameter's shards from two different steps. So a
step is agreed twice, on host flags of the gloo control group:
* before anything changes: what can fail without changing state (the
  16-bit repair, the step's working memory, Muon's read-only phase) runs
  first, and its outcome rides on the gradient flags the step agrees
  anyway (`agree_on_gradients`; Muon adds one flag round after its
  exchange). If any rank failed, every rank raises and none has stepped.
* after the walk: one flag round. A disk tier's walk only wrote the next
  generation (zero3.offload.optimizer_tier), so it is committed when every
  rank's walk succeeded and abandoned on every rank otherwise (the step
  counts and 16-bit shards put back): a failing disk on one rank is a
  step applied nowhere. A memory tier steps in place, with nothing left
  that allocates (the working memory is taken before the first
  agreement); if one rank's update still fails, the others have applied
  it: every rank raises, says so, and the engine refuses to train on
  (`diverged`) until a checkpoint is loaded. A failed write of the 16-bit
  shards after a landed step is every rank's StepIOError(step_applied=True).
A rank that failed still joins every collective of the step in order, so
no rank waits on one that left.

The phases, in `ZeroOptimizer._agreed_step`'s order:
1. `_prepare_step`: what can fail without changing state (the early step's outcome, the 16-bit repair, the
   walk's working memory);
2. `_agree_before_changing`: the first agreement, on the gradient flags and the squared norm
   (`agree_on_gradients`); every rank raises if any failed or a parameter got no gradient anywhere;
3. torchft's commit (zero3.fault_tolerance.replica_step), where replica groups are on: a group that drops
   the step zeroes its gradients; a recovering one takes its peer's state here;
4. the norm, then `_unscale_and_clip`: the dynamic scale's update or the skip of a non-finite step, the clipping
   coefficient with the unscaling folded in, and whether the backward's early steps made this step;
5. `_walk`: Muon's exchange (agreed), the sub-groups stepped through the optimizer-state tier, the new
   16-bit shards written, then the second agreement: committed, abandoned, or diverged.
The engine's `step` brackets it (zero3.engine.engine: the accumulation boundary, the protocol's pass, the
LR schedule, the counters); docs/architecture.md draws the whole flow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zero3.step.early_step import EarlySteps


@dataclass
class StepPlan:
    """One step's values, from the phase that makes each to the phases that read it."""

    repairing: bool  # the 16-bit shards are stale and rewritten first (alike on every rank)
    scale: float  # the loss scale the gradients carry
    early: EarlySteps | None = None  # the backward's early steps, where armed
    failure: BaseException | None = None  # this rank's, before the first agreement
    work: torch.Tensor | None = None  # the walk's fp32 gradients (or the gradients themselves, in place)
    found_inf: torch.Tensor | None = None  # the fused kernel's skip flag, on the step's device
    skip_counted: torch.Tensor | None = None  # what the fused path added to the skip count, to take back
    coefficient: torch.Tensor | None = None  # clipping and unscaling in one factor (None: 1)
    why_not: str | None = None  # why the early steps are not this step's operation, if they are not
    scaler_before: dict[str, Any] | None = None  # the loss scale to put back

    def put_back(self, loss_scaler: Any, skipped: torch.Tensor) -> None:
        """The loss scale and the skip count as before this step (it is not applied after all)."""
        assert self.scaler_before is not None
        loss_scaler.load_state_dict(self.scaler_before)
        if self.skip_counted is not None:
            skipped.sub_(self.skip_counted.to(skipped.dtype))  # what the fused path added
