# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Small AST helpers the rules share: names, words of identifiers, statements in order."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping

__all__ = [
    "bound_names",
    "call_name",
    "children",
    "const",
    "dotted",
    "identifiers",
    "iter_statements",
    "keyword",
    "last_name",
    "nodes_in_order",
    "own_nodes",
    "short",
    "words",
]

_SCOPE_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_NO_VALUE = object()
_NESTED = (ast.stmt, ast.ExceptHandler, ast.match_case)
#: leaf nodes no rule looks at (`Load`, `Add`, `Eq`, ...): left out by `children`
_TOKENS = (ast.expr_context, ast.boolop, ast.operator, ast.unaryop, ast.cmpop)
#: their classes (`Load`, `Add`, ...), for a set lookup in place of an isinstance test on every field value
_TOKEN_CLASSES = frozenset(cls for base in _TOKENS for cls in base.__subclasses__())


def children(node: ast.AST) -> list[ast.AST]:
    """The child nodes of `node` in field order, without contexts and operators (`ast.iter_child_nodes`, faster:
    the lint walks every node of every file it parses)."""
    found = []
    for name in node._fields:
        value = getattr(node, name, None)
        if value.__class__ is list:
            for item in value:
                if item.__class__ not in _TOKEN_CLASSES and isinstance(item, ast.AST):
                    found.append(item)
        elif value.__class__ not in _TOKEN_CLASSES and isinstance(value, ast.AST):
            found.append(value)
    return found


def dotted(node: ast.AST, aliases: Mapping[str, str] | None = None) -> str | None:
    """`a.b.c` for a chain of attributes on a name (the name resolved through import `aliases`), else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id) if aliases else node.id)
    return ".".join(reversed(parts))


def last_name(node: ast.AST | None) -> str | None:
    """The identifier an expression ends with: `x` of `a.b.x`, `a.x(...)`, `a.x[i]`; a string subscript key
    (`batch["seed"]` -> `seed`); None for anything else."""
    while True:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            return node.attr
        if isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.isidentifier():
                return key.value
            node = node.value
        elif isinstance(node, ast.Starred):
            node = node.value
        else:
            return None


def call_name(call: ast.Call, aliases: Mapping[str, str] | None = None) -> str:
    """The dotted name of the called function (import aliases resolved), or its last identifier, or ''."""
    return dotted(call.func, aliases) or last_name(call.func) or ""


_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_SPLIT = re.compile(r"[^a-z0-9]+")


def words(identifier: str | None) -> frozenset[str]:
    """Lower-case words of an identifier or path: `prev_sample` -> {prev, sample},
    `ActorRolloutRefWorker` -> {actor, rollout, ref, worker}, `vllm-rollout.py` -> {vllm, rollout, py}."""
    if not identifier:
        return frozenset()
    return frozenset(w for w in _SPLIT.split(_CAMEL.sub("_", identifier).lower()) if w)


def bound_names(target: ast.AST) -> list[str]:
    """The plain names an assignment target binds: `a`, `a, (b, *c)`; not `x` of `x.attr =` / `x[i] =`."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in bound_names(element)]
    if isinstance(target, ast.Starred):
        return bound_names(target.value)
    return []


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def const(node: ast.AST | None, default: object = _NO_VALUE) -> object:
    """The value of a constant expression (`-1` included), else `default` (a private sentinel if not given)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        value = node.operand.value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value
    return default


def short(node: ast.AST, limit: int = 60) -> str:
    """Source text of a node for a message, shortened to `limit` characters."""
    try:
        text = " ".join(ast.unparse(node).split())
    except RecursionError:  # an expression nested deeper than `ast.unparse` can recurse
        text = f"<{type(node).__name__} at line {getattr(node, 'lineno', '?')}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def identifiers(node: ast.AST) -> Iterator[str]:
    """Every name, attribute name and identifier-like string constant inside `node`."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            yield sub.id
        elif isinstance(sub, ast.Attribute):
            yield sub.attr
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub.value


def iter_statements(body: list[ast.stmt], loops: tuple[ast.stmt, ...] = ()) -> Iterator[tuple[ast.stmt, tuple]]:
    """Statements of one scope in source order, with the loops (`for`/`while`) each one is inside.

    Nested function and class definitions are yielded but not entered (they are scopes of their own).
    """
    for stmt in body:
        yield stmt, loops
        if isinstance(stmt, _SCOPE_NODES):
            continue
        inner = (*loops, stmt) if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)) else loops
        for name, value in ast.iter_fields(stmt):
            if not isinstance(value, list):
                continue
            in_loop_body = name == "body"
            for item in value:
                if isinstance(item, ast.stmt):
                    yield from iter_statements([item], inner if in_loop_body else loops)
                elif isinstance(item, (ast.ExceptHandler, ast.match_case)):
                    yield from iter_statements(item.body, loops)


def own_nodes(stmt: ast.stmt) -> Iterator[ast.AST]:
    """The nodes of a statement itself in source order (a compound statement's header only), not entering
    nested statements or lambdas; contexts and operators left out."""
    yield stmt
    # `nodes_in_order` of each child in turn, on one stack (one generator per statement, not one per child)
    yield from _depth_first([child for child in reversed(children(stmt)) if not isinstance(child, _NESTED)])


def nodes_in_order(node: ast.AST) -> Iterator[ast.AST]:
    """`node` and its descendants in source order (depth first), not entering lambdas; contexts and operators
    left out.

    Iterative, so a long generated expression (`1 + 1 + ... + 1`) does not exhaust Python's recursion limit.
    """
    return _depth_first([node])


def _depth_first(stack: list[ast.AST]) -> Iterator[ast.AST]:
    """Pop `stack` (its last entry first) and each node's children in source order, not entering lambdas."""
    while stack:
        current = stack.pop()
        yield current
        found = children(current)
        if found:
            stack.extend(reversed([child for child in found if child.__class__ is not ast.Lambda]))
