# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Step-wise (continuous-batching) rollout: vLLM-omni's step protocol reproduced in PyTorch.

vLLM-omni's `step_execution` mode keeps one state per request and, at every engine step, runs
`denoise_step` on a batch of whichever requests are running (each possibly at a different denoising step),
then `step_scheduler` per request; requests join and leave between steps. This module is that loop, with
the consistency fixes for the known pitfalls (docs/design.md):

* per-request latents are float32 from the initial draw to the stored trajectory (cast to the
  transformer's dtype only inside the forward);
* prompt embeddings of different lengths are zero-padded to one shared width for the batched forward and
  the text RoPE lengths come from that padded width (`rollout_consistency.adapters.rope.padded_txt_seq_lens`, applied by the
  family's velocity function);
* each request owns its step index, its generator (seeded with its own seed: initial noise first, then one
  SDE draw per window step, as `rollout_consistency.adapters.rollout` documents) and its SDE window; the scheduler step is
  stateless (timesteps are looked up by value), so requests of one schedule share one scheduler.

For the same seeds, windows and conditioning a request's trajectory equals the request-level rollout's bit
for bit whenever every batched forward it took part in is the same computation for its row: the same text
width (pass `text_width` to fix it, or pad prompts to one width) and a batch size that takes the same kernels
(on this CPU build a single row takes a matrix-vector kernel, and some 3-row SD3 batches round differently).
Otherwise the difference is rounding-level (tested).

Layout: the per-request pieces are plain functions over plain dataclasses ([`RequestState`],
[`WindowRecord`]) so a vLLM-omni pipeline (`rollout_consistency.adapters.vllm_omni.worker`) can call them with its own state objects:
[`init_window_record`] / [`record_window_step`] / [`window_trajectory`] (trajectory assembly),
[`gather_latents`] (with vLLM-omni's mixed-dtype check), [`scheduler_step`] (one request, one step),
[`shared_text_width`] and the family's `collate_conditioning` (padding). Only [`denoise_step`] and
[`run_stepwise`] touch the torch forward. The settings shared by every request travel as one
[`SamplingSettings`](rollout_consistency.adapters.settings.SamplingSettings) (noise level, SDE type, guidance,
normaliser), a request's own as its [`StepwiseRequest`] (seed, window, prompt group, training step), and how
the engine batches as [`EngineSettings`] (running requests, text width).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rollout_consistency.schedulers import FlowMatchSDEDiscreteScheduler, SchedulerSetup, SDEWindow

from .batch_invariance import is_batch_invariant
from .families import ModelFamily, model_device
from .pitfalls import MixedDtypeBatchError
from .rollout import make_generators, recorded_experts
from .settings import BatchRequests, SamplingSettings
from .trajectory import Trajectory, stack_trajectories

__all__ = [
    "EngineSettings",
    "RequestState",
    "StepwiseRequest",
    "WindowRecord",
    "advance_request",
    "denoise_step",
    "gather_latents",
    "init_request",
    "init_window_record",
    "record_window_step",
    "run_stepwise",
    "running_experts",
    "scheduler_step",
    "shared_text_width",
    "stored_conditioning",
    "window_trajectory",
]


# ------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class StepwiseRequest:
    """One request submitted to the step-wise engine.

    Args:
        request_id: unique id. seed: the request's seed (initial + SDE noise).
        conditioning: batch-first tensors with one row (e.g. `prompt_embeds` (1, L, D), its own L).
        window: the request's SDE window (share one per prompt group: `rollout_consistency.schedulers.draw_sde_window`).
        prompt_group: its prompt-group id. arrival: engine step at which it may join (default 0).
        global_step: the training step it is sampled for (stored in its trajectory; a batch is one step).
    """

    request_id: str
    seed: int
    conditioning: Mapping[str, torch.Tensor]
    window: SDEWindow
    prompt_group: int = 0
    arrival: int = 0
    global_step: int = 0

    @property
    def requests(self) -> BatchRequests:
        """The request as a one-sample [`BatchRequests`] (seed, window, prompt group, training step)."""
        return BatchRequests(
            seeds=(self.seed,), windows=(self.window,), prompt_groups=(self.prompt_group,), global_step=self.global_step
        )


@dataclass(frozen=True)
class EngineSettings:
    """How the step-wise engine batches requests (vLLM-omni's engine arguments, as this loop reproduces them).

    Args:
        max_num_seqs: requests running together (vLLM-omni's `max_num_seqs`; default 4).
        text_width: the width every forward's text is padded to; `None`: the widest running request's, as
            vLLM-omni does (a fixed width keeps a request's forwards independent of its batch-mates).
    """

    max_num_seqs: int = 4
    text_width: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an int >= 1, got {self.max_num_seqs!r}.")
        if self.text_width is not None and (not isinstance(self.text_width, int) or self.text_width < 1):
            raise ValueError(f"text_width must be an int >= 1 or None, got {self.text_width!r}.")


@dataclass
class WindowRecord:
    """What one request stores, filled step by step (float32 tensors of shape `(1, ...)`): each window step's
    input, log-prob and timestep, the window's last output and, once the request has run its whole schedule,
    its `final_latents` (set by [`advance_request`]; an engine with its own loop sets it itself, or leaves it
    `None`: the trajectory then stores none)."""

    window: SDEWindow
    inputs: list[torch.Tensor] = field(default_factory=list)
    log_probs: list[torch.Tensor] = field(default_factory=list)
    timesteps: list[torch.Tensor] = field(default_factory=list)
    last_output: torch.Tensor | None = None
    experts: list[str | None] = field(default_factory=list)  # the expert of each step (experts by timestep only)
    final_latents: torch.Tensor | None = None

    @property
    def complete(self) -> bool:
        return self.last_output is not None


@dataclass
class RequestState:
    """Per-request state of the step-wise engine (mutable; one per running request)."""

    request: StepwiseRequest
    latents: torch.Tensor  # (1, *latent_shape), float32 (the stock reproduction keeps the model dtype)
    generator: torch.Generator
    scheduler: FlowMatchSDEDiscreteScheduler
    record: WindowRecord
    step_index: int = 0

    @property
    def num_steps(self) -> int:
        return len(self.scheduler.timesteps)

    @property
    def finished(self) -> bool:
        return self.step_index >= self.num_steps

    @property
    def current_timestep(self) -> torch.Tensor:
        return self.scheduler.timesteps[self.step_index].to(torch.float32)


# ------------------------------------------------------------------------------- plain functions
def init_window_record(window: SDEWindow) -> WindowRecord:
    return WindowRecord(window=window)


def record_window_step(
    record: WindowRecord,
    step_index: int,
    sample: torch.Tensor,
    timestep: torch.Tensor,
    log_prob: torch.Tensor,
    prev_sample: torch.Tensor,
    expert: str | None = None,
) -> None:
    """Store one window step of one request: its input `sample` (1, ...), `log_prob` (1,), `timestep`, the expert
    that took it (models with experts by timestep; `None` otherwise) and, at the window's last step, the drawn
    `prev_sample`. All float32; ValueError otherwise."""
    if step_index not in record.window:
        raise ValueError(f"Step {step_index} is outside the request's window {record.window}.")
    if len(record.inputs) != step_index - record.window.start:
        raise ValueError(
            f"Window step {step_index} recorded out of order (have {len(record.inputs)} of the window's steps)."
        )
    for name, tensor in (("sample", sample), ("log_prob", log_prob), ("prev_sample", prev_sample)):
        if tensor.dtype != torch.float32:
            raise TypeError(f"record_window_step: {name} is {tensor.dtype}; the trajectory stores float32 only.")
    record.inputs.append(sample.detach().clone())
    record.log_probs.append(log_prob.detach().reshape(1).clone())
    record.timesteps.append(torch.as_tensor(timestep, dtype=torch.float32).reshape(1).cpu())
    record.experts.append(expert)
    if step_index == record.window.stop - 1:
        record.last_output = prev_sample.detach().clone()


def window_trajectory(
    record: WindowRecord,
    *,
    requests: BatchRequests,
    sampling: SamplingSettings,
    conditioning: Mapping[str, torch.Tensor],
    model_family: str,
    scheduler_setup: SchedulerSetup,
    family_options: Mapping[str, Any],
    provenance: Mapping[str, str] | None = None,
) -> Trajectory:
    """One request's trajectory (B = 1) from its completed [`WindowRecord`]; validated.

    Args:
        requests ([`BatchRequests`] of one sample): its seed, prompt group and training step (and its window,
            which must be the record's; `StepwiseRequest.requests` builds it).
        sampling ([`SamplingSettings`]): the settings its steps were sampled with.
        conditioning: what its forwards saw (`stored_conditioning`). model_family, scheduler_setup,
            family_options: stored as given. provenance: default `{"path": "step-wise"}`.
    """
    if not record.complete:
        raise ValueError(f"The request's window {record.window} is not complete ({len(record.inputs)} steps recorded).")
    if len(requests.seeds) != 1 or requests.windows not in (None, record.window, (record.window,)):
        raise ValueError(
            f"window_trajectory assembles one request: pass its own one-sample BatchRequests (got "
            f"{len(requests.seeds)} seeds, windows {requests.windows} for a record of window {record.window})."
        )
    return Trajectory(
        latents=torch.stack([*record.inputs, record.last_output], dim=1),
        log_probs=torch.cat(record.log_probs).reshape(1, -1),
        timesteps=torch.cat(record.timesteps).reshape(1, -1).to(record.inputs[0].device),
        windows=(record.window,),
        noise_level=sampling.noise_level,
        sde_type=sampling.sde_type,
        guidance_scale=sampling.guidance_scale,
        seeds=requests.seeds,
        prompt_groups=requests.groups,
        global_step=requests.global_step,
        conditioning=dict(conditioning),
        model_family=model_family,
        scheduler=scheduler_setup,
        family_options=dict(family_options),
        include_normalizer=sampling.include_normalizer,
        final_latents=record.final_latents,
        provenance=dict(provenance or {"path": "step-wise"}),
        experts=recorded_experts([record.experts]),
    ).validate()


def gather_latents(latents: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-request latents `(1, ...)` into the batch for one forward.

    Raises:
        MixedDtypeBatchError: requests hold latents of different dtypes (vLLM-omni's "Mixed dtypes in latents
            batch." — the symptom of a step-wise path that keeps some request states in bf16).
    """
    if not latents:
        raise ValueError("Cannot gather an empty batch of requests.")
    dtypes = {t.dtype for t in latents}
    if len(dtypes) > 1:
        raise MixedDtypeBatchError(
            f"Mixed dtypes in latents batch ({', '.join(sorted(map(str, dtypes)))}): keep every request's latents in "
            f"float32 and cast to the transformer's dtype only for the forward."
        )
    shapes = {tuple(t.shape[1:]) for t in latents}
    if len(shapes) > 1:
        raise ValueError(f"Mixed latent shapes in one step-wise batch: {sorted(shapes)}.")
    return torch.cat(list(latents))


def shared_text_width(conditionings: Sequence[Mapping[str, torch.Tensor]], fixed: int | None = None) -> int:
    """Target width the running requests' text embeddings are padded to: `fixed`, or the widest of them."""
    widths = [t.shape[1] for c in conditionings for k, t in c.items() if t.dim() == 3]
    widest = max(widths, default=0)
    if fixed is None:
        return widest
    if fixed < widest:
        raise ValueError(f"text_width={fixed} is narrower than a running request's prompt ({widest} tokens).")
    return fixed


def scheduler_step(
    scheduler: FlowMatchSDEDiscreteScheduler,
    noise_pred: torch.Tensor,
    timestep: torch.Tensor,
    latents: torch.Tensor,
    *,
    in_window: bool,
    generator: torch.Generator,
    sampling: SamplingSettings,
):
    """One request's scheduler step in float32 (SDE inside its window, ODE outside): the scheduler output."""
    return scheduler.sample_previous_step(
        noise_pred.float(),
        timestep,
        latents,
        noise_level=sampling.noise_level if in_window else 0.0,
        sde_type=sampling.sde_type,
        generator=[generator] if in_window else None,
        include_normalizer=sampling.include_normalizer,
    )


def advance_request(
    state: RequestState, noise_pred: torch.Tensor, sampling: SamplingSettings, *, expert: str | None = None
) -> None:
    """`step_scheduler`: one scheduler step of one request in float32, recorded when inside its window.

    Args:
        noise_pred (`torch.Tensor` `(1, *latent_shape)`): the request's row of the batched forward.
        sampling ([`SamplingSettings`]): the noise level, SDE type and normaliser of the step.
        expert: the expert that computed it (models with experts by timestep: `ModelFamily.experts`), recorded.

    The request's state becomes the scheduler's `prev_sample` as returned (float32 from the project's scheduler;
    the `stepwise-bf16` reproduction's scheduler wrapper returns it in the model dtype). At the schedule's last
    step the record also keeps it, in float32, as the request's final latents.
    """
    step = state.step_index
    in_window = step in state.record.window
    sample = state.latents.to(torch.float32)
    out = scheduler_step(
        state.scheduler,
        noise_pred,
        state.current_timestep,
        sample,
        in_window=in_window,
        generator=state.generator,
        sampling=sampling,
    )
    prev = out.prev_sample
    if in_window:
        record_window_step(
            state.record, step, sample, state.current_timestep, out.log_prob, prev.to(torch.float32), expert
        )
    state.latents = prev
    state.step_index += 1
    if state.finished:
        state.record.final_latents = prev.to(torch.float32)


def stored_conditioning(
    family: ModelFamily, conditioning: Mapping[str, torch.Tensor], text_width: int | None
) -> dict[str, torch.Tensor]:
    """A request's conditioning as its trajectory stores it: every text padded to the width its forwards used
    (`text_width`, or its own widest text, the negative prompt included), so that the trainer's recompute runs
    the same forwards."""
    return family.collate_conditioning([conditioning], shared_text_width([conditioning], text_width))


def init_request(
    family: ModelFamily,
    transformer: nn.Module,
    request: StepwiseRequest,
    *,
    scheduler_setup: SchedulerSetup,
    options: Mapping[str, Any],
    scheduler: Any = None,
) -> RequestState:
    """`prepare_encode`: the request's generator, its float32 initial latents and the scheduler it steps with
    (`scheduler`, default: the setup's cached one)."""
    window = request.window
    if window.num_steps != scheduler_setup.num_inference_steps:
        raise ValueError(
            f"Request {request.request_id}: window {window} lies outside the {scheduler_setup.num_inference_steps}-step "
            f"schedule."
        )
    (generator,) = make_generators([request.seed])
    latents = family.initial_latents(transformer, [generator], options).to(model_device(transformer), torch.float32)
    # Requests share the setup's cached scheduler: a request's step is the stateless `sample_previous_step`
    # (timesteps looked up by value), and its progress is `RequestState.step_index`, not scheduler state.
    return RequestState(
        request=request,
        latents=latents,
        generator=generator,
        scheduler=scheduler_setup.scheduler() if scheduler is None else scheduler,
        record=init_window_record(window),
    )


def denoise_step(
    family: ModelFamily,
    transformer: nn.Module,
    states: Sequence[RequestState],
    *,
    sampling: SamplingSettings,
    options: Mapping[str, Any],
    text_width: int | None = None,
) -> torch.Tensor:
    """One batched forward over the running requests: noise_pred `(B, *latent_shape)` float32.

    Gathers the per-request latents (mixed dtypes are an error), pads every request's text to the shared
    width (`text_width`, or the widest running request's), and calls the family's velocity with per-request
    timesteps and `sampling.guidance_scale`.
    """
    latents = gather_latents([s.latents for s in states])
    # Stock reproduction only: bf16-held states are upcast losslessly for the velocity (which takes float32);
    # the damage was already done when the state was rounded.
    latents = latents.to(torch.float32)
    conditionings = [s.request.conditioning for s in states]
    width = shared_text_width(conditionings, text_width)
    conditioning = family.collate_conditioning(conditionings, width)
    conditioning = {k: v.to(latents.device) for k, v in conditioning.items()}
    timesteps = torch.stack([s.current_timestep for s in states]).to(latents.device)
    return family.velocity(transformer, latents, timesteps, conditioning, sampling.guidance_scale, options=options)


def running_experts(
    family: ModelFamily, transformer: nn.Module, states: Sequence[RequestState], options: Mapping[str, Any]
) -> tuple[str, ...] | None:
    """The expert each running request's step takes (the one [`denoise_step`]'s forward used for its row), or None
    for a model without experts by timestep."""
    if family.experts is None:
        return None
    timesteps = torch.stack([s.current_timestep for s in states]).to(model_device(transformer))
    return family.experts(transformer, timesteps, options)


def run_stepwise(
    family: ModelFamily,
    transformer: nn.Module,
    requests: Sequence[StepwiseRequest],
    *,
    scheduler_setup: SchedulerSetup,
    sampling: SamplingSettings,
    options: Mapping[str, Any] | None = None,
    engine: EngineSettings | None = None,
    scheduler: Any = None,
) -> Trajectory:
    """Continuous-batching rollout of `requests`; returns one trajectory, rows in the order of `requests`.

    Each engine step admits waiting requests whose `arrival` has come (up to `engine.max_num_seqs` running),
    runs one batched forward ([`denoise_step`]), takes one scheduler step per request, and retires finished
    requests. The text of each forward is padded to `engine.text_width` (fixed) or to the widest running prompt
    (`None`, as vLLM-omni does). Requests run the whole schedule (their final latents are stored). `scheduler`
    (default: the setup's cached one) is what every request steps with, as in
    `rollout_consistency.adapters.rollout.rollout`. `sampling` ([`SamplingSettings`]) is every request's; each
    request carries its own seed, window, prompt group and training step (one step for the whole batch).
    `engine` defaults to [`EngineSettings`]`()`.

    Raises:
        MixedDtypeBatchError: only under the `stepwise-bf16` reproduction, when a fresh float32 request joins
            running bf16 ones.
    """
    options = dict(options or {})
    engine = EngineSettings() if engine is None else engine
    max_num_seqs, text_width = engine.max_num_seqs, engine.text_width
    if not requests:
        raise ValueError("run_stepwise needs at least one request.")
    if len({r.request_id for r in requests}) != len(requests):
        raise ValueError("Request ids must be unique.")
    for request in requests:
        family.check_conditioning(transformer, request.conditioning, 1, sampling.guidance_scale, options)
    if text_width is None and is_batch_invariant(transformer):
        # Text embeddings are the (1, L, D) conditioning tensors.
        widths = {int(t.shape[1]) for r in requests for t in r.conditioning.values() if t.dim() == 3}
        if len(widths) > 1:
            raise ValueError(
                f"Batch-invariant mode needs one text width for every forward, but the requests' texts are "
                f"{sorted(widths)} tokens wide and text_width=None pads them to the running batch's widest (which "
                f"depends on the batch-mates). Pass engine=EngineSettings(text_width={max(widths)})."
            )

    waiting = deque(sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i)))
    running: list[tuple[int, RequestState]] = []
    finished: dict[int, RequestState] = {}
    engine_step = 0
    with torch.no_grad():
        while waiting or running:
            while waiting and len(running) < max_num_seqs and requests[waiting[0]].arrival <= engine_step:
                index = waiting.popleft()
                state = init_request(
                    family,
                    transformer,
                    requests[index],
                    scheduler_setup=scheduler_setup,
                    options=options,
                    scheduler=scheduler,
                )
                running.append((index, state))
            if not running:
                engine_step += 1
                continue
            states = [s for _, s in running]
            noise_pred = denoise_step(
                family, transformer, states, sampling=sampling, options=options, text_width=text_width
            )
            experts = running_experts(family, transformer, states, options)
            for row, state in enumerate(states):
                advance_request(
                    state, noise_pred[row : row + 1], sampling, expert=None if experts is None else experts[row]
                )
            still_running = []
            for index, state in running:
                if state.finished:
                    finished[index] = state
                else:
                    still_running.append((index, state))
            running = still_running
            engine_step += 1

    provenance = {"path": "step-wise", "max_num_seqs": str(max_num_seqs)}
    injected = [getattr(x, "injection_name", None) for x in (scheduler, transformer)]
    if any(injected):
        provenance["injection"] = ",".join(n for n in injected if n)
    trajectories = [
        window_trajectory(
            finished[i].record,
            requests=r.requests,
            sampling=sampling,
            conditioning=stored_conditioning(family, r.conditioning, text_width),
            model_family=family.name,
            scheduler_setup=scheduler_setup,
            family_options=options,
            provenance=provenance,
        )
        for i, r in enumerate(requests)
    ]
    return stack_trajectories(trajectories, family)
