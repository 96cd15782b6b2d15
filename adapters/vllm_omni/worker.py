# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Per-request engine state: the plain functions the pipeline in vLLM-omni's worker runs for each request.

One function per method of vLLM-omni's step protocol (the pipeline's request mode runs the same four):

    prepare_encode  → start_request     the request's generator, float32 initial latents, its own scheduler
    denoise_step    → batch_noise_pred  one batched forward over the running requests, float32 noise_pred
    step_scheduler  → advance_request   one float32 scheduler step of one request, recorded in its window
    post_decode     → finish_request    the request's validated float32 `Trajectory`

and the request mode's wave over them ([`decode_wave`], [`run_request_wave`]), shared by both pipeline classes.

They wrap `rollout_consistency.adapters.stepwise` (the PyTorch step-wise path's per-request state and step),
so both engines step, record and assemble trajectories with the same code; they run on the CPU with the
diffusers transformer, and on vLLM-omni's transformer through [`TransformerView`].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from rollout_consistency.adapters import stepwise
from rollout_consistency.adapters.families import ModelFamily, get_family
from rollout_consistency.adapters.rollout import make_generators
from rollout_consistency.adapters.rope import takes_txt_seq_lens
from rollout_consistency.adapters.trajectory import Trajectory

from .protocol import BatchSettings, RolloutRequest

__all__ = [
    "RolloutState",
    "TransformerView",
    "advance_request",
    "batch_experts",
    "batch_noise_pred",
    "decode_wave",
    "finish_request",
    "run_request_wave",
    "start_request",
]

OutputT = TypeVar("OutputT")
ItemT = TypeVar("ItemT")


@dataclass(frozen=True)
class _ConfigView:
    in_channels: int
    joint_attention_dim: int


class TransformerView:
    """A transformer as the family functions see it: `.config.in_channels`, `.config.joint_attention_dim`,
    `.parameters()` and a call taking `txt_seq_lens`.

    vLLM-omni's `QwenImageTransformer2DModel` has no diffusers `.config`; this view lends it one (the module
    itself is not modified) so `rollout_consistency.adapters.qwen_image`'s velocity, initial-noise and conditioning checks run on
    it unchanged. Calls go straight to the module; `txt_seq_lens` is passed on only if the module takes it.
    """

    def __init__(self, module: nn.Module, *, in_channels: int, joint_attention_dim: int):
        self.module = module
        self.config = _ConfigView(int(in_channels), int(joint_attention_dim))
        self._passes_lengths = takes_txt_seq_lens(module)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def forward(self, *, txt_seq_lens: Sequence[int] | None = None, **kwargs: Any):
        if self._passes_lengths:
            kwargs["txt_seq_lens"] = txt_seq_lens
        return self.module(**kwargs)

    def __call__(self, **kwargs: Any):
        return self.forward(**kwargs)


@dataclass
class RolloutState:
    """The engine's state of one request (kept in vLLM-omni's `StepRequestState.extra[PAYLOAD_KEY]`).

    `state` is `rollout_consistency.adapters.stepwise.RequestState` — the PyTorch step-wise path's own per-request state — so
    both engines step, record and assemble trajectories with the same functions.
    """

    request: RolloutRequest
    state: stepwise.RequestState
    provenance: Mapping[str, str] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.state.finished


def _family(batch: BatchSettings) -> ModelFamily:
    return get_family(batch.model_family)


def start_request(
    request: RolloutRequest,
    conditioning: Mapping[str, torch.Tensor],
    transformer: TransformerView | nn.Module,
    *,
    device: torch.device | str,
    provenance: Mapping[str, str] | None = None,
) -> RolloutState:
    """`prepare_encode`: the request's generator, float32 initial latents `(1, S, C)` and its own scheduler.

    Args:
        request: the decoded request.
        conditioning: its conditioning with one row (sent, or encoded by the engine).
        transformer: anything with `.config.in_channels` / `.config.joint_attention_dim` (a diffusers model,
            or a [`TransformerView`]).
        device: where the latents and conditioning live (the transformer's device).
    """
    batch = request.batch
    family = _family(batch)
    family.check_conditioning(transformer, conditioning, 1, batch.guidance_scale, batch.options)
    (generator,) = make_generators([request.request.seed])
    latents = family.initial_latents(transformer, [generator], batch.options).to(device=device, dtype=torch.float32)
    scheduler = batch.scheduler.build()
    step_request = stepwise.StepwiseRequest(
        request_id=f"sample-{request.request.sample_index}",
        seed=request.request.seed,
        conditioning={k: v.to(device) for k, v in conditioning.items()},
        window=request.window,
        prompt_group=request.request.prompt_group,
        global_step=request.request.global_step,
    )
    state = stepwise.RequestState(
        request=step_request,
        latents=latents,
        generator=generator,
        scheduler=scheduler,
        record=stepwise.init_window_record(request.window),
    )
    return RolloutState(request=request, state=state, provenance=dict(provenance or {}))


def _forward_settings(batch: BatchSettings) -> tuple:
    return (batch.model_family, batch.guidance_scale, tuple(sorted(batch.options.items())), batch.text_width)


def batch_noise_pred(transformer: TransformerView | nn.Module, states: Sequence[RolloutState]) -> torch.Tensor:
    """`denoise_step`: one batched forward over the running requests, noise_pred `(B, S, C)` float32, rows in
    `states` order. Requests may be at different steps; text is padded to the shared width.

    Raises:
        ValueError: the requests need different forwards (CFG scale, image size, text width).
        rollout_consistency.adapters.pitfalls.MixedDtypeBatchError: a request's latents are not float32.
    """
    if not states:
        raise ValueError("batch_noise_pred needs at least one running request.")
    batch = states[0].request.batch
    if any(_forward_settings(s.request.batch) != _forward_settings(batch) for s in states[1:]):
        raise ValueError(
            "Requests with different forward settings (guidance, image size, text width) landed in one batch; send "
            "them in separate generate calls (vLLM-omni does not key step batches on extra_args)."
        )
    return stepwise.denoise_step(
        _family(batch),
        transformer,
        [s.state for s in states],
        sampling=batch.sampling,
        options=batch.options,
        text_width=batch.text_width,
    )


def batch_experts(transformer: nn.Module, states: Sequence[RolloutState]) -> tuple[str, ...] | None:
    """The expert each running request's row of [`batch_noise_pred`] took (Wan 2.2's two experts), or None for
    a family without experts by timestep; pass each request its own to [`advance_request`] to record it."""
    batch = states[0].request.batch
    return stepwise.running_experts(_family(batch), transformer, [s.state for s in states], batch.options)


def advance_request(rollout: RolloutState, noise_pred: torch.Tensor, expert: str | None = None) -> None:
    """`step_scheduler`: one scheduler step of one request, in float32; records the step inside the window.

    Args:
        noise_pred (`torch.Tensor` `(1, S, C)`, float32): the request's row of [`batch_noise_pred`].
        expert: the expert that computed it ([`batch_experts`]), recorded with the step.
    """
    state, batch = rollout.state, rollout.request.batch
    if state.finished:
        raise ValueError(f"{state.request.request_id} has already run its {state.num_steps} steps.")
    if noise_pred.dtype != torch.float32 or tuple(noise_pred.shape) != tuple(state.latents.shape):
        raise TypeError(
            f"advance_request takes this request's float32 noise_pred {tuple(state.latents.shape)}, got "
            f"{noise_pred.dtype} {tuple(noise_pred.shape)}: cast the transformer output with .float() before the scheduler."
        )
    stepwise.advance_request(state, noise_pred, batch.sampling, expert=expert)


def finish_request(rollout: RolloutState) -> Trajectory:
    """`post_decode`: the request's validated float32 [`Trajectory`] (B = 1), final latents included.

    The stored conditioning is padded as its forwards padded it (`stepwise.stored_conditioning`).
    """
    state, request = rollout.state, rollout.request
    batch = request.batch
    if not state.finished:
        raise ValueError(f"{state.request.request_id} stopped at step {state.step_index} of {state.num_steps}.")
    conditioning = stepwise.stored_conditioning(_family(batch), state.request.conditioning, batch.text_width)
    return stepwise.window_trajectory(
        state.record,
        requests=state.request.requests,
        sampling=batch.sampling,
        conditioning=conditioning,
        model_family=batch.model_family,
        scheduler_setup=batch.scheduler,
        family_options=batch.options,
        provenance={"path": "vllm-omni", **rollout.provenance},
    )


def decode_wave(
    requests: Sequence[ItemT], decode: Callable[[ItemT], RolloutRequest | None]
) -> list[RolloutRequest | Exception | None]:
    """Each request of a wave decoded (`None`: vLLM-omni's warm-up request), or the error that refused it: a bad
    request fails alone, with its reason, in [`run_request_wave`]."""
    decoded: list[RolloutRequest | Exception | None] = []
    for request in requests:
        try:
            decoded.append(decode(request))
        except Exception as error:
            decoded.append(error)
    return decoded


def run_request_wave(
    model: TransformerView | nn.Module,
    request_ids: Sequence[str],
    decoded: Sequence[RolloutRequest | Exception | None],
    *,
    start: Callable[[int, RolloutRequest], RolloutState],
    finish: Callable[[RolloutState], OutputT],
    failed: Callable[[str, BaseException], OutputT],
) -> list[OutputT]:
    """Request mode: a wave's requests stepped together, one output each, in request order.

    Each request is started (`start(index, request)`), then every step is one batched forward over the running
    requests ([`batch_noise_pred`], without grad: a rollout never backpropagates, whatever grad mode the engine
    runs it in) and one float32 scheduler step per request ([`advance_request`], recording the expert each row
    took), until each finishes (`finish(state)`, without grad: the VAE decode). A request that cannot start or
    step fails alone: `failed(request_id, error)`; a request of another kind (`None` in `decoded` beside ours) is
    refused. `request_ids` and `decoded` are the wave's requests in order (the same length).
    """
    outputs: list[OutputT | None] = [None] * len(request_ids)
    running: list[tuple[int, RolloutState]] = []
    for index, (request_id, item) in enumerate(zip(request_ids, decoded, strict=True)):
        try:
            if isinstance(item, Exception):
                raise item
            if item is None:
                raise ValueError("A request wave mixes rollout-consistency requests with plain ones.")
            running.append((index, start(index, item)))
        except Exception as error:
            outputs[index] = failed(request_id, error)
    while running:
        rollouts = [rollout for _, rollout in running]
        with torch.no_grad():
            noise_pred = batch_noise_pred(model, rollouts)
        experts = batch_experts(model, rollouts)
        still_running = []
        for row, (index, rollout) in enumerate(running):
            try:
                advance_request(rollout, noise_pred[row : row + 1], None if experts is None else experts[row])
                if rollout.finished:
                    with torch.no_grad():
                        outputs[index] = finish(rollout)
                else:
                    still_running.append((index, rollout))
            except Exception as error:
                outputs[index] = failed(request_ids[index], error)
        running = still_running
    return outputs  # type: ignore[return-value]
