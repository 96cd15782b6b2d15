# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Which side of a split rollout/trainer system a piece of code runs on, read from names.

A disagreement between the rollout and the trainer needs two different executions: a rollout engine (vLLM,
vLLM-omni, SGLang: its own processes and its own transformer code) and a trainer (an FSDP actor). A
single-process trainer that samples and trains (Flow-GRPO, DanceGRPO) runs one transformer with one set of
process-wide flags for both, so the words "sample", "generate", "inference" or "train" do not make a side;
only names of engines and of the workers that hold them do:

* rollout: rollout, vllm, sglang (`vllm_omni_rollout_adapter.py`, `vLLMRollout`, `rollout/`), or a file
  that imports `vllm`, `vllm_omni` or `sglang`;
* trainer: actor, trainer, learner (`dp_actor.py`, `DataParallelPPOActor`).

A name with both (`ActorRolloutRefWorker`, a colocated worker) decides nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

from .astutil import identifiers, short, words
from .source import SourceFile

__all__ = ["ENGINE_MODULES", "ROLLOUT_WORDS", "TRAINER_WORDS", "engine_evidence", "side_of", "side_of_words"]

ROLLOUT_WORDS = frozenset({"rollout", "rollouts", "vllm", "sglang"})
TRAINER_WORDS = frozenset({"actor", "trainer", "learner"})
#: top-level modules of rollout engines with their own transformer code
ENGINE_MODULES = frozenset({"vllm", "vllm_omni", "sglang"})


def side_of_words(parts: Iterable[str]) -> str | None:
    parts = frozenset(parts)
    rollout, trainer = bool(parts & ROLLOUT_WORDS), bool(parts & TRAINER_WORDS)
    return "rollout" if rollout and not trainer else "trainer" if trainer and not rollout else None


def _path_words(part: str) -> frozenset[str]:
    return words(part.removesuffix(".py"))


def engine_evidence(file: SourceFile, node: ast.AST) -> str | None:
    """What says `node` runs in a rollout engine (a phrase for a message), or None."""
    side, why = side_of(file, node)
    if side == "rollout":
        return why
    for stmt in file.tree.body:
        modules = []
        if isinstance(stmt, ast.Import):
            modules = [alias.name for alias in stmt.names]
        elif isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
            modules = [stmt.module]
        for module in modules:
            if module.split(".")[0] in ENGINE_MODULES:
                return f"file `{file.parts[-1]}` imports `{module}`"
    return None


def side_of(file: SourceFile, node: ast.AST) -> tuple[str, str]:
    """('rollout' | 'trainer' | 'shared', what decided it), looking outwards from `node`: an enclosing `if`
    whose test names a side (its body only; tests with `not`/`!=` are skipped), the enclosing classes, the
    file name, then the directories. No deciding name: 'shared'."""
    child, parent = node, file.parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.If) and any(child is stmt for stmt in parent.body):
            negated = any(isinstance(n, (ast.Not, ast.NotEq, ast.IsNot, ast.NotIn)) for n in ast.walk(parent.test))
            if not negated:
                side = side_of_words(word for i in identifiers(parent.test) for word in words(i))
                if side:
                    return side, f"under `if {short(parent.test, 40)}`"
        elif isinstance(parent, ast.ClassDef):
            side = side_of_words(words(parent.name))
            if side:
                return side, f"in class `{parent.name}`"
        child, parent = parent, file.parents.get(parent)
    for index, part in enumerate(reversed(file.parts)):
        side = side_of_words(_path_words(part))
        if side:
            return side, f"{'file' if index == 0 else 'directory'} `{part}`"
    return "shared", "shared"
