"""The engine under `torchrun` (env:// rendezvous), as users launch it, and on CUDA where present."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks, script_env

# A user's training script: build under Init, train 4 steps on this rank's share of each batch.
TRAIN = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist, zero3
    from tests.models import TiedTransformer, batches

    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    with zero3.Init(config=cfg):
        model = TiedTransformer()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank, world = engine.global_rank, engine.world_size
    for x, y in batches("tokens", 4, 2 * world):
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
    """
)

SCRIPT = TRAIN + textwrap.dedent(
    """
    mean = loss.detach().float().reshape(1)
    dist.all_reduce(mean)
    # one write per line, so the two ranks' lines cannot interleave on the shared pipe
    sys.stdout.write(f"rank {rank}/{world} backend {dist.get_backend()} steps {engine.global_steps} loss {mean.item() / world:.6f}\\n")
    sys.stdout.flush()
    engine.destroy()
    dist.destroy_process_group()
    """
)


def test_two_ranks_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        capture_output=True, text=True, timeout=300, cwd=repo, env=script_env(str(repo)),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank "))
    assert [line.split()[1] for line in lines] == ["0/2", "1/2"]
    assert all("backend gloo" in line and "steps 4" in line for line in lines)
    assert lines[0].split("loss")[1] == lines[1].split("loss")[1]  # one model, one loss


def cuda_parity(rank: int, world: int) -> dict:
    import copy

    import zero3
    from tests import models

    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    model = models.TiedTransformer()
    reference = copy.deepcopy(model).cuda()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    data = [(x.cuda(), y.cuda()) for x, y in models.batches("tokens", 4, 4)]
    losses = []
    for x, y in data:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    ref_losses, _ = models.reference_losses(reference, data, 3e-3, 0.01, 1.0)
    result = {"device": str(engine.device), "losses": losses, "reference": ref_losses,
              "lp_on_cuda": zero3.safe_get_local_lp_param(model.embed.weight).is_cuda}
    engine.destroy()
    return result


@pytest.mark.cuda
def test_cuda_single_rank_parity() -> None:
    # A fresh process: a group left in the test process by an in-process test would pick its backend.
    (result,) = run_ranks(1, cuda_parity)
    assert result["device"] == "cuda:0"
    for ours, ref in zip(result["losses"], result["reference"]):
        assert abs(ours - ref) / abs(ref) <= 1e-4
    assert result["lp_on_cuda"]
