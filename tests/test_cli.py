"""The `zero3` command: its help, its config building, and one real 2-rank run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import children_of
from zero3 import cli
from zero3.config import load_config

REPO = Path(__file__).resolve().parents[1]

TRAIN_OPTIONS = (
    "--nproc", "--steps", "--micro-batch", "--grad-accum", "--block-size", "--n-layer",
    "--n-head", "--n-embd", "--lr", "--precision", "--seed", "--config",
    "--persistence-threshold", "--log-every",
)


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_help_mentions_every_option(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(argv, capsys)
    missing = [opt for opt in TRAIN_OPTIONS if opt not in text]
    assert not missing, f"`zero3 {' '.join(argv)}` does not mention {missing}"


def test_train_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(_help(["train", "--help"], capsys).split())
    for default in ("(default: 2)", "(default: 200)", "(default: auto)", "(default: 0.001)"):
        assert default in text


def test_no_command_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2


def _args(*argv: str) -> object:
    return cli.build_parser().parse_args(["train", *argv])


def test_built_config_is_valid_and_matches_options() -> None:
    cfg = cli.build_config(_args("--micro-batch", "3", "--grad-accum", "2", "--lr", "0.01",
                                 "--precision", "fp16", "--persistence-threshold", "500",
                                 "--steps", "50"))
    parsed = load_config(cfg)
    batch = parsed.resolve_batch(4)
    assert (batch.micro_batch_per_gpu, batch.gradient_accumulation_steps) == (3, 2)
    assert batch.train_batch_size == 24
    assert parsed.fp16.enabled and not parsed.bf16.enabled
    assert parsed.gradient_clipping == 1.0
    assert parsed.zero_optimization.stage3_param_persistence_threshold == 500
    assert cfg["optimizer"] == {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}
    warmup = cfg["scheduler"]["params"]
    assert warmup["warmup_num_steps"] == 5 and warmup["warmup_type"] == "linear"
    assert warmup["warmup_max_lr"] == 0.01


def test_warmup_length_is_bounded() -> None:
    assert cli.build_config(_args("--steps", "5000"))["scheduler"]["params"]["warmup_num_steps"] == 100
    assert cli.build_config(_args("--steps", "4"))["scheduler"]["params"]["warmup_num_steps"] == 1


def test_user_config_overrides_the_built_one() -> None:
    built = cli.build_config(_args())  # bf16, micro 8, accum 1
    merged = cli.merge_user_config(built, {
        "fp16": {"enabled": True},
        "train_batch_size": 64,
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
    })
    # Setting fp16 takes the whole precision group: no clash with the built bf16.
    assert "bf16" not in merged and merged["fp16"] == {"enabled": True}
    # Setting train_batch_size takes the batch group: no clash with micro-batch 8.
    assert "train_micro_batch_size_per_gpu" not in merged
    # Nested sections merge key by key.
    assert merged["zero_optimization"]["stage"] == 3
    assert merged["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert load_config(merged).resolve_batch(2).micro_batch_per_gpu == 32


def test_bad_options_fail_before_launching(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Each of these must be refused in the launching process (exit 2, a message
    # naming the problem) without ever starting a worker.
    assert cli.main(["train", "--n-embd", "30", "--n-head", "4"]) == 2
    assert "divisible" in capsys.readouterr().err

    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    assert cli.main(["train", "--config", str(bad_json)]) == 2
    assert "not valid JSON" in capsys.readouterr().err

    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"train_batch_size": 7}))  # not divisible by 2 ranks
    assert cli.main(["train", "--config", str(wrong)]) == 2
    assert "train_batch_size" in capsys.readouterr().err

    with pytest.raises(SystemExit):
        cli.main(["train", "--nproc", "0"])
    assert "must be >= 1" in capsys.readouterr().err


@pytest.mark.timeout(300)
@pytest.mark.timeout(300)
def test_a_worker_failure_prints_the_workers_error(tmp_path: Path) -> None:
    # Valid config, refused by the engine in every worker (the disk tier's directory does not exist).
    config = tmp_path / "offload.json"
    missing = str(tmp_path / "no-such-dir")
    config.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": missing}}}))
    proc = _run_train("--steps", "2", "--config", str(config))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last_lines = proc.stderr.strip().splitlines()[-3:]
    # The summary itself names the error, not only where the logs are.
    failed = [line for line in last_lines if line.startswith("zero3 train: rank ") and " failed: " in line]
    assert failed, proc.stderr
    assert "TierConfigError: zero_optimization.offload_optimizer.nvme_path=" in failed[0], failed[0]
    assert "does not exist" in failed[0], failed[0]
    assert last_lines[-1].startswith("zero3 train: the workers' logs are in ")


def _train_command(*extra: str) -> tuple[list[str], dict[str, str]]:
    """`zero3 train` of a tiny GPT at 2 ranks in a fresh process (zero3 from this checkout): command, env."""
    argv = ["train", "--nproc", "2", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
            "--micro-batch", "2", "--precision", "fp32", *extra]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return [sys.executable, "-c", f"import sys, zero3.cli; sys.exit(zero3.cli.main({argv!r}))"], env


def _run_train(*extra: str) -> subprocess.CompletedProcess:
    command, env = _train_command(*extra)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _start_train(*extra: str) -> subprocess.Popen:
    """`_run_train` started in the background (a reference run beside the run under test)."""
    command, env = _train_command(*extra)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(job: subprocess.Popen) -> str:
    """A background `_start_train` that must succeed: its stdout."""
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, out + err
    return out


def _train(*extra: str) -> str:
    """`_run_train` that must succeed; its stdout."""
    proc = _run_train(*extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _final_loss(output: str) -> str:
    (line,) = [line for line in output.splitlines() if line.startswith("final loss")]
    return line.split()[-1]


@pytest.mark.timeout(300)
def test_cli_train_saves_and_resumes_as_if_it_never_stopped(tmp_path: Path) -> None:
    save_dir = tmp_path / "ckpt"
    straight_job = _start_train("--steps", "4")  # the uninterrupted run, beside the stopped one (independent)
    _train("--steps", "2", "--save-dir", str(save_dir))
    assert (save_dir / "latest").read_text().strip() == "global_step2"
    resumed = _train("--steps", "4", "--save-dir", str(save_dir), "--resume", "--save-every", "1")
    assert "at step 2" in resumed, resumed
    assert (save_dir / "latest").read_text().strip() == "global_step4"
    straight = _finish(straight_job)
    assert _final_loss(resumed) == _final_loss(straight)
    assert cli.main(["train", "--resume"]) == 2  # needs --save-dir
    # What a plain two-rank run reports: the state per rank, a row per rank, the loss and the throughput.
    assert "16P/N" in straight, straight
    for rank_row in ("│    0 │", "│    1 │"):
        assert rank_row in straight, straight
    assert "final loss" in straight and "tokens/s" in straight, straight


@pytest.mark.timeout(400)
def test_cli_train_restarts_a_killed_worker_and_ends_as_an_uninterrupted_run(tmp_path: Path) -> None:
    import signal
    import time

    save_dir = tmp_path / "ckpt"
    argv = ["train", "--nproc", "2", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
            "--micro-batch", "2", "--precision", "fp32", "--steps", "20", "--log-every", "20"]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, "-c", "import sys, zero3.cli; sys.exit(zero3.cli.main(sys.argv[1:]))"]
    # The uninterrupted run goes beside the one under test (independent: its own ports, no checkpoints).
    straight_job = subprocess.Popen([*command, *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
    job = subprocess.Popen([*command, *argv, "--save-dir", str(save_dir), "--save-every", "4", "--max-restarts", "2"],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 200
    while not (save_dir / "latest").is_file() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = children_of(job.pid, b"spawn_main")  # the elastic launcher's workers
    assert len(workers) == 2 and job.poll() is None, "the job ended before a worker could be killed"
    os.kill(workers[-1], signal.SIGKILL)  # a worker dies mid-run, a checkpoint behind
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, out + err
    assert "(restart 1)" in out and "resumed from" in out, out
    straight_out, straight_err = straight_job.communicate(timeout=300)
    assert straight_job.returncode == 0, straight_out + straight_err
    assert _final_loss(out) == _final_loss(straight_out)


@pytest.mark.timeout(300)
def test_train_on_two_nodes_ends_like_one_node_of_the_same_world(tmp_path: Path) -> None:
    """Two `zero3 train --nnodes 2 --nproc 2 --rdzv-endpoint ...` commands (two nodes on this machine) against one
    `zero3 train --nproc 4`: the same world, the same batches, the same final loss; hpZ's secondary groups of
    2 (a node each on two nodes), through `--config`. (MiCS on simulated nodes: tests/test_mics.py.)"""
    from tests.distributed import free_port

    config = tmp_path / "hpz.json"
    config.write_text('{"zero_optimization": {"zero_hpz_partition_size": 2}}')
    argv = ["train", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
            "--micro-batch", "2", "--precision", "fp32", "--steps", "6", "--log-every", "6", "--device", "cpu",
            "--config", str(config)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, "-c", "import sys, zero3.cli; sys.exit(zero3.cli.main(sys.argv[1:]))"]
    nodes = [*argv, "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    agents = [subprocess.Popen([*command, *nodes], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    # The one-node run beside the two nodes (independent: a standalone rendezvous of its own).
    one_node = subprocess.Popen([*command, *argv, "--nproc", "4"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    outputs = [agent.communicate(timeout=240) for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), outputs
    printed = [out for out, _ in outputs if "final loss" in out]
    assert len(printed) == 1  # global rank 0 reports, on its node
    one_out, one_err = one_node.communicate(timeout=240)
    assert one_node.returncode == 0, one_out + one_err
    assert _final_loss(printed[0]) == _final_loss(one_out)


def test_train_on_several_nodes_needs_a_rendezvous(capsys: pytest.CaptureFixture[str]) -> None:
    import zero3.cli

    assert zero3.cli.main(["train", "--nnodes", "2"]) == 2
    assert "--nnodes 2 needs --rdzv-endpoint HOST:PORT" in capsys.readouterr().err
    assert zero3.cli.main(["train", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "2"]) == 2
    assert "--node-rank 2: expected 0..1 (--nnodes 2)" in capsys.readouterr().err


@pytest.mark.parametrize("native", [False, True])
def test_auto_precision_is_fp32_on_a_cpu_without_bf16_units_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], native: bool,
) -> None:
    from zero3 import accelerator

    monkeypatch.setattr(accelerator, "computes_bf16_natively", lambda device: native)
    cfg = cli.build_config(_args("--device", "cpu"))
    printed = capsys.readouterr().out
    assert cfg["bf16"]["enabled"] is native
    if native:
        assert printed == ""
    else:
        assert printed.count("\n") == 1 and "trains in fp32" in printed and "--precision bf16" in printed
    assert cli.build_config(_args("--device", "cpu", "--precision", "bf16"))["bf16"]["enabled"]  # insisted
