# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Checks a trajectory must pass before the check re-scores it, so nothing in the file is silently ignored.

* [`check_explicit_family`]: a model family the user named must be the trajectory's (the check would
  otherwise re-score the file's family and PASS with only a note);
* [`unknown_family_options`]: ``family_options`` keys the built-in family does not read (a typo such as
  ``mask_txt_padding`` would otherwise fall back to the default and change what is recomputed).

Unknown top-level tensors are refused by `Trajectory.load` itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout_consistency.base.builtin_families import BUILTIN_FAMILIES, builtin_option_keys
from rollout_consistency.gate.config import ConfigError

__all__ = ["FAMILY_OPTION_KEYS", "check_explicit_family", "check_family_options", "unknown_family_options"]

#: The `family_options` keys each built-in family reads (`rollout_consistency.base.builtin_families`, its records).
FAMILY_OPTION_KEYS: Mapping[str, frozenset[str]] = {
    entry.name: entry.option_keys for entry in BUILTIN_FAMILIES.values()
}


def check_explicit_family(path: str, family: str | None) -> None:
    """Raise ConfigError when `family` (named by the user; None = not named) is not the file's family.

    Reads only the file's header; a damaged file is reported by the load that follows."""
    if family is None:
        return
    import json

    from rollout_consistency.adapters.trajectory import TrajectoryFormatError, read_header_metadata

    try:
        stored = json.loads(read_header_metadata(path).get("model_family", "null"))
    except (TrajectoryFormatError, ValueError, FileNotFoundError):
        return
    if stored is not None and stored != family:
        raise ConfigError(
            f"--model-family {family} but the trajectory {path} was written by a {stored!r} rollout; drop "
            f"--model-family (the file names its family) or check the right file."
        )


def unknown_family_options(model_family: str, options: Mapping[str, Any]) -> list[str]:
    """Keys of `options` the built-in family `model_family` does not read (empty for registered families)."""
    known = builtin_option_keys(model_family)
    return [] if known is None else sorted(set(options) - known)


def check_family_options(model_family: str, options: Mapping[str, Any], source: str) -> None:
    """Raise ConfigError naming the first family_options key the family does not read."""
    unknown = unknown_family_options(model_family, options)
    if unknown:
        raise ConfigError(
            f"--trajectory {source}: family_options key {unknown[0]!r} is not read by the {model_family!r} family "
            f"(it reads {', '.join(sorted(builtin_option_keys(model_family) or ()))}); fix the writer rather than let "
            f"the check ignore it."
        )
