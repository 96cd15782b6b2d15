"""Command line: `checkpointing` (old name `recompute`) and `precision` subcommands (consistency/cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rollout_consistency.cli import main
from rollout_consistency.training.precision import audit_precision

REPO = Path(__file__).resolve().parents[1]
TOY = "rollout_consistency.training.toy_denoiser:toy_case"
UNSAFE = "rollout_consistency.training.toy_denoiser:rng_unsafe_checkpoint"


def test_help_is_fast_and_imports_no_torch() -> None:
    code = "import sys; from rollout_consistency.cli import main; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_python_dash_m_runs_main() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rollout_consistency", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "checkpointing" in result.stdout and "precision" in result.stdout


def test_no_command_and_unknown_options_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["checkpointing"]) == 2  # SPEC missing
    assert main(["precision", "--bogus"]) == 2
    assert main(["--help"]) == 0
    capsys.readouterr()


# ----------------------------------------------------------------------------------------------
# checkpointing


def test_checkpointing_fails_for_the_unsafe_helper_and_passes_for_the_fix(tmp_path: Path, capsys) -> None:
    out = tmp_path / "report.json"
    assert main(["checkpointing", TOY, "--arg", "dropout=0.3", "--checkpoint", UNSAFE, "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "does not restore the RNG state" in text
    data = json.loads(out.read_text())
    assert data["verdict"] == "FAIL" and data["global_relative_diff"] > 0.01

    for name in ("consistency", "torch", "torch-reentrant"):
        assert main(["checkpointing", TOY, "--arg", "dropout=0.3", "--checkpoint", name]) == 0, name
    assert "PASS" in capsys.readouterr().out


def test_old_name_recompute_still_runs_and_says_it_is_deprecated(capsys) -> None:
    assert main(["recompute", TOY, "--no-baseline"]) == 0
    captured = capsys.readouterr()
    assert "PASS" in captured.out
    assert "deprecated name, use 'rollout-consistency checkpointing'" in captured.err


def test_checkpointing_segments_override_and_bitwise_tolerance(capsys) -> None:
    assert main(["checkpointing", TOY, "--segments", "blocks.0", "--rtol", "0", "--no-baseline"]) == 0
    text = capsys.readouterr().out
    assert "1 checkpointed call(s)" in text and "bitwise equal: True" in text and "baseline" not in text


def write_module(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "my_factories.py"
    path.write_text(textwrap.dedent(source))
    return path


def test_checkpointing_from_a_file_spec_with_a_tuple_factory(tmp_path: Path, capsys) -> None:
    path = write_module(
        tmp_path,
        """
        import torch
        from torch import nn

        def build(seed):
            torch.manual_seed(seed)
            model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Linear(16, 4))
            return model, torch.randn(8, 4, requires_grad=True)
        """,
    )
    assert main(["checkpointing", f"{path}:build", "--seed", "3"]) == 0
    assert main(["checkpointing", f"{path}:build", "--checkpoint", UNSAFE]) == 1
    capsys.readouterr()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["checkpointing", "no_such_module:factory"], "cannot import 'no_such_module'"),
        (["checkpointing", "rollout_consistency.training.toy_denoiser:nope"], "has no attribute 'nope'"),
        (["checkpointing", "just_a_name"], "must look like"),
        (["checkpointing", "missing/file.py:build"], "does not exist"),
        (["checkpointing", TOY, "--arg", "width"], "name=value"),
        (["checkpointing", TOY, "--arg", "width=3"], "does not accept width"),
        (["checkpointing", TOY, "--checkpoint", "nonsense"], "must be one of"),
        (["checkpointing", TOY, "--segments", "nowhere.*"], "matches no submodule"),
        (["precision", "--arg", "x=1"], "--arg needs --spec"),
        (["precision", "--diff", "missing-a.json", "missing-b.json"], "cannot read JSON"),
    ],
)
def test_usage_errors_exit_2_with_a_message(argv, message, capsys) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_checkpointing_factory_returning_the_wrong_thing(tmp_path: Path, capsys) -> None:
    path = write_module(tmp_path, "def build():\n    return {'model': None}\n")
    assert main(["checkpointing", f"{path}:build"]) == 2
    assert "'module' and 'inputs'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# precision


@pytest.fixture
def restore_matmul_precision():
    saved = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(saved)


def test_precision_audit_writes_json_and_passes_by_default(tmp_path: Path, capsys) -> None:
    out = tmp_path / "trainer.json"
    assert main(["precision", "--label", "trainer", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["label"] == "trainer" and data["settings"]["matmul.float32_precision"] in ("highest", "high", "medium")
    assert "precision audit (trainer)" in capsys.readouterr().out


def test_precision_diff_of_rollout_and_trainer_files(tmp_path: Path, capsys, restore_matmul_precision) -> None:
    trainer = tmp_path / "trainer.json"
    rollout = tmp_path / "rollout.json"
    trainer.write_text(json.dumps(audit_precision(label="trainer").to_dict()))
    torch.set_float32_matmul_precision("high")
    rollout.write_text(json.dumps(audit_precision(label="rollout").to_dict()))

    diff_json = tmp_path / "diff.json"
    assert main(["precision", "--diff", str(rollout), str(trainer), "--json", str(diff_json)]) == 1
    assert "matmul.float32_precision: rollout=high  trainer=highest" in capsys.readouterr().out
    assert json.loads(diff_json.read_text())["consistent"] is False
    assert main(["precision", "--diff", str(trainer), str(trainer)]) == 0
    not_a_report = tmp_path / "other.json"
    not_a_report.write_text("{}")
    assert main(["precision", "--diff", str(not_a_report), str(trainer)]) == 2
    capsys.readouterr()


def test_precision_spec_with_fp16_and_no_scaler_fails(tmp_path: Path, capsys) -> None:
    path = write_module(
        tmp_path,
        """
        import torch

        def fp16_training(with_scaler=False):
            model = torch.nn.Linear(4, 4)
            return {
                "model": model,
                "optimizer": torch.optim.AdamW(model.parameters()),
                "scaler": torch.amp.GradScaler("cpu") if with_scaler else None,
                "autocast_dtype": torch.float16,
            }
        """,
    )
    assert main(["precision", "--spec", f"{path}:fp16_training"]) == 1
    assert "fp16-without-grad-scaler" in capsys.readouterr().out
    assert main(["precision", "--spec", f"{path}:fp16_training", "--fail-on", "never"]) == 0
    assert main(["precision", "--spec", f"{path}:fp16_training", "--arg", "with_scaler=True"]) == 0
    capsys.readouterr()
