"""gate(): the user's own tables or dump -> verdict; the dump format; `rollout-consistency gate`; the pytest
fixture and marker; the mismatch statistics."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from rollout_consistency.cli import main
from rollout_consistency.gate.judging.mismatch import compute_mismatch
from rollout_consistency.gate.tables.api import GateInputError, GateReport, TableSettings, gate
from rollout_consistency.gate.tables.dump import DumpFormatError, read_dump, write_dump


def tables(n: int = 6, t: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    rollout = rng.normal(-1.0, 0.1, (n, t)).astype(np.float32)
    timesteps = np.tile(np.linspace(1.0, 0.5, t, dtype=np.float32), (n, 1))
    return rollout, timesteps


def test_identical_tables_pass_exact_and_unsupported_guards_are_not_checked():
    rollout, ts = tables()
    report = gate(rollout, rollout.copy(), timesteps=ts)
    assert report.passed
    names = [c.name for c in report.verdict.checks if c.kind == "guard"]
    assert "workers" not in names and "windows" not in names  # never shown as passed
    assert set(report.not_checked) == {"workers", "windows"}
    table = report.format_table()
    assert "workers not checked" in table and "windows not checked" in table
    assert "windows ok" not in table and "workers ok" not in table


def test_one_differing_entry_fails_exact_and_names_the_step():
    rollout, ts = tables()
    trainer = rollout.copy()
    trainer[4, 1] = np.nextafter(trainer[4, 1], np.float32(0))  # one float32 ULP
    report = gate(rollout, trainer, timesteps=ts)
    assert not report.passed
    assert any(r.startswith("max_abs_dlogp") and "t=0.75" in r for r in report.reasons)
    assert gate(rollout, trainer, timesteps=ts, profile="kernel").passed  # one ULP is inside the kernel floor


def test_windows_guard_checked_when_groups_and_starts_are_given():
    rollout, _ = tables()
    ok = gate(rollout, rollout.copy(), prompt_groups=[0, 0, 1, 1, 2, 2], window_starts=[3, 3, 1, 1, 0, 0])
    assert ok.passed and "windows" not in ok.not_checked
    split = gate(rollout, rollout.copy(), prompt_groups=[0, 0, 1, 1, 2, 2], window_starts=[3, 3, 1, 2, 0, 0])
    assert not split.passed and any(r.startswith("windows:") and "group 1" in r for r in split.reasons)


def test_shape_mismatch_is_a_fail_and_bad_inputs_are_one_line_errors():
    rollout, _ = tables()
    report = gate(rollout, rollout[:, :2])
    assert not report.passed and report.reasons[0].startswith("shapes:")
    for kwargs, words in (
        (dict(sample_ids=[0, 1, 2, 3, 4, 4]), "repeat"),
        (dict(advantages=[0.0] * 5), "(6,)"),
        (dict(timesteps=np.full((6, 3), np.nan, np.float32)), "NaN"),
        (dict(profile="calibrated"), "calibrated"),
        (dict(thresholds={"clipfrac_gt_one": None}), "pg_clipfrac_higher"),
    ):
        with pytest.raises(GateInputError, match=None) as error:
            gate(rollout, rollout.copy(), **kwargs)
        assert words in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(GateInputError, match="float16"):
        gate(rollout.astype(np.float16), rollout)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_reader_of_a_users_tables_refuses_a_half_precision_tensor_by_name(dtype, tmp_path):
    """One reading of the user's tensors (judging.views.host_array) serves compute_metrics, gate(), StepStats, the
    recorder, the monitor and write_dump: a bf16/fp16 tensor is refused there, naming the argument, even where its dtype would
    otherwise pass (a float16 advantages vector is a float vector)."""
    torch = pytest.importorskip("torch")
    from rollout_consistency.gate.judging.metrics import MetricsInputError, compute_metrics
    from rollout_consistency.gate.monitor import MonitorError, MonitorSettings, RunMonitor, StepStats, StepStatsError
    from rollout_consistency.gate.tables.recorder import RecorderError, Step1Recorder

    rollout, _ = tables()
    half = torch.from_numpy(rollout).to(getattr(torch, dtype))
    path = tmp_path / "step1.safetensors"
    cases = [
        (MetricsInputError, "`trainer_log_probs`", lambda: compute_metrics(rollout, half)),
        (GateInputError, "advantages", lambda: gate(rollout, rollout.copy(), advantages=half[:, 0])),
        (StepStatsError, "mask", lambda: StepStats.from_tables(rollout, rollout.copy(), mask=half)),
        (RecorderError, "log_probs", lambda: Step1Recorder(None).record([0], 0, rollout[:1, 0], half[:1, 0])),
        (MonitorError, "trainer_log_probs", lambda: RunMonitor(MonitorSettings()).observe(0, rollout, half)),
        (DumpFormatError, "write_dump: rollout_log_probs", lambda: write_dump(path, half, rollout)),
    ]
    for error, name, call in cases:
        with pytest.raises(error, match=f"^{name} is a torch.{dtype} tensor: it has already lost the digits"):
            call()
    assert not path.exists()  # refused before anything is written


def test_gate_takes_one_settings_object_and_keywords_are_its_fields():
    """`gate(r, t, TableSettings(...))` and today's keyword call give the same report; keywords override the
    object's fields; a keyword that is no field, or a bad field, is refused before anything is computed."""
    rollout, ts = tables()
    trainer = rollout + np.float32(1e-6)
    settings = TableSettings(profile="kernel", clip_ratio=2e-4, micro_batch_size=3, source="mine", notes=("n",))
    by_object = gate(rollout, trainer, settings, timesteps=ts)
    by_keywords = gate(
        rollout,
        trainer,
        timesteps=ts,
        profile="kernel",
        clip_ratio=2e-4,
        micro_batch_size=3,
        source="mine",
        notes=["n"],
    )
    assert by_object.to_dict() == by_keywords.to_dict()
    assert by_object.run["source"] == "mine" and by_object.notes == ("n",)
    assert by_object.run["settings"]["clip_ratio_low"] == by_object.run["settings"]["clip_ratio_high"] == 2e-4
    assert gate(rollout, trainer, settings, profile="exact").tolerance.profile == "exact"
    assert settings.profile == "kernel"  # frozen: the override made a copy
    with pytest.raises(TypeError, match=r"'profil'.*TableSettings"):
        gate(rollout, trainer, profil="kernel")
    for bad, words in (
        (dict(clip_ratio_c=1.0), "clip_ratio_c"),
        (dict(compute_dtype="int8"), "int8"),
        (dict(profile="loose"), "unknown profile"),
    ):
        with pytest.raises(GateInputError, match=words):
            TableSettings(**bad)


def test_expected_samples_is_a_setting_the_complete_guard_reads():
    """Coverage travels in TableSettings: a count or ids, checked when built; fewer rows is a `complete` FAIL naming
    the samples not gated and why; a guard the caller cannot support is reported as not checked."""
    rollout, _ = tables()
    assert gate(rollout, rollout.copy(), expected_samples=6).passed
    counted = gate(rollout, rollout.copy(), expected_samples=8, ungated_reason="dropped by the loader")
    (reason,) = [r for r in counted.reasons if r.startswith("complete:")]
    assert "2 of the 8 samples the rollout produced were not gated: dropped by the loader" in reason
    by_ids = gate(
        rollout, rollout.copy(), TableSettings(expected_samples=np.arange(10, 17)), sample_ids=np.arange(10, 16)
    )
    (reason,) = [r for r in by_ids.reasons if r.startswith("complete:")]
    assert "1 of the 7 samples" in reason and "(ids [16])" in reason
    unsupported = gate(rollout, rollout.copy(), not_checked={"complete": "my loop cannot say"})
    assert unsupported.passed and unsupported.not_checked["complete"] == "my loop cannot say"
    assert "complete" not in {check.name for check in unsupported.verdict.checks}
    for bad, words in ((-1, ">= 0"), (True, "count or sample ids"), ([0, 1.5], "integers"), (object(), "count")):
        with pytest.raises(GateInputError, match=words):
            TableSettings(expected_samples=bad)


def test_nan_log_prob_fails_closed():
    rollout, _ = tables()
    trainer = rollout.copy()
    trainer[2, 0] = np.nan
    report = gate(rollout, trainer)
    assert not report.passed and any(r.startswith("finite:") and "sample 2 step 0" in r for r in report.reasons)
    assert math.isnan(report.mismatch.overall.k3_kl)


def test_mismatch_statistics_match_their_definitions():
    rollout, ts = tables(n=8, t=2, seed=1)
    rng = np.random.default_rng(2)
    delta = rng.normal(2e-3, 1e-3, rollout.shape)
    trainer = (rollout + delta).astype(np.float32)
    adv = np.array([1, -1, 1, -1, 0, 1, -1, 1], dtype=np.float32)
    stats = compute_mismatch(rollout, trainer, timesteps=ts, advantages=adv, clip_ratio_low=1e-3, clip_ratio_high=1e-3)
    d = trainer.astype(np.float64) - rollout.astype(np.float64)
    w = np.exp(d)
    o = stats.overall
    assert o.count == 16
    assert o.k3_kl == pytest.approx(np.mean(w - 1 - d), rel=1e-9)
    assert o.chi2 == pytest.approx(np.mean((w - 1) ** 2), rel=1e-9)
    assert o.ess == pytest.approx(np.mean(w) ** 2 / np.mean(w**2), rel=1e-12)
    assert o.max_abs_dlogp == np.abs(d).max() and o.p99_abs_dlogp == pytest.approx(np.percentile(np.abs(d), 99))
    assert o.pearson_logp == pytest.approx(np.corrcoef(rollout.ravel(), trainer.ravel())[0, 1], rel=1e-9)
    per_sample = d.mean(axis=1)
    half = 1.959963984540054 * per_sample.std(ddof=1) / math.sqrt(8)
    assert o.bias == pytest.approx(per_sample.mean()) and o.bias_ci_low == pytest.approx(per_sample.mean() - half)
    assert o.bias_ci_low < 2e-3 < o.bias_ci_high  # the true bias is inside the interval
    active = ((adv[:, None] > 0) & (w > 1 + 1e-3)) | ((adv[:, None] < 0) & (w < 1 - 1e-3))
    assert o.pg_clipfrac_adv == pytest.approx(active.mean())
    assert o.pg_clipfrac_dual == 0.0  # no ratio near clip_ratio_c = 3
    assert [s.timestep for s in stats.by_timestep] == [1.0, 0.5] and all(s.values.count == 8 for s in stats.by_timestep)


def test_report_outputs_carry_the_statistics(tmp_path):
    rollout, ts = tables()
    report = gate(rollout, rollout + np.float32(1e-6), timesteps=ts, advantages=np.ones(6), profile="kernel")
    data = json.loads(report.to_json())
    assert data["not_checked"].keys() == {"workers", "windows"}
    assert data["mismatch"]["overall"]["pg_clipfrac_adv"] == 0.0 and len(data["mismatch"]["by_timestep"]) == 3
    assert GateReport.from_dict(data).to_dict() == data
    report.write_junit(tmp_path / "r.xml")
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    skipped = [c.get("name") for c in suite.iter("testcase") if c.find("skipped") is not None]
    assert sorted(skipped) == ["windows", "workers"] and suite.get("skipped") == "2"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert float(props["mismatch.overall.ess"]) == pytest.approx(1.0) and "mismatch.t=0.75.k3_kl" in props
    report.write_plot(tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert "mismatch statistics" in report.format_table()


# ---------------------------------------------------------------------------------------------------- dump
def test_dump_round_trip_and_validation(tmp_path):
    rollout, ts = tables()
    path = write_dump(tmp_path / "d.safetensors", rollout, rollout.copy(), timesteps=ts, sample_ids=np.arange(10, 16))
    dump = read_dump(path)
    assert np.array_equal(dump.rollout_log_probs, rollout) and dump.metadata["format_version"] == "1"
    assert dump.gate().sample_ids == tuple(range(10, 16))
    from safetensors.numpy import save_file

    cases = {
        "no format": ({"rollout_log_probs": rollout, "trainer_log_probs": rollout}, {}, "write_dump"),
        "version": (
            {"rollout_log_probs": rollout, "trainer_log_probs": rollout},
            {"format": "rollout-consistency/logprob-dump", "format_version": "99"},
            "not supported",
        ),
        "typo": ({"rollout_log_probs": rollout, "trainer_logprobs": rollout}, None, "'trainer_log_probs'"),
        "bf16-ish": ({"rollout_log_probs": rollout, "trainer_log_probs": rollout.astype(np.float16)}, None, "F32"),
        "rows": (
            {"rollout_log_probs": rollout, "trainer_log_probs": rollout, "advantages": np.ones(3, np.float32)},
            None,
            "(6,)",
        ),
        "nan ts": ({"rollout_log_probs": rollout, "trainer_log_probs": rollout, "timesteps": ts * np.nan}, None, "NaN"),
    }
    good_meta = {"format": "rollout-consistency/logprob-dump", "format_version": "1"}
    for name, (tensors, meta, words) in cases.items():
        file = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(file), metadata=good_meta if meta is None else meta)
        with pytest.raises(DumpFormatError) as error:
            read_dump(file)
        assert words in str(error.value) and "\n" not in str(error.value), name
    coverage = {"rollout_log_probs": rollout, "trainer_log_probs": rollout}
    for text in ('{"expected_samples": 3}', "not json", '{"recorded_samples": -1}'):  # not what the recorder writes
        file = tmp_path / "coverage.safetensors"
        save_file(coverage, str(file), metadata={**good_meta, "recorder_coverage": text})
        with pytest.raises(DumpFormatError, match="'recorder_coverage' is not the recorder's coverage"):
            read_dump(file)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DumpFormatError, match="write_dump"):
        read_dump(tmp_path / "junk.safetensors")


def test_cli_gate_exit_codes_and_outputs(tmp_path, capsys):
    rollout, ts = tables()
    good = write_dump(tmp_path / "good.safetensors", rollout, rollout.copy(), timesteps=ts)
    bad = write_dump(tmp_path / "bad.safetensors", rollout, rollout * np.float32(1.001), timesteps=ts)
    out = tmp_path / "out"
    assert (
        main(
            [
                "gate",
                str(good),
                "--json",
                str(out / "r.json"),
                "--junit",
                str(out / "r.xml"),
                "--plot",
                str(out / "r.png"),
            ]
        )
        == 0
    )
    assert json.loads((out / "r.json").read_text())["status"] == "PASS"
    assert ET.parse(out / "r.xml").getroot().get("failures") == "0" and (out / "r.png").exists()
    assert main(["gate", str(bad), "--profile", "kernel", "--clip-ratio", "1e-3"]) == 1
    assert "FAIL because" in capsys.readouterr().out
    # One float32 ulp apart: other code, same maths. Fails `exact`, passes `implementation`.
    rounded = write_dump(tmp_path / "ulp.safetensors", rollout, np.nextafter(rollout, np.float32(0)), timesteps=ts)
    assert main(["gate", str(rounded)]) == 1
    assert main(["gate", str(rounded), "--profile", "implementation"]) == 0
    before = good.read_bytes()
    assert main(["gate", str(good), "--json", str(good)]) == 2  # never overwrites the input
    assert good.read_bytes() == before
    assert main(["gate", str(tmp_path / "missing.safetensors")]) == 2
    assert main(["gate", str(good), "--profile", "calibrated"]) == 2
    assert main(["gate", str(good), "--threshold", "clipfrac_gt_one=off"]) == 2
    assert "pg_clipfrac_higher" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- pytest
def test_pytest_fixture_and_marker_gate_a_dump_and_tables(pytester, tmp_path):
    rollout, ts = tables()
    good = write_dump(tmp_path / "good.safetensors", rollout, rollout.copy(), timesteps=ts)
    bad = write_dump(tmp_path / "bad.safetensors", rollout, rollout + np.float32(1e-3), timesteps=ts)
    pytester.makepyfile(
        test_user=f"""
import numpy as np
import pytest

def test_tables(step1_gate):
    rollout = np.full((2, 3), -1.0, dtype=np.float32)
    assert step1_gate(rollout, rollout.copy()).passed

def test_dump(step1_gate):
    step1_gate({str(good)!r})

def test_bad_dump(step1_gate):
    step1_gate({str(bad)!r}, profile="kernel")

@pytest.mark.step1_gate({str(good)!r}, clip_ratio=1e-5)
def test_marked(step1_gate_report):
    assert step1_gate_report.metrics.clip_ratio_low == 1e-5
"""
    )
    reports = tmp_path / "reports"
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--step1-report-dir", str(reports))
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*step-1 gate FAILED*", "*max_abs_dlogp*"])
    assert len(list(reports.glob("*.json"))) == 4 and len(list(reports.glob("*.xml"))) == 4


def test_docs_ci_pytest_example_runs_under_pytest(pytester):
    """docs/ci.md's "From pytest" block, run as a test file next to the dump its "From Python" block writes."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "ci.md").read_text()
    section = page.split("### From pytest", 1)[1]
    block = re.search(r"^```python\n(.*?)^```", section, re.S | re.M).group(1)
    rollout, ts = tables(n=4)
    write_dump(pytester.path / "step1_logprobs.safetensors", rollout, rollout.copy(), timesteps=ts)
    pytester.makepyfile(test_docs_example=block)
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_one_bad_entry_or_a_flat_table_is_a_one_line_error():
    # Not only an all-NaN table: one inf timestep or one NaN advantage is refused, and a 1-D table is not (N, T).
    rollout, ts = tables()
    steps = ts.copy()
    steps[2, 1] = np.inf
    advantages = np.zeros(6)
    advantages[3] = np.nan
    for args, kwargs, words in (
        ((rollout, rollout), dict(timesteps=steps), "timesteps holds NaN or inf"),
        ((rollout, rollout), dict(advantages=advantages), "advantages holds NaN or inf"),
        ((rollout[0], rollout[0]), {}, "must be 2-D"),
    ):
        with pytest.raises(GateInputError, match=words):
            gate(*args, **kwargs)


def test_a_dump_with_repeated_sample_ids_or_one_nan_advantage_is_refused(tmp_path):
    table = np.zeros((2, 3), np.float32)
    with pytest.raises(DumpFormatError, match="'sample_ids' repeat"):
        write_dump(tmp_path / "d.safetensors", table, table.copy(), sample_ids=np.array([4, 4]))
    with pytest.raises(DumpFormatError, match="'advantages' holds NaN or inf"):
        write_dump(tmp_path / "d.safetensors", table, table.copy(), advantages=np.array([0.0, np.nan], np.float32))
    assert not (tmp_path / "d.safetensors").exists()


def test_table_settings_keep_their_earlier_public_name():
    """`TableSettings` is named for what it judges; `GateSettings`, its public name before, is the same class."""
    import rollout_consistency.gate as face
    from rollout_consistency.gate.tables import GateSettings

    assert GateSettings is TableSettings is face.GateSettings is face.TableSettings
    assert {"GateSettings", "TableSettings"} <= set(face.__all__)
