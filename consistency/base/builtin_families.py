# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The built-in model families: one `BuiltinFamily` record each, in the `BUILTIN_FAMILIES` registry.

What the package knows of a built-in family without importing it (torch, diffusers): its name, the adapters
module that registers its `ModelFamily` when imported, the ``family_options`` keys it reads, its tiny offline
model and its vLLM-omni pipeline class. Everything that lists the built-in families reads this table: the
adapters' `get_family` / `family_names` (the module imported on first use), the checker's `MODEL_FAMILIES` and
its check of a trajectory's ``family_options``, the tiny models (`adapters.tiny.get_tiny`) and vLLM-omni's
`SUPPORTED_FAMILIES` / `PIPELINE_CLASSES`. tests/test_family_table.py ties each record to what its module
registers. A new built-in family is one adapters module (its `ModelFamily` and `register_family`, its tiny model
beside the others) plus one record here.

It imports nothing of ours but the `Registry` (the adapters below the gate and the gate both read it).
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_consistency.base.registry import Registry

__all__ = ["BUILTIN_FAMILIES", "BuiltinFamily", "builtin_option_keys"]


@dataclass(frozen=True)
class BuiltinFamily:
    """One built-in model family, as plain data (qualified names, imported where they are used).

    Attributes:
        name: the family id stored in trajectories and named by ``model_family`` (``"qwen-image"``).
        module: the adapters module whose import registers the family's `ModelFamily` (``register_family``).
        option_keys: the ``family_options`` keys the family reads: ``height``, ``width`` and its
            `ModelFamily.default_options` (a trajectory's other keys are refused).
        tiny: ``"module:name"`` of the family's `TinyModel`, the checker's offline model; None: none.
        vllm_omni_pipeline: the qualified pipeline class vLLM-omni loads for the family
            (``custom_pipeline_args={"pipeline_class": ...}``); None: no vLLM-omni rollout.
    """

    name: str
    module: str
    option_keys: frozenset[str]
    tiny: str | None = None
    vllm_omni_pipeline: str | None = None


#: The built-in families, in the order the docs list them. A new one is one `BuiltinFamily` here.
BUILTIN_FAMILIES: Registry[BuiltinFamily] = Registry("built-in model family")

for _family in (
    BuiltinFamily(
        "qwen-image",
        module="rollout_consistency.adapters.qwen_image",
        option_keys=frozenset({"height", "width", "vae_scale_factor", "mask_text_padding"}),
        tiny="rollout_consistency.adapters.tiny:TINY_QWEN_IMAGE",
        vllm_omni_pipeline="rollout_consistency.adapters.vllm_omni.pipeline.RolloutQwenImagePipeline",
    ),
    BuiltinFamily(
        "sd3",
        module="rollout_consistency.adapters.sd3",
        option_keys=frozenset({"height", "width", "vae_scale_factor"}),
        tiny="rollout_consistency.adapters.tiny:TINY_SD3",
    ),
    BuiltinFamily(
        "flux",
        module="rollout_consistency.adapters.flux",
        option_keys=frozenset({"height", "width", "vae_scale_factor", "true_cfg_scale"}),
        tiny="rollout_consistency.adapters.tiny:TINY_FLUX",
    ),
    BuiltinFamily(
        "wan",
        module="rollout_consistency.adapters.wan",
        option_keys=frozenset(
            {
                "height",
                "width",
                "num_frames",
                "vae_scale_factor_spatial",
                "vae_scale_factor_temporal",
                "guidance_scale_2",
                "expand_timesteps",
            }
        ),
        tiny="rollout_consistency.adapters.tiny:TINY_WAN",
        vllm_omni_pipeline="rollout_consistency.adapters.vllm_omni.wan_pipeline.RolloutWanPipeline",
    ),
):
    BUILTIN_FAMILIES.register(_family)


def builtin_option_keys(name: str) -> frozenset[str] | None:
    """The ``family_options`` keys built-in family `name` reads; None for a family that is not built in."""
    entry = BUILTIN_FAMILIES.get(name)
    return None if entry is None else entry.option_keys
