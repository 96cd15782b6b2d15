"""Precision audit and rollout-vs-trainer diff (consistency/training/precision.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from rollout_consistency.training.precision import (
    PrecisionReport,
    audit_precision,
    diff_precision_reports,
    precision_findings,
)


@pytest.fixture(autouse=True)
def restore_global_flags():
    """Every test leaves torch's global precision flags as it found them."""
    matmul = torch.get_float32_matmul_precision()
    benchmark = torch.backends.cudnn.benchmark
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.benchmark = benchmark
    torch.use_deterministic_algorithms(deterministic)


def codes(report_or_findings) -> set[str]:
    findings = report_or_findings.findings if isinstance(report_or_findings, PrecisionReport) else report_or_findings
    return {f.code for f in findings}


def model_and_optimizer(dtype=torch.float32, eps=1e-8):
    model = nn.Linear(8, 8).to(dtype)
    return model, torch.optim.AdamW(model.parameters(), eps=eps)


def test_default_fp32_process_has_no_findings() -> None:
    model, optimizer = model_and_optimizer()
    report = audit_precision(model=model, optimizer=optimizer)
    assert report.findings == ()
    assert report.settings["matmul.float32_precision"] == "highest"
    assert report.settings["autocast.enabled"] is False and report.settings["autocast.dtype"] is None
    assert report.settings["model.param_dtypes"] == {"float32": 72}
    assert report.settings["optimizer.class"] == "AdamW"
    assert report.settings["device.type"] == "cpu"


def test_tf32_matmul_precision_is_reported_with_the_fix() -> None:
    torch.set_float32_matmul_precision("high")
    report = audit_precision()
    assert report.settings["matmul.float32_precision"] == "high"
    (finding,) = [f for f in report.findings if f.code == "tf32-matmul"]
    assert finding.severity == "info" and "set_float32_matmul_precision('highest')" in finding.fix


def test_fp16_autocast_without_scaler_is_an_error() -> None:
    model, optimizer = model_and_optimizer()
    with torch.autocast("cpu", dtype=torch.float16):
        report = audit_precision(model=model, optimizer=optimizer)
    assert report.settings["autocast.dtype"] == "float16" and report.settings["autocast.source"] == "detected"
    assert "fp16-without-grad-scaler" in codes(report) and report.has_errors
    fix = next(f.fix for f in report.findings if f.code == "fp16-without-grad-scaler")
    assert "GradScaler" in fix and "unscale_" in fix

    with_scaler = audit_precision(
        model=model, optimizer=optimizer, scaler=torch.amp.GradScaler("cpu"), autocast_dtype=torch.float16
    )
    assert with_scaler.settings["autocast.source"] == "declared"
    assert "fp16-without-grad-scaler" not in codes(with_scaler) and not with_scaler.has_errors


def test_grad_scaler_with_bf16_is_pointless() -> None:
    model, optimizer = model_and_optimizer()
    report = audit_precision(
        model=model, optimizer=optimizer, scaler=torch.amp.GradScaler("cpu"), autocast_dtype=torch.bfloat16
    )
    assert "grad-scaler-with-bf16" in codes(report)
    disabled = audit_precision(
        model=model, scaler=torch.amp.GradScaler("cpu", enabled=False), autocast_dtype=torch.bfloat16
    )
    assert "grad-scaler-with-bf16" not in codes(disabled)


def test_half_precision_parameters_under_autocast_and_in_the_optimizer() -> None:
    model, optimizer = model_and_optimizer(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = audit_precision(model=model, optimizer=optimizer)
    assert {"half-params-under-autocast", "optimizer-updates-half-params"} <= codes(report)
    assert "model.float()" in next(f.fix for f in report.findings if f.code == "half-params-under-autocast")


def test_fp16_parameters_with_scaler_and_tiny_eps() -> None:
    model, optimizer = model_and_optimizer(torch.float16, eps=1e-8)
    report = audit_precision(model=model, optimizer=optimizer, scaler=torch.amp.GradScaler("cpu"), autocast_dtype=None)
    assert {"grad-scaler-with-fp16-params", "optimizer-eps-underflows-fp16"} <= codes(report)
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0  # the fact the finding rests on
    fine_eps = audit_precision(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), eps=1e-4), autocast_dtype=None
    )
    assert "optimizer-eps-underflows-fp16" not in codes(fine_eps)
    assert "fp16-without-grad-scaler" in codes(fine_eps)  # fp16 parameters and no scaler


def test_findings_errors_come_first() -> None:
    model, optimizer = model_and_optimizer(torch.float16)
    torch.set_float32_matmul_precision("high")
    report = audit_precision(model=model, optimizer=optimizer, autocast_dtype=torch.float16)
    severities = [f.severity for f in report.findings]
    assert severities == sorted(severities, key=("error", "warning", "info").index)
    assert severities[0] == "error" and severities[-1] == "info"


def cuda_settings(**overrides):
    """Settings as a CUDA process would record them (findings are a pure function of settings)."""
    settings = audit_precision(device="cpu").to_dict()["settings"]
    settings.update(
        {
            "device.type": "cuda",
            "device.name": "Tesla V100",
            "device.capability": "7.0",
            "device.bf16_supported": False,
        }
    )
    settings.update(overrides)
    return settings


def test_bf16_on_a_gpu_without_bf16() -> None:
    findings = precision_findings(cuda_settings(**{"autocast.enabled": True, "autocast.dtype": "bfloat16"}))
    assert "bf16-unsupported-hardware" in codes(findings)
    ampere = precision_findings(
        cuda_settings(**{"autocast.enabled": True, "autocast.dtype": "bfloat16", "device.bf16_supported": True})
    )
    assert "bf16-unsupported-hardware" not in codes(ampere)


def test_cuda_determinism_findings() -> None:
    assert "cudnn-benchmark" in codes(precision_findings(cuda_settings(**{"cudnn.benchmark": True})))
    assert "nondeterministic-algorithms" in codes(precision_findings(cuda_settings()))
    broken = precision_findings(
        cuda_settings(**{"deterministic_algorithms": True, "env.CUBLAS_WORKSPACE_CONFIG": None})
    )
    assert "deterministic-without-cublas-workspace" in codes(broken)
    fine = precision_findings(
        cuda_settings(**{"deterministic_algorithms": True, "env.CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    )
    assert not codes(fine) & {"deterministic-without-cublas-workspace", "nondeterministic-algorithms"}


def test_mixed_tf32_apis_are_read_without_crashing() -> None:
    findings = precision_findings(cuda_settings(**{"matmul.float32_precision": "mixed-api"}))
    assert "tf32-mixed-api" in codes(findings)


def test_deterministic_flags_are_recorded() -> None:
    torch.backends.cudnn.benchmark = True
    torch.use_deterministic_algorithms(True)
    settings = audit_precision().settings
    assert settings["cudnn.benchmark"] is True and settings["deterministic_algorithms"] is True


def test_report_round_trips_through_json() -> None:
    model, optimizer = model_and_optimizer()
    report = audit_precision(model=model, optimizer=optimizer, autocast_dtype=torch.float16, label="trainer")
    again = PrecisionReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again == report
    with pytest.raises(ValueError, match="not a precision report"):
        PrecisionReport.from_dict({"findings": []})


def test_rollout_and_trainer_diff() -> None:
    model, optimizer = model_and_optimizer()
    trainer = audit_precision(model=model, optimizer=optimizer, autocast_dtype=torch.bfloat16, label="trainer")
    torch.set_float32_matmul_precision("high")
    rollout = audit_precision(model=nn.Linear(8, 8).to(torch.bfloat16), autocast_dtype=None, label="rollout")

    diff = diff_precision_reports(rollout, trainer)
    assert diff.labels == ("rollout", "trainer") and not diff.consistent
    by_key = {d.key: d for d in diff.differences}
    assert by_key["matmul.float32_precision"].severity == "error"
    assert (by_key["matmul.float32_precision"].a, by_key["matmul.float32_precision"].b) == ("high", "highest")
    assert "set_float32_matmul_precision" in by_key["matmul.float32_precision"].fix
    assert by_key["autocast.dtype"].severity == "error"
    assert by_key["model.param_dtypes"].a == {"bfloat16": 72}
    assert by_key["optimizer.class"].severity == "info"  # recorded on the trainer side only
    assert next(d.severity for d in diff.differences) == "error"

    # The step-1 checker embeds this in its JSON report, and reads rollout reports from JSON.
    embedded = json.loads(json.dumps(diff.to_dict()))
    assert embedded["consistent"] is False
    assert embedded["differences"][0]["rollout"] is not None or embedded["differences"][0]["trainer"] is not None
    from_json = diff_precision_reports(json.loads(json.dumps(rollout.to_dict())), trainer)
    assert from_json == diff
    assert "INCONSISTENT" in diff.format()


def test_identical_sides_agree() -> None:
    model, optimizer = model_and_optimizer()
    a = audit_precision(model=model, optimizer=optimizer, label="rollout")
    b = audit_precision(model=model, optimizer=optimizer, label="trainer")
    diff = diff_precision_reports(a, b)
    assert diff.consistent and diff.differences == ()
    assert "agree" in diff.format()


def test_scale_is_not_compared_but_descriptive_differences_do_not_fail() -> None:
    a = audit_precision(scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16), label="a")
    b = audit_precision(scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10), label="b")
    assert diff_precision_reports(a, b).differences == ()
    b_other_machine = PrecisionReport(dict(b.settings, **{"device.name": "another-cpu"}), b.findings, "b")
    diff = diff_precision_reports(a, b_other_machine)
    assert diff.consistent and [d.severity for d in diff.differences] == ["info"]


def test_bad_autocast_dtype_argument() -> None:
    with pytest.raises(ValueError, match="autocast_dtype"):
        audit_precision(autocast_dtype=torch.float64)
    with pytest.raises(ValueError, match="autocast_dtype"):
        audit_precision(autocast_dtype="bf16")


def test_diff_labels_never_overwrite_entry_keys() -> None:
    # Each to_dict() entry keys the sides' values by their labels next to key/severity/why/fix: a side
    # labelled "severity" must not overwrite the severity (nor lose its own value).
    a = audit_precision(model=nn.Linear(2, 2).to(torch.bfloat16), autocast_dtype=None, label="severity")
    b = audit_precision(model=nn.Linear(2, 2), autocast_dtype=None, label="trainer")
    entry = diff_precision_reports(a, b).to_dict()["differences"][0]
    assert entry["severity"] == "warning" and entry["severity (1)"] == {"bfloat16": 6}
    with pytest.raises(ValueError, match="must differ from each other and from key, severity"):
        diff_precision_reports(a, b, labels=("rollout", "fix"))
