# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Whether anything reads the log-probs a function returns: its callers among the linted files, followed
through the functions that pass the value on.

A sampler that rounds its latents beside float32 log-probs disagrees with a trainer only if a trainer reads
those log-probs. DiffusionNFT's `run_sampling` returns `latents, all_latents, all_log_probs`; its pipeline
binds `all_log_probs` and returns it; the trainer unpacks `images, latents, _ = pipeline_with_logprob(...)`:
no one reads them (negative-aware fine-tuning needs none), so the rounding there is not a finding.

A call site, per position of the returned tuple: *discarded* (bound to `_`-prefixed name, to a name never read,
a position its unpacking does not have, or the call is a statement of its own), *forwarded* (bound to a name
that the calling function only returns, at some positions: the question moves to that function's callers) or
*read* (anything else: a name used, an attribute, a single name bound to the whole tuple, an argument).

Callers are found by the function's name in the text of every linted file (the files are read again here, and
only the few that name and import the function are parsed), so a sampler that no linted file calls is taken as
read (its caller is elsewhere: a file linted alone), and so is a function whose name is one plain word (`step`,
`forward`, `__call__`: too common to tell its callers from others'), and a caller that passes the log-probs on
and that no linted file calls in turn (a trainer not linted, a `functools.partial`). A function in a file that
no running program of its repository reaches (`imports.unreached`: Pref-GRPO's unused copy of the DDPO step) is
read by no one, whatever its callers.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from .astutil import iter_statements, last_name, own_nodes, words
from .imports import import_edges, unreached
from .source import SourceFile, parse_source

__all__ = ["call_pattern", "resolvable", "unread_log_probs"]

_READ = "read"
_DISCARDED = "discarded"
#: a site's statuses: position -> _READ | _DISCARDED | ((path, the calling function), the positions it returns
#: the value at)
_Site = dict


def call_pattern(names: Iterable[str]) -> Callable[[bytes], bool]:
    """Whether a file's text calls one of `names` (`pipeline_with_logprob(`): a plain substring test first (most
    files name none of them), then the pattern."""
    encoded = [name.encode() for name in sorted(names)]
    pattern = re.compile(rb"\b(?:" + b"|".join(re.escape(n) for n in encoded) + rb")\s*\(")
    return lambda data: any(n in data for n in encoded) and pattern.search(data) is not None


def unread_log_probs(
    slots: Mapping[tuple[str, str], Sequence[int]],
    linted: Sequence[tuple[str, tuple[str, ...]]],
    naming: Mapping[str, bytes],
    programs: tuple[Sequence[str], Sequence[str]] = ((), ()),
) -> set[tuple[str, str]]:
    """The (path, function) keys of `slots` (-> the positions of the function's returned tuples that hold a
    log-prob) that some linted file calls, and whose log-prob positions none of their callers reads, directly
    or through a caller that returns them. A call counts where the calling file is the function's own or
    imports it (`imports.import_edges`): a function of the same name in another program is another function.
    `naming`: path -> text of the files that match `call_pattern` of the functions' names (the caller reads the
    files once for this and for other questions). `programs`: the linted files that run as scripts, and those
    that compute log-probs: a function in a file no program runs (`imports.unreached`: a dead copy) returns
    log-probs no one reads."""
    keys = {key for key in slots if resolvable(key[1])}
    if not keys:
        return set()
    sites = _call_sites(keys, linted, naming)
    unread = {
        key for key in keys if sites.get(key) and not any(_is_read(key, slot, sites, set()) for slot in slots[key])
    }
    rest = keys - unread  # read, or taken as read: unless no program runs them
    dead = unreached(linted, {path for path, _ in rest}, *programs) if rest else set()
    return unread | {key for key in rest if key[0] in dead}


def resolvable(name: str) -> bool:
    """A name specific enough to find its callers by: more than one word, not a dunder."""
    return len(words(name)) > 1 and not name.startswith("__")


def _is_read(key: tuple[str, str], slot: int, sites: Mapping[tuple[str, str], list[_Site]], seen: set[tuple]) -> bool:
    if (key, slot) in seen:
        return False
    seen.add((key, slot))
    if not resolvable(key[1]):
        return True  # a plain word (`step`, `__call__`): its callers cannot be told from others'
    calls = sites.get(key)
    if not calls:
        return True  # no caller in sight: its caller is elsewhere (a trainer not linted, an indirect call)
    for site in calls:
        status = site.get(slot, site.get("*", _DISCARDED))
        if status == _READ:
            return True
        if isinstance(status, tuple) and any(_is_read(status[0], j, sites, seen) for j in status[1]):
            return True
    return False


def _call_sites(
    keys: set[tuple[str, str]], linted: Sequence[tuple[str, tuple[str, ...]]], naming: Mapping[str, bytes]
) -> dict[tuple[str, str], list[_Site]]:
    """(path, function) -> the statuses of each of its call sites in the linted files, for `keys` and every
    function that forwards their values (found as they are met; their callers' files are read again)."""
    sites: dict[tuple[str, str], list[_Site]] = {}
    pending, done = set(keys), set()
    parts_of = dict(linted)
    texts = dict(naming)
    while pending - done:
        batch = pending - done
        names = {name for _, name in batch}
        if done:  # functions met on the way: find the files that name them
            calls = call_pattern(names)
            texts = {path: data for path, _ in linted if calls(data := _read(path))}
        done |= batch
        edges = import_edges(linted, list(texts))  # only the files that name a function
        defined_in = {key[0] for key in batch}
        for path, data in texts.items():
            if path not in defined_in and not defined_in & edges.get(path, set()):
                continue  # imports none of the functions' files: cannot call them
            parsed = parse_source(data, path, parts_of[path])
            if not isinstance(parsed, SourceFile):
                continue
            for name, site in _sites_in(parsed, names):
                for key in batch:
                    if key[1] == name and (key[0] == path or key[0] in edges.get(path, ())):
                        sites.setdefault(key, []).append(site)
                        pending.update(s[0] for s in site.values() if isinstance(s, tuple) and resolvable(s[0][1]))
    return sites


def _sites_in(file: SourceFile, names: set[str]) -> Iterable[tuple[str, _Site]]:
    for scope in (file.tree, *file.functions):
        text = file.text_of(scope) if scope is not file.tree else None
        if text is not None and not any(name in text for name in names):
            continue
        for stmt, _ in iter_statements(scope.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            nodes = file.own_nodes(stmt)
            indexed = {id(n.value): n for n in nodes if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Call)}
            for node in nodes:
                if isinstance(node, ast.Call) and last_name(node.func) in names:
                    yield last_name(node.func), _site(file.path, scope, stmt, node, indexed.get(id(node)))


def _site(path: str, scope: ast.AST, stmt: ast.stmt, call: ast.Call, subscript: ast.Subscript | None) -> _Site:
    if isinstance(stmt, ast.Expr) and stmt.value is call:
        return {"*": _DISCARDED}
    if subscript is not None:
        index = subscript.slice
        if isinstance(index, ast.Constant) and isinstance(index.value, int):
            return {index.value: _READ, "*": _DISCARDED}
        return {"*": _READ}
    if not (isinstance(stmt, ast.Assign) and stmt.value is call and len(stmt.targets) == 1):
        return {"*": _READ}
    target = stmt.targets[0]
    if not isinstance(target, (ast.Tuple, ast.List)) or any(isinstance(e, ast.Starred) for e in target.elts):
        return {"*": _READ}
    site: _Site = {"*": _DISCARDED}
    for index, element in enumerate(target.elts):
        site[index] = _name_status(path, scope, element.id) if isinstance(element, ast.Name) else _READ
    return site


def _name_status(path: str, scope: ast.AST, name: str, depth: int = 0) -> str | tuple[str, tuple[int, ...]]:
    """What the calling scope does with `name`: discards it, only returns it (at these positions, also through a
    local list it is appended to: `all_log_probs.append(log_prob)`), or reads it."""
    if name.startswith("_"):
        return _DISCARDED
    returned: set[int] = set()
    for stmt, _ in iter_statements(scope.body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        elements = stmt.value.elts if isinstance(stmt, ast.Return) and isinstance(stmt.value, ast.Tuple) else None
        for node in own_nodes(stmt):
            if not (isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)):
                continue
            index = next((i for i, e in enumerate(elements or ()) if e is node), None)
            if index is not None:
                returned.add(index)
                continue
            if _collects(stmt, node):
                continue  # `all_log_probs.append(...)`: the list filled, not read
            collected = _appended_to(stmt, node)
            if collected is None or depth > 2:
                return _READ
            status = _name_status(path, scope, collected, depth + 1)
            if status == _READ or (isinstance(status, tuple) and status[0] != (path, getattr(scope, "name", ""))):
                return _READ
            if isinstance(status, tuple):
                returned.update(status[1])
    if not returned:
        return _DISCARDED
    if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _READ
    return ((path, scope.name), tuple(sorted(returned)))


def _collects(stmt: ast.stmt, node: ast.Name) -> bool:
    """Whether `node` is the list `stmt` appends to (`node.append(...)` as a statement)."""
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr in ("append", "extend")
        and call.func.value is node
    )


def _appended_to(stmt: ast.stmt, node: ast.Name) -> str | None:
    """`all_log_probs` when `stmt` is `all_log_probs.append(node)` (a local list collecting it), else None."""
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    if (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr in ("append", "extend")
        and isinstance(call.func.value, ast.Name)
        and call.args
        and call.args[0] is node
    ):
        return call.func.value.id
    return None


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""
