# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Running the sides: which samples the check draws, both halves (built in, or a user's own plug-in), the
trainer's recomputation, the work over Ray actors, and step 2's update and weight sync.

The sides read one frozen `SidesSettings` (`settings`), which the check builds once from its `CheckConfig`
(`CheckConfig.sides`), every value resolved there; they never see the `CheckConfig` itself. User code still
receives it: a plug-in's or a registered backend's factory, and a rollout plug-in's request, get it through the
check's binding (`SidesSettings.user_code`).

    settings           `SidesSettings`: `model` (what the model is, how each side computes), `sampling` (what is
                       sampled), `execution` (how it runs), `user_code` (what user code receives, bound)
    plan               which prompt, group, seed and SDE window each sample gets, and the rollout batches
    shared             a worker's state (`Backend`), one batch's result (`BatchResult`), `BackendError`, the
                       attention-kernel switch: what the modules below share
    trainer            the trainer side: every stored window step recomputed (`score_trajectory`) and the registered
                       ``torch`` trainer backend
    floor_tables       the calibrated floor's tables: the trainer against itself, one source of difference changed
    torch_rollout      the registered ``torch`` rollout backend: the diffusers adapters in the worker's process
    vllm_omni_rollout  the registered ``vllm-omni`` rollout backend: one engine per worker
    plugins            a user's own rollout or trainer as a side (``"package.module:factory"``): the protocol
    backends           both sides from the settings (`build_backend`, once per worker: the registered backends'
                       factories, `rollout_consistency.gate.backend_registry`, or plug-ins) and one batch (`run_batch`)
    distributed        batches over Ray actors, or in this process (`run_sharded`); `ray_connect` fails fast
                       on a cluster nobody answers at
    weight_sync        step 2's sides: one optimizer update on the trainer, the user's weight sync (the step-2
                       check itself: `rollout_consistency.gate.weight_sync_check`)
    trajectory_checks  a saved trajectory's model family and options against the settings

Torch and diffusers are imported when a side runs, not here.
"""

from __future__ import annotations

from .backends import build_backend, run_batch
from .distributed import run_sharded
from .plan import BatchSpec, SampleSpec, make_plan
from .plugins import PluginError, PluginRollout, RolloutPlugin, RolloutRequest, TrainerPlugin
from .ray_connect import DistributedError
from .settings import ExecutionSettings, ModelSettings, SampleSettings, SidesSettings
from .shared import Backend, BackendError, BatchResult
from .trainer import score_trajectory
from .weight_sync import SideHandle

__all__ = [
    "Backend",
    "BackendError",
    "BatchResult",
    "BatchSpec",
    "DistributedError",
    "ExecutionSettings",
    "ModelSettings",
    "PluginError",
    "PluginRollout",
    "RolloutPlugin",
    "RolloutRequest",
    "SampleSettings",
    "SampleSpec",
    "SideHandle",
    "SidesSettings",
    "TrainerPlugin",
    "build_backend",
    "make_plan",
    "run_batch",
    "run_sharded",
    "score_trajectory",
]
