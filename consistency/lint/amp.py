# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Mixed-precision training mistakes: `grad-scaler-with-bf16` and `clip-before-unscale`.

`grad-scaler-with-bf16`: an enabled `GradScaler` (`torch.amp.GradScaler`, `torch.cuda.amp.GradScaler`, any
`*GradScaler`) in a file whose every autocast dtype resolves to bfloat16 (`torch.autocast(...,
dtype=torch.bfloat16)`, a dtype name assigned `torch.bfloat16`, `Accelerator(mixed_precision="bf16")`).
bf16 has float32's exponent range: scaling buys nothing, and the scaler's skipped steps and unscale make the
trainer's update differ from a plain one. Left alone: `enabled=<expression>` (a scaler switched on for fp16
only), a scaler built under a condition that mentions fp16, files with an fp16 (or unresolvable) autocast.

`clip-before-unscale`: in one function (or a script's top level) that calls `<scaler>.step(...)`, a `clip_grad_norm_` /
`clip_grad_value_` that comes before `<scaler>.unscale_(...)` (or with no `unscale_` at all): the clip then
measures the scaled gradients, so the threshold is off by the loss scale (which changes during training).
Left alone: `accelerator.clip_grad_norm_` / Fabric / DeepSpeed engines (they unscale themselves), clipping
in a function without a scaler step.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from .astutil import call_name, const, identifiers, keyword, last_name, short, words
from .model import Hit
from .source import SourceFile

__all__ = ["CLIP_RULE_ID", "SCALER_RULE_ID", "check_clip", "check_scaler", "needs_clip", "needs_scaler"]

SCALER_RULE_ID = "grad-scaler-with-bf16"
CLIP_RULE_ID = "clip-before-unscale"

_BF16 = frozenset({"bfloat16", "bf16"})
_FP16 = frozenset({"float16", "half", "fp16"})
_CLIPS = frozenset({"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm", "clip_grad_value"})
_SELF_UNSCALING = frozenset({"accelerator", "fabric", "engine", "strategy", "trainer", "deepspeed", "model_engine"})


def needs_scaler(text: bytes, path: str) -> bool:
    return b"gradscaler" in text


def needs_clip(text: bytes, path: str) -> bool:
    return b"clip_grad" in text and b"scaler" in text and b".step(" in text


def check_scaler(file: SourceFile) -> Iterator[Hit]:
    yield from _check_scaler_file(file)


def check_clip(file: SourceFile) -> Iterator[Hit]:
    for scope in (file.tree, *file.functions):  # a script's top-level training loop too
        yield from _check_clip_function(file, scope)


def _precision_of(node: ast.AST, assigned: dict[str, list[ast.AST]], depth: int = 0) -> set[str]:
    """{'bf16'}, {'fp16'}, both, or {'unknown'} for a dtype expression (names followed through assignments)."""
    if isinstance(node, ast.IfExp):
        return _precision_of(node.body, assigned, depth) | _precision_of(node.orelse, assigned, depth)
    value = const(node, None)
    name = value if isinstance(value, str) else last_name(node)
    if name in _BF16:
        return {"bf16"}
    if name in _FP16:
        return {"fp16"}
    if isinstance(node, ast.Name) and node.id in assigned and depth < 5:
        found: set[str] = set()
        for value_node in assigned[node.id]:
            found |= _precision_of(value_node, assigned, depth + 1)
        return found or {"unknown"}
    return {"unknown"}


def _autocast_precisions(file: SourceFile) -> set[str]:
    assigned: dict[str, list[ast.AST]] = {}
    for node in file.nodes:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)
    found: set[str] = set()
    for node in file.nodes:
        if not isinstance(node, ast.Call):
            continue
        name = call_name(node, file.aliases)
        if name.rsplit(".", 1)[-1] == "autocast":
            dtype = keyword(node, "dtype")
            if dtype is None and name in ("torch.autocast", "torch.amp.autocast") and len(node.args) > 1:
                dtype = node.args[1]
            if dtype is not None:
                found |= _precision_of(dtype, assigned)
        precision = keyword(node, "mixed_precision")
        if precision is not None:
            found |= _precision_of(precision, assigned)
    return found


def _under_fp16_condition(file: SourceFile, node: ast.AST) -> bool:
    parent = file.parents.get(node)
    while parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
        if isinstance(parent, (ast.If, ast.IfExp, ast.While)) and any(
            words(i) & _FP16 for i in identifiers(parent.test)
        ):
            return True
        parent = file.parents.get(parent)
    return False


def _check_scaler_file(file: SourceFile) -> Iterator[Hit]:
    precisions = None
    for node in file.nodes:
        if not (isinstance(node, ast.Call) and (last_name(node.func) or "").endswith("GradScaler")):
            continue
        enabled = keyword(node, "enabled")
        if enabled is not None and const(enabled, None) is not True:
            continue
        if _under_fp16_condition(file, node):
            continue
        if precisions is None:
            precisions = _autocast_precisions(file)
        if precisions == {"bf16"}:
            yield Hit(
                file,
                node,
                f"`{short(node, 40)}` with bfloat16 autocast: bf16 keeps float32's exponent range, so loss scaling "
                "buys nothing and only adds skipped steps; remove the scaler (or pass enabled=False) — only float16 "
                "needs it",
            )


def _is_scaler(node: ast.AST) -> bool:
    return "scaler" in words(last_name(node))


def _own_calls(function: ast.AST) -> list[ast.Call]:
    """Calls in the function's own body (not in nested functions), in source order."""
    calls: list[ast.Call] = []
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Call):
            calls.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset))


def _check_clip_function(file: SourceFile, function: ast.AST) -> Iterator[Hit]:
    calls = _own_calls(function)
    scaler_steps = [
        c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "step" and _is_scaler(c.func.value)
    ]
    if not scaler_steps:
        return
    unscales = [
        c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "unscale_" and _is_scaler(c.func.value)
    ]
    for call in calls:
        if last_name(call.func) not in _CLIPS:
            continue
        receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
        if receiver is not None and words(last_name(receiver)) & _SELF_UNSCALING:
            continue
        position = (call.lineno, call.col_offset)
        if any((u.lineno, u.col_offset) < position for u in unscales):
            continue
        later = f" (`unscale_` comes later, at line {unscales[0].lineno})" if unscales else ""
        yield Hit(
            file,
            call,
            f"`{short(call.func, 40)}(...)` clips the still-scaled gradients before `scaler.unscale_(optimizer)`"
            f"{later}, so the threshold is off by the loss scale; call `scaler.unscale_(optimizer)` first, then "
            "clip, then `scaler.step(optimizer)`",
        )
