"""SD3 rollout and training adapters: bit-exact rollout → recompute, diffusers parity, bf16 pitfall, bad inputs."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

from adapters import Injection, Trajectory, recompute_step_log_prob, sd3
from adapters.tiny_sd3_flux import TINY_SD3_CONFIG, load_sd3, tiny_sd3_prompt_encoder
from adapters.stepwise import StepwiseRequest, run_stepwise
from consistency.metrics import compute_metrics
from consistency.tolerances import exact_tolerance
from consistency.verdict import decide
from schedulers import SDEWindow

PROMPTS = ["a red cat", "a dog in the garden at night", "sky", "photo of a small blue house near the river"]
SEEDS = [1, 2, 3, 4]
SIZE = {"height": 64, "width": 64}


@pytest.fixture(scope="module")
def model():
    return load_sd3()


@pytest.fixture(scope="module")
def model_bf16():
    return load_sd3(dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def cond():
    return tiny_sd3_prompt_encoder().conditioning(PROMPTS, [""] * len(PROMPTS))


def _rollout(model, cond, **kwargs):
    args = dict(num_inference_steps=6, seeds=SEEDS, window=SDEWindow(start=1, size=3, num_steps=6),
                noise_level=0.7, guidance_scale=4.5, **SIZE)
    args.update(kwargs)
    return sd3.rollout(model, cond, **args)


def _recompute(model, trajectory, **kwargs):
    with torch.no_grad():
        return sd3.recompute_log_probs(model, trajectory, **kwargs)


@pytest.mark.parametrize("guidance_scale", [1.0, 4.5])
def test_ode_steps_match_diffusers_pipeline_bit_for_bit(model, cond, guidance_scale):
    """Outside the window the adapter is diffusers' StableDiffusion3Pipeline (initial noise from per-sample
    generators, timestep σ·1000, pooled projections, CFG) to the last bit in float32. The pipeline runs CFG as
    one forward of 2B, the adapter as two forwards of B: on this CPU the tiny model gives the same bits."""
    num_steps = 5
    pipe = StableDiffusion3Pipeline(
        transformer=model, scheduler=FlowMatchEulerDiscreteScheduler(**sd3.SD3_SCHEDULER_CONFIG), vae=None,
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.set_progress_bar_config(disable=True)
    seen = {}

    def capture(pipeline, i, t, tensors):
        seen[i] = tensors["latents"].clone()
        return {}

    pipe(**cond, guidance_scale=guidance_scale, num_inference_steps=num_steps, output_type="latent",
         generator=[torch.Generator().manual_seed(s) for s in SEEDS], callback_on_step_end=capture, **SIZE)
    trajectory = _rollout(model, cond, guidance_scale=guidance_scale, num_inference_steps=num_steps,
                          window=SDEWindow(start=num_steps - 1, size=1, num_steps=num_steps))
    assert torch.equal(trajectory.latents[:, 0], seen[num_steps - 2])


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
@pytest.mark.parametrize("guidance_scale", [1.0, 4.5])
def test_fp32_rollout_then_recompute_is_exact(model, cond, sde_type, guidance_scale):
    trajectory = _rollout(model, cond, sde_type=sde_type, guidance_scale=guidance_scale)
    recomputed = _recompute(model, trajectory)
    assert recomputed.dtype == torch.float32 and recomputed.shape == (4, 3)
    assert torch.equal(recomputed - trajectory.log_probs, torch.zeros(4, 3))


@pytest.mark.parametrize("arrivals", [(0, 0, 0, 0), (0, 0, 2, 2)])
def test_stepwise_equals_request_level_bit_for_bit(model, cond, arrivals):
    """The continuous-batching path: requests join mid-flight and run at different steps inside one forward
    (>= 2 rows per forward, one fixed text width as the pipeline encodes it) — bit-exact."""
    reference = _rollout(model, cond, prompt_groups=[0, 0, 1, 1])
    requests = [StepwiseRequest(f"r{i}", seed=seed, conditioning={k: v[i : i + 1] for k, v in cond.items()},
                                window=reference.windows[i], prompt_group=reference.prompt_groups[i], arrival=arrival)
                for i, (seed, arrival) in enumerate(zip(SEEDS, arrivals))]
    stepwise = run_stepwise(sd3.FAMILY, model, requests, scheduler_setup=reference.scheduler, noise_level=0.7,
                            guidance_scale=4.5, options=reference.family_options, max_num_seqs=4)
    assert stepwise.provenance["path"] == "step-wise"
    for name in ("latents", "log_probs", "timesteps", "final_latents"):
        assert torch.equal(getattr(stepwise, name), getattr(reference, name)), name
    assert torch.equal(_recompute(model, stepwise), stepwise.log_probs)


def test_bf16_weights_with_fp32_storage_is_exact(model_bf16, cond):
    trajectory = _rollout(model_bf16, cond)
    for tensor in (trajectory.latents, trajectory.log_probs, trajectory.timesteps, trajectory.final_latents,
                   *trajectory.conditioning.values()):
        assert tensor.dtype == torch.float32
    recomputed = _recompute(model_bf16, trajectory)
    assert torch.equal(recomputed - trajectory.log_probs, torch.zeros(4, 3))


def test_stock_bf16_stored_latents_bias_the_log_ratio_down(model_bf16):
    """DESIGN.md §1 'precision loss in stored latents' through the SD3 adapter, beside its fix.

    Stock: each prev_sample is rounded to the model's bf16 after its log-prob was computed, and stored and fed
    on rounded. Per latent element the trainer then loses e²/(2σ²) on average (e the rounding error, σ the
    step's std), so log-ratios lean negative and PPO clips on the lower side. Against it stands a noise term
    of order e/(σ·sqrt(D)) per sample; D = 16·16·16 here, a 16·128·128 real latent is 64x larger, so a
    small noise_level puts this tiny run in the real regime. SD3's own schedule ends at a tiny σ (0.009 here),
    where the step's std nears bf16 resolution: there every sample shows it.
    """
    cond16 = tiny_sd3_prompt_encoder().conditioning(PROMPTS * 4)
    args = dict(num_inference_steps=4, seeds=list(range(16)), window=SDEWindow(start=0, size=4, num_steps=4),
                noise_level=0.05, guidance_scale=1.0, height=128, width=128, denoise_to_end=False)
    stock = sd3.rollout(model_bf16, cond16, injection=Injection(bf16_latents=True), **args)
    stock_recomputed = _recompute(model_bf16, stock)
    log_ratio = (stock_recomputed - stock.log_probs).double()
    clip = 1e-4
    assert (log_ratio < 0).double().mean() > 0.8  # a fair coin would give > 80% of 64 with p < 1e-6
    assert (log_ratio < -clip).double().mean() > 5 * (log_ratio > clip).double().mean()
    assert bool((log_ratio[:, -1] < -clip).all())  # the last step (σ ≈ 0.009): every sample clips low
    assert log_ratio.mean() < -1e-5

    verdict = _verdict(stock.log_probs, stock_recomputed, stock)
    assert not verdict.passed
    assert {"ratio_mean", "ppo_kl", "pg_clipfrac_lower"} <= {c.name for c in verdict.checks if not c.passed}

    fixed = sd3.rollout(model_bf16, cond16, **args)
    recomputed = _recompute(model_bf16, fixed)
    assert torch.equal(recomputed - fixed.log_probs, torch.zeros(16, 4))
    assert _verdict(fixed.log_probs, recomputed, fixed).passed


def _verdict(rollout_log_probs, trainer_log_probs, trajectory):
    metrics = compute_metrics(rollout_log_probs, trainer_log_probs, clip_ratio=1e-4, timesteps=trajectory.timesteps)
    return decide(metrics, exact_tolerance())


def test_trajectory_round_trip_then_recompute_is_exact(model, cond, tmp_path):
    trajectory = _rollout(model, cond, sde_type="cps")
    path = trajectory.save(tmp_path / "sd3.safetensors")
    loaded = Trajectory.load(path)
    assert loaded.model_family == "sd3" and dict(loaded.family_options) == dict(trajectory.family_options)
    assert torch.equal(loaded.latents, trajectory.latents)
    assert torch.equal(_recompute(model, loaded) - trajectory.log_probs, torch.zeros(4, 3))


def test_recompute_in_micro_batches_of_two_is_exact(model, cond):
    """A trainer micro-batch of 2 reproduces a rollout of 4 bit for bit. (Not every size does on this CPU:
    single rows and some 3-row batches take other kernels and differ by ~1e-7.)"""
    trajectory = _rollout(model, cond)
    for rows in ([0, 1], [2, 3], [3, 0]):
        assert torch.equal(_recompute(model, trajectory.select(rows)), trajectory.log_probs[rows])


def test_per_sample_windows_recompute_exactly(model, cond):
    """Two prompt groups with different windows: the recompute batches samples at different timesteps."""
    windows = [SDEWindow(1, 2, 6), SDEWindow(1, 2, 6), SDEWindow(3, 2, 6), SDEWindow(3, 2, 6)]
    trajectory = _rollout(model, cond, window=windows, prompt_groups=[0, 0, 1, 1])
    assert trajectory.timesteps[0, 0] != trajectory.timesteps[2, 0]
    assert torch.equal(_recompute(model, trajectory), trajectory.log_probs)


def test_recompute_step_carries_gradients_to_the_transformer(cond):
    model = load_sd3()
    trajectory = _rollout(model, cond)
    log_prob = recompute_step_log_prob(model, trajectory, 1)
    assert log_prob.requires_grad and torch.equal(log_prob.detach(), trajectory.log_probs[:, 1])
    log_prob.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert model.proj_out.weight.grad.abs().sum() > 0


def test_cfg_runs_the_conditional_forward_unchanged(model, cond):
    """CFG is uncond + s·(cond − uncond) of two forwards; at s = 1 it is the conditional forward exactly."""
    latents = torch.randn(4, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.full((4,), 750.0)
    with torch.no_grad():
        cond_only = sd3.velocity(model, latents, t, cond, 1.0, options=SIZE)
        guided = sd3.velocity(model, latents, t, cond, 4.5, options=SIZE)
        no_negative = {k: v for k, v in cond.items() if not k.startswith("negative")}
        assert torch.equal(sd3.velocity(model, latents, t, no_negative, 1.0, options=SIZE), cond_only)
        uncond = sd3.velocity(model, latents, t, {"prompt_embeds": cond["negative_prompt_embeds"],
                                                   "pooled_prompt_embeds": cond["negative_pooled_prompt_embeds"]},
                              1.0, options=SIZE)
    assert guided.dtype == torch.float32
    assert torch.equal(guided, uncond + 4.5 * (cond_only - uncond))


# ---------------------------------------------------------------------------------------------- bad inputs
def test_cfg_without_negative_prompt_is_refused(model, cond):
    positive = {k: v for k, v in cond.items() if not k.startswith("negative")}
    with pytest.raises(ValueError, match="negative prompt"):
        _rollout(model, positive, guidance_scale=4.5)
    _rollout(model, positive, guidance_scale=1.0)  # no CFG: no negative needed


def test_missing_pooled_projections_is_refused(model, cond):
    no_pooled = {k: v for k, v in cond.items() if k != "pooled_prompt_embeds"}
    with pytest.raises(ValueError, match="pooled_prompt_embeds"):
        _rollout(model, no_pooled)


@pytest.mark.parametrize(
    ("key", "value", "error", "match"),
    [
        ("prompt_embeds", torch.zeros(4, 16, 24), ValueError, "joint_attention_dim"),
        ("pooled_prompt_embeds", torch.zeros(4, 8), ValueError, "pooled_projection_dim"),
        ("prompt_embeds", torch.zeros(3, 16, 32), ValueError, "3 rows for 4 samples"),
        ("prompt_embeds", torch.zeros(4, 16, 32, dtype=torch.bfloat16), TypeError, "float32"),
        ("prompt_embeds_mask", torch.ones(4, 16, dtype=torch.int64), ValueError, "no text mask"),
    ],
)
def test_malformed_conditioning_is_refused(model, cond, key, value, error, match):
    with pytest.raises(error, match=match):
        _rollout(model, {**cond, key: value})


def test_wrong_latent_shape_is_refused(model, cond):
    trajectory = _rollout(model, cond)
    t = trajectory.timesteps[:, 0]
    with pytest.raises(ValueError, match="do not fit this SD3 transformer"):
        sd3.velocity(model, torch.zeros(4, 4, 8, 8), t, cond, 1.0, options=SIZE)  # 4 channels, model takes 16
    with pytest.raises(TypeError, match="float32"):
        sd3.velocity(model, trajectory.latents[:, 0].bfloat16(), t, cond, 1.0, options=SIZE)
    other_size = load_sd3(config={**TINY_SD3_CONFIG, "in_channels": 8, "out_channels": 8})
    with pytest.raises(ValueError, match="wrong latent shape for the model"):
        _recompute(other_size, trajectory)


def test_image_size_is_checked(model, cond):
    with pytest.raises(ValueError, match="multiples of vae_scale_factor"):
        _rollout(model, cond, height=60)
    with pytest.raises(ValueError, match="pos_embed_max_size"):
        _rollout(model, cond, height=512, width=512)


def test_trajectory_of_another_family_is_refused(model, cond):
    from adapters import flux
    from adapters.tiny_sd3_flux import load_flux, tiny_flux_prompt_encoder

    other = flux.rollout(load_flux(), tiny_flux_prompt_encoder().conditioning(PROMPTS), num_inference_steps=4,
                         seeds=SEEDS, window=SDEWindow(0, 2, 4), noise_level=0.7, **SIZE)
    with pytest.raises(ValueError, match="'flux' rollout"):
        _recompute(model, other)


def test_collate_refuses_re_padding_text(cond):
    """SD3 attends to padding (no text mask): requests of different text widths must not be zero-padded."""
    one = {k: v[:1] for k, v in cond.items()}
    wider = {k: (torch.cat([v, v.new_zeros(1, 4, v.shape[2])], dim=1) if v.dim() == 3 else v) for k, v in one.items()}
    assert torch.equal(sd3.collate_conditioning([one, one])["prompt_embeds"], cond["prompt_embeds"][[0, 0]])
    with pytest.raises(ValueError, match="attends to padding"):
        sd3.collate_conditioning([one, wider])
    with pytest.raises(ValueError, match="attends to padding"):
        sd3.collate_conditioning([one, one], width=32)


def test_tiny_model_is_a_pure_function_of_the_seed():
    state = torch.random.get_rng_state()
    first, again, other = load_sd3(seed=3), load_sd3(seed=3), load_sd3(seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's global RNG is untouched
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
    assert not torch.equal(first.proj_out.weight, other.proj_out.weight)
    assert torch.equal(load_sd3(seed=3, dtype=torch.bfloat16).proj_out.weight, first.proj_out.weight.bfloat16())


def test_tiny_prompt_encoder_shapes_and_determinism():
    encoder = tiny_sd3_prompt_encoder()
    embeds, pooled = encoder.encode(PROMPTS)
    assert embeds.shape == (4, 16, TINY_SD3_CONFIG["joint_attention_dim"]) and embeds.dtype == torch.float32
    assert pooled.shape == (4, TINY_SD3_CONFIG["pooled_projection_dim"]) and pooled.dtype == torch.float32
    again, pooled_again = tiny_sd3_prompt_encoder().encode(PROMPTS)
    assert torch.equal(embeds, again) and torch.equal(pooled, pooled_again)
    assert not torch.equal(pooled[0], pooled[1])
    with pytest.raises(ValueError, match="narrower than the longest prompt"):
        encoder.encode(["word " * 20])
