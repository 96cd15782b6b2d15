"""Qwen-Image rollout and training adapters: bit-exact rollout → recompute, diffusers parity, bad inputs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from rollout_args import rollout_args

from rollout_consistency.adapters import make_generators, packing, qwen_image, recompute_step_log_prob
from rollout_consistency.adapters.batch_invariance import batch_invariant
from rollout_consistency.adapters.tiny import TinyPromptEncoder, load_qwen_image, load_qwen_image_scheduler_config
from rollout_consistency.schedulers import SDEWindow, draw_sde_window

PROMPTS = ["a red cat", "a dog in the garden at night", "sky", "photo of a small blue house near the river"]
SIZE = {"height": 64, "width": 64}


@pytest.fixture(scope="module")
def model():
    return load_qwen_image()


@pytest.fixture(scope="module")
def model_bf16():
    return load_qwen_image(dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def encoder():
    return TinyPromptEncoder()


@pytest.fixture(scope="module")
def cond(encoder):
    return encoder.conditioning(PROMPTS, [" "] * len(PROMPTS))


def _rollout(model, cond, **kwargs):
    args = dict(
        num_inference_steps=6,
        seeds=[1, 2, 3, 4],
        window=SDEWindow(start=1, size=3, num_steps=6),
        noise_level=0.7,
        guidance_scale=3.0,
        **SIZE,
    )
    args.update(kwargs)
    return qwen_image.rollout(model, cond, **rollout_args(args))


def test_ode_steps_match_diffusers_pipeline_bit_for_bit(model, cond):
    """Outside the window the adapter is diffusers' QwenImagePipeline (packing, img_shapes, true CFG + norm
    rescale, timestep/1000, initial noise from per-sample generators) to the last bit in float32."""
    num_steps = 5
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**load_qwen_image_scheduler_config()),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=model,
    )
    pipe.set_progress_bar_config(disable=True)
    seen = {}

    def capture(pipeline, i, t, tensors):
        seen[i] = tensors["latents"].clone()
        return {}

    pipe(
        **cond,
        true_cfg_scale=3.0,
        num_inference_steps=num_steps,
        output_type="latent",
        generator=[torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)],
        callback_on_step_end=capture,
        **SIZE,
    )
    trajectory = _rollout(
        model, cond, num_inference_steps=num_steps, window=SDEWindow(start=num_steps - 1, size=1, num_steps=num_steps)
    )
    assert torch.equal(trajectory.latents[:, 0], seen[num_steps - 2])


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_fp32_rollout_then_recompute_is_exact(model, cond, sde_type, guidance_scale):
    trajectory = _rollout(model, cond, sde_type=sde_type, guidance_scale=guidance_scale)
    with torch.no_grad():
        recomputed = qwen_image.recompute_log_probs(model, trajectory)
    assert recomputed.dtype == torch.float32 and recomputed.shape == (4, 3)
    assert torch.equal(recomputed - trajectory.log_probs, torch.zeros(4, 3))


def test_bf16_weights_with_fp32_storage_is_exact(model_bf16, cond):
    trajectory = _rollout(model_bf16, cond)
    assert trajectory.latents.dtype == torch.float32
    with torch.no_grad():
        recomputed = qwen_image.recompute_log_probs(model_bf16, trajectory)
    assert torch.equal(recomputed - trajectory.log_probs, torch.zeros(4, 3))


def test_recompute_with_gradients(model, cond):
    trajectory = _rollout(model, cond, guidance_scale=1.0)
    model.zero_grad(set_to_none=True)
    for k in range(trajectory.window_size):
        log_prob = recompute_step_log_prob(model, trajectory, k)
        assert log_prob.requires_grad
        assert torch.equal(log_prob.detach(), trajectory.log_probs[:, k])
        log_prob.mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    model.zero_grad(set_to_none=True)


def test_autocast_trainer_is_close_not_exact(model, cond):
    """fp32 master weights under bf16 autocast compute a different forward: close, and measurably not 0."""
    trajectory = _rollout(model, cond)
    with torch.no_grad():
        recomputed = qwen_image.recompute_log_probs(model, trajectory, autocast_dtype=torch.bfloat16)
    log_ratio = recomputed - trajectory.log_probs
    assert log_ratio.abs().max() < 0.05
    assert log_ratio.abs().max() > 0


def test_trainer_micro_batches_of_two_are_exact(model, cond):
    """Micro-batches are another batch composition: bit-exact in batch-invariant mode (docs/adapters.md)."""
    model = batch_invariant(model, qwen_image.FAMILY)
    trajectory = _rollout(model, cond)
    for rows in ([0, 1], [2, 3], [3, 1]):
        with torch.no_grad():
            recomputed = qwen_image.recompute_log_probs(model, trajectory.select(rows))
        assert torch.equal(recomputed, trajectory.log_probs[rows])


def test_per_group_windows_recompute_exactly(model, cond):
    windows = [draw_sde_window(seed=7, global_step=3, prompt_group=g, num_steps=8, window_size=2) for g in (0, 0, 1, 1)]
    trajectory = _rollout(model, cond, num_inference_steps=8, window=windows, prompt_groups=[0, 0, 1, 1], global_step=3)
    assert trajectory.windows == tuple(windows)
    assert torch.equal(trajectory.timesteps, trajectory.scheduler.timesteps()[trajectory.step_indices()])
    with torch.no_grad():
        assert torch.equal(qwen_image.recompute_log_probs(model, trajectory), trajectory.log_probs)


def test_same_seeds_same_trajectory_and_noise_independent_of_batch_mates(model, cond):
    first = _rollout(model, cond)
    again = _rollout(model, cond)
    assert torch.equal(first.latents, again.latents) and torch.equal(first.log_probs, again.log_probs)
    assert torch.equal(first.final_latents, again.final_latents)
    # A sample's noise is its own generator's: the same whatever the batch around it (default mode).
    noise = qwen_image.FAMILY.initial_latents(model, make_generators([1, 2, 3, 4]), first.family_options)
    alone = qwen_image.FAMILY.initial_latents(model, make_generators([3, 1]), first.family_options)
    assert torch.equal(alone, noise[[2, 0]])
    # Whole trajectories of rows 2 and 0 alone (batch of 2, other order) equal theirs in the batch of 4 in
    # batch-invariant mode; the default mode promises that only for the same batch composition.
    model = batch_invariant(model, qwen_image.FAMILY)
    first = _rollout(model, cond)
    pair = _rollout(model, {k: v[[2, 0]] for k, v in cond.items()}, seeds=[3, 1])
    assert torch.equal(pair.latents, first.latents[[2, 0]]) and torch.equal(pair.log_probs, first.log_probs[[2, 0]])


def test_initial_noise_is_diffusers_draw_per_seed(model):
    generators = [torch.Generator().manual_seed(s) for s in (9, 10)]
    ours = qwen_image.FAMILY.initial_latents(model, generators, SIZE)
    reference = QwenImagePipeline._pack_latents(
        torch.cat([torch.randn((1, 1, 4, 8, 8), generator=torch.Generator().manual_seed(s)) for s in (9, 10)]),
        2,
        4,
        8,
        8,
    )
    assert torch.equal(ours, reference)
    assert torch.equal(packing.unpack_latents(ours, 8, 8), packing.unpack_latents(reference, 8, 8))


# ----------------------------------------------------------------------------- bad inputs
def test_cfg_without_negative_prompt_is_an_error(model, encoder):
    positive_only = encoder.conditioning(PROMPTS)
    with pytest.raises(ValueError, match=r"no negative prompt.*negative_prompt_embeds"):
        _rollout(model, positive_only, guidance_scale=4.0)
    _rollout(model, positive_only, guidance_scale=1.0)  # CFG off: fine


def test_mask_embedding_length_mismatch_is_an_error(model, cond):
    bad = dict(cond, prompt_embeds_mask=cond["prompt_embeds_mask"][:, :-1])
    with pytest.raises(ValueError, match=r"mask must be.*length"):
        _rollout(model, bad)
    with pytest.raises(TypeError, match="int64"):
        _rollout(model, dict(cond, prompt_embeds_mask=cond["prompt_embeds_mask"].bool()))


def test_window_outside_schedule_is_an_error(model, cond):
    with pytest.raises(ValueError, match="outside the schedule"):
        _rollout(model, cond, window=SDEWindow(start=5, size=3, num_steps=8))


def test_wrong_latent_shape_for_model_is_an_error(model, cond):
    trajectory = _rollout(model, cond)
    wrong_size = replace(trajectory, family_options={**trajectory.family_options, "height": 128})
    with pytest.raises(ValueError, match="wrong latent shape"):
        qwen_image.recompute_log_probs(model, wrong_size)
    other_model = load_qwen_image(config={**dict(model.config), "in_channels": 32, "out_channels": 8})
    with pytest.raises(ValueError, match="wrong latent shape"):
        qwen_image.recompute_log_probs(other_model, trajectory)
    with pytest.raises(ValueError, match="do not fit"):
        qwen_image.velocity(model, torch.zeros(4, 15, 16), torch.zeros(4), cond, 1.0, options=SIZE)


def test_other_bad_inputs(model, cond):
    with pytest.raises(ValueError, match="joint_attention_dim"):
        _rollout(model, dict(cond, prompt_embeds=cond["prompt_embeds"][..., :16]))
    with pytest.raises(ValueError, match="one row per sample"):
        _rollout(model, cond, seeds=[1, 2, 3])
    with pytest.raises(ValueError, match="Unknown Qwen-Image conditioning"):
        _rollout(model, dict(cond, pooled_prompt_embeds=torch.zeros(4, 8)))
    with pytest.raises(ValueError, match="multiples"):
        _rollout(model, cond, height=60)
    with pytest.raises(ValueError, match="noise_level"):
        _rollout(model, cond, noise_level=0.0)
    with pytest.raises(TypeError, match="float32"):
        qwen_image.velocity(
            model, torch.zeros(4, 16, 16, dtype=torch.bfloat16), torch.zeros(4), cond, 1.0, options=SIZE
        )
    trajectory = _rollout(model, cond)
    with pytest.raises(ValueError, match=r"'qwen-image' rollout.*'sd3'"):
        from rollout_consistency.adapters.trainer import check_trajectory_for_model

        check_trajectory_for_model(replace(qwen_image.FAMILY, name="sd3"), model, trajectory)


def test_model_directory_goes_through_the_same_loader(model, encoder, cond, tmp_path):
    """`load_qwen_image(path)` is `from_pretrained` of a diffusers model directory; the tiny model saved
    there loads back identical, with its scheduler config and prompt encoder."""
    model.save_pretrained(tmp_path / "transformer")
    (tmp_path / "scheduler").mkdir()
    import json

    (tmp_path / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "FlowMatchEulerDiscreteScheduler", **load_qwen_image_scheduler_config()})
    )
    encoder.save_pretrained(tmp_path / "text")
    loaded = load_qwen_image(tmp_path)
    assert type(loaded) is type(model)
    assert all(
        torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values(), strict=False)
    )
    assert load_qwen_image_scheduler_config(tmp_path) == load_qwen_image_scheduler_config()
    again = TinyPromptEncoder.from_pretrained(tmp_path / "text")
    assert all(torch.equal(a, b) for a, b in zip(again.encode(PROMPTS), encoder.encode(PROMPTS), strict=False))
    first, second = _rollout(model, cond), _rollout(loaded, cond)
    assert torch.equal(first.log_probs, second.log_probs)
    with pytest.raises(FileNotFoundError):
        load_qwen_image(tmp_path / "missing")
