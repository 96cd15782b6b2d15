# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""A family's two public entry points, `rollout` and `recompute_log_probs`, made from its `ModelFamily`.

Every built-in family module binds them in one line,

    rollout, recompute_log_probs = entry_points(FAMILY, __name__)

so `rollout_consistency.adapters.flux.rollout` and the others are one implementation: the rollout is
[`family_rollout`](rollout_consistency.adapters.rollout.family_rollout) for the family (its pipeline's
keywords), the recompute is [`recompute_log_probs`](rollout_consistency.adapters.trainer.recompute_log_probs)
with `family=` set. Their docstrings are written here from the family's fields; what a keyword means for one
family (its `guidance_scale`, its options) is said once, in that family module's docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from . import trainer
from .families import ModelFamily
from .rollout import family_rollout
from .trajectory import Trajectory

__all__ = ["entry_points"]

_ROLLOUT_DOC = """The {name!r} rollout (request-level): `rollout_consistency.adapters.rollout.family_rollout` for
this family, called as its diffusers pipeline is.

Keywords: `num_inference_steps`; `requests` (`BatchRequests`); `sampling` (`SamplingSettings`; what its
`guidance_scale` is for this family, the module docstring says); `scheduler_config` (default: the family's
released one, `FAMILY.scheduler_config`; the schedule is the pipeline's, `FAMILY.scheduler_setup`); `scheduler`;
and the family options `height`, `width`{options} (stored as `Trajectory.family_options`; the module docstring
says what each means).
{experts}
Returns:
    A validated float32 `Trajectory` stamped `model_family={name!r}`.
"""

_RECOMPUTE_DOC = """The {name!r} training adapter: `(B, len(steps))` float32 log-probs of a {name!r} trajectory's
stored window steps (grad when enabled): `rollout_consistency.adapters.recompute_log_probs` with `family=FAMILY`.

The trainer's precision is a setting: load the transformer in bf16 or fp32, or keep float32 master weights and
pass `autocast_dtype=torch.bfloat16`. `steps`: the window steps to score (default: all).
{experts}"""

_EXPERTS_DOC = {
    "rollout": "A transformer with experts by timestep records which expert took each window step "
    "(`Trajectory.experts`).\n",
    "recompute": "Which expert scores each step: `rollout_consistency.adapters.trainer.trainer_experts`.\n",
}


def entry_points(family: ModelFamily, module: str) -> tuple[Callable[..., Trajectory], Callable[..., torch.Tensor]]:
    """`(rollout, recompute_log_probs)` of `family`, named as functions of `module` (the family module's
    `__name__`, where they are bound: pickling and `help()` find them there)."""

    def rollout(transformer: nn.Module, conditioning: Mapping[str, torch.Tensor], **settings: Any) -> Trajectory:
        return family_rollout(family, transformer, conditioning, **settings)

    def recompute_log_probs(
        transformer: nn.Module,
        trajectory: Trajectory,
        *,
        steps: Sequence[int] | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        return trainer.recompute_log_probs(
            transformer, trajectory, family=family, steps=steps, autocast_dtype=autocast_dtype
        )

    options = "".join(f", `{key}={value!r}`" for key, value in family.default_options.items())
    has_experts = family.experts is not None
    rollout.__doc__ = _ROLLOUT_DOC.format(
        name=family.name, module=module, options=options, experts=_EXPERTS_DOC["rollout"] if has_experts else ""
    )
    recompute_log_probs.__doc__ = _RECOMPUTE_DOC.format(
        name=family.name, experts=_EXPERTS_DOC["recompute"] if has_experts else ""
    )
    for function in (rollout, recompute_log_probs):
        function.__module__ = module
        function.__qualname__ = function.__name__
    return rollout, recompute_log_probs
