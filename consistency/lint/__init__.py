# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Static lint (pure AST, no imports of the linted code) for the anti-patterns behind known rollout/trainer
disagreements in diffusion RL: bf16-rounded stored latents, mask-sum text RoPE lengths, SDE windows and
seeds from the rank or an unseeded RNG, RNG-unsafe checkpoint recompute, GradScaler with bf16, clipping
before `unscale_`, precision flags set on one side only. docs/lint.md documents every rule.

    from rollout_consistency.lint import lint_paths, render

    findings = lint_paths(["trainer/", "rollout/worker.py"], ignore=["clip-before-unscale"])
    print(render(findings, "text"), end="")      # path:line:col rule-id message (with the fix)

Command line: `rollout-consistency lint PATH... [--select/--ignore RULE] [--format text|github|sarif]`.
Suppress a finding with a comment on its statement: `# rollout-consistency: ignore[rule-id] reason`.

This package imports nothing outside itself and the standard library.
"""

from __future__ import annotations

from .engine import LintUsageError, lint_paths, lint_source
from .model import Finding, Rule
from .output import FORMATS, render
from .rules import RULES

__all__ = ["FORMATS", "RULES", "Finding", "LintUsageError", "Rule", "lint_paths", "lint_source", "render"]
