# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What the rollout produced, sealed before the trainer sees it: the check's half of the ``distinct`` guard.

A trainer is the user's code, and it runs in the rollout's process with the rollout's tensors at hand: it can
write its recomputation into the rollout's stored log-probs (``samples["log_probs"][:] = new``), change a tensor
the rollout stored that it kept a reference to, or return the rollout's own table. Each of those makes the
comparison vacuous. So, before the trainer runs, [`seal`] keeps private float32 copies of the two tables the
check compares (the rollout's log-probs and timesteps: what the report compares is what the rollout produced,
whatever happens later) and a digest of every tensor the rollout handed over; after it ran, [`seal_problems`]
names every tensor that changed, and [`aliased`] every one the trainer's output shares memory with
(`rollout_consistency.gate.judging.aliasing`). Both are ``distinct`` reasons (a FAIL that keeps the tables).

A digest is SHA-256 over the tensor's bytes up to 2**20 elements; for larger ones (a video's latents) a strided
sample of 2**16 elements plus the float64 sum and 2-norm, computed on the tensor's device, as
`plugins.weights_fingerprint` hashes weights (an in-place write that preserves the sample, the sum and the norm
would go unseen; no arithmetic update does).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_consistency.gate.judging.aliasing import ALIASED_FIX, named_tensors, shares_memory

from .shared import SharedTableError

__all__ = ["Seal", "aliased", "recompute_checked", "seal", "seal_problems", "tensor_digest", "value_bytes"]

_FULL_HASH_ELEMENTS = 1 << 20  # tensors up to this size are hashed byte for byte
_SAMPLED_ELEMENTS = 1 << 16  # larger ones: a strided sample of this many elements + float64 sum and norm


@dataclass(frozen=True)
class Seal:
    """The rollout's output as it was before the trainer ran.

    Attributes:
        log_probs, timesteps (`np.ndarray` `(n, W)` float32): private copies of the rollout's two tables.
        tensors: ``(path, tensor)`` of every tensor the rollout handed over (references, to test afterwards).
        digests: `tensor_digest` of each, in the same order.
    """

    log_probs: np.ndarray
    timesteps: np.ndarray
    tensors: tuple[tuple[str, Any], ...]
    digests: tuple[str, ...]


def seal(log_probs: Any, timesteps: Any, produced: Any, name: str) -> Seal:
    """Seal the rollout's output `produced` (a `Trajectory`, a `PluginRollout`: every tensor inside it) and take
    private copies of its `log_probs` and `timesteps` tables (`(n, W)` float32, torch or NumPy)."""
    tensors = tuple(named_tensors(produced, name))
    return Seal(_copy(log_probs), _copy(timesteps), tensors, tuple(tensor_digest(t) for _, t in tensors))


def seal_problems(sealed: Seal) -> list[str]:
    """``distinct`` reasons: the tensors the rollout stored that changed after the seal (the trainer wrote them)."""
    changed = [
        path
        for (path, tensor), digest in zip(sealed.tensors, sealed.digests, strict=True)
        if tensor_digest(tensor) != digest
    ]
    if not changed:
        return []
    shown = ", ".join(changed[:4]) + (", …" if len(changed) > 4 else "")
    return [
        f"the trainer changed what the rollout stored ({shown}) while it recomputed: a trainer that writes its "
        f"recomputation into the rollout's log-probs, or edits a rollout tensor it kept, leaves nothing to compare "
        f"in a training loop (the table shown is the rollout's, copied before the trainer ran); keep the rollout's "
        f"tensors read-only in the trainer and return a new table; {ALIASED_FIX}"
    ]


def aliased(output: Any, given: Any, name: str) -> list[str]:
    """``distinct`` reasons: the tensors inside `given` (what the trainer was handed, called `name`) whose memory
    `output` (the trainer's table, before any copy) shares."""
    shared = [path for path, tensor in named_tensors(given, name) if shares_memory(output, tensor)]
    if not shared:
        return []
    shown = ", ".join(shared[:4]) + (", …" if len(shared) > 4 else "")
    return [f"the trainer returned the memory of {shown}, not a table of its own: nothing was compared; {ALIASED_FIX}"]


def recompute_checked(backend: Any, batch: Any, kernel: str) -> tuple[np.ndarray, list[str]]:
    """The trainer's ``(n, W)`` table of `batch` under attention kernel `kernel` (`Backend.trainer_recompute`),
    and the ``distinct`` reasons when its output is memory of `batch` (a plug-in's raw output is tested inside
    `plugins.trainer_log_probs`; a registered backend's returned array here): the table is kept, to show."""
    try:
        table = backend.trainer_recompute(backend, batch, kernel)
    except SharedTableError as error:
        return error.table, [str(error)]
    return table, aliased(table, batch, "trajectory")


def tensor_digest(tensor: Any) -> str:
    """SHA-256 of a tensor's or array's dtype, shape and values (sampled beyond 2**20 elements: see the module
    docstring)."""
    import torch

    value = torch.from_numpy(np.ascontiguousarray(tensor)) if isinstance(tensor, np.ndarray) else tensor.detach()
    digest = hashlib.sha256(f"{value.dtype}|{tuple(value.shape)}".encode())
    digest.update(value_bytes(value)[0])
    return digest.hexdigest()


def value_bytes(tensor: Any) -> tuple[bytes, bool]:
    """(bytes standing for a tensor's values, whether they are all of them): every byte up to 2**20 elements;
    beyond, a strided sample of 2**16 elements plus the float64 sum (and 2-norm, for floating point) computed on
    the tensor's device, so that a large tensor is not copied to the host."""
    import torch

    with torch.no_grad():
        tensor = tensor.detach()
        count = tensor.numel()
        if count <= _FULL_HASH_ELEMENTS:
            return _host_bytes(tensor.reshape(-1)), True
        # A strided view (latents[:, :-1]) is read in place: reshaping it would copy it whole.
        whole = tensor.reshape(-1) if tensor.is_contiguous() else tensor
        picks = torch.arange(0, count, count // _SAMPLED_ELEMENTS, device=tensor.device)[:_SAMPLED_ELEMENTS]
        sample = whole[picks] if whole.dim() == 1 else whole[torch.unravel_index(picks, tuple(whole.shape))]
        sums = [torch.sum(whole, dtype=torch.float64)]
        if whole.is_floating_point():
            sums.append(torch.linalg.vector_norm(whole, dtype=torch.float64))
        return _host_bytes(sample) + _host_bytes(torch.stack(sums)), False


def _host_bytes(tensor: Any) -> bytes:
    import torch

    tensor = tensor.cpu().contiguous()
    if tensor.dtype == torch.bool:
        tensor = tensor.to(torch.uint8)
    return tensor.view(torch.uint8).numpy().tobytes()


def _copy(table: Any) -> np.ndarray:
    if hasattr(table, "detach"):
        table = table.detach().cpu().numpy()
    return np.array(table, copy=True)
