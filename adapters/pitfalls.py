# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Reproductions of the stock behaviours of DESIGN.md §1 — each one a *known bug*, kept on purpose.

Nothing in this module is a recommended code path. It exists so that tests and the checker
(`--inject NAME`) can show each pitfall's signature next to the fixed path. Each reproduction is switched
on by one field of the frozen [`Injection`] passed to a rollout; with no injection (the default) none of
this code runs.

| `--inject` name        | `Injection` field    | what the stock code did                                      | the fix (default path)                      |
|------------------------|----------------------|--------------------------------------------------------------|---------------------------------------------|
| `bf16-latents`         | `bf16_latents`       | scheduler casts `prev_sample` to the model dtype; that       | latents stay float32; cast only for the      |
|                        |                      | rounded sample is stored and fed on, the log-prob was        | forward (`sample_previous_step`)            |
|                        |                      | computed from the unrounded one                              |                                             |
| `stepwise-bf16`        | `stepwise_bf16`      | step-wise per-request latents kept in the model dtype; a     | per-request latents float32 throughout      |
|                        |                      | fresh float32 request joining them fails to batch            |                                             |
| `mask-sum-rope`        | `mask_sum_rope`      | Qwen-Image `txt_seq_lens` from `mask.sum()` (valid tokens)   | `padded_txt_seq_lens`: the padded width     |
| `per-request-window`   | `per_request_window` | SDE window drawn per request from an unseeded RNG            | `draw_sde_window` per prompt group, seeded  |
|                        |                      |                                                              | explicitly                                  |

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
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from rollout_consistency.schedulers import SDEWindow

__all__ = [
    "INJECTION_NAMES",
    "Injection",
    "MixedDtypeBatchError",
    "stock_per_request_window",
    "stock_round_to_model_dtype",
]

INJECTION_NAMES = ("bf16-latents", "stepwise-bf16", "mask-sum-rope", "per-request-window")


class MixedDtypeBatchError(ValueError):
    """Raised (as vLLM-omni's input batch does) when requests with latents of different dtypes are batched."""


@dataclass(frozen=True)
class Injection:
    """Which stock behaviours a rollout reproduces. All off by default (the fixed path).

    Build one from the checker's names with `Injection.from_names(["bf16-latents", ...])`.
    """

    bf16_latents: bool = False
    stepwise_bf16: bool = False
    mask_sum_rope: bool = False
    per_request_window: bool = False

    @classmethod
    def from_names(cls, names: Iterable[str]) -> Injection:
        """`Injection` with the fields of the given `--inject` names on; ValueError for an unknown name."""
        flags = {}
        for name in names:
            if name not in INJECTION_NAMES:
                raise ValueError(f"Unknown injection {name!r}; expected one of {', '.join(INJECTION_NAMES)}.")
            flags[name.replace("-", "_")] = True
        return cls(**flags)

    @property
    def names(self) -> tuple[str, ...]:
        """The `--inject` names switched on."""
        return tuple(n for n in INJECTION_NAMES if getattr(self, n.replace("-", "_")))

    def __bool__(self) -> bool:
        return bool(self.names)


def stock_round_to_model_dtype(prev_sample: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
    """REPRODUCTION of diffusers' `FlowMatchEulerDiscreteScheduler.step` ending (`prev_sample.to(model_output.dtype)`).

    Returns the sample rounded to `model_dtype`, held in a float32 tensor: the value the stock rollout stored
    and fed to the next step, while its log-prob had been computed from the unrounded float32 sample.
    """
    # rollout-consistency: ignore[low-precision-latents] the stock bug, reproduced on purpose (--inject bf16-latents)
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
