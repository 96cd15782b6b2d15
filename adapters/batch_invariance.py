# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Batch-invariant mode: every sample's forward runs alone, so its bits do not depend on its batch-mates.

[`batch_invariant`]`(transformer, family)` returns an `nn.Module` proxy with the transformer's parameters,
config and attributes whose forward splits the batch: each row's inputs (the family's `row_inputs`, e.g.
`hidden_states`, `encoder_hidden_states`, `timestep`, Qwen-Image's per-sample lists `img_shapes` and
`txt_seq_lens`) are cut to that row, copied to fresh contiguous memory, run through the transformer at
batch 1, and the B outputs are concatenated. Inputs not in `row_inputs` (FLUX's `img_ids` / `txt_ids`,
`return_dict`) are passed to every row as they are.

Why per-row forwards (and not batch-invariant op overrides): a row's forward then has the same shapes,
strides and input bits whatever its batch-mates, batch size, micro-batch size, position or step-wise arrival
pattern, so every op inside it — GEMMs, attention, convolutions, norms, whichever kernel MKL or cuBLAS picks
for that shape on this machine — takes the same path. Overriding ops one by one (GEMV per row, per-row SDPA)
covers only the ops one thinks of, and a new diffusers block brings new ones. The rest of a denoising step
is invariant already: CFG and the scheduler step are elementwise, the log-prob is a per-row reduction.

Guaranteed (same machine, same software, same model): a sample's velocity, trajectory and log-probs are bit
identical whatever the batch composition around it, as long as its own inputs are the same — including its
text width: text padded to a width that depends on the batch-mates changes the row's shapes (the step-wise
path refuses that in this mode). Not guaranteed: equality across machines or CPU/GPU types (each picks its
own kernels for the batch-1 shapes), or across attention kernels. Cost: B forwards of batch 1 instead of one
of batch B (see docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["BatchInvariant", "batch_invariant", "is_batch_invariant"]


def _row(value: Any, b: int) -> Any:
    """Row `b` of a batch-first input, as a batch of 1 in fresh contiguous memory (lists: `[value[b]]`)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value[b : b + 1].clone(memory_format=torch.contiguous_format)
    return [value[b]]


def _rows_of(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() > 0 else None
    return len(value)


def _concat(outputs: Sequence[Any]) -> Any:
    """Concatenate per-row transformer outputs (a tuple, a diffusers `BaseOutput`, or a tensor) along dim 0."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outputs))
    if isinstance(first, tuple):
        return tuple(_concat([o[i] for o in outputs]) for i in range(len(first)))
    if isinstance(first, Mapping):
        return type(first)(**{key: _concat([o[key] for o in outputs]) for key in first})
    raise TypeError(f"batch_invariant cannot concatenate transformer outputs of type {type(first).__name__}.")


class BatchInvariant(nn.Module):
    """A transformer whose forward runs each batch row alone (see the module docstring).

    Attributes:
        module: the wrapped transformer (its parameters are this proxy's parameters).
        row_inputs: the keyword inputs that are batch-first (tensors) or per-sample (lists).
    """

    def __init__(self, transformer: nn.Module, row_inputs: frozenset[str]):
        super().__init__()
        if isinstance(transformer, BatchInvariant):
            transformer = transformer.module
        self.module = transformer
        self.row_inputs = frozenset(row_inputs)

    def __getattr__(self, name: str) -> Any:
        # `config`, `dtype`, `device`, ...: the velocity functions read the transformer's attributes.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise TypeError("batch_invariant: pass the transformer's inputs by keyword (its rows are split by name).")
        sizes = {name: _rows_of(kwargs.get(name)) for name in self.row_inputs}
        sizes = {name: n for name, n in sizes.items() if n is not None}
        if not sizes:
            raise ValueError(f"batch_invariant: none of the per-row inputs {sorted(self.row_inputs)} was given.")
        if len(set(sizes.values())) != 1:
            raise ValueError(f"batch_invariant: per-row inputs have different batch sizes {sizes}.")
        batch = next(iter(sizes.values()))
        outputs = []
        for b in range(batch):
            row = {k: (_row(v, b) if k in self.row_inputs else v) for k, v in kwargs.items()}
            outputs.append(self.module(**row))
        return _concat(outputs)


def batch_invariant(transformer: nn.Module, family: Any) -> BatchInvariant:
    """The batch-invariant proxy of `transformer` for `family` (a `ModelFamily` or its name).

    Use it wherever the transformer goes (rollout, step-wise, recompute); the family's `row_inputs` say which
    inputs are split by row. Wrapping a proxy again returns a proxy of the same transformer.
    """
    if isinstance(family, str):
        from .families import get_family

        family = get_family(family)
    if not family.row_inputs:
        raise ValueError(f"Model family {family.name!r} declares no row_inputs: batch-invariant mode cannot split it.")
    return BatchInvariant(transformer, family.row_inputs)


def is_batch_invariant(transformer: nn.Module) -> bool:
    """Whether `transformer` is a [`BatchInvariant`] proxy."""
    return isinstance(transformer, BatchInvariant)
