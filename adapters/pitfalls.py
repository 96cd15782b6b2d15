# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Reproductions of the stock pitfalls — each one a *known bug*, kept on purpose — as wrappers.

Nothing in this module is a recommended code path. It exists so that tests and the checker
(`--inject NAME`) can show each pitfall's signature next to the fixed path. Each reproduction wraps what a
rollout is given — its scheduler, its transformer, or its windows — so the rollout code itself has no
switch for it: [`apply_injection`] applies one by name, and the checker applies it to the rollout side only.

| `--inject` name        | wrapper                         | what the stock code did                               | the fix (default path)                  |
|------------------------|---------------------------------|-------------------------------------------------------|-----------------------------------------|
| `bf16-latents`         | [`StockRoundedLatents`]         | scheduler casts `prev_sample` to the model dtype;     | latents stay float32; cast only for the |
|                        | (scheduler)                     | that rounded sample is stored and fed on, the         | forward (`sample_previous_step`)        |
|                        |                                 | log-prob was computed from the unrounded one          |                                         |
| `stepwise-bf16`        | [`StockModelDtypeLatents`]      | step-wise per-request latents kept in the model       | per-request latents float32 throughout  |
|                        | (scheduler)                     | dtype; a fresh float32 request joining them fails     |                                         |
| `mask-sum-rope`        | [`StockMaskSumRope`]            | Qwen-Image `txt_seq_lens` from `mask.sum()` (valid    | `padded_txt_seq_lens`: the padded width |
|                        | (transformer)                   | tokens)                                               |                                         |
| `per-request-window`   | [`stock_per_request_window`]    | SDE window drawn per request from an unseeded RNG     | `draw_sde_window` per prompt group,     |
|                        | (windows)                       |                                                       | seeded explicitly                       |
| `expert-switch`        | [`StockLateExpertSwitch`]       | Wan 2.2: the switch to `transformer_2` taken one step | both sides ask the model which expert   |
|                        | (transformer)                   | late (a step index off by one against the boundary)   | a timestep takes (`t >= boundary`)      |

When each one shows (so a check that injects it sees a signature):

* `bf16-latents`: only with a low-precision transformer (bf16/fp16 weights); with fp32 weights the cast is a
  no-op. Signature: log-ratio < 0 on average, clipping on the lower side only.
* `stepwise-bf16`: the step-wise path only, with a low-precision transformer. Same signature; plus
  [`MixedDtypeBatchError`] when a float32 request joins running low-precision ones.
* `mask-sum-rope`: a transformer that takes `txt_seq_lens` (`rollout_consistency.adapters.rope.QwenImageTransformerTxtSeqLens`,
  which `load_qwen_image` builds), prompt embeddings padded past the longest prompt of the forward (e.g.
  `pad_text_conditioning(cond, width)` or the step-wise shared width), and padded text keys reaching
  attention (`mask_text_padding=False`: attention without a key-padding mask). Under an exact key-padding
  mask the padded positions are invisible to the image tokens and the wrong RoPE changes nothing — the tests
  show that too.
* `per-request-window`: rollouts of one prompt group get different windows; the step-1 ratio stays 1
  (the trainer re-scores the stored steps), so the signature is structural: `Trajectory.windows` disagree
  within a prompt group.
* `expert-switch`: a model with two experts by timestep (Wan 2.2, `rollout_consistency.adapters.wan.WanExperts`)
  and an SDE window holding the first low-noise step. Signature: the log-ratio is non-zero at exactly that step
  and the recorded experts (`Trajectory.experts` against the trainer's) differ there.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rollout_consistency.schedulers import SDEWindow

from .families import model_dtype
from .rope import stock_mask_sum_txt_seq_lens, takes_txt_seq_lens

__all__ = [
    "INJECTION_NAMES",
    "Injected",
    "MixedDtypeBatchError",
    "StockLateExpertSwitch",
    "StockMaskSumRope",
    "StockModelDtypeLatents",
    "StockRoundedLatents",
    "apply_injection",
    "stock_per_request_window",
    "stock_round_to_model_dtype",
]

INJECTION_NAMES = ("bf16-latents", "stepwise-bf16", "mask-sum-rope", "per-request-window", "expert-switch")


class MixedDtypeBatchError(ValueError):
    """Raised (as vLLM-omni's input batch does) when requests with latents of different dtypes are batched."""


def stock_round_to_model_dtype(prev_sample: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
    """REPRODUCTION of diffusers' `FlowMatchEulerDiscreteScheduler.step` ending (`prev_sample.to(model_output.dtype)`).

    Returns the sample rounded to `model_dtype`, held in a float32 tensor: the value the stock rollout stored
    and fed to the next step, while its log-prob had been computed from the unrounded float32 sample.
    """
    return prev_sample.to(model_dtype).to(torch.float32)


def stock_per_request_window(
    request_id: str,
    *,
    num_steps: int,
    window_size: int,
    window_range: tuple[int, int] | None = None,
    rng: random.Random | None = None,
) -> SDEWindow:
    """REPRODUCTION of the per-request SDE window: a start drawn from the request id and an unseeded RNG.

    The stock code mixed a hash of the request id into a generator that no launcher seed reached, so two
    rollouts of one prompt got windows at different timesteps. `rng` defaults to an OS-entropy-seeded
    `random.Random()` exactly for that reason; tests pass their own to be deterministic. The fix is
    `rollout_consistency.schedulers.draw_sde_window(seed=..., global_step=..., prompt_group=...)`.
    """
    low, high = (0, num_steps) if window_range is None else window_range
    rng = rng if rng is not None else random.Random()  # unseeded on purpose: this is the bug
    # rollout-consistency: ignore[non-launcher-seed] deliberate reproduction (--inject per-request-window)
    mixed = random.Random(f"{request_id}/{rng.random()}")
    start = mixed.randint(low, high - window_size)
    return SDEWindow(start=start, size=window_size, num_steps=num_steps)


class StockRoundedLatents:
    """REPRODUCTION (`bf16-latents`): a scheduler whose `sample_previous_step` returns `prev_sample` rounded to
    `dtype`, held in float32 — the value the stock rollout stored and fed on (see
    [`stock_round_to_model_dtype`]). Everything else is the wrapped scheduler's."""

    injection_name = "bf16-latents"

    def __init__(self, scheduler: Any, dtype: torch.dtype):
        self.scheduler = scheduler
        self.dtype = dtype

    def sample_previous_step(self, *args: Any, **kwargs: Any) -> Any:
        out = self.scheduler.sample_previous_step(*args, **kwargs)
        out.prev_sample = self._cast(out.prev_sample)
        return out

    def _cast(self, prev_sample: torch.Tensor) -> torch.Tensor:
        return stock_round_to_model_dtype(prev_sample, self.dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


class StockModelDtypeLatents(StockRoundedLatents):
    """REPRODUCTION (`stepwise-bf16`): `prev_sample` returned *in* `dtype`, so a step-wise request's state stays
    low-precision and a fresh float32 request joining it raises [`MixedDtypeBatchError`]."""

    injection_name = "stepwise-bf16"

    def _cast(self, prev_sample: torch.Tensor) -> torch.Tensor:
        return prev_sample.to(self.dtype)


class _WrappedModel(nn.Module):
    """A transformer wrapper (`inner`) whose config, parameters and dtype are the wrapped model's."""

    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.inner = transformer

    @property
    def config(self) -> Any:
        return self.inner.config

    @property
    def dtype(self) -> torch.dtype:
        return model_dtype(self.inner)


class StockMaskSumRope(_WrappedModel):
    """REPRODUCTION (`mask-sum-rope`): a Qwen-Image transformer whose text RoPE lengths are the valid-token
    counts instead of the padded width.

    Its forward replaces `txt_seq_lens` with each row's count of non-zero rows of `encoder_hidden_states`.
    diffusers' Qwen-Image pipeline (and every encoder here) pads prompt embeddings with exact zeros, so that
    count is the row's number of valid tokens — what the stock code took from `prompt_embeds_mask.sum()`
    (`rollout_consistency.adapters.rope.stock_mask_sum_txt_seq_lens`). Config, parameters and dtype are the
    wrapped model's.

    Raises:
        ValueError: the wrapped transformer does not take `txt_seq_lens` (diffusers' own class always uses the
            padded width, so the pitfall cannot happen there).
    """

    injection_name = "mask-sum-rope"

    def __init__(self, transformer: nn.Module):
        if not takes_txt_seq_lens(transformer):
            raise ValueError(
                "The mask-sum-rope reproduction needs a transformer that takes `txt_seq_lens` (load it with "
                "rollout_consistency.adapters.tiny.load_qwen_image, or vLLM-omni's); diffusers' own class always uses "
                "the padded width."
            )
        super().__init__(transformer)

    def forward(self, *args: Any, encoder_hidden_states: torch.Tensor, txt_seq_lens: Any = None, **kwargs: Any):
        valid = (encoder_hidden_states != 0).any(dim=-1).to(torch.int64)  # (B, L): 1 where a row is not padding
        return self.inner(
            *args,
            encoder_hidden_states=encoder_hidden_states,
            txt_seq_lens=stock_mask_sum_txt_seq_lens(valid),
            **kwargs,
        )


class StockLateExpertSwitch(_WrappedModel):
    """REPRODUCTION (`expert-switch`): Wan 2.2's two experts switching to `transformer_2` one step late.

    The stock code counts the high-noise steps, `n_high = (timesteps >= boundary).sum()`, then takes
    `transformer` for step indices `i <= n_high` (`<=` for `<`): the first step below the boundary still runs the
    high-noise expert. This wrapper answers `expert_names` that way (from the step's index in `schedule`) and
    passes its answer to the wrapped model's forward as `experts=`; config, parameters and dtype are the
    wrapped model's ([`WanExperts`](rollout_consistency.adapters.wan.WanExperts) or its batch-invariant proxy).

    Raises:
        ValueError: the wrapped transformer has no two experts (no `expert_names`).
    """

    injection_name = "expert-switch"

    def __init__(self, transformer: nn.Module, schedule: torch.Tensor):
        if getattr(transformer, "expert_names", None) is None:
            raise ValueError(
                "The expert-switch reproduction needs a model with two experts by timestep (Wan 2.2: "
                "rollout_consistency.adapters.wan.WanExperts, e.g. load_wan(boundary_ratio=0.875))."
            )
        super().__init__(transformer)
        self.schedule = schedule.to(torch.float32).cpu()

    def expert_names(self, timesteps: torch.Tensor) -> tuple[str, ...]:
        right = self.inner.expert_names(self.schedule)  # the right expert of every step of the schedule
        high_steps = sum(name == right[0] for name in right)  # n_high (the schedule starts high)
        names = []
        for t in timesteps.reshape(len(timesteps), -1)[:, 0].cpu():
            (index,) = (self.schedule == t).nonzero()[0].tolist()
            names.append(right[0] if index <= high_steps else right[index])  # `<=`: one step late
        return tuple(names)

    def forward(self, *args: Any, timestep: torch.Tensor, experts: Any = None, **kwargs: Any) -> Any:
        # The velocity passes this wrapper's own answer; a direct call gets it here.
        names = list(experts) if experts is not None else list(self.expert_names(timestep))
        return self.inner(*args, timestep=timestep, experts=names, **kwargs)


@dataclass(frozen=True)
class Injected:
    """What a rollout runs with after [`apply_injection`]: its scheduler, transformer and per-sample windows."""

    scheduler: Any
    transformer: nn.Module
    windows: tuple[SDEWindow, ...]


def apply_injection(
    name: str,
    *,
    scheduler: Any,
    transformer: nn.Module,
    windows: Sequence[SDEWindow],
    request_ids: Sequence[str],
    seed: int = 0,
) -> Injected:
    """Wrap the rollout side's scheduler / transformer, or redraw its windows, to reproduce the stock pitfall `name`.

    Args:
        name: one of [`INJECTION_NAMES`].
        scheduler: the scheduler the rollout steps with (e.g. `SchedulerSetup.scheduler()`; its `timesteps` are
            the schedule `expert-switch` counts steps in).
        transformer: the rollout's transformer (its dtype is the one latents are rounded to).
        windows: one window per sample; `request_ids`: one id per sample (`per-request-window` mixes it in).
        seed: seeds the generator `per-request-window` draws each request's window from, so that one seed
            gives one set of windows (the stock code's generator saw no launcher seed: that is the bug
            reproduced, while the reproduction itself stays repeatable).

    Raises:
        ValueError: an unknown name (naming the known ones), or see [`StockMaskSumRope`].
    """
    windows = tuple(windows)
    if name == "bf16-latents":
        scheduler = StockRoundedLatents(scheduler, model_dtype(transformer))
    elif name == "stepwise-bf16":
        scheduler = StockModelDtypeLatents(scheduler, model_dtype(transformer))
    elif name == "mask-sum-rope":
        transformer = StockMaskSumRope(transformer)
    elif name == "expert-switch":
        transformer = StockLateExpertSwitch(transformer, scheduler.timesteps)
    elif name == "per-request-window":
        draws = random.Random(f"per-request-window/{seed}")
        windows = tuple(
            stock_per_request_window(rid, num_steps=w.num_steps, window_size=w.size, rng=draws)
            for rid, w in zip(request_ids, windows, strict=True)
        )
    else:
        raise ValueError(f"Unknown injection {name!r}; expected one of {', '.join(INJECTION_NAMES)}.")
    return Injected(scheduler=scheduler, transformer=transformer, windows=windows)
