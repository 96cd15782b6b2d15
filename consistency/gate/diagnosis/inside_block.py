# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Inside the first differing block: the submodule where the two sides part, and what differs in its state.

When the replay's first differing stage is a transformer block (``blocks.<i>``) or the model's output (every block
agreeing), [`look_inside`] looks once more at one forward per side — the earliest paired forward in which that
stage differs (`localise_replay`'s ``facts["first_pair"]``). Both sides are built afresh, as for the replay, and
re-run on the same batch from the RNG states their first run began with (the trainer on what the replayed
rollout returned), with hooks only on the modules of that block — for the first block or the output, also the
modules outside the blocks (embedders, final norm and projection) — and each side's run stops right after that
forward (a `BaseException` raised from its hook, so the user's ``except Exception`` lets it pass). The cost is one
model build per side and the forwards up to the one looked at, never a second pass over every block.

For every module run in that forward it records, at the row of the sample looked at: its state as it runs
(`module_state`: training flag, dropout, LoRA scaling / active adapters / merged, attention processor, parameter
dtype), and its inputs and outputs (a digest of their exact bytes, and a strided float64 sample of at most
`REGION_SAMPLE` values, for the size of a difference). The first module, in the order modules finish, whose inputs
agree bit for bit and whose outputs do not, is where the two computations part (its children all agree, or it
would not be first); the state differences at or under it name the cause (`module_state.CAUSES`).

The second look must be the same forward as the first: the recorded block output (or model output) of that row is
compared with the replay's, and where it differs (a side's code that does not re-run the same way) nothing is
claimed (``reproduced: False``).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .module_state import module_state, state_differences
from .replay import (
    BLOCK_SAMPLE,
    _row_sample,
    _rows,
    _watch_point,
    preserved_state,
    run_rollout,
    run_trainer,
    set_rng_state,
    watched_sides,
)
from .settings import DiagnosisSettings

#: Inputs and outputs keep at most this many values per module (strided) for the size of a difference; equality
#: is decided on a digest of every byte.
REGION_SAMPLE = 1 << 14


class _Seen(BaseException):
    """The forward looked at has been recorded: stop the side's run (not an error of the user's code)."""


@dataclass
class ModuleRecord:
    """One module's run inside the forward looked at, at the row looked at.

    Attributes:
        name: its name in the transformer (``#k`` appended for its k-th run when it runs more than once).
        state: `module_state` as it ran. inputs, outputs: ``(digest, float64 sample, values)`` of every tensor it
            was given / returned (``None``: no tensor). order: when it finished (children finish before parents).
    """

    name: str
    state: dict[str, Any]
    inputs: tuple[str, Any, int] | None = None
    outputs: tuple[str, Any, int] | None = None
    order: int = -1


@dataclass
class _Watch:
    """What one side's hooks saw: the module records, and the stage's value for the row (to check the re-run)."""

    records: dict[str, ModuleRecord] = field(default_factory=dict)
    stage_value: Any = None
    seen: bool = False


# ----------------------------------------------------------------------------------------------------
def look_inside(
    settings: DiagnosisSettings, batch_spec: Any, replay: Any, pair: Mapping[str, Any]
) -> dict[str, Any] | None:
    """Where inside `pair`'s stage the two sides part, and the state differences there (JSON-able facts).

    Args:
        settings, batch_spec: the check's `DiagnosisSettings` and the replayed batch (`replay_batch`).
        replay: the first replay (its rollout output and each side's starting RNG states).
        pair: ``{"stage": "blocks.<i>" | "output", "rollout": [call, row], "trainer": [call, row]}``.

    Returns ``None`` where there is nothing to look inside (no blocks watched, no rollout output kept).
    """
    import torch

    if replay.rollout_output is None or set(replay.rng) != {"rollout", "trainer"}:
        return None
    start = time.perf_counter()
    sides = watched_sides(settings)
    if isinstance(sides, str):
        return None
    backend, rollout_model, trainer_model = sides
    watches: dict[str, _Watch] = {}
    with preserved_state([rollout_model, trainer_model]), torch.no_grad():
        for label, model in (("rollout", rollout_model), ("trainer", trainer_model)):
            call, row = pair[label]
            set_rng_state(replay.rng[label])
            with _watch_region(model, pair["stage"], call, row) as watch:
                if watch is None:
                    return None
                with contextlib.suppress(_Seen):
                    if label == "rollout":
                        run_rollout(backend, batch_spec)
                    else:
                        run_trainer(backend, replay.rollout_output, settings)
            watches[label] = watch
    facts = compare_inside(watches["rollout"].records, watches["trainer"].records)
    facts["stage"] = pair["stage"]
    facts["reproduced"] = all(
        watches[label].seen and _same_value(watches[label].stage_value, _first_value(replay, label, pair))
        for label in ("rollout", "trainer")
    )
    facts["seconds"] = time.perf_counter() - start
    return facts


def compare_inside(rollout: Mapping[str, ModuleRecord], trainer: Mapping[str, ModuleRecord]) -> dict[str, Any]:
    """The first module (in the order modules finish) whose inputs agree and outputs differ, and the state
    differences at or under it and elsewhere among the modules both sides ran (JSON-able)."""
    names = [r.name for r in sorted(rollout.values(), key=lambda r: r.order) if r.name in trainer]
    first = None
    for name in names:
        a, b = rollout[name], trainer[name]
        if a.outputs is None or b.outputs is None or _agree(a.outputs, b.outputs):
            continue
        if _agree(a.inputs, b.inputs):
            first = name
            break
    located = None
    if first is not None:
        size, sampled = _size(rollout[first].outputs, trainer[first].outputs)
        located = {"module": first, "max_abs": size, "sampled": sampled, "values": rollout[first].outputs[2]}
    differences = state_differences(
        {n: rollout[n].state for n in names if "#" not in n}, {n: trainer[n].state for n in names if "#" not in n}
    )
    under = [d for d in differences if first is not None and _under(d.module, first)]
    # The module where the sides part first, then its descendants, nearest first.
    under.sort(key=lambda d: (d.module != first, d.module.count(".")))
    elsewhere = [d for d in differences if d not in under]
    return {
        "modules": len(names),
        "first": located,
        "states": {d.module: [rollout[d.module].state, trainer[d.module].state] for d in under},
        "differences": [{**d.to_dict(), "cause": d.cause} for d in under],
        "elsewhere": [{**d.to_dict(), "cause": d.cause} for d in elsewhere[:8]],
        "elsewhere_fields": {f: sum(d.field == f for d in elsewhere) for f in sorted({d.field for d in elsewhere})},
    }


# ----------------------------------------------------------------------------------------------------
def _region(core: Any, stage: str) -> list[tuple[str, Any]]:
    """The modules to watch for `stage`: block i's (``blocks.<i>``, numbered over every block list as the replay
    numbers them), and for the first block or the output also the modules outside the blocks."""
    blocks = _blocks_named(core)
    containers = {name for name, _ in core.named_children() if name.endswith("blocks")}
    if stage.startswith("blocks."):
        index = int(stage.split(".")[1])
        if index >= len(blocks):
            return []
        prefix, block = blocks[index]
        region = [(f"{prefix}.{n}" if n else prefix, m) for n, m in block.named_modules()]
        if index > 0:
            return region
    else:
        region = []
    outside = [
        (n, m) for n, m in core.named_modules() if n and n.split(".")[0] not in containers and n not in containers
    ]
    return outside + region


@contextlib.contextmanager
def _watch_region(model: Any, stage: str, call: int, row: int) -> Iterator[_Watch | None]:
    """Record the region's modules during forward `call` of `model`'s transformer, at `row`; stop after it."""
    import torch

    core, with_blocks = _watch_point(model)
    region = _region(core, stage) if with_blocks else []
    if not region:
        yield None
        return
    watch = _Watch()
    count, rows, finished, runs = [-1], [1], [0], {}
    block = dict(region).get(_block_name(core, stage)) if stage.startswith("blocks.") else None

    def active() -> bool:
        return count[0] == call and not watch.seen

    def core_before(_module, args, kwargs):
        count[0] += 1
        latents = kwargs.get("hidden_states", args[0] if args else None)
        rows[0] = int(latents.shape[0]) if isinstance(latents, torch.Tensor) and latents.dim() else 1

    def core_after(_module, _args, _kwargs, output):
        if not active():
            return
        if stage == "output":
            value = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
            sample = _rows(value)
            watch.stage_value = None if sample is None else sample[row]
        watch.seen = True
        raise _Seen

    def before(name):
        def hook(module, args, kwargs):
            if not active():
                return
            runs[name] = runs.get(name, 0) + 1
            key = name if runs[name] == 1 else f"{name}#{runs[name]}"
            watch.records[key] = ModuleRecord(key, module_state(module), _tensors((args, kwargs), rows[0], row))

        return hook

    def after(name):
        def hook(module, _args, _kwargs, output):
            if not active():
                return
            key = name if runs.get(name, 1) == 1 else f"{name}#{runs[name]}"
            record = watch.records.get(key)
            if record is not None and record.order < 0:
                record.outputs = _tensors(output, rows[0], row)
                finished[0] += 1
                record.order = finished[0]
            if module is block and watch.stage_value is None:
                sample = _row_sample(output, rows[0], BLOCK_SAMPLE)
                watch.stage_value = None if sample is None else sample[row]

        return hook

    handles = [
        core.register_forward_pre_hook(core_before, with_kwargs=True),
        core.register_forward_hook(core_after, with_kwargs=True),
    ]
    for name, module in region:
        handles.append(module.register_forward_pre_hook(before(name), with_kwargs=True))
        handles.append(module.register_forward_hook(after(name), with_kwargs=True))
    try:
        yield watch
    finally:
        for handle in handles:
            handle.remove()


def _blocks_named(core: Any) -> list[tuple[str, Any]]:
    """Every transformer block with its name, in the replay's numbering (``blocks.<i>`` over every block list)."""
    return [
        (f"{name}.{index}", block)
        for name, child in core.named_children()
        if name.endswith("blocks")
        for index, block in enumerate(child)
    ]


def _block_name(core: Any, stage: str) -> str | None:
    names = [name for name, _ in _blocks_named(core)]
    index = int(stage.split(".")[1])
    return names[index] if index < len(names) else None


def _tensors(value: Any, rows: int, row: int) -> tuple[str, Any, int] | None:
    """``(digest of every byte, strided float64 sample, number of values)`` of the tensors in `value` (nested
    tuples, lists, dicts), each at `row` where its first dimension is the forward's rows."""
    import torch

    found: list[Any] = []

    def walk(item: Any, depth: int) -> None:
        if isinstance(item, torch.Tensor):
            found.append(item[row] if item.dim() and item.shape[0] == rows else item)
        elif depth < 3 and isinstance(item, (tuple, list)):
            for part in item:
                walk(part, depth + 1)
        elif depth < 3 and isinstance(item, Mapping):
            for key in sorted(item, key=str):
                walk(item[key], depth + 1)

    walk(value, 0)
    if not found:
        return None
    digest = hashlib.blake2b(digest_size=16)
    parts = []
    for tensor in found:
        tensor = tensor.detach()
        digest.update(str(tensor.dtype).encode())  # not the shape: a row of (1, S, D) is the same as one of (S, D)
        flat = tensor.reshape(-1)
        if flat.numel():
            digest.update(flat.contiguous().view(torch.uint8).cpu().numpy().tobytes())
        parts.append((torch.view_as_real(flat) if flat.is_complex() else flat).reshape(-1).to("cpu", torch.float64))
    joined = torch.cat(parts)
    stride = max(1, -(-joined.numel() // REGION_SAMPLE))
    return digest.hexdigest(), joined[::stride], int(joined.numel())


def _agree(a: tuple[str, Any, int] | None, b: tuple[str, Any, int] | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a[0] == b[0]


def _size(a: tuple[str, Any, int], b: tuple[str, Any, int]) -> tuple[float, int]:
    """Max |Δ| over the two samples (``inf`` when their shapes differ), and how many values it was taken over."""
    x, y = a[1], b[1]
    if x.shape != y.shape:
        return float("inf"), 0
    diff = (x - y).abs().nan_to_num(0.0)
    return (float(diff.max()) if diff.numel() else 0.0), int(diff.numel())


def _under(module: str, ancestor: str) -> bool:
    return module == ancestor or module.startswith(f"{ancestor}.")


def _first_value(replay: Any, label: str, pair: Mapping[str, Any]) -> Any:
    """The replay's recorded value of the stage looked at, for that side's forward and row."""
    trace = replay.rollout if label == "rollout" else replay.trainer
    call, row = pair[label]
    if call >= len(trace.calls):
        return None
    recorded = trace.calls[call]
    if pair["stage"] == "output":
        return None if recorded.output is None else recorded.output[row]
    index = int(pair["stage"].split(".")[1])
    value = recorded.blocks[index] if index < len(recorded.blocks) else None
    return None if value is None else value[row]


def _same_value(a: Any, b: Any) -> bool:
    return a is not None and b is not None and a.shape == b.shape and bool((a == b).all())
