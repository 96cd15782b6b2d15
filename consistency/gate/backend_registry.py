# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The built-in backends by name: a backend is one module (its factory) plus one registration here.

``rollout_backend`` / ``trainer_backend`` name a registered backend, or a user's plug-in spec
(``"package.module:factory"`` or ``"file.py:factory"``, `rollout_consistency.gate.sides.plugins`). A
registration ([`BackendEntry`]) is everything the rest of the checker reads about a backend: the settings
check the name and the backend's own rules (`rollout_consistency.gate.config`), a worker builds the side
with its factory (`rollout_consistency.gate.sides.backends`), the command line lists the names and summaries
in its help, and a run without a ``profile`` gets the backend's default one.

The factory is named by a ``"package.module:function"`` spec and imported only when a worker starts, so this
module (and the settings that read it) imports nothing heavy. It is called once per worker as
``factory(config)`` — the check's `CheckConfig` — and returns the side (the built-in backends, which live in the
sides' layer below the check, take the sides' own settings instead: ``factory(settings)``, a
`rollout_consistency.gate.sides.settings.SidesSettings`; `BackendEntry.receives`):

* rollout: an object with ``in_process`` (True: it samples with the worker's own transformer, which the
  worker then loads; False: the engine holds its own copy of the weights) and
  ``rollout(backend, conditioning, requests, sampling) -> Trajectory`` (one planned batch, float32), as
  `rollout_consistency.gate.sides.torch_rollout` and `rollout_consistency.gate.sides.vllm_omni_rollout` do;
* trainer: ``recompute(backend, trajectory, kernel) -> (B, W) float32 numpy``, the log-prob of every stored
  window step (`rollout_consistency.gate.sides.trainer.torch_log_probs`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rollout_consistency.safeguards.object_spec import is_object_spec

__all__ = [
    "FACTORY_ARGUMENTS",
    "SIDES",
    "BackendEntry",
    "backend_names",
    "default_profile",
    "get_backend",
    "is_plugin_spec",
    "register_backend",
    "scoped_backends",
    "settings_problem",
    "unregister_backend",
]

SIDES: tuple[str, ...] = ("rollout", "trainer")
#: What a factory may receive (`BackendEntry.receives`): the check's `CheckConfig`, or the sides' `SidesSettings`.
FACTORY_ARGUMENTS: tuple[str, ...] = ("config", "sides")


@dataclass(frozen=True)
class BackendEntry:
    """One registered backend.

    Attributes:
        name: what ``rollout_backend`` / ``trainer_backend`` is set to (no colon: that marks a plug-in).
        side: ``"rollout"`` or ``"trainer"``.
        factory: ``"package.module:function"`` (importable as it is) or ``"path/to/file.py:function"``, building
            the side in a worker (see the module docstring).
        summary: one line for the command line's help (what it runs, what it needs).
        default_profile: the tolerance profile of a run that sets none (an engine with its own attention
            kernels: ``"kernel"``).
        check: ``check(config) -> str | None``: the one-line error naming the fix when the settings cannot
            run on this backend (None: they can). Called when a `CheckConfig` is built; reads nothing but the
            settings.
        receives: what the factory is called with: ``"config"``, the `CheckConfig` (a backend you register), or
            ``"sides"``, the sides' `SidesSettings` (the built-in backends).
    """

    name: str
    side: str
    factory: str
    summary: str
    default_profile: str = "exact"
    check: Callable[[Any], str | None] | None = None
    receives: str = "config"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or is_plugin_spec(self.name):
            raise ValueError(f"backend name {self.name!r}: use a non-empty name without ':' (a colon marks a plug-in).")
        if self.side not in SIDES:
            raise ValueError(f"backend {self.name!r}: side must be one of {', '.join(SIDES)}, got {self.side!r}.")
        if self.receives not in FACTORY_ARGUMENTS:
            raise ValueError(
                f"backend {self.name!r}: receives must be one of {', '.join(FACTORY_ARGUMENTS)}, got {self.receives!r}."
            )
        if not is_plugin_spec(self.factory):
            raise ValueError(
                f"backend {self.name!r}: factory must be a 'package.module:function' or 'file.py:function' spec, "
                f"got {self.factory!r}."
            )


# (side, name) -> entry, in registration order: the built-ins below, then any a process registers.
_REGISTRY: dict[tuple[str, str], BackendEntry] = {}


def is_plugin_spec(name: str | None) -> bool:
    """True for ``"package.module:factory"`` / ``"file.py:factory"`` (a registered backend's name has no colon)."""
    return is_object_spec(name)


def register_backend(entry: BackendEntry, *, replace: bool = False) -> BackendEntry:
    """Make `entry` a valid ``{side}_backend`` name in this process; returns it.

    Registering the same entry again is a no-op; another entry under a taken (side, name) is a ValueError unless
    `replace=True`. A Ray worker sees the built-in entries; one registered by your code needs the module that
    registers it imported there too.
    """
    if not isinstance(entry, BackendEntry):
        raise TypeError(f"register_backend takes a BackendEntry, got {type(entry).__name__}.")
    key = (entry.side, entry.name)
    known = _REGISTRY.get(key)
    if known is not None and known != entry and not replace:
        raise ValueError(
            f"a {entry.side} backend named {entry.name!r} is already registered; pick another name, or pass replace=True."
        )
    _REGISTRY[key] = entry
    return entry


@contextlib.contextmanager
def scoped_backends() -> Iterator[None]:
    """Registrations made inside the block are undone when it ends (tests, examples); the built-ins stay."""
    saved = dict(_REGISTRY)
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)


def unregister_backend(side: str, name: str) -> BackendEntry:
    """Remove the `side` backend `name` registered in this process (a test's or a plug-in's own entry); returns
    it. ValueError when none is registered under that name."""
    entry = get_backend(side, name)
    del _REGISTRY[(side, name)]
    return entry


def backend_names(side: str) -> tuple[str, ...]:
    """The registered backends of `side` (``"rollout"`` or ``"trainer"``), in registration order."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {', '.join(SIDES)}, got {side!r}.")
    return tuple(name for entry_side, name in _REGISTRY if entry_side == side)


def get_backend(side: str, name: str) -> BackendEntry:
    """The registered `side` backend `name`; ValueError naming the known ones."""
    entry = _REGISTRY.get((side, name))
    if entry is None:
        raise ValueError(
            f"{side}_backend {name!r} is not registered; expected one of {', '.join(backend_names(side))}, or a "
            f"plug-in 'package.module:factory'."
        )
    return entry


def default_profile(rollout_backend: str) -> str:
    """The profile a run without one gets: the rollout backend's default (a plug-in's: ``"exact"``)."""
    return "exact" if is_plugin_spec(rollout_backend) else get_backend("rollout", rollout_backend).default_profile


def settings_problem(config: Any) -> str | None:
    """The first registered backend's objection to `config` (a `CheckConfig` whose backend names are known)."""
    for side in SIDES:
        name = getattr(config, f"{side}_backend")
        check = None if is_plugin_spec(name) else get_backend(side, name).check
        problem = None if check is None else check(config)
        if problem:
            return problem
    return None


# ----------------------------------------------------------------------------------------------------
# The built-in backends: one registration each.
def _vllm_omni_settings(config: Any) -> str | None:
    if config.trajectory is not None:  # a dump needs no engine
        return None
    if config.device == "cpu":
        return "rollout_backend 'vllm-omni' needs CUDA: set device to 'cuda' (or 'auto')."
    if config.batch_invariant:
        return (
            "batch_invariant wraps the PyTorch adapters' transformer; the vLLM-omni engine batches in its own "
            "worker. Use rollout_backend 'torch' with --batch-invariant, or drop it."
        )
    if config.inject is not None:
        return "--inject reproduces stock behaviours inside the PyTorch adapters; use it with rollout_backend 'torch'."
    return None


register_backend(
    BackendEntry(
        name="torch",
        side="rollout",
        factory="rollout_consistency.gate.sides.torch_rollout:start",
        summary="the diffusers adapters in this process, request-level or step-wise",
        receives="sides",
    )
)
register_backend(
    BackendEntry(
        name="vllm-omni",
        side="rollout",
        factory="rollout_consistency.gate.sides.vllm_omni_rollout:start",
        summary="the vLLM-omni engine; needs the vllm extra and CUDA",
        default_profile="kernel",
        check=_vllm_omni_settings,
        receives="sides",
    )
)
register_backend(
    BackendEntry(
        name="torch",
        side="trainer",
        factory="rollout_consistency.gate.sides.trainer:start",
        summary="the PyTorch training adapter, recompute_log_probs",
        receives="sides",
    )
)
