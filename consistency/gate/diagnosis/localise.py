# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Differential localisation: replay one stored rollout through both sides and name the first stage where
they part.

Where both sides' code is at hand (the built-in backends, or a user's own two velocity functions), the
doctor (`rollout_consistency.gate.diagnosis.doctor`) does not have to guess from the figures. [`localise`] replays every
stored window step of a trajectory through each side, as that side computes it (its model, attention
kernel, rows per forward, settings, velocity function), and records every stage:

==========================  ===============================================================================
``weights``                 the two models' parameters (same dtype only)
``inputs.<name>``           what each side feeds the transformer: latents, timestep, conditioning, text mask,
                            text lengths (``txt_seq_lens``), guidance, pooled text
``rope``                    the rotary tables the first block receives (text/image RoPE)
``embed``                   the first block's inputs (after the input projections and time embedding)
``blocks.<i>``              each transformer block's output (forward hooks)
``velocity``                the velocity after CFG, float32
``transition.mean/std``     the SDE transition each side scores under
``scored_sample``           the sample each side scores: the rollout its own draw (re-drawn from its
                            seeded generators), the trainer the stored ``latents[:, k+1]``
``log_prob``                the log-prob
==========================  ===============================================================================

The first stage with any difference is where the two computations part; its size (max |Δ| and relative
to the stage's magnitude) says whether it is rounding or a different computation. The replay of the
rollout side must reproduce the stored log-probs (``replay_max_abs``): that is how a user knows the replay
is faithful. Settings that differ between the sides are listed as well (``settings``).

Shapes: stage tensors are per row ``(B, ...)``, held as float64 on the CPU for comparison.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .settings import DiagnosisSettings

#: Model-input keyword names, by stage (the names diffusers' and vLLM-omni's transformers take).
INPUT_STAGES: tuple[tuple[str, str], ...] = (
    ("inputs.latents", "hidden_states"),
    ("inputs.timestep", "timestep"),
    ("inputs.conditioning", "encoder_hidden_states"),
    ("inputs.text_mask", "encoder_hidden_states_mask"),
    ("inputs.text_lengths", "txt_seq_lens"),
    ("inputs.guidance", "guidance"),
    ("inputs.pooled", "pooled_projections"),
)
STEP_STAGES: tuple[str, ...] = ("velocity", "transition.mean", "transition.std", "scored_sample", "log_prob")


@dataclass(frozen=True)
class SideSpec:
    """How one side computes a stored step. ``None`` fields take the trajectory's value.

    Attributes:
        label: ``"rollout"`` or ``"trainer"``.
        model: the side's transformer (any dtype).
        attention: diffusers attention backend name for its forwards.
        rows_per_forward: rows per forward (the rollout's batch, the trainer's micro-batch); ``None`` = all.
        guidance_scale, noise_level, sde_type, include_normalizer, options: the settings it computes with.
        velocity: the side's velocity function (default: the family's).
        draws_sample: score the side's own draw (re-drawn from the per-sample seeded generators: what a
            rollout scores) instead of the stored next latent (what a trainer scores).
    """

    label: str
    model: Any
    attention: str = "native"
    rows_per_forward: int | None = None
    guidance_scale: float | None = None
    noise_level: float | None = None
    sde_type: str | None = None
    include_normalizer: bool | None = None
    options: Mapping[str, Any] | None = None
    velocity: Callable[..., Any] | None = None
    draws_sample: bool = False


@dataclass(frozen=True)
class StageDiff:
    """One stage's difference: max |rollout − trainer| over rows and steps, relative to the stage's scale.

    ``max_abs`` is ``inf`` when the shapes differ (``detail`` says how); ``step``/``row`` locate the worst entry.
    """

    stage: str
    max_abs: float
    relative: float
    step: int | None = None
    row: int | None = None
    detail: str = ""

    @property
    def differs(self) -> bool:
        return self.max_abs != 0 or bool(self.detail)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass(frozen=True)
class Localisation:
    """The result of [`localise`].

    Attributes:
        stages: every stage compared, in computation order.
        first_stage: the first stage that differs (``None``: the replays agree bit for bit).
        settings: ``(name, rollout value, trainer value)`` for each setting the sides differ in.
        replay_max_abs: max |replayed rollout log-prob − stored log-prob| (0: the replay is faithful).
        rows: how many rows were replayed; samples: their global sample indices.
        facts: what a replay of the sides' own code measured besides the stages (JSON-able; `localise_replay`):
            ``forwards`` (rows per forward, each side), ``passes`` (forwards per sample and step), ``rounded``
            (which side's differing input holds only bf16 values), ``timestep_neighbour`` (a side's timestep is
            exactly another step's), ``misaligned`` (text conditioning of another sample), ``step_fit`` (the
            step settings that reproduce each side's log-probs), ``replay`` (its faithfulness), ``seconds``;
            where the first differing stage is a block or the output, ``first_pair`` (the earliest paired forwards
            where it differs) and ``inside`` (the submodule where the sides part and its state differences:
            `rollout_consistency.gate.diagnosis.inside_block`).
    """

    stages: tuple[StageDiff, ...]
    settings: tuple[tuple[str, str, str], ...] = ()
    replay_max_abs: float = 0.0
    rows: int = 0
    samples: tuple[int, ...] = ()
    facts: Mapping[str, Any] = field(default_factory=dict)

    @property
    def first(self) -> StageDiff | None:
        return next((s for s in self.stages if s.differs), None)

    @property
    def first_stage(self) -> str | None:
        first = self.first
        return None if first is None else first.stage

    def setting_names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.settings)

    def describe(self) -> str:
        first = self.first
        where = "no stage differs: the two replays agree bit for bit"
        if self.facts:
            where = (
                f"no stage differs: all {self.facts.get('compared_forwards', 0)} paired forwards of the two sides "
                f"agree bit for bit, inputs to output"
            )
        if first is not None:
            size = first.detail or f"max |Δ| {first.max_abs:.3g} ({first.relative:.3g} of its scale)"
            at = "" if first.step is None else f" at window step {first.step}, row {first.row}"
            where = f"first differing stage: {first.stage}{at}, {size}"
        settings = "; settings differ: " + ", ".join(f"{n} {a} vs {b}" for n, a, b in self.settings)
        return where + (settings if self.settings else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "first_stage": self.first_stage,
            "stages": [s.to_dict() for s in self.stages],
            "settings": [list(s) for s in self.settings],
            "replay_max_abs": self.replay_max_abs,
            "rows": self.rows,
            "samples": list(self.samples),
            "facts": dict(self.facts),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Localisation:
        return cls(
            stages=tuple(StageDiff(**s) for s in data.get("stages", ())),
            settings=tuple(tuple(s) for s in data.get("settings", ())),
            replay_max_abs=float(data.get("replay_max_abs", 0.0)),
            rows=int(data.get("rows", 0)),
            samples=tuple(data.get("samples", ())),
            facts=dict(data.get("facts", {})),
        )


# ----------------------------------------------------------------------------------------------------
def localise(trajectory: Any, rollout: SideSpec, trainer: SideSpec, *, samples: Sequence[int] = ()) -> Localisation:
    """Replay every stored window step of `trajectory` through both sides and compare stage by stage.

    Args:
        trajectory: a `rollout_consistency.adapters.Trajectory` (float32) as the rollout stored it.
        rollout, trainer: how each side computes (see [`SideSpec`]).
        samples: the rows' global sample indices (for the report only).
    """
    import torch

    from rollout_consistency.adapters import get_family

    family = get_family(trajectory.model_family)
    with torch.no_grad():
        traces = [_trace_side(family, trajectory, side) for side in (rollout, trainer)]
        weights = _weights_diff(rollout.model, trainer.model)
    stored = trajectory.log_probs.detach().double().cpu()
    replayed = torch.cat([column.reshape(-1, 1) for column in traces[0]["log_prob"]], dim=1)
    replay = (replayed - stored).abs()
    order = _stage_order(traces)
    stages = [weights] if weights is not None else []
    stages += [_compare(name, traces[0].get(name), traces[1].get(name)) for name in order]
    return Localisation(
        stages=tuple(stages),
        settings=_settings_diff(trajectory, rollout, trainer),
        replay_max_abs=float(replay.max()) if replay.numel() else 0.0,
        rows=trajectory.batch_size,
        samples=tuple(samples),
    )


def _trace_side(family: Any, trajectory: Any, side: SideSpec) -> dict[str, Any]:
    """Every stage of every stored step as this side computes it: ``{stage: (B, W, ...) float64}``."""

    from rollout_consistency.adapters import make_generators
    from rollout_consistency.gate.sides.shared import attention

    batch, width = trajectory.batch_size, trajectory.window_size
    rows = side.rows_per_forward or batch
    options = dict(trajectory.family_options if side.options is None else side.options)
    guidance = trajectory.guidance_scale if side.guidance_scale is None else side.guidance_scale
    noise_level = trajectory.noise_level if side.noise_level is None else side.noise_level
    sde_type = trajectory.sde_type if side.sde_type is None else side.sde_type
    normalizer = trajectory.include_normalizer if side.include_normalizer is None else side.include_normalizer
    velocity_fn = side.velocity or family.velocity
    scheduler = trajectory.scheduler.scheduler()
    generators = None
    if side.draws_sample:
        # The rollout's own draws: initial noise first, then one normal per window step (adapters.denoise).
        generators = make_generators(list(trajectory.seeds))
        family.initial_latents(side.model, generators, options)
    per_step: list[dict[str, Any]] = []
    for k in range(width):
        chunks: list[dict[str, Any]] = []
        for start in range(0, batch, rows):
            picked = list(range(start, min(start + rows, batch)))
            sample = trajectory.latents[picked, k].contiguous()
            timestep = trajectory.timesteps[picked, k]
            cond = {name: t[picked] for name, t in trajectory.conditioning.items()}
            with _tracer(side.model) as record, attention(side.attention):
                velocity = velocity_fn(side.model, sample, timestep, cond, guidance, options=options).float()
            out = scheduler.sample_previous_step(
                velocity,
                timestep,
                sample,
                noise_level=noise_level,
                sde_type=sde_type,
                prev_sample=None if side.draws_sample else trajectory.latents[picked, k + 1].contiguous(),
                generator=[generators[b] for b in picked] if side.draws_sample else None,
                include_normalizer=normalizer,
            )
            record["velocity"] = velocity
            record["transition.mean"] = out.prev_sample_mean
            record["transition.std"] = out.prev_sample_std
            record["scored_sample"] = out.prev_sample
            record["log_prob"] = out.log_prob
            chunks.append({name: _rows(value) for name, value in record.items()})
        names = [n for n in chunks[0] if all(n in c for c in chunks)]
        per_step.append({n: (_unique if n.startswith("rope") else _cat)([c[n] for c in chunks]) for n in names})
    names = [n for n in per_step[0] if all(n in s for s in per_step)]
    return {n: _stack_steps([s[n] for s in per_step]) for n in names}


@contextlib.contextmanager
def _tracer(model: Any) -> Iterator[dict[str, Any]]:
    """Record the model's inputs (per forward pass: CFG runs two) and each block's output while inside."""
    record: dict[str, Any] = {}
    passes = [0]
    handles = []

    def suffix() -> str:
        return "" if passes[0] <= 1 else f"[pass {passes[0]}]"

    def model_pre(_module, args, kwargs):
        passes[0] += 1
        for stage, name in INPUT_STAGES:
            value = kwargs.get(name, args[0] if name == "hidden_states" and args else None)
            if value is not None:
                record[stage + suffix()] = value

    def first_block_pre(_module, args, kwargs):
        values = list(args) + [v for k, v in kwargs.items() if "rotary" not in k]
        record["embed" + suffix()] = values
        rope = next((v for k, v in kwargs.items() if "rotary" in k and v is not None), None)
        if rope is not None:
            record["rope" + suffix()] = rope

    # The module that holds the blocks gets the real inputs (a wrapper such as pitfalls.StockMaskSumRope
    # rewrites them on the way in).
    core = _core(model)
    handles.append(core.register_forward_pre_hook(model_pre, with_kwargs=True))
    blocks = [m for name, m in core.named_children() if name.endswith("blocks")]
    index = 0
    for module_list in blocks:
        for block in module_list:
            if index == 0:
                handles.append(block.register_forward_pre_hook(first_block_pre, with_kwargs=True))
            stage = f"blocks.{index}"
            handles.append(
                block.register_forward_hook(lambda _m, _a, out, s=stage: record.__setitem__(s + suffix(), out))
            )
            index += 1
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


def _core(model: Any) -> Any:
    """The module that holds the transformer blocks (a wrapper's inner model)."""
    return next((m for m in model.modules() if any(n.endswith("blocks") for n, _ in m.named_children())), model)


def _rows(value: Any) -> Any:
    """A row-first float64 CPU tensor `(rows, -1)` of any tensor / list / tuple of them (None if none)."""
    import torch

    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, int) for v in value):
            return torch.tensor(value, dtype=torch.float64).reshape(len(value), 1)
        parts = [_rows(v) for v in value]
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        if len({p.shape[0] for p in parts}) == 1:
            return torch.cat(parts, dim=1)
        # Tables shared by all rows (RoPE): compare them whole.
        return torch.cat([p.reshape(1, -1) for p in parts], dim=1)
    if not isinstance(value, torch.Tensor):
        return None
    if value.is_complex():
        value = torch.view_as_real(value)
    value = value.detach().to("cpu", torch.float64)
    if value.dim() == 0:
        return value.reshape(1, 1)
    return value.reshape(value.shape[0], -1)


def _cat(parts: list[Any]) -> Any:
    import torch

    if any(p is None for p in parts):
        return None
    if len({p.shape[1] for p in parts}) > 1:
        return parts  # different widths per forward (e.g. RoPE tables): compared as a list
    return torch.cat(parts, dim=0)


def _unique(tables: list[Any]) -> Any:
    """RoPE tables are shared by a forward's rows: keep each distinct table once (rows per forward may differ)."""
    kept: list[Any] = []
    for table in tables:
        if table is not None and not any(k.shape == table.shape and bool((k == table).all()) for k in kept):
            kept.append(table)
    return kept[0] if len(kept) == 1 else kept


def _stack_steps(parts: list[Any]) -> Any:
    return parts  # one entry per window step; compared step by step


def _stage_order(traces: Sequence[Mapping[str, Any]]) -> list[str]:
    names = [n for n in traces[0]] + [n for n in traces[1] if n not in traces[0]]

    def key(name: str) -> tuple[int, int, str]:
        base, _, passed = name.partition("[")
        if base.startswith("inputs."):
            rank = [s for s, _ in INPUT_STAGES].index(base)
        elif base == "rope":
            rank = len(INPUT_STAGES)
        elif base == "embed":
            rank = len(INPUT_STAGES) + 1
        elif base.startswith("blocks."):
            rank = len(INPUT_STAGES) + 2 + int(base.split(".")[1])
        else:
            rank = 10_000 + STEP_STAGES.index(base)
        return rank, 0 if not passed else 1, name

    return sorted(names, key=key)


def _compare(stage: str, a: Any, b: Any) -> StageDiff:
    """Max |a − b| over steps and rows (a, b: one entry per step, each (rows, -1) or a list of such)."""
    if a is None or b is None:
        side = "rollout" if a is None else "trainer"
        return StageDiff(stage, math.inf, math.inf, detail=f"computed on one side only (absent on the {side})")
    worst = StageDiff(stage, 0.0, 0.0)
    for step, (x, y) in enumerate(zip(a, b, strict=False)):
        if x is None or y is None:
            continue
        xs, ys = (x if isinstance(x, list) else [x]), (y if isinstance(y, list) else [y])
        for xi, yi in zip(xs, ys, strict=False):
            if xi.shape != yi.shape:
                return StageDiff(
                    stage,
                    math.inf,
                    math.inf,
                    step=step,
                    detail=f"shapes differ: {tuple(xi.shape)} vs {tuple(yi.shape)}",
                )
            diff = (xi - yi).abs()
            if not bool(diff.isfinite().all()) and not bool((xi.isfinite() == yi.isfinite()).all()):
                return StageDiff(stage, math.inf, math.inf, step=step, detail="finite on one side only")
            diff = diff.nan_to_num(0.0)
            value = float(diff.max()) if diff.numel() else 0.0
            if value > worst.max_abs:
                scale = float(yi.abs().nan_to_num(0.0).max()) or 1.0
                row = int(diff.amax(dim=1).argmax()) if diff.dim() == 2 else 0
                worst = StageDiff(stage, value, value / scale, step=step, row=row)
    return worst


def _weights_diff(a: Any, b: Any) -> StageDiff | None:
    """Max |Δ| between same-named parameters (None when the modules are one object or of different dtypes)."""
    a, b = _core(a), _core(b)
    if a is b:
        return None
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    if set(pa) != set(pb):
        return StageDiff("weights", math.inf, math.inf, detail="the models have different parameter names")
    worst, largest = 0.0, ""
    for name, tensor in pa.items():
        other = pb[name]
        if tensor.dtype != other.dtype:
            return None  # a dtype difference is a setting, listed there
        if tensor.shape != other.shape:
            return StageDiff("weights", math.inf, math.inf, detail=f"{name}: shapes differ")
        # On the parameters' device, one tensor at a time: a large model is not copied to the host.
        diff = float((tensor.detach().float() - other.detach().float().to(tensor.device)).abs().max())
        if diff > worst:
            worst, largest = diff, name
    if not worst:
        return StageDiff("weights", 0.0, 0.0)
    scale = float(pb[largest].detach().double().abs().max()) or 1.0
    return StageDiff("weights", worst, worst / scale, detail=f"parameter {largest}: max |Δ| {worst:.3g}")


def _settings_diff(trajectory: Any, rollout: SideSpec, trainer: SideSpec) -> tuple[tuple[str, str, str], ...]:
    from rollout_consistency.adapters.families import model_dtype

    def value(side: SideSpec, name: str) -> Any:
        if name == "dtype":
            return str(model_dtype(side.model)).replace("torch.", "")
        if name == "rows_per_forward":
            return side.rows_per_forward or trajectory.batch_size
        if name == "velocity":
            fn = side.velocity
            return "family default" if fn is None else getattr(fn, "__qualname__", repr(fn))
        own = getattr(side, name)
        if own is None:
            own = {"options": trajectory.family_options}.get(name, getattr(trajectory, name, None))
        return dict(own) if isinstance(own, Mapping) else own

    names = ("attention", "dtype", "rows_per_forward", "guidance_scale", "noise_level", "sde_type")
    names += ("include_normalizer", "options", "velocity")
    out = []
    for name in names:
        a, b = value(rollout, name), value(trainer, name)
        if a != b:
            out.append((name, str(a), str(b)))
    return tuple(out)


# ----------------------------------------------------------------------------------------------------
def localise_check(
    settings: DiagnosisSettings, batch_spec: Any, tables: tuple[Any, Any] | None = None
) -> Localisation | str:
    """The check's localisation: replay `batch_spec` through both sides' own code (plug-ins or built-in
    backends, as the check ran them) with their models watched, and compare call by call.

    Returns the [`Localisation`], or a sentence saying why the sides cannot be watched (see
    `rollout_consistency.gate.diagnosis.replay.replay_batch`). `tables`: the check's ``(rollout, trainer)`` log-probs
    of the batch (the replay must reproduce them). Where the first differing stage is a block (or the output), one
    forward per side is looked at once more inside it (`inside_block.look_inside`: the submodule where the sides
    part and the state differences there, ``facts["inside"]``).
    """
    from .replay import replay_batch

    try:
        replay = replay_batch(settings, batch_spec, tables)
        if isinstance(replay, str):
            return replay
        found = localise_replay(replay)
    except Exception as error:  # the user's code failed on the replay: the diagnosis must not end the check
        return f"the replay of the sides' code raised {type(error).__name__}: {str(error)[:200]}"
    pair = found.facts.get("first_pair")
    if pair is None:
        return found
    from .inside_block import look_inside

    try:
        inside = look_inside(settings, batch_spec, replay, pair)
    except Exception as error:  # the localisation stands; only the look inside the block is lost
        inside = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    return found if inside is None else dataclasses.replace(found, facts={**found.facts, "inside": inside})


# ----------------------------------------------------------------------------------------------------
# Call-by-call comparison of a replay (rollout_consistency.gate.diagnosis.replay): stages of the paired forwards.
_KNOWN_INPUTS = [stage for stage, _ in INPUT_STAGES]


def localise_replay(replay: Any) -> Localisation:
    """Compare the two sides' recorded forwards for the same (sample, step), stage by stage.

    Stages, in order: ``weights``, ``forwards`` (a side runs more forwards per sample and step: CFG on one side
    only), ``pairing`` (trainer forwards on latents the rollout never fed), ``inputs.<name>``, ``blocks.<i>``,
    ``output``. When none differs, ``facts["step_fit"]`` holds the step settings that reproduce each side's
    log-probs from its own forwards (`rollout_consistency.gate.diagnosis.step_fit`); when the first differing stage
    is a block or the output, ``facts["first_pair"]`` names the forward to look inside (`localise_check` does).
    """
    from .call_match import match_calls, pair_passes

    r_calls, t_calls, context = replay.rollout.calls, replay.trainer.calls, replay.context
    n = len(context.samples)
    matching = match_calls(r_calls, t_calls, n)
    units = [u for u in matching.units.values() if u.trainer and _window_position(context, u) is not None]
    stages: list[StageDiff] = []
    weights = _weights_diff(replay.rollout_model, replay.trainer_model)
    if weights is not None:
        stages.append(weights)
    passes = {
        "rollout": sorted({len(u.rollout) for u in units}),
        "trainer": sorted({len(u.trainer) for u in units}),
    }
    if units and passes["rollout"] != passes["trainer"]:
        stages.append(
            StageDiff(
                "forwards",
                math.inf,
                math.inf,
                detail=f"forwards per (sample, step): rollout {_listing(passes['rollout'])}, trainer "
                f"{_listing(passes['trainer'])}",
            )
        )
    if matching.unmatched:
        total = sum(c.rows for c in t_calls)
        stages.append(
            StageDiff(
                "pairing",
                math.inf,
                math.inf,
                detail=f"{len(matching.unmatched)} of {total} trainer forward rows fed latents the rollout never fed",
            )
        )
    worst: dict[str, StageDiff] = {}
    earliest: dict[str, tuple[int, ...]] = {}  # stage -> the earliest paired forwards where it differs
    compared = 0
    for unit in units:
        pairs, _, _ = pair_passes(unit, r_calls, t_calls)
        position = _window_position(context, unit)
        for r_ref, t_ref in pairs:
            compared += 1
            for diff in _compare_rows(r_calls[r_ref.call], r_ref.row, t_calls[t_ref.call], t_ref.row):
                located = dataclasses.replace(diff, step=position, row=context.samples[unit.sample])
                kept = worst.get(diff.stage)
                if kept is None or (located.differs and (not kept.differs or located.max_abs > kept.max_abs)):
                    worst[diff.stage] = located
                here = (
                    t_ref.call + r_ref.call,
                    t_ref.call,
                    r_ref.call,
                    r_ref.row,
                    t_ref.row,
                )  # fewest forwards to re-run
                if diff.differs and (diff.stage not in earliest or here < earliest[diff.stage]):
                    earliest[diff.stage] = here
    stages += [worst[name] for name in sorted(worst, key=_replay_stage_rank)]
    facts = _facts(replay, matching, units, worst, passes, compared)
    first = next((stage for stage in stages if stage.differs), None)
    if first is not None and (first.stage.startswith("blocks.") or first.stage == "output"):
        _, t_call, r_call, r_row, t_row = earliest[first.stage]
        facts["first_pair"] = {"stage": first.stage, "rollout": [r_call, r_row], "trainer": [t_call, t_row]}
    if units and not any(stage.differs for stage in stages):
        facts["step_fit"] = _step_fit(replay, matching, units)
    return Localisation(
        stages=tuple(stages),
        settings=_replay_settings(replay, facts),
        replay_max_abs=facts["replay"]["rollout_max_abs"],
        rows=n,
        samples=tuple(context.samples),
        facts=facts,
    )


def _listing(values: Sequence[int]) -> str:
    return "/".join(str(v) for v in values) if values else "none"


def _window_position(context: Any, unit: Any) -> int | None:
    if unit.sample >= len(context.window_starts):
        return None
    position = unit.step - context.window_starts[unit.sample]
    return position if 0 <= position < context.window_size else None


def _replay_stage_rank(name: str) -> tuple[int, int, str]:
    if name.startswith("inputs."):
        known = _KNOWN_INPUTS.index(name) if name in _KNOWN_INPUTS else len(_KNOWN_INPUTS)
        return 0, known, name
    if name.startswith("blocks."):
        return 1, int(name.split(".")[1]), name
    return 2, 0, name


def _compare_rows(a_call: Any, a_row: int, b_call: Any, b_row: int) -> list[StageDiff]:
    """Every stage of one rollout forward row against one trainer forward row."""
    out = []
    for stage in sorted(set(a_call.inputs) | set(b_call.inputs)):
        out.append(_compare_value(stage, a_call.inputs.get(stage), a_row, b_call.inputs.get(stage), b_row))
    blocks = max(len(a_call.blocks), len(b_call.blocks))
    for index in range(blocks):
        a = a_call.blocks[index] if index < len(a_call.blocks) else None
        b = b_call.blocks[index] if index < len(b_call.blocks) else None
        out.append(_compare_value(f"blocks.{index}", a, a_row, b, b_row))
    out.append(_compare_value("output", a_call.output, a_row, b_call.output, b_row))
    return out


def _compare_value(stage: str, a: Any, a_row: int, b: Any, b_row: int) -> StageDiff:
    if a is None or b is None:
        if a is None and b is None:
            return StageDiff(stage, 0.0, 0.0)
        present, row = (b, b_row) if a is None else (a, a_row)
        if stage == "inputs.text_mask" and not isinstance(present, tuple) and bool(present[row].all()):
            # A mask that masks nothing is what no mask means (a forward whose rows are all unpadded may pass
            # none): any effect it has on the kernels shows in the blocks and the output.
            return StageDiff(stage, 0.0, 0.0)
        side = "rollout" if a is None else "trainer"
        return StageDiff(stage, math.inf, math.inf, detail=f"given on one side only (absent on the {side})")
    if isinstance(a, tuple) or isinstance(b, tuple):
        if not (isinstance(a, tuple) and isinstance(b, tuple)) or a[0] != b[0]:
            return StageDiff(stage, math.inf, math.inf, detail="given in different forms")
        if a[0] == "rows":  # one text per row: the row's own
            same = a[1][a_row] == b[1][b_row]
            return StageDiff(
                stage,
                0.0 if same else math.inf,
                0.0,
                detail="" if same else f"{a[1][a_row][:60]} vs {b[1][b_row][:60]}",
            )
        if a[0] == "text":
            same = a[1] == b[1]
            return StageDiff(
                stage, 0.0 if same else math.inf, 0.0, detail="" if same else f"{a[1][:60]} vs {b[1][:60]}"
            )
        x, y = a[1], b[1]
    else:
        x, y = a[a_row], b[b_row]
    if x.shape != y.shape:
        return StageDiff(stage, math.inf, math.inf, detail=f"shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}")
    diff = (x - y).abs()
    if not bool((x.isfinite() == y.isfinite()).all()):
        return StageDiff(stage, math.inf, math.inf, detail="finite on one side only")
    value = float(diff.nan_to_num(0.0).max()) if diff.numel() else 0.0
    scale = float(y.abs().nan_to_num(0.0).max()) if y.numel() else 0.0
    return StageDiff(stage, value, value / (scale or 1.0))


def _rounded_to(values: Any) -> str | None:
    """``"bfloat16"`` / ``"float16"`` when every value is exactly representable there (and not all integers)."""
    import torch

    if values is None or not values.numel() or bool((values == values.round()).all()):
        return None
    for dtype in (torch.bfloat16, torch.float16):
        if bool((values.to(dtype).to(torch.float64) == values).all()):
            return str(dtype).replace("torch.", "")
    return None


def _paired_values(replay: Any, units: Sequence[Any], stage: str) -> tuple[Any, Any]:
    """Both sides' values of `stage` over the paired forwards, row for row (float64), or ``(None, None)``."""
    import torch

    from .call_match import pair_passes

    r_calls, t_calls = replay.rollout.calls, replay.trainer.calls
    a, b = [], []
    for unit in units:
        for r_ref, t_ref in pair_passes(unit, r_calls, t_calls)[0]:
            x, y = r_calls[r_ref.call].inputs.get(stage), t_calls[t_ref.call].inputs.get(stage)
            if hasattr(x, "dim") and hasattr(y, "dim") and x.shape[1] == y.shape[1]:
                a.append(x[r_ref.row])
                b.append(y[t_ref.row])
    return (torch.cat(a), torch.cat(b)) if a else (None, None)


def _rounded_copy(mine: Any, theirs: Any) -> str | None:
    """``"bfloat16"`` / ``"float16"`` when `mine` is exactly `theirs` rounded to that dtype (and `theirs` is not
    already in it): one side feeds a low-precision copy of what the other feeds."""
    import torch

    for dtype in (torch.bfloat16, torch.float16):
        rounded = theirs.to(dtype).to(torch.float64)
        if bool((mine == rounded).all()) and not bool((theirs == rounded).all()):
            return str(dtype).replace("torch.", "")
    return None


_WIDE = ("float32", "float64")


def _facts(replay, matching, units, worst, passes, compared) -> dict[str, Any]:

    r, t, context = replay.rollout, replay.trainer, replay.context
    facts: dict[str, Any] = {
        "source": "replay of both sides' own code",
        "units": len(units),
        "compared_forwards": compared,
        "passes": passes,
        "forwards": {
            "rollout": sorted({c.rows for c in r.calls}),
            "trainer": sorted({c.rows for c in t.calls}),
        },
        "autocast": {
            "rollout": sorted({str(c.autocast) for c in r.calls}),
            "trainer": sorted({str(c.autocast) for c in t.calls}),
        },
        "dtype": {"rollout": sorted({c.dtype for c in r.calls}), "trainer": sorted({c.dtype for c in t.calls})},
        "calls": {"rollout": len(r.calls), "trainer": len(t.calls)},
        "labelled": matching.labelled,
        "seconds": replay.seconds,
    }
    replay_facts = {"rollout_max_abs": 0.0, "trainer_max_abs": 0.0}
    for side, table in (("rollout", context.rollout_table), ("trainer", context.trainer_table)):
        own = r.log_probs if side == "rollout" else t.log_probs
        if table is not None and table.shape == own.shape:
            replay_facts[f"{side}_max_abs"] = float(abs(own - table).max()) if own.size else 0.0
    facts["replay"] = replay_facts
    for stage in ("inputs.latents", "inputs.timestep"):
        if stage in worst and worst[stage].differs:
            a, b = _paired_values(replay, units, stage)
            if a is not None:
                facts["rounded"] = {"stage": stage, "rollout": _rounded_copy(a, b), "trainer": _rounded_copy(b, a)}
            break
    if "inputs.timestep" in worst and worst["inputs.timestep"].differs:
        facts["timestep_neighbour"] = _timestep_neighbour(replay, units, matching.step_values)
        facts["fed_sigmas"] = {
            "steps": len(context.sigmas) - 1,
            **{
                side: {str(k): v for k, v in sorted(_side_sigmas(replay, matching, units, side).items())}
                for side in ("rollout", "trainer")
            },
        }
    for stage in _PER_SAMPLE_INPUTS:
        if stage in worst and worst[stage].differs:
            facts["misaligned"] = _misaligned(replay, matching, units, stage)
            break
    return facts


#: Inputs that belong to one sample (a shuffle that leaves one of them out hands it another sample's), in the
#: order the stages are compared.
_PER_SAMPLE_INPUTS = ("inputs.conditioning", "inputs.text_mask", "inputs.pooled")


def _timestep_neighbour(replay: Any, units: Sequence[Any], step_values: Sequence[float]) -> dict[str, Any]:
    """For the paired forwards whose timesteps differ: how many take exactly another step's timestep, and which."""
    from .call_match import pair_passes, row_timestep

    r_calls, t_calls = replay.rollout.calls, replay.trainer.calls
    offsets: dict[int, int] = {}
    differing = 0
    for unit in units:
        for r_ref, t_ref in pair_passes(unit, r_calls, t_calls)[0]:
            a, b = row_timestep(r_calls[r_ref.call], r_ref.row), row_timestep(t_calls[t_ref.call], t_ref.row)
            if a is None or b is None or a == b:
                continue
            differing += 1
            if b in step_values:
                offset = step_values.index(b) - unit.step
                offsets[offset] = offsets.get(offset, 0) + 1
    return {"differing": differing, "offsets": {str(k): v for k, v in sorted(offsets.items())}}


def _misaligned(replay: Any, matching: Any, units: Sequence[Any], stage: str) -> dict[str, Any]:
    """Paired forwards whose `stage` input differs, how many carry exactly another sample's (the rollout's, at
    the same step), whose (``fed``: sample → the sample it got), and where the batch holds what the trainer fed
    (`_key_pairing`)."""
    from .call_match import pair_passes

    r_calls, t_calls = replay.rollout.calls, replay.trainer.calls
    differing = other = 0
    fed: dict[int, int] = {}
    for unit in units:
        for r_ref, t_ref in pair_passes(unit, r_calls, t_calls)[0]:
            mine, theirs = r_calls[r_ref.call].inputs.get(stage), t_calls[t_ref.call].inputs.get(stage)
            if not (hasattr(mine, "dim") and hasattr(theirs, "dim")) or mine.shape[1] != theirs.shape[1]:
                continue
            row = theirs[t_ref.row]
            if bool((mine[r_ref.row] == row).all()):
                continue
            differing += 1
            source = _sample_holding(replay, matching, unit, stage, row)
            if source is not None:
                other += 1
                fed.setdefault(unit.sample, source)
    out: dict[str, Any] = {"stage": stage, "differing": differing, "other_sample": other}
    out["fed"] = {str(k): v for k, v in sorted(fed.items())}

    def value_of(ref: Any, _unit: Any) -> Any:
        value = t_calls[ref.call].inputs.get(stage)
        return value[ref.row] if hasattr(value, "dim") and value.dim() == 2 else None

    out.update(_key_pairing(replay, units, value_of))
    return out


def _sample_holding(replay: Any, matching: Any, unit: Any, stage: str, row: Any) -> int | None:
    """Another sample whose rollout forward at the same step fed exactly `row` at `stage` (None: no other)."""
    r_calls = replay.rollout.calls
    for peer in matching.units.values():
        if peer.step != unit.step or peer.sample == unit.sample:
            continue
        for ref in peer.rollout:
            value = r_calls[ref.call].inputs.get(stage)
            if hasattr(value, "dim") and value.shape[1] == row.shape[0] and bool((value[ref.row] == row).all()):
                return peer.sample
    return None


def _key_pairing(replay: Any, units: Sequence[Any], value_of: Any) -> dict[str, Any]:
    """Per-key pairing of the trainer's forwards: in the order they ran (per step), the batch row its latents
    came from and the batch row `value_of(trainer ref, unit)` (a 1-D value or None) came from
    (`call_match.locate`: exact copies only).

    Returns ``{"latents_key", "key", "order": {"latents": [...], "other": [...]}, "batch_order", "permuted"}`` —
    ``batch_order``: the rows of ``key`` the forwards took are the batch's rows in order (0, 1, …), ``permuted``:
    the latents rows are not; empty where a value was found in no key (a cast copy, a tensor the batch lacks)."""
    from .call_match import batch_keys, locate

    if replay.batch is None:
        return {}
    keys = batch_keys(replay.batch, len(replay.context.samples))
    t_calls = replay.trainer.calls
    first_ref = {}
    for unit in units:
        for ref in unit.trainer:
            first_ref.setdefault(unit.step, []).append((ref.call, ref.row, unit))
    latents_rows: dict[int, list[int]] = {}
    other_rows: dict[int, list[list[int]]] = {}
    latents_key = other_key = None
    for step, refs in first_ref.items():
        seen = set()
        for call, row, unit in sorted(refs, key=lambda item: (item[0], item[1])):
            if unit.sample in seen:
                continue
            seen.add(unit.sample)
            x = t_calls[call].inputs["inputs.latents"][row]
            places = [p for p in locate(x, keys) if latents_key in (None, p.key)]
            if not places:
                return {}
            latents_key = places[0].key
            latents_rows.setdefault(step, []).append(places[0].row)
            rows: list[int] = []
            for ref in unit.trainer:
                value = value_of(ref, unit)
                if value is None:
                    continue
                for place in _places(value, keys, places[0]):
                    if other_key in (None, place.key):
                        other_key = place.key
                        rows.append(place.row)
            other_rows.setdefault(step, []).append(sorted(set(rows)))
    if latents_key is None or other_key is None:
        return {}
    steps = sorted(latents_rows)
    batch_order = all(all(k in rows for k, rows in enumerate(other_rows[s])) for s in steps)
    permuted = any(any(k != r for k, r in enumerate(latents_rows[s])) for s in steps)
    first = steps[0]
    return {
        "latents_key": latents_key,
        "key": other_key,
        "order": {"latents": latents_rows[first], "other": [rows[:1] for rows in other_rows[first]]},
        "batch_order": batch_order,
        "permuted": permuted,
    }


def _places(value: Any, keys: Mapping[str, Any], latents: Any) -> list[Any]:
    """Where the batch holds `value`, the latents' own key left out when another key holds it too, and a step's
    entry (the latents' entry) preferred: ``next_latents[s, j]`` over ``latents[s, j + 1]``."""
    from .call_match import locate

    places = locate(value, keys)
    others = [p for p in places if p.key != latents.key] or places
    same_entry = [p for p in others if p.entry == latents.entry]
    return same_entry or others


def _replay_settings(replay: Any, facts: Mapping[str, Any]) -> tuple[tuple[str, str, str], ...]:
    context = replay.context
    out = []
    if context.attention[0] != context.attention[1]:
        out.append(("attention", context.attention[0], context.attention[1]))
    for name, key in (("rows_per_forward", "forwards"), ("autocast", "autocast"), ("dtype", "dtype")):
        a, b = facts[key]["rollout"], facts[key]["trainer"]
        if a != b:
            out.append(
                (
                    name,
                    _listing(a) if name == "rows_per_forward" else "/".join(a),
                    _listing(b) if name == "rows_per_forward" else "/".join(b),
                )
            )
    return tuple(out)


def _step_fit(replay: Any, matching: Any, units: Sequence[Any]) -> dict[str, Any]:
    """Each side's step settings, fitted to its own table from its own forwards (`step_fit.fit_side`)."""
    from . import step_fit

    context = replay.context
    cfg = context.cfg_scale if context.cfg_scale > 1 else None
    import torch

    # Each side's schedule as it fed its model; where it is not the plan's but a shift of it (a loop that builds
    # its own schedule), that side's fit starts from that shift (and refits it: fed timesteps may be rounded).
    schedules = {side: _side_sigmas(replay, matching, units, side) for side in ("rollout", "trainer")}
    baselines = {
        side: step_fit.StepSettings(
            context.noise_level, context.sde_type, guidance=cfg, shift=_shift_of(context.sigmas, schedules[side])
        )
        for side in schedules
    }
    data = {side: _unit_data(replay, matching, units, side) for side in ("rollout", "trainer")}
    table_diff = replay.trainer.log_probs - replay.rollout.log_probs
    disagreement = float(abs(table_diff).max()) if table_diff.size else 0.0
    significant = 0.25 * disagreement  # an offset explains the disagreement only if it is a good part of it
    # Each side fitted from the config's settings, the other from the first's fit: the pair explaining both
    # tables best (fewest changes between them) is what the two sides ran.
    pairs = []
    for first, second in (("rollout", "trainer"), ("trainer", "rollout")):
        a = step_fit.fit_side(data[first], baselines[first], context.sigmas, min_offset=significant)
        b = step_fit.fit_side(
            data[second], baselines[second] if a is None else a.settings, context.sigmas, min_offset=significant
        )
        pairs.append({first: a, second: b})
        if a is not None and b is not None and max(a.error, b.error) <= 0.01 * disagreement:
            break  # both tables reproduced: the other order cannot do better
    pairs.sort(key=lambda p: max(math.inf if f is None else f.error for f in p.values()))
    fits: dict[str, Any] = {side: None if fit is None else fit.to_dict() for side, fit in pairs[0].items()}
    rollout_fit, trainer_fit = pairs[0]["rollout"], pairs[0]["trainer"]
    if rollout_fit is not None and trainer_fit is not None and rollout_fit.reproduced and not trainer_fit.reproduced:
        fits["next_pairing"] = _next_pairing(replay, matching, units, rollout_fit)
    # The samples the rollout stepped on after its first step, where its model received them in float32: all
    # exactly bf16 values means they were rounded (after the step scored them).
    calls = replay.rollout.calls
    stepped = [
        calls[ref.call].inputs["inputs.latents"][ref.row]
        for unit in matching.units.values()
        if unit.step > 0
        for ref in unit.rollout[:1]
        if calls[ref.call].input_dtypes.get("inputs.latents") in _WIDE
    ]
    fits["rollout_next_rounded"] = _rounded_to(torch.cat(stepped)) if stepped else None
    fits["disagreement"] = disagreement
    fits["sigmas"] = list(context.sigmas)  # the plan's: each fit's `shift` scales these
    fits["fed"] = {side: {str(k): v for k, v in sorted(schedules[side].items())} for side in schedules}
    return fits


def _next_pairing(replay: Any, matching: Any, units: Sequence[Any], fit: Any) -> dict[str, Any]:
    """Which sample's next latents the trainer's step scored: for each trainer (sample, step), the sample whose
    latents the rollout stepped to (its next forward's input) that reproduces the trainer's log-prob under the
    rollout's fitted settings (`fit`), within `step_fit.REPRODUCED_RTOL`.

    Returns ``{"reproduced": False}`` when some (sample, step) is reproduced by none; else ``reproduced``,
    ``units``, ``moved`` (how many scored another sample's), ``error`` (the worst relative error), ``scored``
    (``[sample, step, the sample scored]``) and, where some moved, the per-key pairing (`_key_pairing`)."""
    from . import step_fit

    context, r_calls, t_calls = replay.context, replay.rollout.calls, replay.trainer.calls
    table = replay.trainer.log_probs
    stepped_to: dict[int, dict[int, Any]] = {}  # step → {sample: the latents the rollout stepped to from it}
    for unit in matching.units.values():
        if unit.rollout:
            ref = unit.rollout[0]
            stepped_to.setdefault(unit.step - 1, {})[unit.sample] = r_calls[ref.call].inputs["inputs.latents"][ref.row]
    scored: dict[tuple[int, int], int] = {}
    worst = 0.0
    for unit in units:
        position, pool = _window_position(context, unit), stepped_to.get(unit.step)
        if position is None or not pool or unit.sample >= table.shape[0]:
            continue
        calls = [t_calls[ref.call] for ref in unit.trainer]
        base = step_fit.UnitData(
            x=calls[0].inputs["inputs.latents"][unit.trainer[0].row],
            outputs=tuple(call.output[ref.row] for call, ref in zip(calls, unit.trainer, strict=True)),
            output_shape=calls[0].output_shape,
            x_next=None,
            step=unit.step,
            log_prob=float(table[unit.sample, position]),
        )
        orders = (0, 1) if len(calls) > 1 else (0,)
        errors = {
            sample: min(
                step_fit.unit_error(dataclasses.replace(base, x_next=x), fit.settings, context.sigmas, order)
                for order in orders
            )
            for sample, x in pool.items()
        }
        best = min(errors, key=errors.__getitem__)
        if not errors[best] <= step_fit.REPRODUCED_RTOL:
            return {"reproduced": False}
        scored[(unit.sample, unit.step)] = best
        worst = max(worst, errors[best])
    if not scored:
        return {}
    out: dict[str, Any] = {
        "reproduced": True,
        "units": len(scored),
        "moved": sum(sample != other for (sample, _), other in scored.items()),
        "error": worst,
        "scored": [[sample, step, other] for (sample, step), other in sorted(scored.items())],
    }
    if out["moved"]:

        def value_of(_ref: Any, unit: Any) -> Any:
            other = scored.get((unit.sample, unit.step))
            return None if other is None else stepped_to[unit.step][other]

        out.update(_key_pairing(replay, [u for u in units if (u.sample, u.step) in scored], value_of))
    return out


def _side_sigmas(replay: Any, matching: Any, units: Sequence[Any], side: str) -> dict[int, float]:
    """The sigma `side` fed its model at each step of the batch (its timestep over the timestep unit): the rollout's
    over every step it walked, the trainer's over the steps it re-scored; a step fed several values is left out."""
    from .call_match import row_timestep
    from .sigma_schedules import timestep_unit

    unit = timestep_unit(matching.step_values)
    if side == "rollout":
        return {k: v / unit for k, v in enumerate(matching.step_values)}
    calls = replay.trainer.calls
    seen: dict[int, set[float]] = {}
    for u in units:
        for ref in u.trainer:
            value = row_timestep(calls[ref.call], ref.row)
            if value is not None:
                seen.setdefault(u.step, set()).add(value / unit)
    return {k: next(iter(v)) for k, v in seen.items() if len(v) == 1}


#: A side's fed sigmas are a shift of the plan's when one odds factor maps every step within this: integer
#: timesteps (DanceGRPO's ``int(sigma * 1000)``) are off by up to 1e-3.
_FED_SHIFT_TOLERANCE = 2e-3


def _shift_of(plan: Sequence[float], fed: Mapping[int, float]) -> float:
    """The odds factor from the plan's sigmas to those a side fed its model (1: the plan's, or no one factor)."""
    from .sigma_schedules import estimate_shift, shifted

    fed = {k: v for k, v in fed.items() if k < len(plan)}
    if all(abs(plan[k] - v) <= _FED_SHIFT_TOLERANCE for k, v in fed.items()):
        return 1.0  # the plan's schedule (integer timesteps round it)
    shift = estimate_shift(plan, fed)
    fits = all(abs(shifted(plan[k], shift) - v) <= _FED_SHIFT_TOLERANCE for k, v in fed.items())
    return shift if fits else 1.0


def _unit_data(replay: Any, matching: Any, units: Sequence[Any], side: str) -> list[Any]:
    from . import step_fit

    trace = replay.rollout if side == "rollout" else replay.trainer
    other = replay.trainer if side == "rollout" else replay.rollout
    context = replay.context
    out = []
    for unit in units:
        refs = unit.rollout if side == "rollout" else unit.trainer
        if not refs:
            continue
        calls = [trace.calls[ref.call] for ref in refs]
        x = calls[0].inputs["inputs.latents"][refs[0].row]
        following = matching.units.get((unit.sample, unit.step + 1))
        x_next = None
        if following is not None:
            for own, pool in ((side, trace), ("trainer" if side == "rollout" else "rollout", other)):
                next_refs = following.rollout if own == "rollout" else following.trainer
                if next_refs:
                    x_next = pool.calls[next_refs[0].call].inputs["inputs.latents"][next_refs[0].row]
                    break
        position = _window_position(context, unit)
        table = trace.log_probs
        if position is None or unit.sample >= table.shape[0]:
            continue
        out.append(
            step_fit.UnitData(
                x=x,
                outputs=tuple(call.output[ref.row] for call, ref in zip(calls, refs, strict=True)),
                output_shape=calls[0].output_shape,
                x_next=x_next,
                step=unit.step,
                log_prob=float(table[unit.sample, position]),
            )
        )
    return out
