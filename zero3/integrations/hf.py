"""Hugging Face's `Trainer` on zero3: `Zero3Trainer`, a `transformers.Trainer` given `zero3_config=`.

Needs the `hf` extra (transformers, accelerate). Accelerate stays on its plain
multi-process path (it shards the data loaders and sets up the process
group); nothing here poses as DeepSpeed. The engine takes the model's place:

* **Built at construction**, from the DeepSpeed-format config with its
  `"auto"` values filled from `TrainingArguments` as Hugging Face fills them
  (zero3.integrations.hf_config). Without an `optimizer` section the engine
  steps the Trainer's own optimizer (its AdamW, with the decay / no-decay
  groups); without a `scheduler` section, the Trainer's scheduler
  (`lr_scheduler_type`, warmup) drives the engine's optimizer.
* **Accumulation is decided once.** The Trainer divides the loss by its
  accumulation steps (or normalises it by the tokens in the window) and says
  which micro-batch ends a window; the engine takes both as given
  (`backward(loss, scale_wrt_gas=False)`, `set_gradient_accumulation_boundary`).
* **Clipping and the logged `grad_norm` are the engine's**: the config's
  `gradient_clipping` is `max_grad_norm`, applied in the engine's step to the
  global norm of the sharded gradients; the norm logged is that one.
* **`save_model`** writes safetensors (`engine.save_16bit_model`: streamed, one
  parameter gathered at a time, rank 0 writes) and the model's `config.json`,
  which a plain `from_pretrained` loads.
* **Checkpoints** (`save_strategy`): the engine's sharded checkpoint goes in
  `checkpoint-N/zero3/` beside the Trainer's own state, and
  `resume_from_checkpoint` restores it (masters, optimizer state, scheduler,
  counters; the Trainer restores its state, RNG and data position).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

try:
    import transformers
    from transformers import Trainer
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("zero3.integrations.hf needs transformers and accelerate: pip install 'zero3[hf]'") from error

import zero3
from zero3.integrations.hf_config import fill_from_training_arguments, read_zero3_config
from zero3.integrations.hf_loading import from_pretrained
from zero3.integrations.hf_resize import resize_token_embeddings
from zero3.engine.engine import ZeroEngine

__all__ = ["Zero3Trainer", "Zero3TrainerMixin", "from_pretrained", "resize_token_embeddings"]

ENGINE_TAG = "zero3"  # the engine's checkpoint, inside the Trainer's checkpoint-N/


# The Trainer's methods Zero3Trainer overrides or relies on: without one of them (another transformers
# version) the Trainer would train around the engine, so it is refused up front.
_TRAINER_HOOKS = ("_prepare_for_training", "_wrap_model", "training_step", "_clip_grad_norm", "_get_grad_norm",
                  "_maybe_log_save_evaluate", "create_optimizer", "create_scheduler", "compute_loss")


class _EngineOptimizer:
    """What the Trainer calls its optimizer: `step()` is the engine's step at the window's end (clip, step
    the shards, release); `param_groups` are the engine's, so the Trainer's scheduler and LR logging
    work. Gradients live in the engine; `zero_grad` leaves them to it."""

    def __init__(self, engine: ZeroEngine) -> None:
        self.engine = engine

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        assert self.engine.optimizer is not None
        return self.engine.optimizer.optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("the zero3 engine's step takes no closure")
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine drops the window's gradients after its step; nothing to do between."""

    def train(self) -> None:
        """Schedule-free optimizers' mode switch: not used by the engine's optimizers."""

    def eval(self) -> None:
        """Schedule-free optimizers' mode switch: not used by the engine's optimizers."""


class Zero3TrainerMixin:
    """Makes a `transformers.Trainer` subclass train on a zero3 engine: `class MySFT(Zero3TrainerMixin,
    trl.SFTTrainer)`. Construction takes `zero3_config=` (DeepSpeed's format, a dict or a JSON path, Hugging
    Face's `"auto"` values allowed) beside the trainer's own arguments."""

    def __init__(self, *args: Any, zero3_config: dict[str, Any] | str | os.PathLike[str], **kwargs: Any) -> None:
        if not isinstance(self, Trainer):
            raise TypeError(f"{type(self).__name__}: Zero3TrainerMixin goes before a transformers.Trainer subclass")
        missing = [name for name in _TRAINER_HOOKS if not hasattr(Trainer, name)]
        if missing:
            raise ImportError(
                f"Zero3Trainer needs a transformers Trainer with {', '.join(missing)} (transformers 5.x); "
                f"this is transformers {transformers.__version__}"
            )
        config = read_zero3_config(zero3_config)  # refused before the Trainer sets anything up
        super().__init__(*args, **kwargs)
        if getattr(self.args, "deepspeed", None):
            raise ValueError("TrainingArguments.deepspeed is set: Zero3Trainer takes its config as zero3_config=")
        self.zero3_config = fill_from_training_arguments(
            config, self.args, self.accelerator.num_processes, self.model, num_training_steps=None,
        )
        client_optimizer = None
        if "optimizer" not in self.zero3_config:
            client_optimizer = self.create_optimizer()  # the Trainer's: its class, hyperparameters, groups
            self.optimizer = None
        engine_config = {key: value for key, value in self.zero3_config.items() if key != "scheduler"}
        self.engine: ZeroEngine = zero3.initialize(
            model=self.model, optimizer=client_optimizer, config=engine_config, device=self.args.device,
        )[0]
        self.model_wrapped = self.engine
        self.optimizer = _EngineOptimizer(self.engine) if self.engine.optimizer is not None else None
        self.ref_engine: ZeroEngine | None = None
        reference = getattr(self, "ref_model", None)
        if isinstance(reference, nn.Module):
            # TRL's reference model (DPO, KTO...): partitioned like the policy, frozen, no optimizer state.
            reference = self.accelerator.unwrap_model(reference)
            reference.requires_grad_(False)
            reference_config = {key: value for key, value in engine_config.items() if key != "optimizer"}
            self.ref_engine = zero3.initialize(model=reference, config=reference_config, device=self.args.device)[0]
            self.ref_model = self.ref_engine

    # ---- training ---------------------------------------------------------------
    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        if self.optimizer is None:
            raise RuntimeError("Zero3Trainer.train: no parameter of the model requires grad, so nothing to train")
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        if self.lr_scheduler is None:
            torch_optimizer = self.optimizer.optimizer
            if "scheduler" in self.zero3_config:
                from zero3.config import load_config
                from zero3.step.lr_schedules import build_lr_scheduler

                filled = fill_from_training_arguments(
                    self.zero3_config, self.args, self.accelerator.num_processes, self.model, max_steps,
                )
                self.lr_scheduler = build_lr_scheduler(load_config(filled).scheduler, torch_optimizer)
                self._created_lr_scheduler = True
            else:
                self.create_scheduler(num_training_steps=max_steps, optimizer=torch_optimizer)
        self.model_wrapped = self.engine
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.engine, train_dataloader

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        return self.engine  # type: ignore[return-value]  # called like the module it wraps

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        engine = self.engine
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if getattr(self, "loss_is_scaled_for_ga", None) is not None:
            scaled_for_window = self.loss_is_scaled_for_ga
        else:  # the Trainer's rule: normalised by the window's tokens, by the model or by compute_loss_func
            scaled_for_window = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not scaled_for_window:
            loss = loss / self.current_gradient_accumulation_steps
        boundary = bool(self.accelerator.gradient_state.sync_gradients)
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss, scale_wrt_gas=False)
        if not boundary:
            engine.step()  # counts the micro-step; the window's step comes from the Trainer at its end
        return loss.detach()

    def _clip_grad_norm(self, model: nn.Module) -> None:
        return None  # the engine clips at its step (gradient_clipping = max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        return None  # known once the engine has stepped: see _maybe_log_save_evaluate

    def _maybe_log_save_evaluate(self, tr_loss: Any, grad_norm: Any, *args: Any, **kwargs: Any) -> Any:
        # The norm the engine clipped by, over every rank's shards, before clipping (what the Trainer logs).
        norm = self.engine.last_grad_norm if self.engine.optimizer is not None else grad_norm
        return super()._maybe_log_save_evaluate(tr_loss, norm, *args, **kwargs)

    # ---- saving -------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Safetensors of the whole model (compute dtype) plus `config.json`, for a plain `from_pretrained`;
        collective (every rank calls it, as the Trainer does); rank 0 writes."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        self.engine.save_16bit_model(output_dir, "model.safetensors")
        if self.args.should_save:
            model_config = getattr(self.model, "config", None)
            if model_config is not None and hasattr(model_config, "save_pretrained"):
                model_config.save_pretrained(output_dir)
            generation_config = getattr(self.model, "generation_config", None)
            if generation_config is not None and hasattr(generation_config, "save_pretrained"):
                generation_config.save_pretrained(output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    # ---- checkpoints ----------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Inside the Trainer's `checkpoint-N/`: the engine's sharded checkpoint under `zero3/` (every rank
        writes its pieces of the fp32 masters and optimizer state; no rank gathers the model) and the
        scheduler's state (rank 0). The Trainer adds its own state and each rank's RNG state."""
        self.engine.save_checkpoint(output_dir, tag=ENGINE_TAG)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The weights come back with the engine's checkpoint (`_load_optimizer_and_scheduler`); this
        only checks there is one, before the Trainer goes on."""
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ENGINE_TAG)):
            raise ValueError(
                f"{resume_from_checkpoint} holds no zero3 checkpoint (no {ENGINE_TAG}/ in it): resume from a "
                "checkpoint-N directory a Zero3Trainer saved"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self.engine.load_checkpoint(checkpoint, tag=ENGINE_TAG)  # weights, optimizer state, counters
        scheduler_file = os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


class Zero3Trainer(Zero3TrainerMixin, Trainer):
    """A `transformers.Trainer` that trains on a zero3 engine; `zero3_config` is DeepSpeed's format (a dict or a
    JSON path) and may hold Hugging Face's `"auto"` values. Every other argument is the Trainer's."""
