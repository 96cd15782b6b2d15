"""`rollout-consistency check` and scripts/step1_check.py: exit codes, outputs, config files, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from rollout_consistency.cli import main
from rollout_consistency.gate.judging.report import SCHEMA_NAME, SCHEMA_VERSION

SMALL = ["--no-progress", "--num-prompts", "2", "--num-images-per-prompt", "2", "--rollout-batch-size", "2"]
REPO = Path(__file__).resolve().parents[1]


def test_no_arguments_runs_the_tiny_check_and_passes(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    # `in`, not startswith: a Ray session of an earlier test may still print to this process's stdout.
    assert "rollout-consistency step-1 check: PASS" in out
    assert "qwen-image torch->torch" in out


def test_outputs_are_written_and_parse(tmp_path, capsys):
    paths = {name: tmp_path / "out" / name for name in ("r.json", "r.xml", "r.png")}
    code = main(
        [
            "check",
            *SMALL,
            "--json",
            str(paths["r.json"]),
            "--junit",
            str(paths["r.xml"]),
            "--plot",
            str(paths["r.png"]),
            "--per-sample",
        ]
    )
    assert code == 0
    data = json.loads(paths["r.json"].read_text())
    assert (data["schema"], data["schema_version"], data["status"]) == (SCHEMA_NAME, SCHEMA_VERSION, "PASS")
    suite = ET.parse(paths["r.xml"]).getroot().find("testsuite")
    assert suite.get("failures") == "0" and len(suite.findall("testcase")) == len(data["verdict"]["checks"])
    assert paths["r.png"].read_bytes()[:4] == b"\x89PNG"
    assert "per sample" in capsys.readouterr().out


def test_an_injected_pitfall_exits_1_with_a_failing_report(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["check", *SMALL, "--inject", "mask-sum-rope", "--json", str(path)]) == 1
    data = json.loads(path.read_text())
    assert data["status"] == "FAIL" and data["config"]["inject"] == "mask-sum-rope"
    assert "FAIL because:" in capsys.readouterr().out


def test_config_file_and_flags_combine(tmp_path):
    config = tmp_path / "step1.toml"
    config.write_text('noise_level = 0.5\nseed = 3\nnum_prompts = 1\n[thresholds]\npg_clipfrac = "off"\n')
    path = tmp_path / "r.json"
    assert (
        main(
            [
                "check",
                "--config",
                str(config),
                "--seed",
                "5",
                "--threshold",
                "ppo_kl=1e-3",
                "--no-progress",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    data = json.loads(path.read_text())
    assert data["config"]["noise_level"] == 0.5 and data["config"]["seed"] == 5
    assert data["config"]["thresholds"] == {"pg_clipfrac": None, "ppo_kl": 1e-3}
    assert "pg_clipfrac" not in data["tolerance"]["limits"] and data["tolerance"]["limits"]["ppo_kl"] == 1e-3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--noise-levl", "0.5"], "unrecognized arguments: --noise-levl"),
        (["--sde-type", "SDE"], "invalid choice: 'SDE'"),
        (["--num-prompts", "two"], "invalid int value"),
        (["--threshold", "ppo_k=1"], "Did you mean 'ppo_kl'"),
        (["--threshold", "ppo_kl"], "METRIC=VALUE"),
        (["--noise-level", "0"], "nothing to check"),
        (["--micro-batch-size", "3"], "divide rollout_batch_size"),
        (["--trajectory", "/nonexistent/t.safetensors"], "t.safetensors"),
        (["--height", "24"], "multiples of"),
        (["--trainer-attention", "flash-attn"], "not one of diffusers' backends"),
        (["--ray-address", "auto", "--workers", "0"], "'workers' must be >= 1"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(argv, message, capsys):
    assert main(["check", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bad_config_keys_exit_2_naming_the_closest_key(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("noise_level: 0.7\nsde_windw_size: 2\n")
    assert main(["check", "--config", str(config)]) == 2
    assert "unknown setting 'sde_windw_size'. Did you mean 'sde_window_size'?" in capsys.readouterr().err
    config.write_text("clip_range: 1e-4\n")
    assert main(["check", "--config", str(config)]) == 2
    assert "calls that setting 'clip_ratio'" in capsys.readouterr().err
    assert main(["check", "--config", str(tmp_path / "none.toml")]) == 2


def test_help_lists_every_setting(capsys):
    assert main(["check", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--noise-level",
        "--sde-window-range",
        "--clip-ratio",
        "--step-execution",
        "--max-num-seqs",
        "--inject",
        "--ray-address",
        "--workers",
        "--trajectory",
        "--json",
        "--junit",
        "--plot",
        "--true-cfg-scale",
        "--profile",
        "--threshold",
    ):
        assert flag in out


def _run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "step1_check.py"), *args], capture_output=True, text=True, timeout=300
    )


def test_script_form_has_the_same_interface(tmp_path):
    passed = _run_script(*SMALL, "--json", str(tmp_path / "r.json"))
    assert passed.returncode == 0, passed.stderr
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "PASS"
    usage = _run_script("--sde-type", "nope")
    assert usage.returncode == 2 and "--sde-type" in usage.stderr


def test_misspelt_flag_names_the_closest_one(capsys):
    assert main(["check", "--noise-levle", "0.3"]) == 2
    assert "did you mean --noise-level?" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--micro-batch-size", "1", "--rollout-batch-size", "4"],
        ["--micro-batch-size", "3", "--num-prompts", "3", "--rollout-batch-size", "6"],
        ["--step-execution", "--stagger-arrivals", "--max-num-seqs", "3", "--rollout-batch-size", "4"],
    ],
    ids=["micro-batch-1", "micro-batch-3", "step-wise-staggered"],
)
def test_batch_invariant_mode_passes_exact_across_batch_compositions(argv, tmp_path, capsys):
    """The trainer's micro-batches and the step-wise engine's running batches differ from the rollout batch;
    `--batch-invariant` makes `exact` hold anyway, on any CPU."""
    path = tmp_path / "r.json"
    code = main(["check", "--no-progress", "--num-prompts", "2", *argv, "--batch-invariant", "--json", str(path)])
    assert code == 0, capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["config"]["batch_invariant"] is True and data["tolerance"]["profile"] == "exact"
    assert data["metrics"]["overall"]["max_abs_dlogp"] == 0
