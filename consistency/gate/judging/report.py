# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The result of a step-1 check and its renderings: terminal table, JSON, JUnit XML, plot (and, through
`Report.log_to`, TensorBoard, wandb or MLflow: `rollout_consistency.gate.judging.loggers`).

JSON schema (``schema`` = ``"rollout-consistency/step1-report"``, ``schema_version`` = 1). Top-level keys,
always present and in this order::

    schema, schema_version, status, passed, reasons,
    verdict    {status, reasons, checks: [{name, kind, passed, message, value, limit, excess, steps, timesteps}]}
    tolerance  {profile, limits: {metric: limit}, floor, multiple, overridden, basis}
    metrics    null | {overall, by_position, by_timestep, by_sample, nonfinite, missing, empty_samples,
                       num_samples, num_positions, micro_batch_size, clip_ratio_low, clip_ratio_high}
    samples    [{index, prompt_index, prompt_group, seed, window_start, window_size}]
    config     the CheckConfig fields
    precision  null | the precision-audit diff
    notes      [str]
    run        {mode, workers, timings_s, environment, ...}
    diagnosis  [{cause, summary, evidence: [str], fix, confidence, source, details?}]  ranked likely causes
               of a FAIL or a near-limit PASS (rollout_consistency.gate.diagnosis.doctor); empty otherwise
    mismatch   null | {overall, by_timestep, clip_ratio_low, clip_ratio_high, clip_ratio_c}: the statistics
               LLM trainers log (rollout_consistency.gate.judging.mismatch); reported, never gated

Floats that are not finite are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (the file is
strict JSON). Adding keys bumps nothing; renaming or removing one bumps ``schema_version``.
``results_dict()`` is the part that depends only on the inputs (verdict, tolerance, metrics, samples):
two runs with the same seeds and settings give equal ``results_dict()`` on any number of workers.
"""

from __future__ import annotations

import json
import math
import os
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .causes import Diagnosis, format_diagnosis
from .metrics import METRICS, ConsistencyMetrics, StepMetrics
from .mismatch import STATISTICS, MismatchStats
from .tolerances import Tolerance
from .verdict import Verdict

SCHEMA_NAME = "rollout-consistency/step1-report"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class SampleInfo:
    """Where one compared sample came from: its prompt, group, seed and SDE window."""

    index: int
    prompt_index: int
    prompt_group: int
    seed: int
    window_start: int | None = None
    window_size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass(frozen=True)
class Report:
    """A finished step-1 check. Frozen; `to_dict` / `from_dict` round-trip (see the module docstring)."""

    verdict: Verdict
    tolerance: Tolerance
    metrics: ConsistencyMetrics | None
    samples: tuple[SampleInfo, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict)
    precision: Mapping[str, Any] | None = None
    notes: tuple[str, ...] = ()
    run: Mapping[str, Any] = field(default_factory=dict)
    diagnosis: tuple[Mapping[str, Any], ...] = ()  # causes.Diagnosis.to_dict(), ranked
    mismatch: MismatchStats | None = None  # reported, never gated

    @property
    def passed(self) -> bool:
        return self.verdict.passed

    @property
    def status(self) -> str:
        return self.verdict.status

    @property
    def reasons(self) -> tuple[str, ...]:
        return self.verdict.reasons

    # -- serialisation ---------------------------------------------------------------------------
    def results_dict(self) -> dict[str, Any]:
        """Verdict, tolerance, metrics and samples: the figures that depend only on seeds and settings."""
        return _encode(
            {
                "verdict": self.verdict.to_dict(),
                "tolerance": self.tolerance.to_dict(),
                "metrics": None if self.metrics is None else self.metrics.to_dict(),
                "samples": [s.to_dict() for s in self.samples],
            }
        )

    def to_dict(self) -> dict[str, Any]:
        results = self.results_dict()
        return {
            "schema": SCHEMA_NAME,
            "schema_version": SCHEMA_VERSION,
            "status": self.status,
            "passed": self.passed,
            "reasons": list(self.reasons),
            **results,
            "config": _encode(dict(self.config)),
            "precision": _encode(None if self.precision is None else dict(self.precision)),
            "notes": list(self.notes),
            "run": _encode(dict(self.run)),
            "diagnosis": _encode([dict(d) for d in self.diagnosis]),
            "mismatch": _encode(None if self.mismatch is None else self.mismatch.to_dict()),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Report:
        if data.get("schema") != SCHEMA_NAME:
            raise ValueError(f"not a step-1 report (schema {data.get('schema')!r}, expected {SCHEMA_NAME!r}).")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(
                f"report schema_version {data.get('schema_version')!r} is not supported (this version reads "
                f"{SCHEMA_VERSION})."
            )
        return cls(
            verdict=Verdict.from_dict(data["verdict"]),
            tolerance=Tolerance.from_dict(data["tolerance"]),
            metrics=None if data["metrics"] is None else ConsistencyMetrics.from_dict(data["metrics"]),
            samples=tuple(SampleInfo(**s) for s in data["samples"]),
            config=dict(data["config"]),
            precision=data["precision"],
            notes=tuple(data["notes"]),
            run=dict(data["run"]),
            diagnosis=tuple(data.get("diagnosis", ())),
            mismatch=None if data.get("mismatch") is None else MismatchStats.from_dict(_decode(data["mismatch"])),
        )

    @classmethod
    def from_json(cls, text: str) -> Report:
        return cls.from_dict(json.loads(text))

    # -- outputs ---------------------------------------------------------------------------------
    def format_table(self, *, per_sample: bool = False) -> str:
        return format_table(self, per_sample=per_sample)

    def write_json(self, path: str | os.PathLike[str]) -> None:
        _write_text(path, self.to_json() + "\n")

    def write_junit(self, path: str | os.PathLike[str]) -> None:
        _write_text(path, junit_xml(self))

    def write_plot(self, path: str | os.PathLike[str]) -> None:
        write_plot(self, path)

    def log_to(
        self, target: Any, *, step: int | None = None, prefix: str | None = None, plot: bool = True
    ) -> dict[str, float]:
        """Log the figures, verdict, per-timestep rows and plot to TensorBoard, wandb or MLflow: a tracker named
        by text (``"tensorboard:DIR"``, ``"wandb"``, ``"mlflow"``) or the trainer's own writer or run, at the
        trainer's ``step``. See `rollout_consistency.gate.judging.loggers.log_report`; returns the scalars."""
        from .loggers import log_report

        return log_report(self, target, step=step, prefix=prefix, plot=plot)


# ----------------------------------------------------------------------------------------------------
# JSON helpers
def _encode(value: Any) -> Any:
    """Strict-JSON form: non-finite floats as strings, tuples as lists, keys as strings."""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    """Inverse of `_encode` for the floats: ``"nan"``, ``"inf"``, ``"-inf"`` back to floats."""
    if value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, Mapping):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _make_parent_directory(path: str | os.PathLike[str]) -> None:
    directory = os.path.dirname(os.fspath(path))
    if directory:
        os.makedirs(directory, exist_ok=True)


def _write_text(path: str | os.PathLike[str], text: str) -> None:
    _make_parent_directory(path)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


# ----------------------------------------------------------------------------------------------------
# Terminal table
def _fmt(value: float | None, metric: str | None = None) -> str:
    if metric is not None and metric in METRICS:
        return METRICS[metric].format(value)
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    return f"{value:.3e}" if value != 0 else "0"


def format_table(report: Report, *, per_sample: bool = False) -> str:
    """Plain-text summary: verdict, the gated figures, per-step figures, and every reason to fail."""
    lines: list[str] = []
    m = report.metrics
    shape = f"{m.num_samples} samples x {m.num_positions} window steps" if m is not None else "no comparison"
    cfg = report.config
    if m is None:
        micro = "micro-batch -"
    elif m.micro_batch_size:
        micro = f"micro-batch {m.micro_batch_size}"
    else:  # no micro-batch given (gate(), the recorder): each step's entries pool as one cell
        micro = f"micro-batch not given: one cell of {m.num_samples} samples per step"
    clip = (
        "-"
        if m is None
        else (
            f"{m.clip_ratio_low:g}"
            if m.clip_ratio_low == m.clip_ratio_high
            else f"{m.clip_ratio_low:g}/{m.clip_ratio_high:g}"
        )
    )
    lines.append(f"rollout-consistency step-1 check: {report.status}")
    lines.append(
        f"  profile {report.tolerance.profile} | {shape} | clip_ratio {clip} | {micro}"
        + (f" | {cfg.get('model_family')} {cfg.get('rollout_backend')}->{cfg.get('trainer_backend')}" if cfg else "")
    )
    if report.tolerance.basis:
        lines.append(f"  limits: {report.tolerance.basis}")
    if report.diagnosis:
        lines += ["", *format_diagnosis(report.diagnosis)]
    lines.append("")
    lines.append(f"  {'metric':<20} {'value':>16}  {'limit':<22} status")
    for metric in METRICS.values():
        value = None if m is None else m.overall.get(metric.name)
        limit = report.tolerance.limit(metric.name)
        check = next((c for c in report.verdict.checks if c.kind == "metric" and c.name == metric.name), None)
        status = "-" if check is None else ("ok" if check.passed else "FAIL")
        lines.append(f"  {metric.name:<20} {metric.format(value):>16}  {metric.limit_text(limit):<22} {status}")
    guards = [c for c in report.verdict.checks if c.kind == "guard"]
    lines.append("  guards: " + "  ".join(f"{c.name} {'ok' if c.passed else 'FAIL'}" for c in guards))

    if m is not None and m.by_position:
        lines.append("")
        steps = m.by_timestep if m.by_timestep else m.by_position
        lines.append(
            "  per timestep (pos: its column of the log-prob table, the step's place in the SDE window; - where "
            "it sits in several)"
            if m.by_timestep
            else "  per window position (pos: the column of the log-prob table)"
        )
        header = f"  {'pos':>4} {'t':>9} {'n':>4}" + "".join(f" {k.column:>12}" for k in METRICS.values())
        lines.append(header)
        for s in steps:
            lines.append(_step_row(s))
    if per_sample and m is not None:
        lines.append("")
        lines.append("  per sample")
        lines.append(
            f"  {'idx':>4} {'group':>5} {'seed':>8} {'n':>4}" + "".join(f" {k.column:>12}" for k in METRICS.values())
        )
        info = {s.index: s for s in report.samples}
        for s in m.by_sample:
            extra = info.get(s.index)
            group = "-" if extra is None else str(extra.prompt_group)
            seed = "-" if extra is None else str(extra.seed)
            lines.append(
                f"  {s.index:>4} {group:>5} {seed:>8} {s.values.count:>4}"
                + "".join(f" {k.format(s.values.get(k.name)):>12}" for k in METRICS.values())
            )
    if report.mismatch is not None:
        lines.extend(_mismatch_lines(report.mismatch))
    if report.notes:
        lines.append("")
        lines.extend(f"  note: {n}" for n in report.notes)
    if report.reasons:
        lines.append("")
        lines.append("  FAIL because:")
        lines.extend(f"   - {r}" for r in report.reasons)
    return "\n".join(lines)


def _mismatch_lines(stats: MismatchStats) -> list[str]:
    o = stats.overall
    shown = [s for s in STATISTICS.values() if s.column is not None and o.get(s.name) is not None]
    names = [s.name for s in shown]
    lines = ["", "  mismatch statistics (pooled over entries; reported, not gated; docs/checker.md)"]
    lines.append(f"  {'':>14}" + "".join(f" {s.column:>11}" for s in shown) + "  bias 95% CI")
    lines.append(_mismatch_row("overall", o, names))
    for s in stats.by_timestep:
        label = f"t={s.timestep:.4g}" if s.timestep is not None else f"step {s.position}"
        lines.append(_mismatch_row(label, s.values, names))
    if o.pg_clipfrac_adv is not None:
        lines.append(
            "  clip_adv/clip_dual: LLM verl's advantage-dependent pg_clipfrac and dual-clip pg_clipfrac_lower "
            f"(clip_ratio_c {stats.clip_ratio_c:g})"
        )
    return lines


def _mismatch_row(label: str, values: Any, names: list[str]) -> str:
    ci = f"[{_statistic(values.bias_ci_low)}, {_statistic(values.bias_ci_high)}]"
    return f"  {label:>14}" + "".join(f" {_statistic(getattr(values, k)):>11}" for k in names) + f"  {ci}"


def _statistic(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    return "0" if value == 0 else f"{value:.3e}"


def _step_row(s: StepMetrics) -> str:
    pos = "-" if s.position is None else str(s.position)
    ts = "-" if s.timestep is None else f"{s.timestep:.4g}"
    return f"  {pos:>4} {ts:>9} {s.values.count:>4}" + "".join(
        f" {k.format(s.values.get(k.name)):>12}" for k in METRICS.values()
    )


# ----------------------------------------------------------------------------------------------------
# JUnit XML
def junit_xml(report: Report) -> str:
    """JUnit XML: one ``<testsuite>`` per check, one ``<testcase>`` per guard and per gated metric.

    A failed check is a ``<failure>`` with the reason as its message. Config and tolerance go into
    ``<properties>``; the terminal table into ``<system-out>``. Parses with ``xml.etree``.
    """
    checks = report.verdict.checks
    failures = sum(1 for c in checks if not c.passed)
    suites = ET.Element(
        "testsuites", name="rollout-consistency", tests=str(len(checks)), failures=str(failures), errors="0"
    )
    timings = report.run.get("timings_s", {}) if isinstance(report.run, Mapping) else {}
    total = timings.get("total", 0.0) if isinstance(timings, Mapping) else 0.0
    suite = ET.SubElement(
        suites,
        "testsuite",
        name=f"step1-consistency[{report.tolerance.profile}]",
        tests=str(len(checks)),
        failures=str(failures),
        errors="0",
        skipped="0",
        time=f"{float(total):.3f}",
    )
    properties = ET.SubElement(suite, "properties")
    props = {"status": report.status, "profile": report.tolerance.profile, "limits_basis": report.tolerance.basis}
    for key in (
        "model_family",
        "rollout_backend",
        "trainer_backend",
        "step_execution",
        "noise_level",
        "sde_type",
        "sde_window_size",
        "clip_ratio",
        "seed",
        "global_step",
        "inject",
        "trajectory",
    ):
        if key in report.config:
            props[key] = report.config[key]
    for key, value in props.items():
        ET.SubElement(properties, "property", name=str(key), value=str(value))
    if report.mismatch is not None:
        views = [("overall", report.mismatch.overall)] + [
            (f"t={s.timestep:g}" if s.timestep is not None else f"step{s.position}", s.values)
            for s in report.mismatch.by_timestep
        ]
        for view, values in views:
            for name, value in values.to_dict().items():
                if name != "count" and value is not None:
                    ET.SubElement(properties, "property", name=f"mismatch.{view}.{name}", value=repr(float(value)))
    classname = f"rollout_consistency.step1.{report.tolerance.profile}"
    for check in checks:
        case = ET.SubElement(suite, "testcase", classname=f"{classname}.{check.kind}", name=check.name, time="0")
        if not check.passed:
            headline = _diagnosis_headline(report)
            failure = ET.SubElement(
                case,
                "failure",
                message=f"{headline} | {check.message}" if headline else check.message,
                type="ThresholdExceeded" if check.kind == "metric" else "GuardFailed",
            )
            detail = [headline, check.message] if headline else [check.message]
            if check.value is not None:
                detail.append(f"value={_fmt(check.value)} limit={_fmt(check.limit)} excess={_fmt(check.excess)}")
            if check.steps:
                detail.append("steps=" + ",".join(map(str, check.steps)))
            if check.timesteps:
                detail.append("timesteps=" + ",".join(f"{t:g}" for t in check.timesteps))
            failure.text = "\n".join(detail)
    out = ET.SubElement(suite, "system-out")
    out.text = format_table(report)
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def _diagnosis_headline(report: Report) -> str:
    """The doctor's top cause and fix, one line (empty without a diagnosis)."""
    if not report.diagnosis:
        return ""
    return Diagnosis.from_dict(report.diagnosis[0]).headline()


# ----------------------------------------------------------------------------------------------------
# Plot
def write_plot(report: Report, path: str | os.PathLike[str]) -> None:
    """PNG: per-timestep signed Δlogp (mean ± spread, ± max |Δlogp|) with the clip band and the profile's
    limits, and ratio_mean ± ratio_std with the tolerance band.

    Uses matplotlib's Agg backend (no display needed); imported here so that importing this module stays
    cheap.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    m = report.metrics
    fig = Figure(figsize=(8, 6.5), dpi=100)
    ax_dlogp, ax_ratio = fig.subplots(2, 1, sharex=True)
    title = f"step-1 consistency: {report.status} (profile {report.tolerance.profile})"
    fig.suptitle(title, color="tab:green" if report.passed else "tab:red")
    steps = [] if m is None else list(m.by_timestep or m.by_position)
    if not steps:
        ax_dlogp.text(0.5, 0.5, "no comparison was made", ha="center", va="center", transform=ax_dlogp.transAxes)
    else:
        use_t = all(s.timestep is not None for s in steps)
        xs = [s.timestep if use_t else s.position for s in steps]
        _signed_dlogp_panel(ax_dlogp, report, steps, xs)
        ratio = [s.values.ratio_mean for s in steps]
        spread = [s.values.ratio_std for s in steps]
        ax_ratio.errorbar(xs, ratio, yerr=spread, fmt="o-", capsize=3, label="ratio_mean ± ratio_std")
        limit = report.tolerance.limit("ratio_mean")
        if limit is not None:
            low, high = 1 - limit, 1 + limit
            ax_ratio.axhspan(low, high, color="tab:green", alpha=0.2, label=f"tolerance 1 ± {limit:.2g}")
        ax_ratio.axhline(1.0, color="black", linewidth=0.8)
        ax_ratio.set_ylabel("ratio = exp(Δlogp)")
        ax_ratio.ticklabel_format(axis="y", useOffset=False, style="plain")
        ax_ratio.legend(fontsize=8)
        if use_t:
            ax_ratio.set_xlabel("timestep (denoising runs left to right)")
            ax_ratio.invert_xaxis()
        else:
            ax_ratio.set_xlabel("window position")
    fig.tight_layout()
    _make_parent_directory(path)
    fig.savefig(path, format="png")


def _signed_dlogp_panel(ax: Any, report: Report, steps: list[StepMetrics], xs: list[Any]) -> None:
    """Signed Δlogp per timestep: the mean (= −ppo_kl), its spread sqrt(2·approx_kl − mean²) (the cell RMS
    around the mean), ± max |Δlogp|, the clip band log(1 ± ε) and the profile's limits on ppo_kl and
    max |Δlogp|. A one-sided bias (the stored-latents bug) shows as a band below 0."""
    mean = [-s.values.ppo_kl for s in steps]
    spread = [math.sqrt(max(2 * s.values.approx_kl - s.values.ppo_kl**2, 0.0)) for s in steps]
    worst = [s.values.max_abs_dlogp for s in steps]
    ax.fill_between(
        xs,
        [m - d for m, d in zip(mean, spread, strict=False)],
        [m + d for m, d in zip(mean, spread, strict=False)],
        color="C0",
        alpha=0.3,
        label="mean ± spread",
    )
    ax.plot(xs, mean, "o-", color="C0", label="mean Δlogp (= −ppo_kl)")
    ax.plot(xs, worst, "v:", color="C1", markersize=4, label="± max |Δlogp|")
    ax.plot(xs, [-w for w in worst], "^:", color="C1", markersize=4)
    m = report.metrics
    if m is not None:
        low, high = math.log1p(-min(m.clip_ratio_low, 0.999999)), math.log1p(m.clip_ratio_high)
        ax.axhspan(low, high, color="tab:green", alpha=0.15, label=f"clip band log(1 ± ε), ε {m.clip_ratio_high:g}")
    for metric, color in (("ppo_kl", "tab:purple"), ("max_abs_dlogp", "tab:red")):
        limit = report.tolerance.limit(metric)
        if limit:
            label = f"{METRICS[metric].column} limit ±{limit:.2g}"
            ax.axhline(limit, color=color, linestyle="--", linewidth=0.8, label=label)
            ax.axhline(-limit, color=color, linestyle="--", linewidth=0.8)
    ax.axhline(0.0, color="black", linewidth=0.8)
    values = [abs(v) for v in mean + spread + worst if math.isfinite(v) and v != 0]
    if values:
        ax.set_yscale("symlog", linthresh=min(values) / 2)  # 1e-9 .. 1e-1 both signs on one axis
    else:
        ax.text(0.5, 0.5, "Δlogp = 0 at every step (bit for bit)", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("Δlogp (trainer − rollout)")
    ax.legend(fontsize=7)
