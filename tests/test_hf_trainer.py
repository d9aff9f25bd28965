"""zero3.integrations.hf.Zero3Trainer against the plain `transformers.Trainer`.

A tiny LlamaForCausalLM built from a config (no download), an in-memory
dataset read in order, accumulation 2, clipping, warmup then cosine, the
Trainer's own AdamW with its decay / no-decay groups: the Zero3Trainer at
world sizes 1 and 2 against the plain Trainer at world 1, on the same global
batches. Each step's logged loss, grad norm and learning rate, the final
weights and the evaluation loss must agree (losses rtol 1e-4, weights atol
1e-5). `save_model`
then a plain `from_pretrained` gives the trained engine's logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import zero3
from tests.distributed import run_ranks
from tests.memory import peak_extra_bytes

GLOBAL_ROWS, ACCUMULATION, STEPS = 4, 2, 4
CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


def tiny_llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)


def dataset() -> list[dict[str, torch.Tensor]]:
    rows = torch.randint(0, 64, (GLOBAL_ROWS * ACCUMULATION * STEPS, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


def arguments(world: int, output_dir: str, **overrides: Any) -> Any:
    options: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=GLOBAL_ROWS // world,
        gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=1e-2, weight_decay=0.1,
        warmup_steps=1, lr_scheduler_type="cosine", max_grad_norm=0.5, logging_steps=1, save_strategy="no",
        report_to=[], seed=0, use_cpu=True,
    )
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def in_order(trainer_class: type) -> type:
    """The same class reading the dataset in order: the plain run and the zero3 runs see the same batches."""

    class InOrder(trainer_class):  # type: ignore[valid-type, misc]
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return InOrder


def logged(trainer: Any) -> list[tuple[float, float, float]]:
    return [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h]


def plain_run(rank: int, world: int, output_dir: str) -> dict:
    model = tiny_llama()
    trainer = in_order(transformers.Trainer)(model=model, args=arguments(world, output_dir), train_dataset=dataset())
    trainer.train()
    return {"logged": logged(trainer), "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "eval_loss": trainer.evaluate(eval_dataset=dataset()[:8])["eval_loss"]}


def zero3_run(rank: int, world: int, output_dir: str, zero: dict | None = None) -> dict:
    """`zero`: more zero_optimization keys, run as nodes of 2 ranks (torchrun's variables)."""
    import os

    from zero3.integrations.hf import Zero3Trainer

    config = CONFIG
    if zero:
        os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2))
        config = {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"], **zero}}
    model = tiny_llama()
    trainer = in_order(Zero3Trainer)(
        model=model, args=arguments(world, output_dir), train_dataset=dataset(), zero3_config=config,
    )
    engine = trainer.engine
    out: dict[str, Any] = {
        "groups": [(len(g["params"]), g["weight_decay"]) for g in engine.optimizer.param_groups],
        "clipping": engine.config.gradient_clipping,
        "micro_batch": engine.train_micro_batch_size_per_gpu(),
    }
    trainer.train()
    out["logged"] = logged(trainer)
    out["weights"] = {n: zero3.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    out["global_steps"] = engine.global_steps
    out["eval_loss"] = trainer.evaluate(eval_dataset=dataset()[:8])["eval_loss"]
    saved = Path(output_dir) / f"saved-{world}"
    trainer.save_model(str(saved))
    probe = torch.arange(16).view(1, 16)
    with torch.no_grad():
        out["logits"] = engine(input_ids=probe).logits
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_ranks(1, plain_run, str(tmp_path_factory.mktemp("plain")))[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "zero"), [
    (1, None), (4, {"zero_hpz_partition_size": 2}),
], ids=["1", "4-hpz"])
def test_zero3_trainer_trains_like_the_plain_trainer(world: int, zero: dict | None, plain: dict, tmp_path: Path) -> None:
    """Also at 4 ranks as 2 nodes of 2 with hpZ's secondary groups of a node."""
    results = run_ranks(world, zero3_run, str(tmp_path), zero)
    for out in results:
        # The Trainer's AdamW groups (decay / no-decay), its clipping and micro-batch, filled from "auto".
        assert [decay for _, decay in out["groups"]] == [0.1, 0.0] and sum(n for n, _ in out["groups"]) == 21
        assert out["clipping"] == 0.5 and out["micro_batch"] == GLOBAL_ROWS // world
        assert out["global_steps"] == STEPS  # one engine step per accumulation window, not per micro-batch
        assert out["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-4)  # evaluate() runs on the engine
        assert len(out["logged"]) == STEPS
        for (loss, norm, lr), (ref_loss, ref_norm, ref_lr) in zip(out["logged"], plain["logged"]):
            assert loss == pytest.approx(ref_loss, rel=1e-4)
            assert norm == pytest.approx(ref_norm, rel=1e-4)  # the engine's pre-clip global norm
            assert lr == pytest.approx(ref_lr, rel=1e-9)  # the Trainer's warmup + cosine drove the engine
        for name, ref in plain["weights"].items():
            torch.testing.assert_close(out["weights"][name], ref, rtol=0, atol=1e-5, msg=name)

    # save_model: safetensors and config.json that a plain from_pretrained loads, giving the engine's logits.
    saved = tmp_path / f"saved-{world}"
    assert (saved / "model.safetensors").is_file()
    assert json.loads((saved / "config.json").read_text())["model_type"] == "llama"
    loaded = transformers.LlamaForCausalLM.from_pretrained(saved)
    with torch.no_grad():
        logits = loaded(input_ids=torch.arange(16).view(1, 16)).logits
    torch.testing.assert_close(logits, results[0]["logits"], rtol=0, atol=1e-5)


def test_a_written_value_that_disagrees_with_the_arguments_is_named() -> None:
    from zero3.integrations.hf_config import fill_from_training_arguments

    args = arguments(1, "/tmp/unused")
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": "auto", "optimizer": {
        "type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": 1e-6, "weight_decay": "auto"}}}
    with pytest.raises(ValueError) as info:
        fill_from_training_arguments(config, args, world_size=1)
    message = str(info.value)
    assert "train_micro_batch_size_per_gpu=3 but TrainingArguments.per_device_train_batch_size=4" in message
    assert "optimizer.params.eps=1e-06 but TrainingArguments.adam_epsilon=1e-08" in message
    config.update(train_micro_batch_size_per_gpu=4)
    config["optimizer"]["params"]["eps"] = "auto"
    filled = fill_from_training_arguments(config, args, world_size=1, model=tiny_llama())
    assert filled["gradient_clipping"] == 0.5
    assert filled["optimizer"]["params"] == {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}
    assert config["gradient_clipping"] == "auto"  # the caller's dict is left as it was
    assert "bf16" not in filled and "fp16" not in filled
    # A config silent on precision follows the arguments' bf16 / fp16, as accelerate's DeepSpeed plugin does.
    assert fill_from_training_arguments({}, arguments(1, "/tmp/unused", bf16=True), 1)["bf16"] == {"enabled": True}


def test_an_unfilled_auto_handed_to_initialize_names_the_key() -> None:
    # The same template outside the Trainer: nothing fills "auto", and zero3 says which key is unfilled.
    with pytest.raises(zero3.ConfigError, match="train_micro_batch_size_per_gpu"):
        zero3.load_config(CONFIG)


def resumed_run(rank: int, world: int, output_dir: str) -> dict:
    """Train 4 steps saving a checkpoint at step 3; then a new Trainer resumes from checkpoint-3."""
    from zero3.integrations.hf import Zero3Trainer

    out: dict[str, Any] = {}
    for how in ("through", "resumed"):
        model = tiny_llama()
        if how == "resumed":
            torch.manual_seed(1234)  # a different state everywhere: what resumes must come from the checkpoint
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_()
        args = arguments(world, f"{output_dir}/{how}", save_strategy="steps", save_steps=3)
        trainer = in_order(Zero3Trainer)(model=model, args=args, train_dataset=dataset(), zero3_config=CONFIG)
        trainer.train(resume_from_checkpoint=f"{output_dir}/through/checkpoint-3" if how == "resumed" else None)
        out[how] = {
            "logged": logged(trainer),
            "weights": {n: zero3.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()},
            "global_steps": trainer.engine.global_steps,
        }
        trainer.engine.destroy()
    out["checkpoint"] = sorted(p.name for p in Path(f"{output_dir}/through/checkpoint-3").iterdir())
    return out


@pytest.mark.timeout(300)
def test_a_run_resumed_from_checkpoint_3_ends_as_the_uninterrupted_one(tmp_path: Path) -> None:
    for out in run_ranks(2, resumed_run, str(tmp_path)):
        assert {"zero3", "trainer_state.json", "scheduler.pt", "model.safetensors"} <= set(out["checkpoint"])
        through, resumed = out["through"], out["resumed"]
        assert resumed["global_steps"] == through["global_steps"] == STEPS
        # The Trainer's state brings the first three steps' logs back; the fourth is trained again, alike.
        assert resumed["logged"] == through["logged"] and len(resumed["logged"]) == STEPS
        for name, value in through["weights"].items():
            assert torch.equal(resumed["weights"][name], value), name  # bit-exact


@pytest.mark.timeout(300)
def test_the_example_runs_under_torchrun_and_resumes(tmp_path: Path) -> None:
    """examples/hf_trainer.py as its docstring launches it: two ranks under torchrun, then resumed under
    `accelerate launch`."""
    import subprocess
    import sys

    from tests.distributed import script_env

    repo = Path(__file__).resolve().parents[1]
    script = [str(repo / "examples" / "hf_trainer.py"), "--out", str(tmp_path), "--seq-len", "32", "--micro-batch", "2",
              "--save-steps", "2"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *script]
    # --multi_gpu is accelerate's multi-process launcher (torchrun's); without a GPU the ranks run on the CPU.
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no", *script]
    first = subprocess.run([*torchrun, "--steps", "2"], capture_output=True, text=True, timeout=240, cwd=repo,
                           env=script_env(str(repo)))
    assert first.returncode == 0, first.stdout + first.stderr
    assert (tmp_path / "checkpoint-2" / "zero3").is_dir() and (tmp_path / "model.safetensors").is_file()
    resumed = subprocess.run([*accelerate, "--steps", "3", "--resume", str(tmp_path / "checkpoint-2")],
                             capture_output=True, text=True, timeout=240, cwd=repo, env=script_env(str(repo)))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    # Two processes under each launcher: each rank wrote its own piece of the engine's checkpoint.
    for step in (2, 3):
        assert sorted(p.name for p in (tmp_path / f"checkpoint-{step}" / "zero3").glob("*.distcp")) == [
            "__0_0.distcp", "__1_0.distcp"]
    state = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and len([h for h in state["log_history"] if "loss" in h]) == 3
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.num_hidden_layers == 2


def word_tokenizer() -> Any:
    """A tokenizer built here (no download): one token per word "t0".."t61", with pad and eos."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i + 2 for i in range(62)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def text_dataset() -> Any:
    import datasets

    rows = torch.randint(0, 62, (GLOBAL_ROWS * ACCUMULATION * STEPS, 12), generator=torch.Generator().manual_seed(1))
    return datasets.Dataset.from_dict({"text": [" ".join(f"t{int(i)}" for i in row) for row in rows]})


def train_and_log(trainer: Any, keys: tuple[str, ...], on_zero3: bool) -> dict:
    """Train; the logged values under `keys` at each logged step, and under zero3 the engine's step count
    (the engine is then destroyed)."""
    trainer.train()
    out: dict[str, Any] = {"logged": [tuple(h[key] for key in keys) for h in trainer.state.log_history if "loss" in h]}
    if on_zero3:
        out["steps"] = trainer.engine.global_steps
        trainer.engine.destroy()
    return out


def sft_trainer(model: Any, world: int, output_dir: str, on_zero3: bool, zero3_config: dict = CONFIG,
                max_steps: int = STEPS, max_length: int = 16) -> Any:
    """TRL's SFTTrainer over `model` on the word dataset, read in order: through Zero3TrainerMixin on
    `zero3_config`, or plain."""
    import trl

    from zero3.integrations.hf import Zero3TrainerMixin

    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    args = trl.SFTConfig(
        output_dir=output_dir, per_device_train_batch_size=GLOBAL_ROWS // world,
        gradient_accumulation_steps=ACCUMULATION, max_steps=max_steps, learning_rate=1e-2, warmup_steps=1,
        max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
        max_length=max_length,
        bf16=False,  # SFTConfig's default is bf16: fp32 on both sides, to compare within float32 rounding
    )
    if on_zero3:
        class SFT(Zero3TrainerMixin, trl.SFTTrainer):  # what the users write
            pass

        return in_order(SFT)(model=model, args=args, train_dataset=text_dataset(),
                             processing_class=word_tokenizer(), zero3_config=zero3_config)
    return in_order(trl.SFTTrainer)(model=model, args=args, train_dataset=text_dataset(),
                                    processing_class=word_tokenizer())


def sft_run(rank: int, world: int, output_dir: str, on_zero3: bool) -> dict:
    return train_and_log(sft_trainer(tiny_llama(), world, output_dir, on_zero3), ("loss", "grad_norm"), on_zero3)


@pytest.mark.timeout(300)
def test_trls_sft_trainer_trains_on_zero3_through_the_mixin(tmp_path: Path) -> None:
    (plain,) = run_ranks(1, sft_run, str(tmp_path / "plain"), False)
    for out in run_ranks(2, sft_run, str(tmp_path / "zero3"), True):
        assert out["steps"] == STEPS and len(out["logged"]) == STEPS
        for (loss, norm), (ref_loss, ref_norm) in zip(out["logged"], plain["logged"]):
            assert loss == pytest.approx(ref_loss, rel=1e-4)
            assert norm == pytest.approx(ref_norm, rel=1e-4)


def preference_dataset() -> Any:
    import datasets

    words = torch.randint(0, 62, (GLOBAL_ROWS * ACCUMULATION * STEPS, 3, 5), generator=torch.Generator().manual_seed(2))

    def text(row: torch.Tensor) -> str:
        return " ".join(f"t{int(i)}" for i in row)

    return datasets.Dataset.from_dict({
        "prompt": [text(w[0]) for w in words], "chosen": [text(w[1]) for w in words],
        "rejected": [text(w[2]) for w in words],
    })


def dpo_run(rank: int, world: int, output_dir: str, on_zero3: bool) -> dict:
    import trl

    from zero3.integrations.hf import Zero3TrainerMixin

    model, reference = tiny_llama(), tiny_llama()
    for m in (model, reference):
        m.config.pad_token_id, m.config.eos_token_id = 0, 1
    args = trl.DPOConfig(
        output_dir=output_dir, per_device_train_batch_size=GLOBAL_ROWS // world,
        gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=1e-2, warmup_steps=1,
        max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True, bf16=False,
        max_length=16,
    )
    base = trl.DPOTrainer
    if on_zero3:
        class DPO(Zero3TrainerMixin, trl.DPOTrainer):
            pass

        base = DPO
    kwargs = {"zero3_config": CONFIG} if on_zero3 else {}
    trainer = in_order(base)(model=model, ref_model=reference, args=args, train_dataset=preference_dataset(),
                             processing_class=word_tokenizer(), **kwargs)
    trainer.train()
    out: dict[str, Any] = {"logged": [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]}
    if on_zero3:
        ref_engine = trainer.ref_engine
        out["reference"] = {
            "is_engine": trainer.ref_model is ref_engine, "optimizer": ref_engine.optimizer,
            "trainable": sum(p.requires_grad for p in reference.parameters()),
            "state": ref_engine.model_state_bytes(),
        }
        trainer.engine.destroy()
        ref_engine.destroy()
    return out


@pytest.mark.timeout(300)
def test_trls_dpo_trainer_trains_on_zero3_with_a_partitioned_frozen_reference(tmp_path: Path) -> None:
    (plain,) = run_ranks(1, dpo_run, str(tmp_path / "plain"), False)
    for out in run_ranks(2, dpo_run, str(tmp_path / "zero3"), True):
        reference = out["reference"]
        assert reference["is_engine"] and reference["optimizer"] is None and reference["trainable"] == 0
        state = reference["state"]  # its 16-bit shards (and persistent small parameters), nothing for a step
        assert state["hp_params"] == state["optim_states"] == state["lp_grads"] == state["contiguous_grad_buffer"] == 0
        assert state["lp_params"] > 0
        assert len(out["logged"]) == STEPS
        for (loss, norm), (ref_loss, ref_norm) in zip(out["logged"], plain["logged"]):
            assert loss == pytest.approx(ref_loss, rel=1e-4)
            assert norm == pytest.approx(ref_norm, rel=1e-4)


def grpo_run(rank: int, world: int, output_dir: str, on_zero3: bool) -> dict:
    """TRL's GRPOTrainer: completions sampled from the policy (through the engine under zero3), rewarded by
    how often they say "t5", the policy stepped on the group-relative advantages."""
    import datasets
    import trl

    from zero3.integrations.hf import Zero3TrainerMixin

    model = tiny_llama()
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    prompts = datasets.Dataset.from_dict(
        {"prompt": [" ".join(f"t{(7 * i + j) % 62}" for j in range(4)) for i in range(16)]})

    def says_t5(completions: list[str], **_: Any) -> list[float]:
        return [float(completion.split().count("t5")) for completion in completions]

    args = trl.GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=3, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
        bf16=False,
    )
    base = trl.GRPOTrainer
    if on_zero3:
        class GRPO(Zero3TrainerMixin, trl.GRPOTrainer):
            pass

        base = GRPO
    kwargs = {"zero3_config": CONFIG} if on_zero3 else {}
    trainer = base(model=model, reward_funcs=says_t5, args=args, train_dataset=prompts,
                   processing_class=word_tokenizer(), **kwargs)
    return train_and_log(trainer, ("loss", "grad_norm", "reward", "completions/mean_length"), on_zero3)


@pytest.mark.timeout(300)
def test_trls_grpo_trainer_generates_and_trains_on_zero3(tmp_path: Path) -> None:
    # Sampling draws from each rank's own generator, so the plain run is at world 2 as well (DDP through
    # accelerate): the same seeds give the same completions when the policies agree.
    plain = run_ranks(2, grpo_run, str(tmp_path / "plain"), False)
    on_zero3 = run_ranks(2, grpo_run, str(tmp_path / "zero3"), True)
    for out, ref in zip(on_zero3, plain):
        assert out["steps"] == 3 and len(out["logged"]) == len(ref["logged"]) == 3
        for (loss, norm, reward, length), (ref_loss, ref_norm, ref_reward, ref_length) in zip(out["logged"],
                                                                                              ref["logged"]):
            assert reward == ref_reward and length == ref_length  # the same completions were generated
            assert loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
            assert norm == pytest.approx(ref_norm, rel=1e-4)
    assert any(reward > 0 for _, _, reward, _ in on_zero3[0]["logged"])


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def load_partitioned(rank: int, world: int, path: str, warm_up: str) -> dict:
    from zero3.integrations.hf import from_pretrained

    from_pretrained(transformers.LlamaForCausalLM, warm_up, zero3_config=CONFIG)  # imports, process group, threads
    loaded: list[Any] = []
    before = _rss_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
    peak = peak_extra_bytes(lambda: loaded.append(
        from_pretrained(transformers.LlamaForCausalLM, path, zero3_config=CONFIG)))["all"]
    rss_peak = _rss_bytes("VmHWM") - before
    (model,) = loaded
    engine = zero3.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3}})[0]
    probe = torch.arange(16).view(1, 16)
    with torch.no_grad():
        logits = engine(input_ids=probe).logits
    with zero3.GatheredParameters(list(model.parameters())):
        full = {name: p.detach().clone() for name, p in model.named_parameters()} if rank == 0 else {}
    engine.destroy()
    return {"peak": peak, "rss_peak": rss_peak, "logits": logits, "full": full}


@pytest.mark.timeout(300)
def test_from_pretrained_streams_the_checkpoint_into_the_partitions(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=32)
    source = transformers.LlamaForCausalLM(config)
    source.save_pretrained(tmp_path, max_shard_size="10MB")  # sharded, with an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    full_bytes = sum(p.numel() * p.element_size() for p in source.parameters())
    with torch.no_grad():
        expected = source(input_ids=torch.arange(16).view(1, 16)).logits

    warm_up = tmp_path / "tiny"
    tiny_llama().save_pretrained(warm_up)
    world = 4
    results = run_ranks(world, load_partitioned, str(tmp_path), str(warm_up))
    for name, value in source.named_parameters():
        assert torch.equal(results[0]["full"][name], value), name
    for out in results:
        torch.testing.assert_close(out["logits"], expected, rtol=0, atol=1e-5)
    peaks = [out["peak"] for out in results]
    print(f"\nfrom_pretrained, {full_bytes / 2**20:.0f} MiB model at world {world} (a rank's share "
          f"{full_bytes / world / 2**20:.0f} MiB, the largest tensor 8 MiB): peak tensor bytes per rank "
          f"{', '.join(f'{peak / 2**20:.0f}' for peak in peaks)} MiB; peak RSS growth "
          f"{', '.join(str(out['rss_peak'] // 2**20) for out in results)} MiB")
    # Its shards plus the module being built (its parameters, flattened and broadcast) and a slice of
    # the tensor being read: never the model. RSS is printed, not asserted: glibc's thread arenas keep
    # freed blocks in a way that varies run to run.
    largest = max(p.numel() * p.element_size() for p in source.parameters())
    assert max(peaks) <= full_bytes / world + 2 * largest + 4 * 2**20 < 0.5 * full_bytes
