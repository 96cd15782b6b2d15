# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""A tiny flow_grpo-style GRPO loop watched by the run monitor at every step, with bugs to switch on mid-run.

Shape of flow_grpo's ``train.py`` kept here (CPU, a few milliseconds a step): the rollout samples with the
project's FlowMatch SDE scheduler and returns flow_grpo's ``samples`` dict (``latents``, ``next_latents``,
``log_probs``, ``timesteps``, ``prompt_embeds``, ``advantages`` from per-prompt-group rewards); training shuffles
the samples (``torch.randperm``) and each sample's timesteps, loops over micro-batches and timesteps with the
clipped loss, and updates after each micro-batch — so only the first micro-batch of a step is scored by the
weights the rollout used. Rollout and trainer hold separate modules (an engine and a trainer would); after each
update the trainer's weights are synced into the rollout's. The policy is a small velocity MLP on 16-dim latents
conditioned on the timestep and the prompt embedding.

The monitor's hooks, as a user adds them::

    monitor = RunMonitor(settings, optimizer=optimizer)    # the first real update of each step ends it
    for step in range(steps):
        samples = rollout(...)
        monitor.begin_step(step)
        for micro-batch, for j:                             # flow_grpo's inner loop
            log_prob = compute_log_prob(...)
            monitor.record(samples["log_probs"][rows, j], log_prob, timesteps=samples["timesteps"][rows, j])
            ...
        if monitor.should_stop: break

Bugs `run_loop(bug=..., bug_step=k)` switches on at step k (each the way it happens in real runs):

``sync-drops-layer``  a resume at step k restarts the rollout engine from the base weights and syncs the trainer's
                      state dict with one layer's keys under a ``module.`` prefix, loaded with ``strict=False``:
                      that layer keeps the base weights (the monitor is told of the sync: ``mark_sync``)
``ema-bf16``          from step k the rollout takes its weights through an EMA swap whose copy is bfloat16
``noise-schedule``    from step k a schedule lowers the rollout's ``noise_level`` (0.7 -> 0.6); the trainer keeps 0.7
``drift``             from step k the rollout's weights carry an error that grows 35 % a step from 1e-9 (a slow
                      drift: the mismatch reaches the clip range only after tens of steps)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rollout_consistency.gate.monitor import RunMonitor, StepVerdict
from rollout_consistency.schedulers import FlowMatchSDEDiscreteScheduler

D, HIDDEN, GROUPS, GROUP_SIZE, STEPS = 16, 32, 2, 4, 4
BATCH = GROUPS * GROUP_SIZE
MICRO_BATCH = 4
NOISE_LEVEL = 0.7
CLIP_RANGE = 1e-4
DRIFT_GROWTH = 1.35
BUGS = ("sync-drops-layer", "ema-bf16", "noise-schedule", "drift")


class VelocityModel(nn.Module):
    """v(x, t, prompt): three linear layers (``net.0``, ``net.2``, ``net.4``). ``float64=True`` computes the same
    maths in float64 and rounds the output to float32: a correct engine in other code, which differs from the
    trainer's float32 forward by float32 rounding (a clean run that is not bit-exact)."""

    def __init__(self, seed: int = 0, *, float64: bool = False) -> None:
        super().__init__()
        self.float64 = float64
        generator = torch.Generator().manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(2 * D + 1, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, HIDDEN), nn.SiLU())
        self.net.append(nn.Linear(HIDDEN, D))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))

    def forward(self, x: torch.Tensor, t: torch.Tensor, prompt_embeds: torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(t, dtype=torch.float32).expand(x.shape[0])[:, None] / 1000.0
        inputs = torch.cat([x, prompt_embeds, t], dim=1)
        if self.float64:
            return torch.func.functional_call(
                self.net, {k: v.double() for k, v in self.net.state_dict().items()}, (inputs.double(),)
            ).float()
        return self.net(inputs)


def scheduler() -> FlowMatchSDEDiscreteScheduler:
    s = FlowMatchSDEDiscreteScheduler()
    s.set_timesteps(STEPS)
    return s


def rollout(
    model: nn.Module, sched: Any, prompt_embeds: torch.Tensor, generator: torch.Generator, noise_level: float
) -> dict:
    """flow_grpo's ``samples`` dict: (B, T, D) latents and next_latents, (B, T) float32 log_probs and timesteps."""
    x = torch.randn(BATCH, D, generator=generator)
    latents, next_latents, log_probs = [], [], []
    with torch.no_grad():
        for t in sched.timesteps:
            v = model(x, t, prompt_embeds)
            out = sched.sample_previous_step(v, t, x, noise_level=noise_level, generator=generator)
            latents.append(x)
            next_latents.append(out.prev_sample)
            log_probs.append(out.log_prob)
            x = out.prev_sample
    reward = -((x - prompt_embeds) ** 2).mean(dim=1)  # reach the prompt's point
    grouped = reward.view(GROUPS, GROUP_SIZE)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)
    return {
        "prompt_embeds": prompt_embeds,
        "latents": torch.stack(latents, 1),
        "next_latents": torch.stack(next_latents, 1),
        "log_probs": torch.stack(log_probs, 1),
        "timesteps": sched.timesteps.expand(BATCH, STEPS).clone(),
        "advantages": advantages,
    }


def compute_log_prob(model: nn.Module, sched: Any, sample: dict, j: int) -> torch.Tensor:
    """The trainer's recompute of SDE step column `j` for the rows of `sample` (flow_grpo's compute_log_prob)."""
    v = model(sample["latents"][:, j], sample["timesteps"][:, j], sample["prompt_embeds"])
    return sched.sample_previous_step(
        v,
        sample["timesteps"][:, j],
        sample["latents"][:, j],
        noise_level=NOISE_LEVEL,
        prev_sample=sample["next_latents"][:, j],
    ).log_prob


@dataclass
class LoopResult:
    """What a run left: the monitor (its summary, alarm records), each step's verdict, and the mean |Δlogp| the
    monitor measured at each step."""

    monitor: RunMonitor
    verdicts: list[StepVerdict] = field(default_factory=list)
    mean_abs: list[float] = field(default_factory=list)

    def first_alarm(self, kinds: tuple[str, ...] | None = None) -> int | None:
        for verdict in self.verdicts:
            if any(kinds is None or a.kind in kinds for a in verdict.alarms):
                return verdict.step
        return None


def run_loop(
    monitor_settings: Any,
    *,
    seed: int = 0,
    steps: int = 50,
    bug: str | None = None,
    bug_step: int = 20,
    log_to: Any = None,
    engine_float64: bool = False,
) -> LoopResult:
    """Train `steps` GRPO steps with the monitor watching; `bug` (one of `BUGS`) switches on at `bug_step`;
    ``engine_float64`` gives the rollout engine a float64 forward (a clean floor of float32 rounding)."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; one of {', '.join(BUGS)}.")
    torch.manual_seed(seed)  # nothing below draws from it; seeded so a stray draw is reproducible
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randn(GROUPS, D, generator=generator).repeat_interleave(GROUP_SIZE, 0)
    trainer = VelocityModel(seed)
    engine = VelocityModel(seed, float64=engine_float64)
    optimizer = torch.optim.Adam(trainer.parameters(), lr=3e-3)
    monitor = RunMonitor(monitor_settings, optimizer=optimizer, log_to=log_to)
    result = LoopResult(monitor)
    sched = scheduler()
    drift_noise = [torch.randn(p.shape, generator=torch.Generator().manual_seed(99)) for p in engine.parameters()]
    for step in range(steps):
        active = bug is not None and step >= bug_step
        noise_level = 0.6 if active and bug == "noise-schedule" else NOISE_LEVEL
        if active and bug == "sync-drops-layer" and step == bug_step:
            engine = VelocityModel(seed, float64=engine_float64)  # the engine restarts from the base weights ...
            state = {("module." + k if k.startswith("net.2.") else k): v for k, v in trainer.state_dict().items()}
            engine.load_state_dict(state, strict=False)  # ... and net.2 never loads
            monitor.mark_sync()
        samples = rollout(engine, sched, prompts, generator, noise_level)
        monitor.begin_step(step)
        train(trainer, sched, optimizer, samples, generator, monitor)
        verdict = monitor.last_verdict
        assert verdict is not None and verdict.step == step
        result.verdicts.append(verdict)
        result.mean_abs.append(monitor.last_figures.values["mean_abs_dlogp"])
        # The sync after step s makes the weights step s+1 samples with: a sync bug switched on at k acts there.
        sync(
            engine, trainer, bug if bug is not None and step + 1 >= bug_step else None, step + 1 - bug_step, drift_noise
        )
        if monitor.should_stop:
            break
    monitor.close()
    return result


def train(
    trainer: nn.Module, sched: Any, optimizer: Any, samples: dict, generator: torch.Generator, monitor: RunMonitor
) -> None:
    """flow_grpo's inner loop: shuffle samples and timesteps; clipped loss; an update after each micro-batch."""
    perm = torch.randperm(BATCH, generator=generator)
    samples = {k: v[perm] for k, v in samples.items()}
    order = torch.stack([torch.randperm(STEPS, generator=generator) for _ in range(BATCH)])
    rows = torch.arange(BATCH)[:, None]
    for key in ("latents", "next_latents", "log_probs", "timesteps"):
        samples[key] = samples[key][rows, order]
    for start in range(0, BATCH, MICRO_BATCH):
        sample = {k: v[start : start + MICRO_BATCH] for k, v in samples.items()}
        for j in range(STEPS):
            log_prob = compute_log_prob(trainer, sched, sample, j)
            monitor.record(sample["log_probs"][:, j], log_prob, timesteps=sample["timesteps"][:, j])
            ratio = torch.exp(log_prob - sample["log_probs"][:, j])
            advantages = sample["advantages"]
            unclipped = -advantages * ratio
            clipped = -advantages * torch.clamp(ratio, 1.0 - CLIP_RANGE, 1.0 + CLIP_RANGE)
            (torch.maximum(unclipped, clipped).mean() / STEPS).backward()
        optimizer.step()
        optimizer.zero_grad()


def sync(engine: nn.Module, trainer: nn.Module, bug: str | None, since: int, drift_noise: list) -> None:
    """The weight sync after the update (a full state dict), with the bug that is on."""
    state = trainer.state_dict()
    if bug == "sync-drops-layer":
        state = {("module." + k if k.startswith("net.2.") else k): v for k, v in state.items()}
        engine.load_state_dict(state, strict=False)
        return
    engine.load_state_dict(state)
    with torch.no_grad():
        if bug == "ema-bf16":
            for p in engine.parameters():
                p.copy_(p.to(torch.bfloat16))
        elif bug == "drift":
            scale = 1e-9 * DRIFT_GROWTH**since
            for p, noise in zip(engine.parameters(), drift_noise, strict=True):
                p.add_(scale * noise)


def steps_to_clip(result: LoopResult, clip: float = CLIP_RANGE) -> int | None:
    """The first step whose mean |Δlogp| reaches the clip range (None if none does)."""
    return next((v.step for v, m in zip(result.verdicts, result.mean_abs, strict=True) if m >= clip), None)


__all__ = ["BUGS", "LoopResult", "VelocityModel", "run_loop", "steps_to_clip"]
