# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The ``torch`` rollout backend: the diffusers adapters in the worker's own process.

Request-level (`rollout_consistency.adapters.rollout`) or, with ``step_execution``, the step-wise engine
(`rollout_consistency.adapters.stepwise`), on the worker's rollout transformer, with the ``--inject`` pitfall
applied to the rollout side only. Registered in `rollout_consistency.gate.backend_registry`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .settings import SidesSettings
from .shared import Backend

__all__ = ["TorchRollout", "start"]


class TorchRollout:
    """The rollout side of a worker that samples with its own transformer (`Backend.rollout_model`)."""

    in_process = True

    def rollout(self, backend: Backend, conditioning: Any, requests: Any, sampling: Any) -> Any:
        """One planned batch as a float32 `Trajectory`."""
        from rollout_consistency import adapters

        transformer, scheduler, windows = _rollout_side(backend, requests.windows, requests.seeds[0])
        requests = dataclasses.replace(requests, windows=tuple(windows))
        if backend.settings.execution.step_execution:
            return _rollout_stepwise(backend, transformer, scheduler, conditioning, requests, sampling)
        return adapters.rollout(
            backend.family,
            transformer,
            conditioning,
            scheduler_setup=backend.scheduler_setup,
            requests=requests,
            sampling=sampling,
            options=backend.options,
            scheduler=scheduler,
        )


def start(settings: SidesSettings) -> TorchRollout:
    """The registered factory: nothing to start (the worker loads the transformer)."""
    return TorchRollout()


def _rollout_side(backend: Backend, windows, seed: int):
    """The rollout side's transformer, scheduler and windows, with the `--inject` pitfall applied (rollout only:
    the trainer keeps the plain model and scheduler)."""
    transformer, scheduler = backend.rollout_model, backend.scheduler_setup.scheduler()
    if backend.injection is None:
        return transformer, scheduler, windows
    from rollout_consistency.adapters.pitfalls import apply_injection

    injected = apply_injection(
        backend.injection,
        scheduler=scheduler,
        transformer=transformer,
        windows=windows,
        request_ids=[f"sample-{index}" for index in range(len(windows))],
        seed=seed,  # the batch's first sample seed: one check, one set of injected windows (each batch its own)
    )
    return injected.transformer, injected.scheduler, list(injected.windows)


def _rollout_stepwise(backend: Backend, transformer, scheduler, conditioning, batch_requests, sampling):
    """The step-wise engine on the batch's requests (`max_num_seqs` running; see `stagger_arrivals`).

    Every request's text is padded to the batch's width and every forward uses that width: the stored
    conditioning then has the width the rollout's forwards had, so the trainer recomputes the same
    computation (a forward padded to another width differs in the last bits).
    """
    from rollout_consistency.adapters import stepwise

    execution = backend.settings.execution
    seeds, windows, groups = batch_requests.seeds, batch_requests.windows, batch_requests.groups
    rows = [{k: v[i : i + 1] for k, v in conditioning.items()} for i in range(len(seeds))]
    # Staggered: two requests join per engine step, so forwards mix requests at different steps (pairs keep
    # every forward at >= 2 rows: this CPU build takes another kernel for a single row).
    requests = [
        stepwise.StepwiseRequest(
            request_id=f"sample-{index}",
            seed=seed,
            conditioning=row,
            window=window,
            prompt_group=group,
            arrival=index // 2 if execution.stagger_arrivals else 0,
            global_step=batch_requests.global_step,
        )
        for index, (seed, row, window, group) in enumerate(zip(seeds, rows, windows, groups, strict=False))
    ]
    return stepwise.run_stepwise(
        backend.family,
        transformer,
        requests,
        scheduler_setup=backend.scheduler_setup,
        sampling=sampling,
        options=backend.options,
        engine=stepwise.EngineSettings(
            max_num_seqs=execution.max_num_seqs, text_width=stepwise.shared_text_width(rows)
        ),
        scheduler=scheduler,
    )
