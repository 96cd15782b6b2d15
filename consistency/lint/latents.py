# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`low-precision-latents`: a scheduler step's sample cast to bf16/fp16 or the model's dtype, then kept.

diffusers' `FlowMatchEulerDiscreteScheduler.step` ends with `prev_sample.to(model_output.dtype)`; Flow-GRPO
style code computes the log-prob in float32 from the unrounded sample and then stores, returns or feeds on
the rounded one, so the trainer re-scores a different latent.

What counts (per function, statements in source order):
* a *cast*: `x.to(<dtype>)` (also `dtype=`, `x.to(device, dtype)`), `x.half()`, `x.bfloat16()`,
  `x.type(<dtype>)`, `x.type_as(y)`, where the dtype is bf16/fp16 or a model dtype (`dtype`,
  `weight_dtype`, `model_output.dtype`, `self.transformer.dtype`, ...) — not float32/float64, not the
  sample's own `latents.dtype`;
* of a *step sample*: `.prev_sample`, a `prev_*`/`next_*` sample or latent, the result of a `*step*(...)`
  call or a name bound from one, or a `latents`/`sample`-like name inside a loop or a `*step*` function;
* that is *kept*: returned or yielded, stored (`.append`/`.extend`/`.insert`, assigned into a subscript or
  an attribute), passed to a `*step*(...)` call, or rebound in a loop as the name the loop carries. A name
  bound to the cast carries it to a later statement (`.float()` does not undo the rounding).

A cast that only feeds the transformer (`transformer(hidden_states=latents.to(dtype))`, or a name used only
as a forward's argument) is not kept.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

from .astutil import bound_names, iter_statements, last_name, own_nodes, short, words
from .model import Hit
from .source import SourceFile

__all__ = ["RULE_ID", "check"]

RULE_ID = "low-precision-latents"

_LOW = frozenset({"bfloat16", "float16", "half", "bf16", "fp16"})
_HIGH = frozenset({"float32", "float", "float64", "double", "fp32", "fp64"})
_SAMPLE_WORDS = frozenset({"latent", "latents", "sample", "samples"})
_SAMPLE_NAMES = frozenset({"x_t", "xt", "z_t", "zt"})
_STEP_OUTPUT_NAMES = frozenset({"x_prev", "x_next", "prev_x", "next_x", "z_prev", "z_next"})
#: methods whose result still holds the cast value (the rounding survives them)
_PASSTHROUGH = frozenset(
    {
        "to",
        "float",
        "double",
        "half",
        "bfloat16",
        "type",
        "type_as",
        "clone",
        "detach",
        "contiguous",
        "cpu",
        "cuda",
        "view",
        "reshape",
        "squeeze",
        "unsqueeze",
        "permute",
        "flatten",
        "requires_grad_",
    }
)
_STORE_METHODS = frozenset({"append", "extend", "insert", "add", "appendleft", "put", "put_nowait"})
_NOT_STEP_RECEIVERS = frozenset({"optimizer", "optim", "lr", "scaler", "ema", "opt"})
#: a call named `step`, or `*step*` with one of these words, is a sampler step (`sde_step_with_logprob`,
#: `scheduler_step`, `flux_step`); `train_step`, `optimizer.step` and `record_window_step` are not
_STEP_FUNCTION_WORDS = frozenset(
    {
        "sde",
        "ode",
        "scheduler",
        "logprob",
        "log",
        "denoise",
        "denoising",
        "euler",
        "flow",
        "sampler",
        "sample",
        "sampling",
        "diffusion",
        "flux",
        "sd3",
        "sdxl",
        "grpo",
        "dance",
    }
)
_CONTAINER_CALLS = frozenset({"dict", "tuple", "list", "stack", "cat", "concat", "concatenate"})

_FIX = "keep latents float32 and cast only a copy for the transformer forward"


@dataclass(frozen=True)
class _Cast:
    call: ast.Call
    subject: ast.expr
    dtype: str


def check(files) -> Iterator[Hit]:
    for file in files:
        for scope in (file.tree, *file.functions):
            yield from _Scope(file, scope).run()


def dtype_kind(node: ast.AST) -> str | None:
    """'low' (bf16/fp16), 'model' (a model's dtype), 'high' (float32/64) or None (not a dtype)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return "low" if node.value in _LOW else "high" if node.value in _HIGH else None
    if isinstance(node, ast.Call):
        return "high" if last_name(node.func) == "get_default_dtype" else None
    if not isinstance(node, (ast.Name, ast.Attribute)):
        return None
    name = last_name(node)
    if name in _LOW:
        return "low"
    if name in _HIGH:
        return "high"
    if isinstance(node, ast.Attribute) and node.attr == "dtype":
        return None if words(last_name(node.value)) & _SAMPLE_WORDS else "model"  # `latents.dtype`: its own
    parts = words(name)
    if "dtype" in parts:
        return "high" if parts & {"float32", "fp32", "float64", "fp64"} else "model"
    return None


def _low_cast(call: ast.Call) -> _Cast | None:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr in ("half", "bfloat16") and not call.args:
        return _Cast(call, func.value, f"torch.{'float16' if func.attr == 'half' else 'bfloat16'}")
    if func.attr in ("to", "type"):
        candidates = [kw.value for kw in call.keywords if kw.arg == "dtype"] or list(call.args)
        for arg in candidates:
            kind = dtype_kind(arg)
            if kind is not None:
                return _Cast(call, func.value, short(arg, 40)) if kind != "high" else None
        return None
    if func.attr == "type_as" and call.args:
        other = call.args[0]
        if words(last_name(other)) & _SAMPLE_WORDS:
            return None
        return _Cast(call, func.value, f"{short(other, 30)}.dtype")
    return None


def _strip(node: ast.AST) -> ast.AST:
    """`latents[:, 0].detach()` -> `latents`; `scheduler.step(...).prev_sample` -> the step call."""
    while True:
        if isinstance(node, ast.Subscript) or (
            isinstance(node, ast.Attribute) and node.attr == "prev_sample" and isinstance(node.value, ast.Call)
        ):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _PASSTHROUGH:
            node = node.func.value
        else:
            return node


def _is_step_call(node: ast.AST) -> bool:
    """`scheduler.step(...)`, `sde_step_with_logprob(...)`, `scheduler_step(...)`: a sampler step."""
    if not isinstance(node, ast.Call):
        return False
    name = last_name(node.func)
    parts = words(name)
    if name != "step" and not ("step" in parts and parts & _STEP_FUNCTION_WORDS):
        return False
    receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
    return not (receiver is not None and words(last_name(receiver)) & _NOT_STEP_RECEIVERS)


def _is_sample_name(name: str | None) -> bool:
    return bool(words(name) & _SAMPLE_WORDS) or name in _SAMPLE_NAMES


def _is_step_output_name(name: str | None) -> bool:
    parts = words(name)
    return name in _STEP_OUTPUT_NAMES or bool(parts & {"prev", "next"} and parts & _SAMPLE_WORDS)


class _Scope:
    """One function (or the module's top level), walked statement by statement."""

    def __init__(self, file: SourceFile, scope: ast.AST) -> None:
        self.file = file
        self.scope = scope
        name_words = words(getattr(scope, "name", ""))
        self.step_function = "step" in name_words and not name_words & {"train", "training", "optimizer"}
        self.step_bound: dict[str, ast.stmt | None] = {}  # name bound from a step call -> its innermost loop
        self.tainted: dict[str, _Cast] = {}  # names holding a cast sample
        self.reported: set[int] = set()

    def run(self) -> Iterator[Hit]:
        for stmt, loops in iter_statements(self.scope.body):
            yield from self._statement(stmt, loops)

    def _statement(self, stmt: ast.stmt, loops: tuple) -> Iterator[Hit]:
        self._record_step_bound(stmt, loops)
        bound: dict[str, _Cast] = {}
        for node in self.file.own_nodes(stmt):
            origin = None
            if isinstance(node, ast.Call):
                cast = _low_cast(node)
                if cast is not None and self._is_step_sample(cast.subject, loops):
                    origin = cast
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                origin = self.tainted.get(node.id)
            if origin is None:
                continue
            sink, names = self._follow(node, origin, loops)
            for name in names:
                bound.setdefault(name, origin)
            if sink is not None and id(origin.call) not in self.reported:
                self.reported.add(id(origin.call))
                yield Hit(
                    self.file,
                    origin.call,
                    f"`{short(origin.call)}` rounds the step's sample to {origin.dtype} and the rounded value is "
                    f"{sink}, but its log-prob came from the float32 sample; {_FIX}",
                )
        for target in _assigned_names(stmt):
            if target in bound:
                self.tainted[target] = bound[target]
            else:
                self.tainted.pop(target, None)

    def _record_step_bound(self, stmt: ast.stmt, loops: tuple) -> None:
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
            return
        if _is_step_call(_strip(stmt.value)):
            for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                first = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else target
                if isinstance(first, ast.Name):
                    self.step_bound[first.id] = loops[-1] if loops else None

    def _is_step_sample(self, subject: ast.AST, loops: tuple) -> bool:
        node = _strip(subject)
        if isinstance(node, ast.Call):
            return _is_step_call(node)
        name = last_name(node)
        if name is None:
            return False
        if name == "prev_sample" or _is_step_output_name(name):
            return True
        if isinstance(node, ast.Name) and name in self.step_bound:
            # bound in this loop (or in straight-line code): the step's output, not the loop's final result
            loop = self.step_bound[name]
            return loop is None or any(loop is outer for outer in loops)
        if not _is_sample_name(name):
            return False
        # A latents-like name inside a loop is the step's sample when the loop feeds it to a step call or binds
        # it from one (the conditioning latents of the same loop are not); inside a step function it always is.
        return self.step_function or (
            bool(loops)
            and isinstance(node, ast.Name)
            and (_passed_to_step(node.id, loops[-1]) or _bound_from_step(node.id, loops[-1]))
        )

    def _follow(self, node: ast.AST, origin: _Cast, loops: tuple) -> tuple[str | None, list[str]]:
        """Where the value of `node` goes: (the sink phrase or None, the names it is bound to)."""
        parents = self.file.parents
        path = [node]
        while True:
            parent = parents.get(node)
            if parent is None:
                return None, []
            carried = (
                isinstance(parent, (ast.Tuple, ast.List, ast.Set, ast.Starred, ast.keyword))
                or (isinstance(parent, ast.Dict) and node in parent.values)
                or (isinstance(parent, ast.IfExp) and node is not parent.test)
                or (isinstance(parent, ast.Subscript) and node is parent.value)
            )
            if isinstance(parent, ast.Attribute) and parent.attr in _PASSTHROUGH:
                call = parents.get(parent)
                if isinstance(call, ast.Call) and call.func is parent:
                    node = call
                    path.append(node)
                    continue
            if isinstance(parent, ast.Call) and node is not parent.func and _is_container_call(parent):
                carried = True
            if not carried:
                break
            node = parent
            path.append(node)
        at = self._where(parent, origin)
        if isinstance(parent, (ast.Return, ast.Yield, ast.YieldFrom)):
            return f"returned{at}", []
        if isinstance(parent, ast.Call) and node is not parent.func:
            func = parent.func
            if isinstance(func, ast.Attribute) and func.attr in _STORE_METHODS:
                return f"stored with `{short(func, 40)}(...)`{at}", []
            if _is_step_call(parent):
                return f"fed to `{short(func, 40)}(...)`{at}", []
            return None, []
        if isinstance(parent, (ast.Assign, ast.AnnAssign)) and node is parent.value:
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            names: list[str] = []
            for target in targets:
                for element in _matching_targets(target, path):
                    if isinstance(element, (ast.Subscript, ast.Attribute)):
                        return f"stored in `{short(element, 40)}`{at}", []
                    if isinstance(element, ast.Name):
                        names.append(element.id)
            for name in names:
                if loops and self._carried_by_loop(name, origin, loops[-1]):
                    return f"carried to the next step as `{name}`{at}", names
            return None, names
        return None, []

    def _carried_by_loop(self, name: str, origin: _Cast, loop: ast.stmt) -> bool:
        """A name the loop reads before it writes it (`latents = latents.to(dtype)` at the end of the body), or
        one it passes to a step call; not a forward's input rebuilt every iteration (`latent_model_input`)."""
        return _read_before_written(name, loop) or _passed_to_step(name, loop)

    def _where(self, node: ast.AST, origin: _Cast) -> str:
        line = getattr(self.file.statement_of(node), "lineno", None)
        return f" (line {line})" if line is not None and line != origin.call.lineno else ""


def _passed_to_step(name: str, loop: ast.stmt) -> bool:
    for node in ast.walk(loop):
        if _is_step_call(node):
            for arg in [*node.args, *(kw.value for kw in node.keywords)]:
                stripped = _strip(arg)
                if isinstance(stripped, ast.Name) and stripped.id == name:
                    return True
    return False


def _bound_from_step(name: str, loop: ast.stmt) -> bool:
    for node in ast.walk(loop):
        if (
            isinstance(node, (ast.Assign, ast.AnnAssign))
            and node.value is not None
            and _is_step_call(_strip(node.value))
        ):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                first = target.elts[0] if isinstance(target, (ast.Tuple, ast.List)) and target.elts else target
                if isinstance(first, ast.Name) and first.id == name:
                    return True
    return False


def _read_before_written(name: str, loop: ast.stmt) -> bool:
    """Whether the loop body reads `name` before it assigns it: a value carried from one iteration to the next
    (the loop's own target is rebound every iteration, so it is not)."""
    if isinstance(loop, (ast.For, ast.AsyncFor)) and name in bound_names(loop.target):
        return False
    for stmt, _ in iter_statements(loop.body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        reads = any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in own_nodes(stmt))
        if reads or (isinstance(stmt, ast.AugAssign) and name in bound_names(stmt.target)):
            return True
        if name in _assigned_names(stmt):
            return False
    return False


def _is_container_call(call: ast.Call) -> bool:
    name = last_name(call.func) or ""
    return name in _CONTAINER_CALLS or name[:1].isupper()


def _matching_targets(target: ast.AST, path: list[ast.AST]) -> list[ast.AST]:
    """The assignment targets a value reaches: element-wise for `a, b = x, y`."""
    if isinstance(target, (ast.Tuple, ast.List)) and len(path) >= 2:
        value = path[-1]
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
            index = next((i for i, elt in enumerate(value.elts) if elt is path[-2]), None)
            if index is not None:
                return [target.elts[index]]
        return []
    return [target]


def _assigned_names(stmt: ast.stmt) -> list[str]:
    targets: list[ast.AST] = []
    if isinstance(stmt, ast.Assign):
        targets = list(stmt.targets)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
        targets = [stmt.target]
    return [name for target in targets for name in bound_names(target)]
