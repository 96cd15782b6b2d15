"""The cause registry: one `Cause` record per cause id, from which the catalogue's FIXES and NOT_A_BUG, the
sentences the doctor says and docs/doctor.md's table of causes all derive; no other table of causes in the
package, and every cause id the doctor names is a record."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rollout_consistency.gate.diagnosis import CONFIDENCE, FIXES, NOT_A_BUG
from rollout_consistency.gate.diagnosis.catalogue import make
from rollout_consistency.gate.diagnosis.cause_registry import (
    CAUSES,
    Cause,
    causes_table,
    localised_summaries,
    summaries,
)

ROOT = Path(__file__).resolve().parents[1]
DIAGNOSIS = ROOT / "consistency" / "gate" / "diagnosis"


def test_every_cause_has_a_summary_a_fix_and_known_evidence_kinds():
    assert len(CAUSES) >= 28
    for cause in CAUSES.values():
        assert cause.id == cause.name and cause.id == cause.id.strip().lower() and " " not in cause.id
        assert cause.summary.strip() and cause.summary.endswith("."), cause.id
        assert cause.fix.strip(), f"{cause.id}: no fix"
        assert cause.kinds and set(cause.kinds) <= set(CONFIDENCE), (cause.id, cause.kinds)
        assert cause.localised_fix is None or cause.localised_fix.strip(), cause.id


def test_the_catalogue_and_the_doctor_modules_read_the_registry():
    assert {cause: FIXES[cause] for cause in CAUSES} == FIXES
    assert all(FIXES[c.id] == c.fix for c in CAUSES.values())
    assert {c.id for c in CAUSES.values() if c.not_a_bug} == NOT_A_BUG == {"attention-kernel", "batch-composition"}
    assert summaries() == {c.id: c.summary for c in CAUSES.values()}
    assert localised_summaries() == {c.id: c.localised_summary for c in CAUSES.values() if c.localised_summary}
    assert localised_summaries()["logprob-convention"] != CAUSES["logprob-convention"].summary  # the replay's own
    assert localised_summaries()["noise-level-mismatch"] == CAUSES["noise-level-mismatch"].summary
    assert "model-input" not in localised_summaries()  # the replay says where the sides part


def test_the_docs_table_is_the_registry():
    """docs/doctor.md's table of causes, row for row: a row for a non-cause, or a cause without its row, fails."""
    page = (ROOT / "docs" / "doctor.md").read_text()
    section = page.split("\n## Cause ids\n", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    assert table == causes_table()


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _diagnosis_trees() -> list[tuple[str, ast.AST]]:
    return [(p.name, ast.parse(p.read_text())) for p in sorted(DIAGNOSIS.glob("*.py"))]


def test_every_cause_the_doctor_names_is_a_record_with_that_evidence_kind():
    """Every literal `make(cause, summary, evidence, kind)` (and `guard_cause(cause, ...)`, kind ``guard``) in the
    doctor names a registered cause, by a kind its record lists; every cause id in the doctor's lookup tables is
    registered."""
    checked = 0
    for name, tree in _diagnosis_trees():
        for node in ast.walk(tree):
            function = getattr(node, "func", None)
            if isinstance(node, ast.Call) and getattr(function, "id", None) == "guard_cause" and node.args:
                cause, kind = _literal(node.args[0]), "guard"
            elif isinstance(node, ast.Call) and getattr(function, "id", None) == "make" and len(node.args) >= 4:
                cause, kind = _literal(node.args[0]), _literal(node.args[3])
            else:
                continue
            if cause is not None:
                assert cause in CAUSES, f"{name}:{node.lineno}: {cause!r} has no Cause record"
                if kind is not None:
                    assert kind in CAUSES[cause].kinds, f"{name}:{node.lineno}: {cause} by {kind}"
                checked += 1
    assert checked >= 20
    # The doctor's lookup tables (a stage, a setting or a direction of Δlogp -> the causes it names).
    tables = {"_STAGE_CAUSES": set(), "_SETTING_CAUSES": set(), "_SHIFT_CANDIDATES": set()}
    for _, tree in _diagnosis_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in tables:
                texts = {_literal(n) for n in ast.walk(node.value)} - {None}
                tables[node.targets[0].id] |= texts & {t for t in texts if "-" in t}
    assert all(tables.values()), tables
    assert set().union(*tables.values()) - set(CAUSES) == set()
    candidates = {c.id for c in CAUSES.values() if "candidates" in c.kinds}
    assert tables["_SHIFT_CANDIDATES"] <= candidates


def test_no_other_table_of_causes_in_the_package():
    """A dict of texts keyed by cause ids (a fix or a summary per cause) anywhere in the package but the registry
    is a parallel table: the records are the one place. (The --inject names' settings are keyed by the same
    names, but hold settings, not texts.)"""
    found = []
    for path in sorted((ROOT / "consistency").rglob("*.py")):
        if path.name == "cause_registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                texts = {
                    _literal(k) for k, v in zip(node.keys, node.values, strict=True) if k is not None and _literal(v)
                }
                if len(texts & set(CAUSES)) >= 2:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_a_new_cause_is_one_record():
    record = Cause(
        "my-cause",
        summary="The rollout scores the step with last step's sigma.",
        fix="look the sigma up by the stored timestep",
        kinds=("replay-step",),
    )
    with CAUSES.scoped():
        CAUSES.register(record)
        found = make("my-cause", record.summary, ["the fits differ in sigma"], "replay-step", source="localisation")
        assert (found.cause, found.fix, found.confidence) == ("my-cause", record.fix, CONFIDENCE["replay-step"])
        assert "| `my-cause` |" in causes_table()
        with pytest.raises(ValueError, match="already registered"):
            CAUSES.register(Cause("my-cause", summary="Other.", fix="other", kinds=("guard",)))
    assert "my-cause" not in CAUSES
    with pytest.raises(KeyError, match="Unknown cause 'my-cause'"):
        make("my-cause", "summary", [], "replay-step")


def test_a_localised_fix_replaces_the_fix_only_after_a_replay():
    cause = CAUSES["different-computation"]
    assert cause.localised_fix and cause.localised_fix != cause.fix
    assert make(cause.id, cause.summary, [], "unknown").fix == cause.fix
    assert make(cause.id, cause.summary, [], "replay-stage", source="localisation").fix == cause.localised_fix
    plain = CAUSES["step-index"]
    assert make(plain.id, plain.summary, [], "replay-step", source="localisation").fix == plain.fix
