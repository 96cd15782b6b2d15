# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""[`MonitorSettings`]: how the run monitor judges every step, as one frozen object checked when it is built."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from rollout_consistency.gate.tables.settings import GateInputError, TableSettings

from .distributed import DEFAULT_MAX_TIMESTEPS
from .figures import FIGURE_NAMES

__all__ = ["ON_ALARM", "MonitorError", "MonitorSettings"]

#: What the monitor does on an alarm: ``log`` (a warning; training goes on), ``raise`` (`MonitorAlarm` from the
#: call that judged the step), ``stop`` (`RunMonitor.should_stop` turns True: the loop ends at its own boundary).
ON_ALARM: tuple[str, ...] = ("log", "raise", "stop")


class MonitorError(ValueError):
    """A setting, a step or a figure the monitor cannot judge (out of order, repeated, nothing to compare); the
    message names the fix."""


@dataclass(frozen=True)
class MonitorSettings:
    """How the run monitor judges each training step.

    Args:
        gate ([`TableSettings`]): the per-step verdict's profile, compute dtype, clip ranges and threshold
            overrides — the step-1 gate's own settings; each step's pooled figures must stay within the profile's
            limits (``exact``: 0; ``kernel``: the published attention-kernel floor's; ``implementation``: float32
            rounding). Default ``TableSettings()`` (``exact``).
        warmup_steps (`int`): K, the number of first judged steps whose drift figure sets the drift alarm's floor
            (steps that fail their verdict are left out of it). The drift alarm is armed from step K+1 on.
        drift_figure (`str`): the figure the drift alarm follows (default ``mean_abs_dlogp``, verl-omni's
            ``rollout_corr/logprob_abs_diff_mean``).
        drift_slack, drift_threshold (`float`): the one-sided CUSUM's k and h, in floor standard deviations
            (docs/monitor.md: the false-alarm rate per run and the detection delay they give, measured).
        drift_z_cap (`float`): each step adds at most this many standard deviations to the CUSUM (a winsorised
            CUSUM): one spike of kernel noise cannot cross h alone; a sustained rise crosses it in a few steps.
        drift_min_spread (`float`): the least standard deviation of ``log10`` of the drift figure the floor may
            have (decades): a floor measured flat over K steps must not make every wiggle an alarm.
        drift_epsilon (`float`): added to the drift figure before its ``log10`` (a floor of exact zeros is
            ``log10(drift_epsilon)``, so leaving bit-exact agreement is a drift at once).
        step_stride (`int`): the step increment expected between judged steps; another increment is a ``gap``
            alarm (the steps in between were not judged).
        on_alarm (`str`): ``log``, ``raise`` or ``stop`` (`ON_ALARM`).
        dump_dir (`str`, *optional*): where an alarmed step's tables are written (`write_dump`, checksummed), for
            ``rollout-consistency gate DUMP`` and ``doctor``; None writes none.
        max_dumps (`int`): at most this many dumps per run (the first alarms'): disk use stays bounded.
        prefix (`str`): the tracker names' prefix for our figures and for verl's names the monitor logs
            (``monitor/rollout_corr/...``: never the trainer's own bare ``rollout_corr/*`` series); non-empty,
            ending in ``/`` (``watch`` groups a run's series by it).
        max_alarms_kept (`int`): alarms kept in full in the summary (the rest are counted): memory stays bounded.
        distributed (`bool`): each rank holds a shard of the global batch (DDP, FSDP): every step's statistics are
            reduced across the ranks of torch.distributed's process group (one ``all_gather``,
            `reduce_step_stats`) before the verdict, so every rank judges the global batch, bit for bit the figures
            of one process; tracker logging, the doctor and warnings happen on rank 0 only (docs/monitor.md,
            "Under torch.distributed"). Needs an initialised process group. Default False: each process judges
            what it is given.
        max_timesteps (`int`): with ``distributed``, the per-timestep slots each rank sends; more distinct timestep
            values in a rank's shard is an error on every rank.
        reduce_timeout_s (`float`): with ``distributed``, how long a rank waits for the others at a step before a
            `DistributedMonitorError` (a rank crashed or skipped the monitor).

    Raises:
        MonitorError: a setting out of range, an unknown drift figure or ``on_alarm``, or a `TableSettings` the gate
            refuses.
    """

    gate: TableSettings = field(default_factory=TableSettings)
    warmup_steps: int = 20
    drift_figure: str = "mean_abs_dlogp"
    drift_slack: float = 1.0
    drift_threshold: float = 15.0
    drift_z_cap: float = 2.5
    drift_min_spread: float = 0.1
    drift_epsilon: float = 1e-12
    step_stride: int = 1
    on_alarm: str = "log"
    dump_dir: str | os.PathLike[str] | None = None
    max_dumps: int = 10
    prefix: str = "monitor/"
    max_alarms_kept: int = 100
    distributed: bool = False
    max_timesteps: int = DEFAULT_MAX_TIMESTEPS
    reduce_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.gate, TableSettings):
            raise MonitorError(f"gate must be a TableSettings, got {type(self.gate).__name__}.")
        if not isinstance(self.distributed, bool):
            raise MonitorError(f"distributed must be True or False, got {self.distributed!r}.")
        for name in ("warmup_steps", "step_stride", "max_dumps", "max_alarms_kept", "max_timesteps"):
            value = getattr(self, name)
            least = 0 if name == "max_dumps" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise MonitorError(f"{name} must be an int >= {least}, got {value!r}.")
        for name in (
            "drift_slack",
            "drift_threshold",
            "drift_z_cap",
            "drift_min_spread",
            "drift_epsilon",
            "reduce_timeout_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise MonitorError(f"{name} must be a finite number >= 0, got {value!r}.")
        if min(self.drift_threshold, self.drift_z_cap, self.drift_min_spread, self.drift_epsilon) <= 0:
            raise MonitorError("drift_threshold, drift_z_cap, drift_min_spread and drift_epsilon must be > 0.")
        if self.reduce_timeout_s <= 0:
            raise MonitorError("reduce_timeout_s must be > 0.")
        if self.drift_z_cap <= self.drift_slack:
            raise MonitorError("drift_z_cap must exceed drift_slack, or the CUSUM can never grow.")
        if self.drift_figure not in FIGURE_NAMES:
            raise MonitorError(f"drift_figure {self.drift_figure!r}: expected one of {', '.join(FIGURE_NAMES)}.")
        if not isinstance(self.prefix, str) or not self.prefix.endswith("/") or self.prefix.strip("/") == "":
            raise MonitorError(
                f"prefix {self.prefix!r}: give a non-empty prefix ending in '/' (e.g. 'monitor/'); bare names are "
                f"the trainer's own series."
            )
        if self.on_alarm not in ON_ALARM:
            raise MonitorError(f"on_alarm {self.on_alarm!r}: expected one of {', '.join(ON_ALARM)}.")

    def replace(self, **changes: Any) -> MonitorSettings:
        """A copy with `changes` applied (checked again); `TableSettings` fields are passed on to ``gate``."""
        names = {f.name for f in dataclasses.fields(self)}
        gate_names = {f.name for f in dataclasses.fields(TableSettings)}
        unknown = sorted(set(changes) - names - gate_names)
        if unknown:
            raise TypeError(
                f"unknown monitor setting(s) {', '.join(map(repr, unknown))}; the settings are MonitorSettings' "
                f"fields ({', '.join(sorted(names))}) and TableSettings' ({', '.join(sorted(gate_names))})."
            )
        own = {k: v for k, v in changes.items() if k in names}
        gate_changes = {k: v for k, v in changes.items() if k not in names}
        if gate_changes:
            try:
                own["gate"] = own.get("gate", self.gate).replace(**gate_changes)
            except GateInputError as error:
                raise MonitorError(str(error)) from error
        return dataclasses.replace(self, **own)
