# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Which linted files belong to one program: what a file reaches by the imports among the linted files.

A rollout worker and a trainer's actor are parts of one RL system when one imports the other, or both are
imported by a third linted file (verl's `fsdp_workers.py` imports `dp_actor` and `vllm_rollout`); a reward
model's training script and an OCR reward served by vLLM in the same repository are not, and neither are a
library's single-process DDPO trainer and its LLM vLLM client, though both import the library's helpers and
its tests import the whole library (trl). Imports are followed in their direction only, and a package's
`__init__` is not followed (it imports the whole package): a name imported from it leads to the module it
re-exports that name from. Imports are read
from the text (`import a.b`, `from a.b import c`, `from ..x import y`, indented ones too), not from a parsed
tree: the files are many, and most are never parsed.

An import names a linted file when the file's module path (its path components as linted, `.py` and
`__init__` dropped) ends with the imported module, and what comes before it can be an import root for the
importing file: the importing file's directory or one above it (a script's directory, the repository root,
`src/`), not itself a package. `from verl.workers.actor import dp_actor` links
`verl/workers/actor/dp_actor.py`; `import datasets` (the library) does not link `sft/configs/datasets/` when
`sft/configs/` is a package, and `import utils` in `service_a/app.py` does not link `service_b/utils.py`.

`unreached` asks the reverse question for `low-precision-latents`: which files no running program reaches,
going from the scripts through what they import (a dead copy of a sampler, as in Pref-GRPO and DanceGRPO-kontext),
what they spell in strings and what they load by names built at run time (`loads`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from .loads import config_names, file_loads, may_load, named_by

__all__ = ["import_edges", "is_entry", "programs", "unreached"]

# Statements that open a line (after blanks): `_line_starts` checks the line, so that each pattern opens with a
# word the regex engine searches for directly (`^[ \t]*from` is tried at every byte of every file).
_FROM = re.compile(rb"from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#;]*)")
_IMPORT = re.compile(rb"import[ \t]+([^\n#;]+)")
_REEXPORT = re.compile(rb"from[ \t]+(\.+)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#;]*)")


def programs(files: Sequence[tuple[str, tuple[str, ...]]], members: Iterable[str]) -> list[frozenset[str]]:
    """The programs `members` belong to: for each linted file that reaches a member by imports (the member
    itself included), the set of files it reaches. Two files are in one program when one reaches the other, or
    a third reaches both (verl's `fsdp_workers.py` imports `dp_actor` and `vllm_rollout`) — never because both
    import a common helper, nor through a package's `__init__` (`import trl` is the whole library, not a data
    flow): an import of a name from a package follows the package's re-export of that name to its module, and
    goes no further than the `__init__` otherwise. Larger programs first; none is a subset of another."""
    edges = import_edges(files)
    importers: dict[str, set[str]] = {path: set() for path, _ in files}
    for path, targets in edges.items():
        for target in targets:
            importers[target].add(path)
    ancestors: set[str] = set()
    stack = [m for m in members if m in importers]
    while stack:
        path = stack.pop()
        if path in ancestors:
            continue
        ancestors.add(path)
        stack.extend(importers[path])
    found: list[frozenset[str]] = []
    covered: set[str] = set()
    # roots first (files no linted file imports), then what cycles leave uncovered
    for path in sorted(ancestors, key=lambda p: (bool(importers[p]), p)):
        if path in covered:
            continue
        reached = _reach(path, edges)
        covered |= reached
        found.append(frozenset(reached))
    found.sort(key=len, reverse=True)
    kept: list[frozenset[str]] = []
    for program in found:
        if not any(program <= other for other in kept):
            kept.append(program)
    return kept


def _reach(start: str, edges: dict[str, set[str]]) -> set[str]:
    reached: set[str] = set()
    stack = [start]
    while stack:
        path = stack.pop()
        if path in reached:
            continue
        reached.add(path)
        stack.extend(edges.get(path, ()))
    return reached


def _is_init(path: str) -> bool:
    return path.replace("\\", "/").rsplit("/", 1)[-1] == "__init__.py"


def _modules(
    files: Sequence[tuple[str, tuple[str, ...]]],
) -> tuple[dict[str, tuple[str, ...]], set[tuple[str, ...]], dict[str, list[str]]]:
    """path -> module path, the packages (modules with an `__init__`), last component -> paths."""
    modules = {path: _module_of(parts) for path, parts in files}
    packages = {module for path, module in modules.items() if _is_init(path)}
    by_last: dict[str, list[str]] = {}
    for path, module in modules.items():
        if module:
            by_last.setdefault(module[-1], []).append(path)
    return modules, packages, by_last


def import_edges(
    files: Sequence[tuple[str, tuple[str, ...]]], importing: Iterable[str] | None = None
) -> dict[str, set[str]]:
    """path -> the linted files it imports, for the files of `importing` (default: all), read again here (a
    file that cannot be read imports nothing). An `__init__.py` imports nothing: it is a package's index; a
    name taken from it leads to the module that defines it."""
    modules, packages, by_last = _modules(files)
    wanted = set(modules) if importing is None else set(importing)
    texts = {path: _read(path) for path in modules if path in wanted or _is_init(path)}
    reexports = {path: _reexports(texts[path], modules[path]) for path in modules if _is_init(path)}
    edges: dict[str, set[str]] = {}
    for path in modules:
        if _is_init(path) or path not in wanted:
            continue
        targets = {other for other, _ in _targets(path, texts[path], modules, packages, by_last, reexports)}
        targets.discard(path)
        edges[path] = targets
    return edges


def _targets(
    path: str,
    data: bytes,
    modules: dict[str, tuple[str, ...]],
    packages: set[tuple[str, ...]],
    by_last: dict[str, list[str]],
    reexports: dict[str, dict[str, tuple[str, ...]]],
) -> Iterable[tuple[str, tuple[str, ...] | None]]:
    """(linted file, the import root it was found from; None for a relative import) for each import of `path`
    that names a linted file."""
    module = modules[path]
    package = module if _is_init(path) else module[:-1]
    roots = {package[:depth] for depth in range(len(package) + 1)} - packages
    for imported, names, relative in _imports(data, package):
        for other in _resolve(imported, by_last, modules, roots):
            root = None if relative else modules[other][: len(modules[other]) - len(imported)]
            yield other, root
            for name in names if _is_init(other) else ():
                yield from ((found, root) for found in _definition(name, other, reexports, by_last, modules))


def unreached(
    files: Sequence[tuple[str, tuple[str, ...]]], among: Iterable[str], entries: Iterable[str], running: Iterable[str]
) -> set[str]:
    """The files of `among` that no program among the linted files runs. A *program* is an entry point of
    `entries` (a file run as a script: `is_entry`) with what it imports, transitively — a package's `__init__`
    and what it imports included — a module whose path one of those files spells in a string
    (`importlib.import_module("pkg.mod")`, `"pkg.mod.Class"`), and a module loaded by a name built at run time
    as far as the text bounds it (`loads`: `import_module(f"pkg.rollout.{name}")` reaches every module under
    `pkg.rollout.`; a config file's `_target_: pkg.mod.Class` reaches `pkg.mod`). A file is answered only where
    a program is seen running the project's sampling or training — an entry point that reaches one of `running`
    (the files that compute log-probs) — and only below the directory that program's imports resolve from: a
    part of a project linted alone (no entry point, or none that runs what it holds) has no unreached file, its
    callers may be elsewhere. Nor has a repository (the files below one `owner+repo` directory, or the whole
    run) where a reached file loads a module by a name the text does not bound (`import_module(args.sampler)`):
    any of its files may run."""
    among, running = set(among), set(running)
    if not among:
        return set()
    modules, packages, by_last = _modules(files)
    inits = {module: path for path, module in modules.items() if _is_init(path)}
    texts: dict[str, bytes] = {}
    reexports = {path: _reexports(texts.setdefault(path, _read(path)), modules[path]) for path in inits.values()}
    edges: dict[str, list[tuple[str, tuple[str, ...] | None]]] = {}

    def imported_by(path: str) -> list[tuple[str, tuple[str, ...] | None]]:
        if path not in edges:
            data = texts.setdefault(path, _read(path))
            edges[path] = list(_targets(path, data, modules, packages, by_last, reexports))
            package = modules[path] if _is_init(path) else modules[path][:-1]
            edges[path] += [(inits[package[:d]], None) for d in range(1, len(package) + 1) if package[:d] in inits]
        return edges[path]

    # An import names a module by identifiers: a file below a directory that is none (`owner+repo`, trees
    # linted side by side, `rl-trees/`) is reached only from scripts below the same directory.
    bounds = {_bound(modules[path]) for path in among}
    entries = [path for path in entries if path in modules and any(modules[path][: len(b)] == b for b in bounds)]
    reached, _ = _reach_by(entries, imported_by)  # every program at once
    if among <= reached:
        return set()  # every file asked about runs
    # The programs that run sampling or training, by the directory their entry point's imports resolve from.
    live_roots: set[tuple[str, ...]] = set()
    for entry in entries:
        roots = [root for _, root in imported_by(entry) if root is not None]
        root = min(roots, key=len) if roots else None  # a script that imports no linted module by its full name
        if root is None or root in live_roots:  # says nothing
            continue
        if any(modules[path][: len(root)] == root for path in among - reached) and _reaches(
            entry, running, imported_by
        ):
            live_roots.add(root)
    if not live_roots:
        return set()
    # modules a config file names (hydra's `_target_`, an entry point), taken as reached: read only where a
    # file may be declared dead (`loads.config_names`)
    live = [(path, module) for path, module in modules.items() if any(module[: len(r)] == r for r in live_roots)]
    named = _config_named(files, live_roots, among - reached, live)
    unknown: set[tuple[str, ...]] = set()  # bounds where a reached file loads modules no text bounds
    # modules a reached file names in a string (`importlib.import_module("pkg.mod")`), and what they import
    tails = {
        ".".join(module[len(root) :]): path
        for path, module in modules.items()
        for root in live_roots
        if module[: len(root)] == root and len(module) > len(root) + 1
    }
    # a string can spell one only if it opens with its first component (`"fastvideo_edited.models...`)
    openings = {quote + tail.split(".", 1)[0].encode() for tail in tails for quote in (b'"', b"'")}
    fresh, loaded = set(reached), named
    while fresh or loaded:
        spelled = {
            tails.get(name)
            for path in fresh
            if any(opening in texts[path] for opening in openings)
            for name in _dotted_strings(texts[path])
        }
        # modules a reached file loads by a name built at run time (`import_module(f"pkg.models.{name}")`)
        for path in sorted(fresh):
            if may_load(texts[path]):
                bound = _bound(modules[path])
                found = file_loads(texts[path], modules[path], _is_init(path))
                if found.unknown:
                    unknown.add(bound)
                within = [(p, m) for p, m in modules.items() if m[: len(bound)] == bound]
                loaded |= named_by(found.names, found.prefixes, within)
        if () in unknown:
            return set()  # a load no text bounds, in a run with no directory no import can name: cannot tell
        seen, _ = _reach_by(sorted(spelled - {None} - reached | loaded - reached), imported_by)
        fresh, loaded = seen - reached, set()
        reached |= fresh
    return {
        path
        for path in among - reached
        if any(modules[path][: len(r)] == r for r in live_roots)
        and not any(modules[path][: len(b)] == b for b in unknown)
    }


def _config_named(
    files: Sequence[tuple[str, tuple[str, ...]]],
    live_roots: set[tuple[str, ...]],
    unreached_yet: set[str],
    live: list[tuple[str, tuple[str, ...]]],
) -> set[str]:
    """The files of `live` that the config files below a live root name (`loads.config_names`), for the live
    roots that hold a file of `unreached_yet` (the others declare nothing dead: their configs are not read)."""
    parts_of = dict(files)
    named: set[str] = set()
    for root in sorted(live_roots):
        below = sorted(path for path in unreached_yet if _module_of(parts_of[path])[: len(root)] == root)
        # the directory the root's modules are below: the file's path less its components past the root
        if not below:
            continue
        parts = parts_of[below[0]]
        directory = Path(below[0]).parents[len(parts) - len(root) - 1]
        within = [(path, module) for path, module in live if module[: len(root)] == root]
        named |= named_by(config_names(str(directory)), (), within)
    return named


def _bound(module: tuple[str, ...]) -> tuple[str, ...]:
    """The module path up to its deepest component that is not an identifier (no import can name it, so an
    importer of the module lies below it too); () when every component is one."""
    last = max((i for i, part in enumerate(module[:-1]) if not part.isidentifier()), default=-1)
    return module[: last + 1]


def _reaches(start: str, targets: set[str], imported_by: Callable[[str], list]) -> bool:
    """Whether `start` reaches one of `targets` by imports (a depth-first walk that stops at the first)."""
    seen: set[str] = set()
    stack = [start]
    while stack:
        path = stack.pop()
        if path in targets:
            return True
        if path not in seen:
            seen.add(path)
            stack.extend(other for other, _ in imported_by(path))
    return False


def _reach_by(starts: Iterable[str], imported_by: Callable[[str], list]) -> tuple[set[str], set[tuple[str, ...]]]:
    """The files `starts` reach by imports, and the import roots those imports resolved from."""
    seen: set[str] = set()
    roots: set[tuple[str, ...]] = set()
    stack = list(starts)
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        seen.add(path)
        for other, root in imported_by(path):
            if root is not None:
                roots.add(root)
            stack.append(other)
    return seen, roots


_DOTTED = re.compile(rb"""["']([A-Za-z_]\w*(?:[./][A-Za-z_]\w*)+)(?:\.py)?["']""")


def _dotted_strings(data: bytes) -> set[str]:
    """The module paths a text spells in strings (`"pkg.mod"`, `'pkg/mod.py'`), dotted, each also less its
    trailing components, down to two: a registry's `"pkg.rollout.sde.SDERollout"` (a class, a function after
    its module's path) names `pkg.rollout.sde`."""
    found: set[str] = set()
    for match in _DOTTED.findall(data):
        parts = match.decode("ascii", "replace").replace("/", ".").split(".")
        found.update(".".join(parts[:end]) for end in range(2, len(parts) + 1))
    return found


def is_entry(path: str, data: bytes) -> bool:
    """Whether a file runs as a script: `if __name__ == "__main__":`, a `__main__.py`, a loop at its top level
    (a script without the guard). A test module (`test_*.py`, `*_test.py`, `conftest.py`) is not one."""
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    if name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py":
        return False
    if name == "__main__.py":
        return True
    maybe = b"__main__" in data or b"\nfor " in data or b"\nwhile " in data or data.startswith((b"for ", b"while "))
    return maybe and _ENTRY.search(data) is not None


_ENTRY = re.compile(rb"^(?:if[ \t(]+__name__[ \t]*==|for[ \t]|while[ \t])", re.MULTILINE)


def _definition(
    name: str,
    init: str,
    reexports: dict[str, dict[str, tuple[str, ...]]],
    by_last: dict[str, list[str]],
    modules: dict[str, tuple[str, ...]],
) -> set[str]:
    """The linted modules a package's `__init__` takes `name` from, through the `__init__`s of subpackages
    (`from trl import DDPOTrainer` -> `trl/trainer/__init__.py` -> `trl/trainer/ddpo_trainer.py`)."""
    found: set[str] = set()
    pending, seen = [init], set()
    while pending:
        current = pending.pop()
        source = reexports.get(current, {}).get(name)
        if current in seen or source is None:
            continue
        seen.add(current)
        for module in _resolve(source, by_last, modules, {()}):  # `source` is the module's whole path
            if _is_init(module):
                pending.append(module)
            else:
                found.add(module)
    return found


def _reexports(data: bytes, package: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """name -> the module a package's `__init__` takes it from (`from .vllm_rollout import vLLMRollout`)."""
    found: dict[str, tuple[str, ...]] = {}
    for match in _line_starts(_REEXPORT, data):
        level = len(match.group(1))
        if level - 1 > len(package):
            continue
        base = (*package[: len(package) - (level - 1)], *_parts(match.group(2)))
        for name in _names(match.group(3)):
            found.setdefault(name, base)
    return found


def _parts(dotted: bytes) -> tuple[str, ...]:
    return tuple(part for part in dotted.decode("ascii", "replace").split(".") if part)


def _module_of(parts: tuple[str, ...]) -> tuple[str, ...]:
    if not parts:
        return ()
    *packages, name = parts
    name = name.removesuffix(".py")
    return tuple(packages) if name == "__init__" else (*packages, name)


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def _imports(data: bytes, package: tuple[str, ...]) -> Iterable[tuple[tuple[str, ...], tuple[str, ...], bool]]:
    """(module path, names taken from it, whether the import is relative) for each module an import of the file
    may name: for `from a.b import c`, (`a.b`, (c,)) and (`a.b.c`, ()) — `c` may be a submodule."""
    for match in _line_starts(_FROM, data):
        level = len(match.group(1))
        base = _parts(match.group(2))
        if level:
            if level - 1 > len(package):
                continue
            base = (*package[: len(package) - (level - 1)], *base)
        names = tuple(_names(match.group(3)))
        if base:
            yield base, names, bool(level)
        for name in names:
            yield (*base, name), (), bool(level)
    for match in _line_starts(_IMPORT, data):
        for name in match.group(1).decode("ascii", "replace").split(","):
            module = name.split(" as ")[0].strip()
            if module:
                yield tuple(module.split(".")), (), False


def _line_starts(pattern: re.Pattern[bytes], data: bytes) -> Iterator[re.Match[bytes]]:
    """The matches `pattern.finditer` would give with `^[ \t]*` before it under `re.MULTILINE`: those with only
    blanks between the line's start and theirs (a match ends on its statement's line or on a `)`, so what
    follows it on its line is never one)."""
    pos = 0
    while (match := pattern.search(data, pos)) is not None:
        start = match.start()
        if data[data.rfind(b"\n", 0, start) + 1 : start].strip(b" \t"):
            pos = start + 1  # inside a line: not a statement; a later match may still open one
            continue
        yield match
        pos = match.end()


def _names(listed: bytes) -> Iterable[str]:
    for item in listed.strip(b"()").decode("ascii", "replace").replace("\n", " ").split(","):
        name = item.split(" as ")[0].strip().strip("\\").strip()
        if name.isidentifier():
            yield name


def _resolve(
    imported: tuple[str, ...],
    by_last: dict[str, list[str]],
    modules: dict[str, tuple[str, ...]],
    roots: set[tuple[str, ...]],
) -> Iterable[str]:
    """The linted files `imported` may name from one of `roots` (the import roots of the importing file)."""
    for path in by_last.get(imported[-1], ()):
        module = modules[path]
        root = module[: len(module) - len(imported)]
        if len(module) >= len(imported) and module[len(root) :] == imported and root in roots:
            yield path
