"""A DeepSpeed ZeRO-3 job resumed on zero3: `zero3 import-deepspeed SRC OUT --trust-checkpoint`.

DeepSpeed 0.19.8 itself (the test extra installs it; it runs on the CPU without building its ops) trains
tests/deepspeed_job.py at 2 ranks for 3 steps, saves, and trains 3 more; the imported checkpoint resumed
on zero3 at 2 and at 1 rank gives DeepSpeed's next losses (fp32: to the last bit here; bf16: within bf16's
rounding, the two engines' kernels summing in other orders). The masters equal DeepSpeed's own
zero_to_fp32 reconstruction. Every refusal (no --trust-checkpoint, a missing rank's file, a stage other
than 3, a file holding more than DeepSpeed writes) names the file or flag and writes nothing; a model of
other shapes is refused by the load.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import script_env
from zero3 import cli

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "deepspeed_job.py"
CLI = [sys.executable, "-c", "import sys, zero3.cli; sys.exit(zero3.cli.main(sys.argv[1:]))"]


def torchrun(nproc: int, *args: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(JOB), *args]
    env = script_env(str(REPO), GLOO_SOCKET_IFNAME="lo", DS_ACCELERATOR="cpu")
    done = subprocess.run(command, capture_output=True, text=True, timeout=420, cwd=REPO, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """DeepSpeed's own runs, each saving a checkpoint at step 3 and training on to 6."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as error:  # the test extra installs it: its absence is a broken environment
        pytest.fail(f"deepspeed is not installed ({error}): pip install -e '.[test]' installs deepspeed==0.19.8")
    root = tmp_path_factory.mktemp("deepspeed")
    runs = {}
    for precision in ("fp32", "bf16"):
        out = root / precision
        torchrun(2, str(out), "--ckpt", str(out / "ckpt"), "--engine", "deepspeed", "--precision", precision)
        runs[precision] = out
    return runs


def losses(path: Path) -> dict[str, float]:
    return json.loads(path.read_text())["after"]


def imported(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "zero3-ckpt"
    done = subprocess.run([*CLI, "import-deepspeed", str(run / "ckpt"), str(out), "--trust-checkpoint"],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=script_env(str(REPO)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == str(out / "global_step3")
    return out


@pytest.mark.timeout(900)
def test_an_fp32_deepspeed_run_resumed_on_zero3_at_2_and_1_ranks_continues_as_deepspeed_does(
    deepspeed_runs: dict[str, Path], tmp_path: Path,
) -> None:
    run = deepspeed_runs["fp32"]
    out = imported(run, tmp_path)
    expected = losses(run / "losses_deepspeed.json")
    for world in (2, 1):
        torchrun(world, str(tmp_path), "--ckpt", str(out), "--engine", "zero3")
        got = losses(tmp_path / f"losses_zero3_w{world}.json")
        assert got.keys() == expected.keys() == {"4", "5", "6"}
        assert all(math.isclose(got[s], expected[s], rel_tol=1e-6) for s in expected), (world, got, expected)


@pytest.mark.timeout(900)
def test_a_bf16_deepspeed_run_resumed_on_zero3_continues_within_bf16_rounding(
    deepspeed_runs: dict[str, Path], tmp_path: Path,
) -> None:
    run = deepspeed_runs["bf16"]
    out = imported(run, tmp_path)
    expected = losses(run / "losses_deepspeed.json")
    torchrun(2, str(tmp_path), "--ckpt", str(out), "--engine", "zero3", "--precision", "bf16")
    got = losses(tmp_path / "losses_zero3_w2.json")
    assert all(math.isclose(got[s], expected[s], rel_tol=1e-3) for s in expected), (got, expected)


def test_the_masters_are_deepspeeds_own_reconstruction(deepspeed_runs: dict[str, Path]) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from zero3.checkpoint import deepspeed_files

    for run in deepspeed_runs.values():
        theirs = get_fp32_state_dict_from_zero_checkpoint(str(run / "ckpt"))
        ours = deepspeed_files.read(run / "ckpt", trusted=True)
        assert ours.world_size == 2 and ours.global_steps == 3 and ours.client_state == {"data_position": 24}
        assert set(ours.masters) | set(ours.buffers) == set(theirs)
        assert all(torch.equal(ours.masters[name].whole(), theirs[name].float()) for name in ours.masters)


def test_zero_to_fp32_reads_deepspeeds_own_directories(deepspeed_runs: dict[str, Path], tmp_path: Path) -> None:
    """zero3.deepspeed.utils.zero_to_fp32 on a DeepSpeed directory: DeepSpeed's own script's answer, the
    safetensors file too; refused without trust_checkpoint (the files are pickles), writing nothing."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as deepspeeds
    from safetensors.torch import load_file

    from zero3.checkpoint.tags import CheckpointError
    from zero3.deepspeed.utils import zero_to_fp32

    ckpt = deepspeed_runs["bf16"] / "ckpt"
    theirs = deepspeeds(str(ckpt))
    ours = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt, trust_checkpoint=True)
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    files = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "out", trust_checkpoint=True)
    assert [f.name for f in files] == ["model.safetensors"]
    written = load_file(files[0])
    assert set(written) == set(theirs) and all(torch.equal(written[name], theirs[name]) for name in theirs)
    with pytest.raises(CheckpointError, match="trust_checkpoint=True"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="trust_checkpoint=True"):
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def refusal(src: Path, out: Path, *flags: str) -> str:
    """The CLI's error for an import that must be refused; nothing may be written."""
    before = sorted(p.name for p in out.parent.iterdir())
    done = subprocess.run([*CLI, "import-deepspeed", str(src), str(out), *flags], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=script_env(str(REPO)))
    assert done.returncode == 2, done.stdout + done.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == before  # no output, no staging left behind
    return done.stderr


def rewrite(path: Path, change: Any) -> None:
    """One of DeepSpeed's files with `change` applied to its dict (read and written by torch)."""
    from zero3.checkpoint.deepspeed_files import read_file

    state = read_file(path, trusted=True)
    change(state)
    torch.save(state, path)


def test_refusals_name_what_is_wrong_and_write_nothing(deepspeed_runs: dict[str, Path], tmp_path: Path) -> None:
    source = deepspeed_runs["fp32"] / "ckpt"
    out = tmp_path / "out" / "zero3-ckpt"
    out.parent.mkdir()
    said = refusal(source, out)
    assert "--trust-checkpoint" in said and "pickles" in said and "Nothing was written" in said
    assert cli.main(["import-deepspeed", str(source), str(out)]) == 2  # the same in-process

    missing = tmp_path / "missing"
    shutil.copytree(source, missing)
    (missing / "global_step3" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    said = refusal(missing, out, "--trust-checkpoint")
    assert "zero_pp_rank_1_mp_rank_00_model_states.pt" in said and "is missing" in said

    stage2 = tmp_path / "stage2"
    shutil.copytree(source, stage2)
    for rank in (0, 1):
        rewrite(stage2 / "global_step3" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                lambda state: state["ds_config"]["zero_optimization"].update(stage=2))
    said = refusal(stage2, out, "--trust-checkpoint")
    assert "zero_optimization.stage=2" in said and "expected 3" in said

    foreign = tmp_path / "foreign"
    shutil.copytree(source, foreign)
    rewrite(foreign / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
            lambda state: state.update(extra=shutil.rmtree))  # a function: no DeepSpeed file holds one
    from zero3.checkpoint import deepspeed_files
    from zero3.checkpoint.tags import CheckpointError

    with pytest.raises(CheckpointError, match="holds more than DeepSpeed's tensors"):
        deepspeed_files.read(foreign, trusted=False)


def other_shapes(rank: int, world: int, checkpoint: str) -> str:
    import zero3
    from tests import deepspeed_job

    class Wider(deepspeed_job.TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(deepspeed_job.WIDTH, deepspeed_job.VOCAB + 1, bias=False)

    engine, *_ = zero3.initialize(model=Wider(), config=deepspeed_job.config("fp32"))
    try:
        engine.load_checkpoint(checkpoint)
    except zero3.CheckpointError as error:
        return str(error)
    finally:
        engine.destroy()
    return ""


def test_a_model_of_other_shapes_is_refused_by_the_load(deepspeed_runs: dict[str, Path], tmp_path: Path) -> None:
    from tests.distributed import run_ranks

    out = imported(deepspeed_runs["fp32"], tmp_path)
    (said,) = run_ranks(1, other_shapes, str(out))
    assert "head.weight" in said, said
