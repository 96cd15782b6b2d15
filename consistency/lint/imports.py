# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Which linted files belong to one program: the groups of files linked by imports among them.

A rollout worker and a trainer's actor are parts of one RL system when one imports the other, or both are
imported by a third linted file (verl's `fsdp_workers.py` imports `dp_actor` and `vllm_rollout`); a reward
model's training script and an OCR reward served by vLLM in the same repository are not. Imports are read
from the text (`import a.b`, `from a.b import c`, `from ..x import y`, indented ones too), not from a parsed
tree: the files are many, and most are never parsed.

An import names a linted file when the file's module path (its path components as linted, `.py` and
`__init__` dropped) ends with the imported module, and what comes before it can be an import root for the
importing file: the importing file's directory or one above it (a script's directory, the repository root,
`src/`), not itself a package. `from verl.workers.actor import dp_actor` links
`verl/workers/actor/dp_actor.py`; `import datasets` (the library) does not link `sft/configs/datasets/` when
`sft/configs/` is a package, and `import utils` in `service_a/app.py` does not link `service_b/utils.py`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["linked_groups"]

_FROM = re.compile(rb"^[ \t]*from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#;]*)", re.MULTILINE)
_IMPORT = re.compile(rb"^[ \t]*import[ \t]+([^\n#;]+)", re.MULTILINE)


def linked_groups(files: Sequence[tuple[str, tuple[str, ...]]]) -> dict[str, int]:
    """path -> group number, for (path, path components) of every linted file (read again here: a file that
    cannot be read now links nothing)."""
    modules = {path: _module_of(parts) for path, parts in files}
    packages = {module for path, module in modules.items() if path.replace("\\", "/").endswith("/__init__.py")}
    by_last: dict[str, list[str]] = {}
    for path, module in modules.items():
        if module:
            by_last.setdefault(module[-1], []).append(path)
    parent = {path: path for path in modules}

    def find(path: str) -> str:
        while parent[path] != path:
            parent[path] = parent[parent[path]]
            path = parent[path]
        return path

    for path, module in modules.items():
        package = module if path.replace("\\", "/").endswith("/__init__.py") else module[:-1]
        roots = {package[:depth] for depth in range(len(package) + 1)} - packages
        for imported in _imported_modules(_read(path), package):
            for other in _resolve(imported, by_last, modules, roots):
                parent[find(other)] = find(path)
    roots: dict[str, int] = {}
    return {path: roots.setdefault(find(path), len(roots)) for path in modules}


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


def _imported_modules(data: bytes, package: tuple[str, ...]) -> Iterable[tuple[str, ...]]:
    """Module paths an import of the file may name: `a.b` and `a.b.c` for `from a.b import c`."""
    for match in _FROM.finditer(data):
        level = len(match.group(1))
        base = tuple(part for part in match.group(2).decode("ascii", "replace").split(".") if part)
        if level:
            if level - 1 > len(package):
                continue
            base = (*package[: len(package) - (level - 1)], *base)
        if base:
            yield base
        for name in _names(match.group(3)):
            yield (*base, name)
    for match in _IMPORT.finditer(data):
        for name in match.group(1).decode("ascii", "replace").split(","):
            module = name.split(" as ")[0].strip()
            if module:
                yield tuple(module.split("."))


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
