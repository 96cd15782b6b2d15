# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`rng-unsafe-recompute`: a forward re-run in backward (home-made gradient checkpointing) without restoring
the forward's RNG state, so dropout draws a new mask and the gradients belong to another network.

What counts:
* a subclass of `torch.autograd.Function` named for checkpointing (`CheckpointFunction`, `BlockRecompute`,
  `RematFn`: a checkpoint/recompute/remat word) whose `backward` calls something the forward saved on `ctx`
  (`ctx.run_function(*inputs)`, `ctx.module(x)`, or a name bound from a `ctx` attribute) under
  `torch.enable_grad()` / `set_grad_enabled(True)`, or in a backward that then calls
  `torch.autograd.backward`/`grad` — and restores no RNG state in `backward`;
* a function named like a checkpoint helper (`checkpoint`, `recompute`, `remat`) that calls one of its own
  parameters under `enable_grad()` or inside a nested function (a hook run at backward time), restoring no
  RNG state anywhere in the helper;
* any call passing `preserve_rng_state=False` (`torch.utils.checkpoint.checkpoint`, `checkpoint_sequential`).

An RNG restore is a call whose name is `set_rng_state`, `set_rng_state_all`, `set_device_states`,
`fork_rng`, `setstate` or `set_state`, or has the words rng/random together with restore/set/load/fork/
isolated (`restore_rng_state`, `isolated_rng`). `torch.utils.checkpoint.checkpoint` itself restores the RNG
(`preserve_rng_state=True` by default) and is left alone.

A Function named for something else that re-runs a computation in backward (verl's `TiledMLP` recomputes an
MLP shard to save memory) re-runs a fixed, dropout-free computation: a checkpoint wrapper takes any block,
dropout included, and says so in its name.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from .astutil import call_name, const, dotted, last_name, short, words
from .model import Hit
from .source import SourceFile

__all__ = ["RULE_ID", "check", "needs"]

RULE_ID = "rng-unsafe-recompute"

_CTX_API = frozenset(
    {
        "save_for_backward",
        "mark_dirty",
        "mark_non_differentiable",
        "set_materialize_grads",
        "saved_tensors",
        "needs_input_grad",
        "saved_variables",
    }
)
_RESTORE_NAMES = frozenset(
    {"set_rng_state", "set_rng_state_all", "set_device_states", "fork_rng", "setstate", "set_state"}
)
_HELPER_WORDS = frozenset({"checkpoint", "checkpointed", "checkpointing", "recompute", "remat", "rematerialize"})
_FIX = (
    "save the RNG state in forward (torch.get_rng_state(), CUDA's too) and restore it around the re-run, or use "
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
)


#: a helper re-runs its function for backward under one of these (`_check_helper`): `save_checkpoint` and
#: `load_checkpoint` in a file with none of them are not looked at
_RERUN_TOKENS = (b"enable_grad", b"set_grad_enabled", b"hook", b"no_grad")
#: ... or in a nested function run at backward time (`_backward_hooks`)
_BACKWARD_DEFINITION = re.compile(rb"def [a-z0-9_]*(?:backward|unpack|recompute)")
_HELPER_DEFINITION = re.compile(rb"def [a-z0-9_]*(?:checkpoint|recompute|remat)")
#: a Function class named for checkpointing (`class CheckpointFunction(torch.autograd.Function)`)
_FUNCTION_CLASS = re.compile(rb"class [a-z0-9_]*(?:checkpoint|recompute|remat)")


def needs(text: bytes, path: str) -> bool:
    """`preserve_rng_state`, an autograd.Function's backward, or a function named like a checkpoint helper
    (`text` lower-cased)."""
    if b"preserve_rng_state" in text:
        return True
    if not (b"checkpoint" in text or b"recompute" in text or b"remat" in text):
        return False  # a Function is looked at only when named for checkpointing, a helper likewise
    return (b"autograd" in text and b"def backward" in text and bool(_FUNCTION_CLASS.search(text))) or (
        (any(token in text for token in _RERUN_TOKENS) or bool(_BACKWARD_DEFINITION.search(text)))
        and bool(_HELPER_DEFINITION.search(text))
    )


def check(file: SourceFile) -> Iterator[Hit]:
    yield from _check_file(file)


def _is_function_class(cls: ast.ClassDef, aliases) -> bool:
    for base in cls.bases:
        name = dotted(base, aliases) or ""
        if name in ("torch.autograd.Function", "torch.autograd.function.Function") or name.endswith(
            "autograd.Function"
        ):
            return True
    return False


def _restores_rng(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            name = last_name(sub.func) or ""
            parts = words(name)
            if name in _RESTORE_NAMES or (
                parts & {"rng", "random"} and parts & {"restore", "set", "load", "fork", "isolated"}
            ):
                return True
    return False


def _grad_enabled_blocks(node: ast.AST) -> list[ast.With]:
    blocks = []
    for sub in ast.walk(node):
        if isinstance(sub, (ast.With, ast.AsyncWith)):
            for item in sub.items:
                expr = item.context_expr
                if isinstance(expr, ast.Call):
                    name = last_name(expr.func)
                    if name == "enable_grad" or (
                        name == "set_grad_enabled" and const(expr.args[0] if expr.args else None, None) is True
                    ):
                        blocks.append(sub)
    return blocks


def _inside(node: ast.AST, blocks: list[ast.AST], file: SourceFile) -> bool:
    parent = file.parents.get(node)
    while parent is not None:
        if any(parent is block for block in blocks):
            return True
        parent = file.parents.get(parent)
    return False


def _check_file(file: SourceFile) -> Iterator[Hit]:
    in_function_class: set[int] = set()
    for cls in file.statements:
        if isinstance(cls, ast.ClassDef) and _is_function_class(cls, file.aliases) and words(cls.name) & _HELPER_WORDS:
            for item in cls.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    in_function_class.add(id(item))
                    if item.name == "backward":
                        yield from _check_backward(file, item)
    for function in file.functions:
        if id(function) not in in_function_class and words(function.name) & _HELPER_WORDS:
            yield from _check_helper(file, function)
    if not any("preserve_rng_state" in line for line in file.lines):
        return
    for node in file.nodes:
        if isinstance(node, ast.Call):
            value = next((kw.value for kw in node.keywords if kw.arg == "preserve_rng_state"), None)
            if value is not None and const(value, None) is False:
                yield Hit(
                    file,
                    value,
                    f"`{short(node.func, 40)}(..., preserve_rng_state=False)` recomputes the segment with a new "
                    "dropout mask (the gradients belong to another forward); drop the argument (default True)",
                )


def _check_backward(file: SourceFile, backward: ast.FunctionDef) -> Iterator[Hit]:
    if not backward.args.args or _restores_rng(backward):
        return
    ctx = backward.args.args[0].arg
    saved = {ctx}
    for node in ast.walk(backward):  # names bound from ctx attributes: `fn = ctx.run_function`, `fn, m = ctx.f, ctx.m`
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts, strict=False))
            for name, value in pairs:
                if (
                    isinstance(name, ast.Name)
                    and isinstance(value, ast.Attribute)
                    and isinstance(value.value, ast.Name)
                    and value.value.id == ctx
                ):
                    saved.add(name.id)
    blocks = _grad_enabled_blocks(backward)
    differentiates = any(
        isinstance(node, ast.Call) and call_name(node, file.aliases).endswith(("autograd.backward", "autograd.grad"))
        for node in ast.walk(backward)
    )
    for node in ast.walk(backward):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        reruns = (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == ctx
            and func.attr not in _CTX_API
        ) or (isinstance(func, ast.Name) and func.id in saved and func.id != ctx)
        if reruns and (differentiates or _inside(node, blocks, file)):
            yield Hit(
                file,
                node,
                f"autograd.Function backward re-runs the forward (`{short(node, 40)}`) without restoring the "
                f"forward's RNG state (dropout draws a new mask); {_FIX}",
            )
            return


def _check_helper(file: SourceFile, helper: ast.FunctionDef) -> Iterator[Hit]:
    """A checkpoint-named helper that calls its function parameter again for backward: under
    `enable_grad()`, in a nested backward hook, or both under `no_grad()` and outside it."""
    params = {a.arg for a in (*helper.args.posonlyargs, *helper.args.args, *helper.args.kwonlyargs)}
    if not params or _restores_rng(helper):
        return
    enabled = _grad_enabled_blocks(helper)
    disabled = [
        n
        for n in ast.walk(helper)
        if isinstance(n, (ast.With, ast.AsyncWith))
        and any(isinstance(i.context_expr, ast.Call) and last_name(i.context_expr.func) == "no_grad" for i in n.items)
    ]
    hooks = _backward_hooks(helper)
    calls = [
        n for n in ast.walk(helper) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in params
    ]
    for node in calls:
        twice = not _inside(node, disabled, file) and any(
            other.func.id == node.func.id and _inside(other, disabled, file) for other in calls
        )
        if _inside(node, enabled, file) or _inside(node, hooks, file) or twice:
            yield Hit(
                file,
                node,
                f"checkpoint helper `{helper.name}` re-runs `{short(node, 40)}` for backward without restoring "
                f"the forward's RNG state (dropout draws a new mask); {_FIX}",
            )
            return


def _backward_hooks(helper: ast.FunctionDef) -> list[ast.AST]:
    """Nested functions run at backward time: named like a hook/backward, or passed to a `*hook(s)*` call."""
    registered: set[str] = set()
    for call in ast.walk(helper):
        if isinstance(call, ast.Call) and words(last_name(call.func)) & {"hook", "hooks"}:
            registered.update(arg.id for arg in call.args if isinstance(arg, ast.Name))
    return [
        node
        for node in ast.walk(helper)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node is not helper
        and (node.name in registered or words(node.name) & {"backward", "hook", "unpack", "recompute"})
    ]
