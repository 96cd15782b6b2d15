# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The modules a program loads by a name it builds at run time, as far as the text bounds them: for the
dead-copy question (`imports.unreached`), which must never take a module loaded that way for one no program
runs.

Two kinds of load:

- a call of `importlib.import_module` or `__import__` in a Python file. Its argument, read from the parsed
  call: a string constant names one module; a string built at run time with a constant head —
  `f"myproj.rollout.{cfg.name}"`, `"myproj.rollout." + name`, `"myproj.rollout.%s" % name`,
  `"myproj.rollout.{}".format(name)` — may name any module whose path opens with the head (a *prefix*). A name
  bound in the same function (or at the module's top level) only to string constants, directly or as the
  loop variable over a list of them (`for sub_dir in ["extensions", "extensions_built_in"]`), stands for those
  constants. A relative name (`"." + name`, with `package=__name__`, `__package__` or a constant) is taken
  from the file's package. Anything else — a variable from a caller or a config, a head that is not a
  constant — is a load no text bounds: the file *loads unknown modules*.
- a config file (`*.yaml`, `*.yml`, `*.json`, `*.toml`, `*.cfg`: hydra's `_target_`, `target:`,
  `class_path:`, a pyproject's entry points `pkg.cli:main`): every dotted name in its text is read as a module
  path, or a module's path followed by attributes (`myproj.rollout.sde.SDERollout`).

A name or prefix is matched against the path of a module from any directory above it (a program may put any
directory on `sys.path`), never across a directory no import can name (`owner+repo`: `imports._bound`).
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ["CONFIG_SUFFIXES", "SKIPPED_DIRECTORIES", "Loads", "config_names", "file_loads", "may_load", "named_by"]

#: directory names never entered when walking a directory (a path named explicitly is still linted)
SKIPPED_DIRECTORIES = ("__pycache__", "node_modules", "site-packages", "venv", "*.egg-info", ".*")

#: the config files whose dotted names count as loads
CONFIG_SUFFIXES = (".yaml", ".yml", ".json", ".toml", ".cfg")
#: a config file larger than this is data (a dataset's JSON, a state-dict key map), not a config: not read
_CONFIG_BYTES = 1 << 18
_LOADERS = ("import_module", "__import__")
#: a dotted name (`a.b`, `a.b.C`), or a word before `:attr` (an entry point's `cli:main`), not inside a path
_DOTTED_NAME = re.compile(
    r"(?<![\w.$/\\-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+|[A-Za-z_]\w*(?=:[A-Za-z_]))(:[A-Za-z_]\w*)?"
)
_LOADER_CALL = re.compile(rb"\b(?:import_module|__import__)\s*\(")


@dataclass(frozen=True)
class Loads:
    """What one file loads by names built at run time: `names`, whole module paths (dotted); `prefixes`, the
    constant heads of names built at run time (every module whose dotted path opens with one may be loaded);
    `unknown`, whether some load has no constant head (no module of its repository can be said not to be
    loaded)."""

    names: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    unknown: bool = False


def may_load(data: bytes) -> bool:
    """Whether a file's text may call a loader (`import_module(`, `__import__(`: a text test, most files call
    none, and only those that may are parsed)."""
    return (b"import_module" in data or b"__import__" in data) and _LOADER_CALL.search(data) is not None


def file_loads(data: bytes, module: tuple[str, ...], is_init: bool) -> Loads:
    """The loads of the file with text `data` and module path `module` (a package's `__init__`: `is_init`). A
    file that does not parse loads unknown modules (what it runs cannot be read)."""
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError, RecursionError):
        return Loads(unknown=True)
    package = module if is_init else module[:-1]
    names: list[str] = []
    prefixes: list[str] = []
    lines = {data.count(b"\n", 0, match.start()) + 1 for match in _LOADER_CALL.finditer(data)}
    for call, scope in _loader_calls(tree, lines):
        argument = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "name"), None)
        heads = _heads(argument, scope, tree) if argument is not None else None
        if not heads:
            return Loads(unknown=True)
        for text, exact in heads:
            if text.startswith("."):
                base = _relative_base(call, module, package, scope, tree)
                level = len(text) - len(text.lstrip("."))
                if base is None or level - 1 > len(base):
                    return Loads(unknown=True)
                text = ".".join((*base[: len(base) - (level - 1)], text[level:]))
            if not text or text == ".":
                return Loads(unknown=True)  # no constant head: any module
            (names if exact else prefixes).append(text)
    return Loads(tuple(names), tuple(prefixes))


def _loader_calls(tree: ast.Module, lines: set[int]) -> Iterator[tuple[ast.Call, ast.AST]]:
    """(call of a loader, the innermost function holding it, or the module), among the statements and
    expressions that span one of `lines` (those where the text calls a loader: the rest is not walked)."""
    stack: list[tuple[ast.AST, ast.AST]] = [(tree, tree)]
    while stack:
        node, scope = stack.pop()
        end = getattr(node, "end_lineno", None)
        if end is not None and not any(node.lineno <= line <= end for line in lines):
            continue
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in _LOADERS:
                yield node, scope
        inner = node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else scope
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def _heads(node: ast.AST, scope: ast.AST, tree: ast.Module) -> list[tuple[str, bool]] | None:
    """(text, whether it is the whole name) for each value `node` may take that opens with a constant; None
    where one does not (or is not a string)."""
    if isinstance(node, ast.Constant):
        return [(node.value, True)] if isinstance(node.value, str) else None
    if isinstance(node, ast.Name):
        values = _constants(node.id, scope, tree)
        return [(value, True) for value in values] if values else None
    if isinstance(node, ast.JoinedStr) and node.values:
        first, rest = node.values[0], node.values[1:]
        tail = rest[0].value if rest and isinstance(rest[0], ast.Constant) else ""
        if isinstance(first, ast.Constant):
            return [(first.value, not rest)]
        inner = _heads(first.value, scope, tree) if isinstance(first, ast.FormattedValue) else None
        if inner is None or first.format_spec is not None or first.conversion not in (-1, 115):
            return None
        return [(value + tail, exact and len(rest) == 1 and bool(tail)) for value, exact in inner]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _heads(node.left, scope, tree)
        return None if left is None else [(value, False) for value, _ in left]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant):
        text = node.left.value
        return [(text.split("%", 1)[0], False)] if isinstance(text, str) else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        template = node.func.value
        if isinstance(template, ast.Constant) and isinstance(template.value, str):
            return [(template.value.split("{", 1)[0], False)]
    return None


def _constants(name: str, scope: ast.AST, tree: ast.Module) -> list[str]:
    """The string constants `name` is bound to in `scope` (else at the module's top level), when every binding
    there is one: `name = "a"`, `for name in ("a", "b")`, `for name in folders` with `folders = ["a", "b"]`;
    [] otherwise."""
    for where in (scope, tree) if scope is not tree else (tree,):
        bindings = list(_bindings(name, where))
        if not bindings:
            continue
        values: list[str] = []
        for kind, value in bindings:
            found = _strings(value) if kind == "each" else _strings(ast.Tuple([value]))
            if kind == "each" and found is None and isinstance(value, ast.Name) and value.id != name:
                found = next((_strings(v) for k, v in _bindings(value.id, where) if k == "is"), None)
            if not found:
                return []
            values.extend(found)
        return values
    return []


def _bindings(name: str, scope: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """("is", value) for each `name = value` in `scope`, ("each", iterable) for each `for name in iterable`, and
    ("is", None) for any other binding (a parameter, an augmented assignment, a `with ... as name`)."""
    body = scope.body if isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)) else []
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        arguments = scope.args
        every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
        if any(argument is not None and argument.arg == name for argument in every):
            yield "is", None
    stack = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue  # another scope
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            yield "is", node.value
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) and _binds(node.target, name):
            yield ("each", node.iter) if isinstance(node.target, ast.Name) else ("is", None)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)) and _binds(node.target, name):
            yield "is", getattr(node, "value", None) if isinstance(node, ast.AnnAssign) else None
        elif isinstance(node, (ast.Assign, ast.withitem)) and any(
            _binds(t, name) for t in getattr(node, "targets", [getattr(node, "optional_vars", None)]) if t is not None
        ):
            yield "is", None  # unpacked, or `with ... as name`
        stack.extend(ast.iter_child_nodes(node))


def _binds(target: ast.AST, name: str) -> bool:
    return any(isinstance(node, ast.Name) and node.id == name for node in ast.walk(target))


def _strings(node: ast.AST | None) -> list[str] | None:
    """The items of a literal list, tuple or set of string constants; None for anything else."""
    if not isinstance(node, (ast.List, ast.Tuple, ast.Set)) or not node.elts:
        return None
    items = [e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None for e in node.elts]
    return None if None in items else items


def _relative_base(
    call: ast.Call, module: tuple[str, ...], package: tuple[str, ...], scope: ast.AST, tree: ast.Module
) -> tuple[str, ...] | None:
    """The package a relative name is resolved from: `package=` (or the second argument) — `__name__` (the file's
    module), `__package__` (its package) or a string constant; None for any other (`self.__name__`: a module
    the text does not name) or none."""
    argument = (
        call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "package"), None)
    )
    if isinstance(argument, ast.Name) and argument.id == "__package__":
        return package
    if isinstance(argument, ast.Name) and argument.id == "__name__":
        return module
    heads = _heads(argument, scope, tree) if argument is not None else None
    if heads and all(exact for _, exact in heads) and len(heads) == 1:
        return tuple(heads[0][0].split("."))
    return None


def config_names(directory: str) -> set[str]:
    """The dotted names in the config files below `directory` (`SKIPPED_DIRECTORIES` not entered; files over
    256 KiB not read): each name, with what it is once its trailing attributes are dropped
    (`a.b.C` -> `a.b.C`, `a.b`; `a.b:main` -> `a.b`). A single component counts only as `mod:attr` or before a
    capitalised attribute (`mod.Class`): a lone word is not a module path."""
    found: set[str] = set()
    stack = [directory]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as iterator:
                entries = list(iterator)
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    if not any(fnmatch.fnmatch(entry.name, skip) for skip in SKIPPED_DIRECTORIES):
                        stack.append(entry.path)
                elif entry.name.endswith(CONFIG_SUFFIXES) and entry.stat().st_size <= _CONFIG_BYTES:
                    with open(entry.path, "rb") as handle:
                        found |= _names_in(handle.read().decode("utf-8", "replace"))
            except OSError:
                continue
    return found


def _names_in(text: str) -> set[str]:
    found: set[str] = set()
    for match in _DOTTED_NAME.finditer(text):
        parts = match.group(1).split(".")
        if match.group(2):
            found.add(match.group(1))  # `pkg.cli:main`: the module is what precedes the colon
        for end in range(len(parts), 0, -1):
            if end >= 2 or (end == 1 and len(parts) > 1 and parts[1][:1].isupper()):
                found.add(".".join(parts[:end]))
    return found


def named_by(names: Iterable[str], prefixes: Iterable[str], modules: Iterable[tuple[str, tuple[str, ...]]]) -> set[str]:
    """The paths of `modules` ((path, module path) pairs) that one of `names` names, or whose dotted path opens
    with one of `prefixes`, the module's path taken from any directory above it."""
    names, prefixes = set(names), tuple(prefixes)
    found: set[str] = set()
    for path, module in modules:
        for start in range(len(module)):
            dotted = ".".join(module[start:])
            if dotted in names or (prefixes and dotted.startswith(prefixes)):
                found.add(path)
                break
    return found
