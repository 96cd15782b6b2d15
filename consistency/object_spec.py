# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Load a Python object named by a `module:attribute` spec (used by the command line).

Specs look like `package.module:factory` (imported like any module, so the package must be
importable: installed, or under the current directory) or `path/to/file.py:factory` (loaded from the
file). The attribute part may be dotted (`module:Class.method`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["SpecError", "call_with_supported_kwargs", "load_object"]


class SpecError(ValueError):
    """A spec that cannot be resolved; the message says what to fix."""


def load_object(spec: str) -> Any:
    """Resolve `module:attr` or `file.py:attr` to the object it names.

    Raises:
        SpecError: malformed spec, module or file not importable, attribute missing.
    """
    module_part, sep, attr_part = spec.rpartition(":")
    if not sep or not module_part or not attr_part:
        raise SpecError(f"spec {spec!r} must look like 'package.module:factory' or 'path/to/file.py:factory'")
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        module = _load_file(Path(module_part), spec)
    else:
        # The current directory first, as `python -m` would: specs usually name the user's own code.
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(module_part)
        except ImportError as error:
            raise SpecError(f"cannot import {module_part!r} from spec {spec!r}: {error}") from error
    value: Any = module
    for name in attr_part.split("."):
        try:
            value = getattr(value, name)
        except AttributeError as error:
            raise SpecError(f"{module_part!r} has no attribute {attr_part!r} (spec {spec!r})") from error
    return value


def _load_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise SpecError(f"file {str(path)!r} of spec {spec!r} does not exist")
    module_name = f"_rollout_consistency_spec_{abs(hash(path.resolve()))}"
    file_spec = importlib.util.spec_from_file_location(module_name, path)
    if file_spec is None or file_spec.loader is None:
        raise SpecError(f"cannot load {str(path)!r} as a Python module (spec {spec!r})")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    file_spec.loader.exec_module(module)
    return module


def call_with_supported_kwargs(
    factory: Callable[..., Any], *, optional: dict[str, Any] | None = None, required: dict[str, Any] | None = None
) -> Any:
    """Call `factory` with keywords: `required` ones always, `optional` ones only if its signature takes them.

    Raises:
        SpecError: the factory does not accept one of the `required` keywords.
    """
    optional, required = dict(optional or {}), dict(required or {})
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no introspectable signature: pass only what was asked for
        return factory(**required)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    rejected = [name for name in required if not (takes_any or name in parameters)]
    if rejected:
        raise SpecError(
            f"{getattr(factory, '__qualname__', factory)} does not accept {', '.join(rejected)}; "
            f"its parameters are: {', '.join(parameters) or '(none)'}"
        )
    kwargs = {name: value for name, value in optional.items() if takes_any or name in parameters}
    kwargs.update(required)
    return factory(**kwargs)
