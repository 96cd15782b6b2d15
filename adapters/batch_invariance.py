# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Batch-invariant mode: a sample's forward does not depend on its batch-mates, so neither do its bits.

[`batch_invariant`]`(transformer, family, rows_per_forward=1)` returns an `nn.Module` proxy with the
transformer's parameters, config and attributes whose forward never lets the batch decide a row's kernels.
Each row's inputs (the family's `row_inputs`, e.g. `hidden_states`, `encoder_hidden_states`, `timestep`,
Qwen-Image's per-sample lists `img_shapes` and `txt_seq_lens`) are gathered into fresh contiguous memory,
the transformer runs on forwards of a shape that depends on nothing but the row, and the outputs are put
back in batch order. Inputs not in `row_inputs` (FLUX's `img_ids` / `txt_ids`, `return_dict`) are passed to
every forward as they are. Two routes:

* **per-row** (`rows_per_forward=1`, the default, and the fallback): every row runs alone at batch 1. Its
  forward then has the same shapes, strides and input bits whatever its batch-mates, batch size,
  micro-batch size, position or step-wise arrival pattern, so every op inside it — GEMMs, attention,
  norms, whichever kernel MKL or cuBLAS picks for that shape — takes the same path. Right on any machine.
  Cost: B forwards of batch 1 instead of one of batch B.
* **fixed-shape** (`rows_per_forward=P > 1`): every forward holds exactly P rows — a batch is cut into
  chunks of P and the last chunk is padded with copies of its first row, whose outputs are dropped. The
  forward's shape is then fixed, but a row's bits still depend on its *position* among the P rows wherever
  a kernel treats rows at some offsets differently (MKL's AVX2 path does on the Intel Xeon measured in
  docs/performance.md; its AVX-512 path does not). So the proxy checks it where it runs: the first time it sees an input
  signature (per-row shapes and dtypes, which inputs are given, per-row list values, torch's thread count,
  grad and autocast mode) it runs two probe forwards — P copies of one row (every output row must be
  bit-identical: no position dependence) and that row last behind P-1 different rows (the call's other
  rows, or the row's own inputs times -1/2 when it has no others; its output must not change: no batch-mate
  dependence) — and takes the fixed-shape route for that signature only if both hold,
  the per-row route otherwise. The decision is cached per proxy ([`BatchInvariant.routes`]). Cost: one
  forward of P rows per chunk, plus the two probe forwards once per signature.

Why a row's forward rather than batch-invariant op overrides (GEMV per row, per-row SDPA): overriding ops one
by one covers only the ops one thinks of, and a new diffusers block brings new ones. The rest of a denoising
step is invariant already: CFG and the scheduler step are elementwise, the log-prob is a per-row reduction.

Guaranteed (same machine, same software, same model, same torch thread count): a sample's velocity,
trajectory and log-probs are bit identical whatever the batch composition around it, as long as its own
inputs are the same — including its text width: text padded to a width that depends on the batch-mates
changes the row's shapes (the step-wise path refuses that in this mode) — and both sides use the same
`rows_per_forward`. Not guaranteed: equality across machines or CPU/GPU types (each picks its own kernels),
across attention kernels, or between the two routes (a row's bits at batch 1 and inside a forward of P rows
differ). The fixed-shape route assumes what the probes cannot see: that the transformer's Python code does
not aggregate per-row inputs over the batch (rows with different per-row list values never share a forward)
and that kernel choice depends on shapes, not values; `exact` checks in this mode would show a breach.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .families import get_family

__all__ = ["ROUTE_FIXED_SHAPE", "ROUTE_PER_ROW", "BatchInvariant", "batch_invariant", "is_batch_invariant"]

#: Route names of [`BatchInvariant.routes`].
ROUTE_PER_ROW = "per-row"
ROUTE_FIXED_SHAPE = "fixed-shape"


def _rows_of(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() > 0 else None
    return len(value)


def _gather(value: Any, rows: Sequence[int], negate: Sequence[int] = ()) -> Any:
    """Rows `rows` of a batch-first input in fresh contiguous memory (lists: the picked entries).

    `negate`: positions (into `rows`) whose floating-point values are multiplied by -1/2 (exact in binary
    floating point) to make probe batch-mates that differ from the probed row in sign and size.
    """
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        return [value[b] for b in rows]
    if value.dim() == 0:
        return value
    picked = value.index_select(0, torch.tensor(rows, device=value.device)).contiguous()
    if negate and picked.is_floating_point():
        factor = torch.ones(len(rows), dtype=picked.dtype, device=picked.device)
        factor[list(negate)] = -0.5
        picked = picked * factor.view(-1, *([1] * (picked.dim() - 1)))
    return picked


def _map_tensors(output: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` applied to every tensor of a transformer output (a tensor, a tuple, or a diffusers `BaseOutput`)."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple):
        return tuple(_map_tensors(item, fn) for item in output)
    if isinstance(output, Mapping):
        return type(output)(**{key: _map_tensors(item, fn) for key, item in output.items()})
    raise TypeError(f"batch_invariant cannot split transformer outputs of type {type(output).__name__}.")


def _first_rows(output: Any, count: int) -> Any:
    """The first `count` rows of every tensor of a transformer output (the padding rows dropped)."""
    return _map_tensors(output, lambda tensor: tensor[:count])


def _leaves(output: Any) -> list[torch.Tensor]:
    """The tensors of a transformer output, in order."""
    if isinstance(output, torch.Tensor):
        return [output]
    items = output.values() if isinstance(output, Mapping) else output
    if not isinstance(output, (tuple, Mapping)):
        raise TypeError(f"batch_invariant cannot split transformer outputs of type {type(output).__name__}.")
    return [leaf for item in items for leaf in _leaves(item)]


def _concat(outputs: Sequence[Any]) -> Any:
    """Concatenate transformer outputs (tuples, diffusers `BaseOutput`s or tensors) along dim 0."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outputs))
    if isinstance(first, tuple):
        return tuple(_concat([o[i] for o in outputs]) for i in range(len(first)))
    if isinstance(first, Mapping):
        return type(first)(**{key: _concat([o[key] for o in outputs]) for key in first})
    raise TypeError(f"batch_invariant cannot concatenate transformer outputs of type {type(first).__name__}.")


class BatchInvariant(nn.Module):
    """A transformer whose rows' bits do not depend on their batch-mates (see the module docstring).

    Attributes:
        module: the wrapped transformer (its parameters are this proxy's parameters).
        row_inputs: the keyword inputs that are batch-first (tensors) or per-sample (lists).
        rows_per_forward: rows in every forward: 1 runs each row alone; P > 1 pads forwards to P rows where
            the probes show that this machine's kernels allow it.
    """

    def __init__(self, transformer: nn.Module, row_inputs: frozenset[str], rows_per_forward: int = 1):
        super().__init__()
        if isinstance(transformer, BatchInvariant):
            transformer = transformer.module
        if isinstance(rows_per_forward, bool) or not isinstance(rows_per_forward, int) or rows_per_forward < 1:
            raise ValueError(f"batch_invariant: rows_per_forward must be an integer >= 1, got {rows_per_forward!r}.")
        self.module = transformer
        self.row_inputs = frozenset(row_inputs)
        self.rows_per_forward = rows_per_forward
        self._routes: dict[Hashable, str] = {}

    def __getattr__(self, name: str) -> Any:
        # `config`, `dtype`, `device`, ...: the velocity functions read the transformer's attributes.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    @property
    def routes(self) -> dict[Hashable, str]:
        """The route taken for each input signature seen so far (a copy): `"fixed-shape"` or `"per-row"`."""
        return dict(self._routes)

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
        if self.rows_per_forward == 1:
            return _concat([self._run(kwargs, [b]) for b in range(batch)])

        pieces, order = [], []
        for signature, rows in self._groups(kwargs, batch).items():
            route = self._routes.get(signature)
            if route is None:
                route = ROUTE_FIXED_SHAPE if self._fixed_shape_is_invariant(kwargs, rows) else ROUTE_PER_ROW
                self._routes[signature] = route
            size = self.rows_per_forward if route == ROUTE_FIXED_SHAPE else 1
            for start in range(0, len(rows), size):
                real = rows[start : start + size]
                output = self._run(kwargs, real + [real[0]] * (size - len(real)))
                pieces.append(output if len(real) == size else _first_rows(output, len(real)))
                order.extend(real)
        output = pieces[0] if len(pieces) == 1 else _concat(pieces)
        if order != list(range(batch)):  # groups of different per-row list values: back to batch order
            inverse = torch.empty(batch, dtype=torch.long)
            inverse[torch.tensor(order)] = torch.arange(batch)
            output = _map_tensors(output, lambda t: t.index_select(0, inverse.to(t.device)))
        return output

    # ------------------------------------------------------------------------------------------------
    def _run(self, kwargs: Mapping[str, Any], rows: Sequence[int], negate: Sequence[int] = ()) -> Any:
        """One forward of the transformer on rows `rows` of the call (repeats allowed)."""
        picked = {k: (_gather(v, rows, negate) if k in self.row_inputs else v) for k, v in kwargs.items()}
        return self.module(**picked)

    def _groups(self, kwargs: Mapping[str, Any], batch: int) -> dict[Hashable, list[int]]:
        """The call's rows by input signature, in batch order. Rows whose per-row lists differ (e.g. two
        `img_shapes`) never share a forward: the transformer may read such lists batch-wide."""
        call = [torch.get_num_threads(), torch.is_grad_enabled()]
        for name in sorted(kwargs):
            value = kwargs[name]
            if isinstance(value, torch.Tensor):
                shape = value.shape[1:] if name in self.row_inputs and value.dim() > 0 else value.shape
                autocast = torch.is_autocast_enabled(value.device.type)
                call.append((name, tuple(shape), value.dtype, str(value.device), value.requires_grad, autocast))
            elif name in self.row_inputs and value is not None:
                continue  # a per-row list: part of each row's signature below
            else:
                call.append(
                    (name, value if value is None or isinstance(value, (bool, int, float, str)) else type(value))
                )
        lists = sorted(k for k in self.row_inputs if k in kwargs and _rows_of(kwargs[k]) is not None)
        lists = [k for k in lists if not isinstance(kwargs[k], torch.Tensor)]
        groups: dict[Hashable, list[int]] = {}
        for b in range(batch):
            signature = (tuple(call), tuple((k, repr(kwargs[k][b])) for k in lists))
            groups.setdefault(signature, []).append(b)
        return groups

    def _fixed_shape_is_invariant(self, kwargs: Mapping[str, Any], rows: Sequence[int]) -> bool:
        """Whether a row's output in a forward of `rows_per_forward` rows is the same at every position and
        with other batch-mates, probed on this call's own rows with this machine's kernels."""
        size, probed = self.rows_per_forward, rows[0]
        copies = _leaves(self._run(kwargs, [probed] * size))
        if not copies or any(t.dim() == 0 or t.shape[0] != size for t in copies):
            return False  # outputs that are not batch-first: nothing to compare row by row
        if not all(torch.equal(t[0], t[p]) for t in copies for p in range(1, size)):
            return False  # position dependence: identical rows came out different
        if len(rows) > 1:  # the probed row last, behind real batch-mates
            mates = [rows[1 + i % (len(rows) - 1)] for i in range(size - 1)]
            mixed = _leaves(self._run(kwargs, [*mates, probed]))
        else:  # a single row: batch-mates are its own inputs times -1/2
            mixed = _leaves(self._run(kwargs, [probed] * size, negate=range(size - 1)))
        return all(torch.equal(m[size - 1], c[0]) for m, c in zip(mixed, copies, strict=True))


def batch_invariant(transformer: nn.Module, family: Any, *, rows_per_forward: int = 1) -> BatchInvariant:
    """The batch-invariant proxy of `transformer` for `family` (a `ModelFamily` or its name).

    Use it wherever the transformer goes (rollout, step-wise, recompute), with the same `rows_per_forward` on
    both sides; the family's `row_inputs` say which inputs are split by row. `rows_per_forward=1` runs every
    row alone (right on any machine); `P > 1` runs forwards of exactly P rows wherever the probes show this
    machine's kernels give each row the same bits at any position (else it falls back to one row per
    forward). Wrapping a proxy again returns a proxy of the same transformer.
    """
    if isinstance(family, str):
        family = get_family(family)
    if not family.row_inputs:
        raise ValueError(f"Model family {family.name!r} declares no row_inputs: batch-invariant mode cannot split it.")
    return BatchInvariant(transformer, family.row_inputs, rows_per_forward)


def is_batch_invariant(transformer: nn.Module) -> bool:
    """Whether `transformer` is a [`BatchInvariant`] proxy."""
    return isinstance(transformer, BatchInvariant)
