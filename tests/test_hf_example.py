"""examples/hf_causal_lm.py: a Hugging Face Llama fine-tuned under zero3.Init, as users run it.

The example's own functions train at world sizes 1 and 2 (fp32), and each
step's loss, the mean over every rank's rows, is compared with plain
single-process PyTorch (the same LlamaForCausalLM built with the same seed, the
same global batches, torch.optim.AdamW with the same hyperparameters, clipping
by global norm) within rtol 1e-5. Both world sizes train on the same global
batches (4 rows: 1 x 4 and 2 x 2), so they share one reference. The saved
directory must load with `from_pretrained` and give the trained engine's
logits (within 1e-5). Then the script runs end to end as a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import zero3
from tests.distributed import load_script, run_ranks, script_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "hf_causal_lm.py"
STEPS = 4
GLOBAL_ROWS = 4
RTOL = 1e-5  # fp32: the engine and plain torch differ only in summation order
LOGIT_ATOL = 1e-5


def example() -> ModuleType:
    return load_script(SCRIPT, "zero3_example_hf_causal_lm")


def argv(world: int, out: Path, *extra: str) -> list[str]:
    return ["--hidden", "32", "--intermediate", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
            "--seq-len", "16", "--micro-batch", str(GLOBAL_ROWS // world), "--steps", str(STEPS),
            "--lr", "3e-3", "--weight-decay", "0.01", "--clip", "1.0", "--precision", "fp32",
            "--persistence-threshold", "0", "--device", "cpu", "--seed", "7", "--out", str(out), *extra]


def train_job(rank: int, world: int, args_list: list[str]) -> dict:
    """The example's pieces on this rank: build under Init, train, save; then the round trip."""
    from transformers import LlamaForCausalLM

    ex = example()
    args = ex.parse_args(args_list)
    ex.init_distributed(args)
    engine = ex.build_engine(args)
    losses = ex.train(engine, args, log=False)
    statuses = {zero3.param_status(p) for p in engine.module.parameters()}
    ex.save(engine, args)
    ids = ex.rank_rows(args, ex.global_batch(args, STEPS, world), rank)
    with torch.no_grad():
        logits = engine(input_ids=ids, use_cache=False).logits
    loaded = LlamaForCausalLM.from_pretrained(args.out)
    with torch.no_grad():
        plain = loaded(input_ids=ids, use_cache=False).logits
    engine.destroy()
    return {"losses": losses, "logit_diff": (plain - logits).abs().max().item(),
            "loaded_dtype": next(loaded.parameters()).dtype, "statuses": statuses}


def reference_losses(args_list: list[str]) -> list[float]:
    """Plain single-process PyTorch on the whole global batch of each step."""
    from transformers import LlamaForCausalLM

    ex = example()
    args = ex.parse_args(args_list)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(ex.model_config(args))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    tokens = ex.corpus_tokens() if args.data == "corpus" else None
    losses = []
    for step in range(args.steps):
        ids = ex.global_batch(args, step, 1, tokens)  # world 1 with micro = GLOBAL_ROWS: every row
        assert ids.shape == (GLOBAL_ROWS, args.seq_len)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(("world", "extra"), [(1, ()), (2, ()), (2, ("--tie-embeddings", "--data", "random"))],
                         ids=["world1", "world2", "world2-tied-random"])
def test_the_example_trains_like_plain_pytorch_and_its_output_loads_with_from_pretrained(
    tmp_path: Path, world: int, extra: tuple[str, ...]
) -> None:
    out = tmp_path / "run"
    results = run_ranks(world, train_job, argv(world, out, *extra))
    reference = reference_losses(argv(1, out, *extra))
    assert reference[-1] < reference[0]  # it learns
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(reference, rel=RTOL), (rank, result["losses"], reference)
        assert result["logit_diff"] < LOGIT_ATOL, (rank, result["logit_diff"])
        assert result["loaded_dtype"] == torch.float32
        assert result["statuses"] == {zero3.ParamStatus.NOT_AVAILABLE}  # all partitioned, and released
    assert results[0]["losses"] == results[-1]["losses"]  # one global mean, the same on every rank
    tag = (out / "checkpoint" / "latest").read_text().strip()
    assert tag == f"global_step{STEPS}"
    assert (out / "checkpoint" / tag / "zero3_engine.pt").is_file()
    assert len(list((out / "checkpoint" / tag).glob("*.distcp"))) == world
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_the_script_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "2", "--hidden", "32", "--layers", "1", "--heads", "4",
         "--seq-len", "16", "--micro-batch", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=script_env(str(REPO)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    from zero3 import accelerator

    if accelerator.computes_bf16_natively(torch.device("cpu")):
        assert "1 rank(s) on cpu, bf16, corpus data" in lines[0], proc.stdout
    else:  # `--precision auto` says why it trains in fp32, in one line
        assert "would emulate bf16" in lines[0] and "1 rank(s) on cpu, fp32, corpus data" in lines[1], proc.stdout
        lines = lines[1:]
    assert [line.split(" loss ")[0] for line in lines if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    assert any(line.startswith("saved ") for line in lines), proc.stdout
    round_trip = lines[-1]
    assert round_trip.startswith(f"from_pretrained('{out}'): loss "), proc.stdout
    loaded, engine = round_trip.split(": loss ")[1].split(" (engine ")
    assert loaded == engine.split(")")[0]  # the same 4 decimals
    assert (out / "model.safetensors").is_file() and (out / "checkpoint" / "latest").is_file()


def test_bad_options_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    ex = example()
    with pytest.raises(SystemExit) as exc:
        ex.parse_args(["--vocab", "10"])
    assert exc.value.code == 2 and "smaller than the corpus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ex.parse_args(["--hidden", "30", "--heads", "4"])
    assert "multiple of --heads" in capsys.readouterr().err
