"""``proctor train``: the rollout-batching flags, their refusals at parse time, the configuration they make, the
per-step line, and a real run of the tiny model with packed passes against a real dataserver."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from proctor.client.training.command import StepReporter, build_parser, config_from_args, main, train

ROOT = Path(__file__).resolve().parents[2]
UNREACHABLE = "http://127.0.0.1:9"  # nothing listens on the discard port: a run that got there would fail


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The last line ``proctor train`` prints to stderr when it refuses ``argv`` the argparse way (status 2)."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("flag", "value", "unit"),
    [
        ("--max-tokens-per-microbatch-in-train", "0", "tokens per micro-batch"),
        ("--max-tokens-per-microbatch-in-infer", "-5", "tokens per micro-batch"),
        ("--sequence-length-round-in-train", "0", "tokens"),
        ("--sequence-length-round-in-infer", "x", "tokens"),
        ("--rollout-micro-batch-size", "0", "rows per generate call"),
        ("--ref-logps-micro-batch-size", "1.5", "rows per reference forward"),
        ("--old-logps-micro-batch-size", "0", "rows per old-policy forward"),
        ("--per-device-train-batch-size", "0", "rows"),
    ],
)
def test_a_count_below_one_is_refused_at_parse_time(
    flag: str, value: str, unit: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refusal(["--server", UNREACHABLE, f"{flag}={value}"], capsys)
    assert line == f"proctor train: error: argument {flag}: must be a positive integer ({unit}), got {value}"


def test_padding_free_is_auto_or_off(capsys: pytest.CaptureFixture[str]) -> None:
    line = refusal(["--server", UNREACHABLE, "--padding-free", "on"], capsys)
    assert line.startswith("proctor train: error: argument --padding-free: invalid choice: 'on'")


@pytest.mark.e2e
def test_no_server_at_the_address_is_one_line(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = refusal(["--server", UNREACHABLE, "--tiny-dir", str(tiny_model), "--connect-timeout-s", "0.3"], capsys)
    assert line == (
        f"proctor train: error: no dataserver answers at {UNREACHABLE}: start one with `make serve` (or "
        "`proctor serve`), or pass --server URL"
    )


@pytest.mark.e2e
def test_a_missing_api_key_is_one_line(
    live_server: Callable[..., Any], tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with live_server(api_key="hunter2") as url:
        line = refusal(["--server", url, "--tiny-dir", str(tiny_model)], capsys)
    assert line.startswith(
        f"proctor train: error: the dataserver at {url} wants its API key: pass --api-key KEY, or set PROCTOR_API_KEY ("
    )


@pytest.mark.e2e
def test_a_request_the_server_refuses_mid_run_is_one_line(
    live_server: Callable[..., Any], tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two prompts a step, one more than this server serves: refused at the first step's /sample.
    argv = ["--tiny-dir", str(tiny_model), "--output-dir", str(tmp_path / "run"), "--max-steps", "1"]
    with live_server(max_batch_size=1) as url:
        line = refusal(["--server", url, *argv], capsys)
    assert line == (
        "proctor train: error: the dataserver refused a request (422): batch_size: 2 is above this server's "
        "maximum of 1 (PROCTOR_MAX_BATCH_SIZE)"
    )


def test_a_configuration_the_trainer_refuses_exits_before_the_server_is_asked(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # 3 rows per generation do not cut into generate calls of 2 rows; steps_per_generation is given, so it is
    # not derived away. The server is never contacted: its address has nothing behind it.
    argv = ["--server", UNREACHABLE, "--output-dir", str(tmp_path / "run")]
    argv += ["--per-device-train-batch-size", "3", "--num-generations", "3", "--steps-per-generation", "1"]
    line = refusal([*argv, "--rollout-micro-batch-size", "2"], capsys)
    assert line.startswith("proctor train: error: the local generation batch, per_device_train_batch_size (3)")
    assert "steps_per_generation" in line


def test_the_flags_reach_the_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "--output-dir", str(tmp_path / "run"),
            "--rollout-micro-batch-size", "2",
            "--ref-logps-micro-batch-size", "4",
            "--old-logps-micro-batch-size", "8",
            "--max-tokens-per-microbatch-in-infer", "64",
            "--sequence-length-round-in-infer", "8",
            "--max-tokens-per-microbatch-in-train", "48",
            "--sequence-length-round-in-train", "16",
            "--padding-free", "off",
            "--no-balance-ranks",
            "--bf16",
        ]
    )  # fmt: skip
    config = config_from_args(args, gpu=False)
    assert (config.rollout_micro_batch_size, config.ref_logps_micro_batch_size) == (2, 4)
    assert config.old_logps_micro_batch_size == 8
    assert config.use_dynamic_batching_in_infer and config.use_dynamic_batching_in_train
    assert (config.max_tokens_per_microbatch_in_infer, config.sequence_length_round_in_infer) == (64, 8)
    assert (config.max_tokens_per_microbatch_in_train, config.sequence_length_round_in_train) == (48, 16)
    assert config.padding_free == "off"
    assert config.balance_ranks_by_tokens is False
    assert config.bf16 is True  # asked for, although run_defaults picks fp32 on a CPU
    assert config.max_steps == -1  # train() sets it from the server's curriculum
    # 8 rows per generation: lcm(2, 4, 8) = 8 already divides them, so steps_per_generation stays 1.
    assert (config.steps_per_generation, config.service_target_bs) == (1, 8)


def test_without_batching_flags_the_passes_are_stock(tmp_path: Path) -> None:
    config = config_from_args(build_parser().parse_args(["--output-dir", str(tmp_path / "run")]), gpu=False)
    assert not config.use_dynamic_batching_in_infer and not config.use_dynamic_batching_in_train
    assert config.rollout_micro_batch_size is None
    assert (config.padding_free, config.balance_ranks_by_tokens, config.bf16) == ("auto", True, False)


def test_the_docs_gpu_command_makes_a_valid_config(tmp_path: Path) -> None:
    # The real-model line of docs/training.md, checked here on a CPU (use_cpu keeps bf16 allowed without a GPU).
    text = (ROOT / "docs" / "training.md").read_text().replace("\\\n", " ")  # shell line continuations joined
    [line] = [ln for ln in text.splitlines() if ln.startswith("proctor train") and "--bf16" in ln]
    argv = shlex.split(line.split("#", 1)[0])[2:]
    config = config_from_args(build_parser().parse_args([*argv, "--output-dir", str(tmp_path / "run")]), gpu=False)
    sizes = config.batch_sizes
    assert sizes.local_generation_rows % sizes.service_batch_size == 0
    assert config.use_dynamic_batching_in_infer and config.use_dynamic_batching_in_train
    assert config.bf16


class Stages:
    """What ``StepReporter`` asks of the dataset: the stage of an iteration."""

    def stage_of(self, iteration: int) -> str:
        return "warm" if iteration < 10 else "main"


def report(logs: dict[str, float], capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    reporter = StepReporter(Stages())  # type: ignore[arg-type]
    reporter.on_log(None, SimpleNamespace(global_step=3), None, logs=logs)
    [entry] = reporter.steps
    return entry, capsys.readouterr().out.rstrip("\n")


def test_the_step_line_without_packed_passes_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    entry, line = report({"reward": 0.25, "proctor/iteration": 2.0}, capsys)
    assert re.fullmatch(r"step    3  iteration    2  stage warm         reward 0\.250  \(\d+s\)", line), line
    assert entry == {"step": 3, "iteration": 2, "stage": "warm", "reward": 0.25}


def test_the_step_line_carries_micro_batches_and_padding(capsys: pytest.CaptureFixture[str]) -> None:
    logs = {
        "reward": 0.5,
        "proctor/iteration": 12.0,
        "batching/train_micro_batches": 3.0,
        "batching/train_padding_ratio": 1.0712,
        "batching/ref_micro_batches": 2.5,
        "batching/ref_padding_ratio": 1.03,
        "batching/old_micro_batches": 2.0,  # no padding ratio: not shown
    }
    entry, line = report(logs, capsys)
    assert re.fullmatch(
        r"step    3  iteration   12  stage main         reward 0\.500  micro-batches 3 padding 1\.07  ref 2\.5×1\.03"
        r"  \(\d+s\)",
        line,
    ), line
    assert entry["train_micro_batches"] == 3.0 and entry["train_padding_ratio"] == 1.0712
    assert (entry["ref_micro_batches"], entry["ref_padding_ratio"]) == (2.5, 1.03)
    assert "old_micro_batches" not in entry


@pytest.mark.e2e
def test_a_run_with_packed_passes_reports_them(
    live_server: Callable[..., Any],
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # train() sets these with setdefault; set here, they are undone when the test ends.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    with live_server() as url:
        args = build_parser().parse_args(
            [
                "--server", url,
                "--model", "tiny",
                "--tiny-dir", str(tiny_model),
                "--output-dir", str(tmp_path / "run"),
                "--max-steps", "2",
                "--per-device-train-batch-size", "4",
                "--num-generations", "4",
                "--max-completion-length", "16",
                "--max-tokens-per-microbatch-in-infer", "64",
                "--max-tokens-per-microbatch-in-train", "48",
                "--rollout-micro-batch-size", "2",
                "--beta", "0.04",  # a reference model, so a packed reference pass
            ]
        )  # fmt: skip
        summary = train(args)
    out = capsys.readouterr().out
    assert "  batch sizes: 4 rows per micro-step" in out
    assert "  packed by token budget: log-prob passes ≤ 64 tokens (round 1); training ≤ 48 tokens (round 1)" in out
    steps = summary["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["train_micro_batches"] >= 1 and s["train_padding_ratio"] >= 1.0
        assert s["ref_micro_batches"] >= 1 and s["ref_padding_ratio"] >= 1.0
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(lines) == 2
    assert all("micro-batches " in ln and " padding " in ln and "  ref " in ln for ln in lines), lines


def test_a_step_that_generated_nothing_reports_the_latest_generation(capsys: pytest.CaptureFixture[str]) -> None:
    # steps_per_generation = 2: the second step trains on the first step's generation and logs no reward.
    reporter = StepReporter(Stages())  # type: ignore[arg-type]
    reporter.on_log(
        None, SimpleNamespace(global_step=1), None, logs={"loss": 0.1, "reward": 0.5, "proctor/iteration": 12.0}
    )
    reporter.on_log(None, SimpleNamespace(global_step=2), None, logs={"loss": 0.2})
    reporter.on_log(None, SimpleNamespace(global_step=2), None, logs={"train_loss": 0.15})  # the run's summary
    assert reporter.steps == [
        {"step": 1, "iteration": 12, "stage": "main", "reward": 0.5},
        {"step": 2, "iteration": 12, "stage": "main", "reward": 0.5},
    ]
    assert len(capsys.readouterr().out.splitlines()) == 2
