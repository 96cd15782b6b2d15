# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`one-sided-precision-flag`: a TF32 / determinism / autotuning flag set on one side only.

Settings (each belongs to one *flag*; equivalent spellings share one):

| flag | set by |
|---|---|
| TF32 for matmuls | `torch.backends.cuda.matmul.allow_tf32 = ...`, `torch.set_float32_matmul_precision(...)`, `torch.backends.cuda.matmul.fp32_precision = ...` |
| TF32 for cuDNN | `torch.backends.cudnn.allow_tf32 = ...`, `torch.backends.cudnn.conv.fp32_precision = ...` |
| deterministic algorithms | `torch.use_deterministic_algorithms(...)` |
| cuDNN deterministic | `torch.backends.cudnn.deterministic = ...` |
| cuDNN benchmark | `torch.backends.cudnn.benchmark = ...` |
| bf16 / fp16 reduced-precision reductions | `torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction = ...` |

The side of a setting is read from the innermost place that names exactly one side, looking outwards:
an enclosing `if` whose test names a side (body only; tests with `not`/`!=` are skipped), the enclosing
functions and classes, the file name, then the directories between the linted path and the file. Rollout
words: rollout, inference, infer, generate, generation, sampling, sampler, vllm, sglang. Trainer words:
train, trainer, training, learner, finetune, actor. A place naming both (`ActorRolloutRefWorker`) or neither
decides nothing; a setting no place decides is *shared* (a launcher that both sides run).

A file that defines both rollout- and trainer-named functions or classes (a single-process trainer that
samples and trains) is shared outside those functions, whatever its name.

Across all the linted files, per flag: a flag set on one side, never on the other and nowhere shared, is a
finding at each of that side's settings — provided the linted code *has* the other side (some function,
class, file or directory named for it): one side alone, or one process doing both, cannot be one-sided.
Otherwise, when both sides' effective values are constants (a side's own settings, else the shared ones)
and differ, each side's own setting is a finding.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .astutil import call_name, const, dotted, identifiers, short, words
from .model import Hit
from .source import SourceFile

__all__ = ["RULE_ID", "check", "side_of"]

RULE_ID = "one-sided-precision-flag"

ROLLOUT_WORDS = frozenset(
    {"rollout", "rollouts", "inference", "infer", "generate", "generation", "sampling", "sampler", "vllm", "sglang"}
)
TRAINER_WORDS = frozenset({"train", "trainer", "training", "learner", "finetune", "actor"})

_UNKNOWN = object()
_BOOL = {True: True, False: False}
_FP32_PRECISION = {"tf32": True, "ieee": False}
_MATMUL_PRECISION = {"highest": False, "high": True, "medium": True}

#: attribute suffix -> (flag, value map)
_ATTRIBUTES = (
    ("cuda.matmul.allow_tf32", "TF32 for matmuls", _BOOL),
    ("cuda.matmul.fp32_precision", "TF32 for matmuls", _FP32_PRECISION),
    ("cudnn.allow_tf32", "TF32 for cuDNN", _BOOL),
    ("cudnn.conv.fp32_precision", "TF32 for cuDNN", _FP32_PRECISION),
    ("cudnn.deterministic", "cuDNN deterministic", _BOOL),
    ("cudnn.benchmark", "cuDNN benchmark", _BOOL),
    ("allow_bf16_reduced_precision_reduction", "bf16 reduced-precision reductions", _BOOL),
    ("allow_fp16_reduced_precision_reduction", "fp16 reduced-precision reductions", _BOOL),
)
#: function name -> (flag, value map of its first argument)
_CALLS = {
    "set_float32_matmul_precision": ("TF32 for matmuls", _MATMUL_PRECISION),
    "use_deterministic_algorithms": ("deterministic algorithms", _BOOL),
}


@dataclass(frozen=True)
class _Setting:
    file: SourceFile
    node: ast.AST
    flag: str
    value: object
    side: str
    why: str

    @property
    def where(self) -> str:
        return f"{self.file.path}:{self.node.lineno}"

    def shown_value(self) -> str:
        return "unknown" if self.value is _UNKNOWN else ("on" if self.value else "off")


def check(files: Sequence[SourceFile]) -> Iterator[Hit]:
    present = _present_sides(files)
    by_flag: dict[str, list[_Setting]] = {}
    for file in files:
        for setting in _settings(file):
            by_flag.setdefault(setting.flag, []).append(setting)
    for flag, settings in by_flag.items():
        groups = {side: [s for s in settings if s.side == side] for side in ("rollout", "trainer", "shared")}
        shared = groups["shared"]
        for side, other_side in (("rollout", "trainer"), ("trainer", "rollout")):
            if groups[side] and not groups[other_side] and not shared and other_side in present:
                for setting in groups[side]:
                    yield Hit(
                        setting.file,
                        setting.node,
                        f"`{short(setting.node, 60)}` sets {flag} on the {side} side only ({setting.why}) while the "
                        f"{other_side} side ({present[other_side]}) never sets it; set it identically there, or once "
                        "in a launcher both sides run",
                    )
        if not (groups["rollout"] and groups["trainer"]) and not shared:
            continue
        effective = {side: groups[side] or shared for side in ("rollout", "trainer")}
        values = {side: {s.value for s in group} for side, group in effective.items()}
        if _UNKNOWN in values["rollout"] | values["trainer"] or values["rollout"] == values["trainer"]:
            continue
        for side, other_side in (("rollout", "trainer"), ("trainer", "rollout")):
            other = effective[other_side][0]
            for setting in groups[side]:
                yield Hit(
                    setting.file,
                    setting.node,
                    f"`{short(setting.node, 60)}` gives the {side} side {flag} {setting.shown_value()} "
                    f"({setting.why}), the {other_side} side has it {other.shown_value()} ({other.where}); set it "
                    "identically on both sides, or once in a launcher both sides run",
                )


def _present_sides(files: Sequence[SourceFile]) -> dict[str, str]:
    """side -> evidence that the linted code has that side at all (a function, class or file named so)."""
    present: dict[str, str] = {}
    for file in files:
        for node in file.nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                side = _side_of_words(words(node.name))
                if side and side not in present:
                    kind = "class" if isinstance(node, ast.ClassDef) else "function"
                    present[side] = f"{kind} `{node.name}`, {file.path}:{node.lineno}"
        for part in file.parts:
            side = _side_of_words(words(part.removesuffix(".py")))
            if side and side not in present:
                present[side] = f"`{file.path}`"
    return present


def _settings(file: SourceFile) -> Iterator[_Setting]:
    for node in file.nodes:
        found = None
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                name = dotted(target, file.aliases) or ""
                if "backends" not in name.split("."):
                    continue
                for suffix, flag, values in _ATTRIBUTES:
                    if name == suffix or name.endswith("." + suffix):
                        found = (flag, values.get(const(node.value, None), _UNKNOWN))
                        break
        elif isinstance(node, ast.Call):
            name = call_name(node, file.aliases).rsplit(".", 1)[-1]
            if name in _CALLS and node.args:
                flag, values = _CALLS[name]
                found = (flag, values.get(const(node.args[0], None), _UNKNOWN))
        if found is not None:
            side, why = side_of(file, node)
            yield _Setting(file, node, found[0], found[1], side, why)


def _side_of_words(parts: frozenset[str]) -> str | None:
    rollout, trainer = bool(parts & ROLLOUT_WORDS), bool(parts & TRAINER_WORDS)
    return "rollout" if rollout and not trainer else "trainer" if trainer and not rollout else None


def side_of(file: SourceFile, node: ast.AST) -> tuple[str, str]:
    """('rollout' | 'trainer' | 'shared', what decided it)."""
    child, parent = node, file.parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.If) and any(child is stmt for stmt in parent.body):
            negated = any(isinstance(n, (ast.Not, ast.NotEq, ast.IsNot, ast.NotIn)) for n in ast.walk(parent.test))
            if not negated:
                side = _side_of_words(frozenset().union(*(words(i) for i in identifiers(parent.test))))
                if side:
                    return side, f"under `if {short(parent.test, 40)}`"
        elif isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            side = _side_of_words(words(parent.name))
            if side:
                kind = "class" if isinstance(parent, ast.ClassDef) else "function"
                return side, f"in {kind} `{parent.name}`"
        child, parent = parent, file.parents.get(parent)
    defined = {
        _side_of_words(words(n.name))
        for n in file.nodes
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    if {"rollout", "trainer"} <= defined:
        return "shared", f"file `{file.parts[-1]}` holds both rollout and trainer code"
    for index, part in enumerate(reversed(file.parts)):
        side = _side_of_words(words(part.removesuffix(".py")))
        if side:
            return side, f"{'file' if index == 0 else 'directory'} `{part}`"
    return "shared", "shared"
