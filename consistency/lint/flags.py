# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`one-sided-precision-flag`: a TF32 / determinism / autotuning flag set on one side of a split rollout/trainer
system only.

Settings (each belongs to one *flag*; equivalent spellings share one):

| flag | set by |
|---|---|
| TF32 for matmuls | `torch.backends.cuda.matmul.allow_tf32 = ...`, `torch.set_float32_matmul_precision(...)`, `torch.backends.cuda.matmul.fp32_precision = ...` |
| TF32 for cuDNN | `torch.backends.cudnn.allow_tf32 = ...`, `torch.backends.cudnn.conv.fp32_precision = ...` |
| deterministic algorithms | `torch.use_deterministic_algorithms(...)` |
| cuDNN deterministic | `torch.backends.cudnn.deterministic = ...` |
| cuDNN benchmark | `torch.backends.cudnn.benchmark = ...` |
| bf16 / fp16 reduced-precision reductions | `torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction = ...` |

These flags belong to the process. A trainer that samples and trains in one process (Flow-GRPO, DanceGRPO,
MixGRPO) runs both with whatever it set, so a flag can only be one-sided where the rollout runs elsewhere: in
a rollout engine's process (vLLM, vLLM-omni, SGLang) or a rollout worker, apart from the trainer's actor.
The side of a setting is read from names of such places (`sides.side_of`): an enclosing `if` whose test
names a role, the enclosing classes, the file name, then the directories — rollout, vllm, sglang against
actor, trainer, learner. A setting no such name decides is *shared* (a launcher, a single-process script).

Within each program (`imports.programs`: the files a linted file reaches by imports; not a reward model's
training script beside a vLLM-served reward, nor a library's DDPO trainer beside its LLM vLLM client), per flag: a flag set on one side, never on the other and
nowhere shared, is a finding at each of that side's settings — provided the group *has* the other side (a
file or directory named for it, or a class named for it in a file with settings). Otherwise, when both sides' effective values are constants (a side's own settings,
else the shared ones) and differ, each side's own setting is a finding.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .astutil import call_name, const, dotted, short, words
from .imports import programs
from .model import Finding, span
from .sides import side_of, side_of_words
from .source import SourceFile

__all__ = ["RULE_ID", "compare", "needs", "summarise"]

RULE_ID = "one-sided-precision-flag"

_UNKNOWN = "unknown"
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
_FLAG_TOKENS = (
    b"allow_tf32",
    b"fp32_precision",
    b"cudnn",
    b"reduced_precision_reduction",
    b"float32_matmul_precision",
    b"deterministic_algorithms",
)


def needs(text: bytes, path: str) -> bool:
    """A flag setting (`text` lower-cased). The other side's presence is read from the paths of all linted
    files and the classes of the files with settings."""
    return any(token in text for token in _FLAG_TOKENS)


@dataclass(frozen=True)
class _Setting:
    """One flag setting, kept as plain data after its file's tree is dropped."""

    path: str
    place: tuple[int, int, int, int]  # line, col, end_line, end_col
    text: str
    flag: str
    value: object  # True, False or _UNKNOWN (compared with ==: a worker process sends a copy)
    side: str
    why: str
    suppressed: bool

    @property
    def where(self) -> str:
        return f"{self.path}:{self.place[0]}"

    def shown_value(self) -> str:
        return "unknown" if self.value == _UNKNOWN else ("on" if self.value else "off")


@dataclass(frozen=True)
class _Facts:
    path: str
    settings: tuple[_Setting, ...]
    classes: dict[str, str]  # side -> the first class of the file named for it (evidence it exists)


def summarise(file: SourceFile) -> _Facts:
    classes: dict[str, str] = {}
    for node in file.statements:
        if isinstance(node, ast.ClassDef):
            side = side_of_words(words(node.name))
            if side and side not in classes:
                classes[side] = f"class `{node.name}`, {file.path}:{node.lineno}"
    return _Facts(file.path, tuple(_settings(file)), classes)


def compare(facts: Sequence[_Facts], linted: Sequence[tuple[str, tuple[str, ...]]]) -> Iterator[Finding]:
    """The findings across all the linted files (a setting with a suppression comment is not reported)."""
    for setting, message in _one_sided(facts, linted):
        if not setting.suppressed:
            line, col, end_line, end_col = setting.place
            yield Finding(setting.path, line, col, RULE_ID, message, end_line, end_col)


def _one_sided(
    facts: Sequence[_Facts], linted: Sequence[tuple[str, tuple[str, ...]]]
) -> Iterator[tuple[_Setting, str]]:
    """Per program (the files one file reaches by imports): only there can one side miss what the other sets."""
    if not any(setting.side != "shared" for file_facts in facts for setting in file_facts.settings):
        return  # settings that no name puts on a side: nothing can be one-sided
    # A test module (`test_*.py`, `*_test.py`, `conftest.py`) runs no side of a deployed system: it is no
    # program's root (a test importing a trainer and a rollout worker does not run them as one) and its name
    # says nothing (`test_grouped_rollout.py` beside a single-process trainer).
    linted = [item for item in linted if not _is_test(item[1][-1] if item[1] else item[0])]
    facts = [f for f in facts if not _is_test(f.path)]
    for program in programs(linted, [f.path for f in facts if f.settings]):
        yield from _one_sided_in(
            [f for f in facts if f.path in program], [item for item in linted if item[0] in program]
        )


def _one_sided_in(
    facts: Sequence[_Facts], linted: Sequence[tuple[str, tuple[str, ...]]]
) -> Iterator[tuple[_Setting, str]]:
    present = _present_sides(facts, linted)
    by_flag: dict[str, list[_Setting]] = {}
    for file_facts in facts:
        for setting in file_facts.settings:
            by_flag.setdefault(setting.flag, []).append(setting)
    for flag, settings in by_flag.items():
        groups = {side: [s for s in settings if s.side == side] for side in ("rollout", "trainer", "shared")}
        shared = groups["shared"]
        for side, other_side in (("rollout", "trainer"), ("trainer", "rollout")):
            if groups[side] and not groups[other_side] and not shared and other_side in present:
                for setting in groups[side]:
                    yield (
                        setting,
                        f"`{setting.text}` sets {flag} on the {side} side only ({setting.why}), in another process "
                        f"than the {other_side} side ({present[other_side]}), which never sets it: the two sides "
                        "multiply (or pick kernels) differently; set it identically there, or once in a launcher "
                        "both sides run",
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
                yield (
                    setting,
                    f"`{setting.text}` gives the {side} side {flag} {setting.shown_value()} ({setting.why}), the "
                    f"{other_side} side has it {other.shown_value()} ({other.where}); set it identically on both "
                    "sides, or once in a launcher both sides run",
                )


def _is_test(path: str) -> bool:
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    return name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"


def _present_sides(facts: Sequence[_Facts], linted: Sequence[tuple[str, tuple[str, ...]]]) -> dict[str, str]:
    """side -> evidence that the linted code has that side at all (a class, file or directory named so)."""
    present: dict[str, str] = {}
    for file_facts in facts:
        for side, evidence in file_facts.classes.items():
            present.setdefault(side, evidence)
    for path, parts in linted:
        for part in parts:
            side = side_of_words(words(part.removesuffix(".py")))
            if side and side not in present:
                present[side] = f"`{path}`"
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
            yield _Setting(
                path=file.path,
                place=span(file, node),
                text=short(node, 60),
                flag=found[0],
                value=found[1],
                side=side,
                why=why,
                suppressed=file.is_suppressed(node, RULE_ID),
            )
