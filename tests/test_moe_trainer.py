"""A Hugging Face MoE model with expert parallelism under Hugging Face's Trainer and generate: the Zero3Trainer
at 2 ranks with `expert_parallel` (autoep_size 2) against the plain Trainer at one rank on the same global
batches (each step's loss and grad norm, the trained weights), `save_model` loaded into the plain Hugging Face
class, the weights delivered whole to a generator model (`zero3.weights.load_into`), TRL's SFTTrainer through
the mixin, and greedy generation with `synced_gpus` (ranks of different prompt and answer lengths, each expert-
parallel rank in every forward until all are done) against the plain model's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import transformers

import zero3
from tests.distributed import run_ranks
from tests.test_hf_trainer import in_order, logged, sft_trainer
from tests.test_moe_expert_parallel import EXPERTS, VOCAB, moe_model
from zero3.moe import expert_share

GLOBAL_ROWS, ACCUMULATION, STEPS = 4, 2, 3
CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "expert_parallel": {"enabled": True, "autoep_size": 2},
}


def dataset() -> list[dict[str, torch.Tensor]]:
    rows = torch.randint(0, VOCAB, (GLOBAL_ROWS * ACCUMULATION * STEPS, 8), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


def arguments(world: int, output_dir: str) -> Any:
    return transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=GLOBAL_ROWS // world, gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS, learning_rate=1e-2, weight_decay=0.1, warmup_steps=1, lr_scheduler_type="cosine",
        max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True)


def prompt(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 3 + 2 * rank), generator=torch.Generator().manual_seed(50 + rank))


def answer_length(rank: int) -> int:
    return 2 + 3 * rank  # ranks finish at different steps: synced_gpus keeps the finished one in the forwards


def plain_run(rank: int, world: int, output_dir: str) -> dict:
    model = moe_model(seed=0)
    trainer = in_order(transformers.Trainer)(model=model, args=arguments(1, output_dir), train_dataset=dataset())
    trainer.train()
    model.eval()
    answers = [model.generate(prompt(r), max_new_tokens=answer_length(r), do_sample=False) for r in range(2)]
    return {"logged": logged(trainer), "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "answers": answers}


def zero3_run(rank: int, world: int, output_dir: str) -> dict:
    from zero3.integrations.hf import Zero3Trainer

    model = moe_model(seed=rank)  # seeded apart: rank 0's weights are everyone's
    trainer = in_order(Zero3Trainer)(model=model, args=arguments(world, output_dir), train_dataset=dataset(),
                                     zero3_config=CONFIG)
    trainer.train()
    out: dict[str, Any] = {"logged": logged(trainer)}
    out["weights"] = {n: (share.first if (share := expert_share(p)) else None, zero3.safe_get_full_fp32_param(p))
                      for n, p in model.named_parameters()}
    trainer.save_model(str(Path(output_dir) / "saved"))
    generator = moe_model(seed=99)  # a plain model of the class, whole experts: an RLHF job's generator
    out["copied"] = zero3.weights.load_into(trainer.engine, generator)
    out["delivered"] = {n: p.detach().clone() for n, p in generator.named_parameters()}
    model.eval()
    with torch.no_grad():
        out["answer"] = model.generate(prompt(rank), max_new_tokens=answer_length(rank), do_sample=False,
                                       synced_gpus=True)
    dist.barrier()
    trainer.engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict], Path]:
    output_dir = tmp_path_factory.mktemp("moe_trainer")
    plain = run_ranks(1, plain_run, str(output_dir / "plain"))[0]
    return plain, run_ranks(2, zero3_run, str(output_dir)), output_dir


def test_the_zero3_trainer_with_expert_parallelism_trains_like_the_plain_trainer(runs: tuple) -> None:
    plain, ranks, _ = runs
    count = EXPERTS // 2
    for result in ranks:
        for (loss, norm, lr), (want_loss, want_norm, want_lr) in zip(result["logged"], plain["logged"], strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-4) and norm == pytest.approx(want_norm, rel=1e-4)
            assert lr == pytest.approx(want_lr)
        for name, want in plain["weights"].items():
            first, got = result["weights"][name]
            expected = want if first is None else want[first:first + count]
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_save_model_loads_into_the_plain_hugging_face_class(runs: tuple) -> None:
    plain, _, output_dir = runs
    loaded = transformers.Qwen3MoeForCausalLM.from_pretrained(output_dir / "saved")
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p.detach(), plain["weights"][name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


def test_the_trained_weights_load_whole_into_a_generator_in_process(runs: tuple) -> None:
    plain, ranks, _ = runs
    for result in ranks:
        assert result["copied"] == len(plain["weights"])
        for name, want in plain["weights"].items():
            torch.testing.assert_close(result["delivered"][name], want, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{name}: {m}")


def test_generate_with_synced_gpus_gives_the_plain_models_answers(runs: tuple) -> None:
    plain, ranks, _ = runs
    for rank, result in enumerate(ranks):
        assert torch.equal(result["answer"], plain["answers"][rank]), rank


def sft_run(rank: int, world: int, output_dir: str, on_zero3: bool) -> dict:
    model = moe_model(seed=rank if on_zero3 else 0)
    trainer = sft_trainer(model, world, output_dir, on_zero3, CONFIG, max_steps=STEPS, max_length=12)
    trainer.train()
    out = {"logged": [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]}
    if on_zero3:
        out["shares"] = sorted({share.count for p in model.parameters() if (share := expert_share(p))})
        trainer.engine.destroy()
    return out


@pytest.mark.timeout(300)
def test_trls_sft_trainer_trains_an_moe_model_with_expert_parallelism(tmp_path: Path) -> None:
    (plain,) = run_ranks(1, sft_run, str(tmp_path / "plain"), False)
    for out in run_ranks(2, sft_run, str(tmp_path / "zero3"), True):
        assert out["shares"] == [EXPERTS // 2] and len(out["logged"]) == STEPS == len(plain["logged"])
        for (loss, norm), (ref_loss, ref_norm) in zip(out["logged"], plain["logged"]):
            assert loss == pytest.approx(ref_loss, rel=1e-4) and norm == pytest.approx(ref_norm, rel=1e-4)
