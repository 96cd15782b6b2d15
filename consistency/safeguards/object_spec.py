# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Load a Python object named by a `module:attribute` spec (used by the command line).

Specs look like `package.module:factory` (imported like any module, so the package must be
importable: installed, or under the current directory) or `path/to/file.py:factory` (loaded from the
file). The attribute part may be dotted (`module:Class.method`).

A file is imported **once per process**, with **its own folder importable** (put first on ``sys.path``, as
``python path/to/file.py`` does): two specs naming one file — a rollout and a trainer plug-in — get the same
module, so module-level state is shared, and the file may ``import`` its neighbours. It is imported under its
own name (``my_loop.py`` as ``my_loop``, so a neighbour's ``import my_loop`` gets the same module) unless that
name is taken by another module. The import is fenced (`rollout_consistency.safeguards.fence`): a ``sys.exit`` at the
module's top level is a usage error, not the end of the run.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_consistency.safeguards.fence import fenced
from rollout_consistency.safeguards.paths import special_kind

__all__ = ["SpecError", "call_with_supported_kwargs", "is_object_spec", "load_object", "spec_file", "spec_source"]


class SpecError(ValueError):
    """A spec that cannot be resolved; the message says what to fix."""


def is_object_spec(name: object) -> bool:
    """True for ``"package.module:factory"`` / ``"file.py:factory"``: a name with a colon (names the project
    registers, backends and weight syncs, have none)."""
    return isinstance(name, str) and ":" in name


def spec_file(spec: str) -> str | None:
    """The file part of a ``path/to/file.py:attr`` spec (as written: relative or absolute), ``None`` for a
    ``package.module:attr`` spec or a malformed one."""
    module_part, sep, attr_part = spec.rpartition(":")
    if not sep or not module_part or not attr_part:
        return None
    return module_part if _names_file(module_part) else None


def _names_file(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or "\\" in module_part


def load_object(spec: str, *, owner: str | None = None, timeout_s: float | None = None) -> Any:
    """Resolve `module:attr` or `file.py:attr` to the object it names.

    Args:
        spec: the spec.
        owner: who names it, for the fence's messages (default ``"spec '<spec>'"``).
        timeout_s: bound on the import (`rollout_consistency.safeguards.fence`; ``None``: unbounded).

    Raises:
        SpecError: malformed spec, module or file not importable (or a FIFO, a device), attribute missing.
        rollout_consistency.safeguards.fence.UserCodeError: the module's import raised SystemExit or overran `timeout_s`.
    """

    module_part, sep, attr_part = spec.rpartition(":")
    if not sep or not module_part or not attr_part:
        raise SpecError(f"spec {spec!r} must look like 'package.module:factory' or 'path/to/file.py:factory'")
    fence = fenced(owner or f"spec {spec!r}", f"import of {module_part}", timeout_s=timeout_s)
    if _names_file(module_part):
        module = _load_file(Path(module_part), spec, fence)
    else:
        # The current directory first, as `python -m` would: specs usually name the user's own code.
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            with fence:
                module = importlib.import_module(module_part)
        except ImportError as error:
            raise SpecError(
                f"cannot import {module_part!r} from spec {spec!r}: {error} (searched sys.path, the working "
                f"directory {Path.cwd()} first; a file is named 'path/to/file.py:{attr_part}')"
            ) from error
    value: Any = module
    for name in attr_part.split("."):
        try:
            value = getattr(value, name)
        except AttributeError as error:
            raise SpecError(f"{module_part!r} has no attribute {attr_part!r} (spec {spec!r})") from error
    return value


def spec_source(spec: str | None) -> str | None:
    """The source file a spec's module lives in, found without importing or running anything (None when the
    spec is not one, or its module is not found the way `load_object` would find it). Commands refuse to write a
    report over it (`rollout_consistency.safeguards.output_paths`)."""
    module_part = (spec or "").rpartition(":")[0]
    if not module_part:
        return None
    if _names_file(module_part):
        return module_part
    from importlib.machinery import PathFinder

    search: list[str] | None = [str(Path.cwd()), *sys.path]  # the current directory first, as load_object
    found = None
    names = module_part.split(".")
    for depth in range(1, len(names) + 1):
        name = ".".join(names[:depth])
        loaded = sys.modules.get(name)
        try:  # PathFinder looks in the given folders only: no parent package is imported, no code runs
            found = getattr(loaded, "__spec__", None) if loaded is not None else PathFinder.find_spec(name, search)
        except (ImportError, ValueError, OSError):
            return None
        if found is None:
            return None
        search = list(found.submodule_search_locations or [])
    origin = getattr(found, "origin", None)
    return origin if origin and Path(origin).is_file() else None


def _load_file(path: Path, spec: str, fence: Any) -> Any:
    kind = special_kind(path)
    if kind is not None:
        raise SpecError(f"file {str(path)!r} of spec {spec!r} is {kind}, not a Python file; name the .py file")
    if not path.is_file():
        # Say where a relative path was looked for: the working directory is rarely where users think it is.
        where = "" if path.is_absolute() else f" (looked for {Path.cwd() / path}: relative to the working directory)"
        raise SpecError(f"file {str(path)!r} of spec {spec!r} does not exist{where}")
    resolved = path.resolve()
    folder = str(resolved.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # its neighbours are importable, as for `python path/to/file.py`
    module_name = _module_name(resolved)
    loaded = sys.modules.get(module_name)
    if loaded is not None and _is_file_of(loaded, resolved):
        return loaded  # once per process: both sides of a check share the module's state
    file_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if file_spec is None or file_spec.loader is None:
        raise SpecError(f"cannot load {str(path)!r} as a Python module (spec {spec!r})")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        with fence:
            file_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)  # as a failed import does: a retry imports afresh
        raise
    return module


def _module_name(resolved: Path) -> str:
    """The file's own name when importing that name gives this file (or nothing yet), else a private one."""
    stem = resolved.stem
    if stem.isidentifier():
        loaded = sys.modules.get(stem)
        if loaded is not None:
            if _is_file_of(loaded, resolved):
                return stem
        else:
            try:
                found = importlib.util.find_spec(stem)
            except (ImportError, ValueError):
                found = None
            if found is not None and found.origin and Path(found.origin).resolve() == resolved:
                return stem
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    return f"_rollout_consistency_spec_{stem if stem.isidentifier() else 'file'}_{digest}"


def _is_file_of(module: Any, resolved: Path) -> bool:
    origin = getattr(module, "__file__", None)
    return origin is not None and Path(origin).resolve() == resolved


def call_with_supported_kwargs(
    factory: Callable[..., Any],
    *,
    optional: dict[str, Any] | None = None,
    required: dict[str, Any] | None = None,
    positional: tuple[Any, ...] = (),
) -> Any:
    """Call `factory` with `positional` arguments and keywords: `required` ones always, `optional` ones only if
    its signature takes them.

    Raises:
        SpecError: the factory does not accept one of the `required` keywords.
    """
    optional, required = dict(optional or {}), dict(required or {})
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no introspectable signature: pass only what was asked for
        return factory(*positional, **required)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    rejected = [name for name in required if not (takes_any or name in parameters)]
    if rejected:
        raise SpecError(
            f"{getattr(factory, '__qualname__', factory)} does not accept {', '.join(rejected)}; "
            f"its parameters are: {', '.join(parameters) or '(none)'}"
        )
    kwargs = {name: value for name, value in optional.items() if takes_any or name in parameters}
    kwargs.update(required)
    return factory(*positional, **kwargs)
