# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Whether two tables are one buffer: the ``distinct`` guard's test.

Two independently computed log-prob tables may be equal bit for bit (that is what the ``exact`` profile asks
for), so equal *values* prove nothing wrong. What proves that nothing was compared is *memory*: the same array
or tensor passed twice, a view of it, a NumPy array over a torch tensor's buffer, or a trainer that returns the
rollout's own tensor (verl's ``algorithm.rollout_correction.bypass_mode`` sets ``old_log_probs :=
rollout_log_probs``). [`shares_memory`] answers that from each object's address, shape and byte strides alone —
exactly, for any strided view, on any device (two tensors on different devices never share) — and never reads
the data. [`named_tensors`] lists the tensors inside a batch object (dicts, lists, dataclasses) so that a
trainer's output can be tested against every tensor of its input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["ALIASED_FIX", "named_tensors", "shares_memory"]

#: The fix every ``distinct`` failure names: the trainer must score the rollout's samples itself.
ALIASED_FIX = (
    "the trainer's table must be its own recomputation of the rollout's samples, not the rollout's stored "
    "log-probs (verl / verl-omni: algorithm.rollout_correction.bypass_mode=True sets old_log_probs := "
    "rollout_log_probs; turn it off so the actor recomputes old_log_probs)"
)

#: Bound on `np.shares_memory`'s exact search; beyond it the answer is "shares" (fail closed). Tables and
#: batch tensors are contiguous or simply strided: the search ends in a few steps.
_MAX_WORK = 1 << 20


def _layout(value: Any) -> tuple[str, int, tuple[int, ...], tuple[int, ...], int] | None:
    """(device, address of element 0, shape, byte strides, item size) of a tensor or array; None for anything
    else, an empty one, or one without addressable memory (sparse, meta)."""
    if isinstance(value, np.ndarray):
        if value.size == 0:
            return None
        return "cpu", int(value.__array_interface__["data"][0]), value.shape, value.strides, value.itemsize
    if hasattr(value, "data_ptr") and hasattr(value, "stride") and hasattr(value, "element_size"):
        try:
            address, itemsize = int(value.data_ptr()), int(value.element_size())
            strides = tuple(int(s) * itemsize for s in value.stride())
        except (RuntimeError, NotImplementedError):  # sparse or otherwise strideless tensors
            return None
        if address == 0 or value.numel() == 0:
            return None
        return str(value.device), address, tuple(value.shape), strides, itemsize
    return None


class _Extent:
    """A NumPy view of raw addresses (`__array_interface__`) whose bytes are never read: only `np.shares_memory`'s
    address arithmetic sees it."""

    def __init__(self, address: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> None:
        # One extra axis of the item's bytes, so that items of different sizes compare byte by byte.
        self.__array_interface__ = {
            "data": (address, True),
            "shape": (*shape, itemsize),
            "strides": (*strides, 1),
            "typestr": "|u1",
            "version": 3,
        }


def shares_memory(a: Any, b: Any) -> bool:
    """Whether arrays or tensors `a` and `b` have at least one byte of memory in common.

    The same object, a view, a transpose, a NumPy array over a CPU tensor (``t.numpy()``) all share; a copy
    (``t.clone()``, ``np.copy``) and two views of one buffer that touch no common element (``x[:, 0]`` and
    ``x[:, 1]``) do not. Tensors on different devices never share. Anything that is neither a NumPy array nor
    a tensor shares nothing.
    """
    if a is b and _layout(a) is not None:
        return True
    la, lb = _layout(a), _layout(b)
    if la is None or lb is None or la[0] != lb[0]:
        return False
    views = [np.asarray(_Extent(*layout[1:])) for layout in (la, lb)]
    try:
        return bool(np.shares_memory(views[0], views[1], max_work=_MAX_WORK))
    except np.exceptions.TooHardError:
        return True  # fail closed: a layout too tangled to decide is taken as shared


def named_tensors(value: Any, name: str = "batch", *, depth: int = 4) -> Iterator[tuple[str, Any]]:
    """``(path, tensor)`` for every tensor or array inside `value`: itself, the values of a mapping (or of an
    object with ``items()``, such as a TensorDict), the items of a list or tuple, the fields of a dataclass,
    down to `depth` levels (``batch['log_probs']``, ``batch.latents``)."""
    if _layout(value) is not None:
        yield name, value
        return
    if depth <= 0 or isinstance(value, (str, bytes)):
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from named_tensors(getattr(value, field.name, None), f"{name}.{field.name}", depth=depth - 1)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from named_tensors(item, f"{name}[{index}]", depth=depth - 1)
    elif callable(getattr(type(value), "items", None)):  # the type's: an object's __getattr__ may raise anything
        try:
            items = list(value.items())
        except Exception:  # an object whose items() wants arguments: not a mapping
            return
        for pair in items:
            if isinstance(pair, tuple) and len(pair) == 2:
                yield from named_tensors(pair[1], f"{name}[{pair[0]!r}]", depth=depth - 1)
