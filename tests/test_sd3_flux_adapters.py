"""What the SD3 and FLUX adapters promise alike, tested once for both families: diffusers parity outside the
window, bit-exact rollout → recompute (fp32, bf16 weights, step-wise, saved, micro-batched, with gradients),
the bf16-latents pitfall beside its fix, and bad inputs. Family-specific tests stay in
tests/test_sd3_adapter.py and tests/test_flux_adapter.py; the family table and helpers are in tests/sd3_flux_cases.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from rollout_args import rollout_args
from sd3_flux_cases import FAMILIES, PROMPTS, SEEDS, SIZE, Family, recompute, rollout

from rollout_consistency.adapters import SamplingSettings, Trajectory, recompute_step_log_prob
from rollout_consistency.adapters.batch_invariance import batch_invariant
from rollout_consistency.adapters.pitfalls import StockRoundedLatents
from rollout_consistency.adapters.stepwise import EngineSettings, StepwiseRequest, run_stepwise
from rollout_consistency.gate.judging.metrics import compute_metrics
from rollout_consistency.gate.judging.tolerances import exact_tolerance
from rollout_consistency.gate.judging.verdict import decide
from rollout_consistency.schedulers import SDEWindow


def _verdict(rollout_log_probs, trainer_log_probs, trajectory):
    metrics = compute_metrics(rollout_log_probs, trainer_log_probs, clip_ratio=1e-4, timesteps=trajectory.timesteps)
    return decide(metrics, exact_tolerance())


def _cases(per_family: Callable[[Family], list]) -> list:
    """pytest params `(family name, *case)` for each family's cases, with readable ids."""

    def case_id(family: Family, case: tuple) -> str:
        return "-".join([family.name, *(str(part) for part in case if isinstance(part, (str, float)))])

    return [
        pytest.param(family.name, *case, id=case_id(family, case))
        for family in FAMILIES.values()
        for case in per_family(family)
    ]


def _cfg_cases(family: Family) -> list:
    """CFG off, and on at the standard rollout's setting."""
    return [(family.cfg_key, 1.0), (family.cfg_key, family.cfg[family.cfg_key])]


# Module-scoped and keyed by name, so pytest builds each family's models once and runs its tests together.
@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def model(family):
    return family.load()


@pytest.fixture(scope="module")
def model_bf16(family):
    return family.load(dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def cond(family):
    return family.conditioning(PROMPTS, [""] * len(PROMPTS))


@pytest.mark.parametrize(("family", "cfg_key", "cfg_scale"), _cases(_cfg_cases), indirect=["family"])
def test_ode_steps_match_diffusers_pipeline_bit_for_bit(family, model, cond, cfg_key, cfg_scale):
    """Outside the window the adapter is the family's diffusers pipeline to the last bit in float32: initial noise
    from per-sample generators; for SD3 timestep σ·1000, pooled projections, CFG; for FLUX 2x2 packing,
    img_ids/txt_ids, timestep/1000, embedded guidance, true CFG. StableDiffusion3Pipeline runs CFG as one
    forward of 2B, the adapter as two forwards of B: on this CPU the tiny model gives the same bits."""
    num_steps = 5
    cfg = {**family.cfg, cfg_key: cfg_scale}
    pipe = family.pipeline(model)
    pipe.set_progress_bar_config(disable=True)
    seen = {}

    def capture(pipeline, i, t, tensors):
        seen[i] = tensors["latents"].clone()
        return {}

    pipe(
        **cond,
        **cfg,
        num_inference_steps=num_steps,
        output_type="latent",
        generator=[torch.Generator().manual_seed(s) for s in SEEDS],
        callback_on_step_end=capture,
        **SIZE,
    )
    trajectory = rollout(
        family,
        model,
        cond,
        **cfg,
        num_inference_steps=num_steps,
        window=SDEWindow(start=num_steps - 1, size=1, num_steps=num_steps),
    )
    assert torch.equal(trajectory.latents[:, 0], seen[num_steps - 2])


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
@pytest.mark.parametrize(("family", "cfg_key", "cfg_scale"), _cases(_cfg_cases), indirect=["family"])
def test_fp32_rollout_then_recompute_is_exact(family, model, cond, cfg_key, cfg_scale, sde_type):
    trajectory = rollout(family, model, cond, sde_type=sde_type, **{cfg_key: cfg_scale})
    recomputed = recompute(family, model, trajectory)
    assert recomputed.dtype == torch.float32 and recomputed.shape == (4, 3)
    assert torch.equal(recomputed - trajectory.log_probs, torch.zeros(4, 3))


@pytest.mark.parametrize("arrivals", [(0, 0, 0, 0), (0, 0, 2, 2)])
def test_stepwise_equals_request_level_bit_for_bit(family, model, cond, arrivals):
    """The continuous-batching path: requests join mid-flight and run at different steps inside one forward
    (one fixed text width as the pipeline encodes it) — bit-exact: in the default mode when every forward has
    the request-level batch composition (all arrive at once), in batch-invariant mode for any arrivals."""
    if len(set(arrivals)) > 1:
        model = batch_invariant(model, family.adapter.FAMILY)
    reference = rollout(family, model, cond, prompt_groups=[0, 0, 1, 1])
    requests = [
        StepwiseRequest(
            f"r{i}",
            seed=seed,
            conditioning={k: v[i : i + 1] for k, v in cond.items()},
            window=reference.windows[i],
            prompt_group=reference.prompt_groups[i],
            arrival=arrival,
        )
        for i, (seed, arrival) in enumerate(zip(SEEDS, arrivals, strict=False))
    ]
    stepwise = run_stepwise(
        family.adapter.FAMILY,
        model,
        requests,
        scheduler_setup=reference.scheduler,
        sampling=SamplingSettings(noise_level=0.7, guidance_scale=family.guidance_scale),
        options=reference.family_options,
        engine=EngineSettings(max_num_seqs=4),
    )
    assert stepwise.provenance["path"] == "step-wise"
    for name in ("latents", "log_probs", "timesteps", "final_latents"):
        assert torch.equal(getattr(stepwise, name), getattr(reference, name)), name
    assert torch.equal(recompute(family, model, stepwise), stepwise.log_probs)


def test_bf16_weights_with_fp32_storage_is_exact(family, model_bf16, cond):
    trajectory = rollout(family, model_bf16, cond)
    for tensor in (
        trajectory.latents,
        trajectory.log_probs,
        trajectory.timesteps,
        trajectory.final_latents,
        *trajectory.conditioning.values(),
    ):
        assert tensor.dtype == torch.float32
    recomputed = recompute(family, model_bf16, trajectory)
    assert torch.equal(recomputed - trajectory.log_probs, torch.zeros(4, 3))


def test_stock_bf16_stored_latents_bias_the_log_ratio_down(family, model_bf16):
    """The known pitfall 'precision loss in stored latents' through each adapter, beside its fix.

    Stock: each prev_sample is rounded to the model's bf16 after its log-prob was computed, and stored and fed
    on rounded. Per latent element the trainer then loses e²/(2σ²) on average (e the rounding error, σ the
    step's std), so log-ratios lean negative and PPO clips on the lower side. Against it stands a noise term
    of order e/(σ·sqrt(D)) per sample; D = 16·16·16 here, a 16·128·128 real latent is 64x larger, so a
    small noise_level puts this tiny run in the real regime. SD3's own schedule ends at a tiny σ (0.009 here),
    where the step's std nears bf16 resolution: there every sample shows it.
    """
    cond16 = family.conditioning(PROMPTS * 4)
    args = dict(
        num_inference_steps=4,
        seeds=list(range(16)),
        window=SDEWindow(start=0, size=4, num_steps=4),
        noise_level=0.05,
        height=128,
        width=128,
        denoise_to_end=False,
    )
    args[family.cfg_key] = 1.0  # no CFG: the 16 prompts come without negatives
    fixed_setup = family.adapter.rollout(
        model_bf16, {k: v[:1] for k, v in cond16.items()}, **rollout_args({**args, "seeds": [0]})
    )
    rounded = StockRoundedLatents(fixed_setup.scheduler.scheduler(), torch.bfloat16)
    stock = family.adapter.rollout(model_bf16, cond16, scheduler=rounded, **rollout_args(args))
    stock_recomputed = recompute(family, model_bf16, stock)
    log_ratio = (stock_recomputed - stock.log_probs).double()
    clip = 1e-4
    assert (log_ratio < 0).double().mean() > 0.8  # a fair coin would give > 80% of 64 with p < 1e-6
    assert (log_ratio < -clip).double().mean() > 5 * (log_ratio > clip).double().mean()
    if family.last_step_clips_every_sample:
        assert bool((log_ratio[:, -1] < -clip).all())  # SD3's last step (σ ≈ 0.009): every sample clips low
    assert log_ratio.mean() < -1e-5

    verdict = _verdict(stock.log_probs, stock_recomputed, stock)
    assert not verdict.passed
    assert {"ratio_mean", "ppo_kl", "pg_clipfrac_lower"} <= {c.name for c in verdict.checks if not c.passed}

    fixed = family.adapter.rollout(model_bf16, cond16, **rollout_args(args))
    recomputed = recompute(family, model_bf16, fixed)
    assert torch.equal(recomputed - fixed.log_probs, torch.zeros(16, 4))
    assert _verdict(fixed.log_probs, recomputed, fixed).passed


@pytest.mark.parametrize(("family", "sde_type"), [("sd3", "cps"), ("flux", "dance_sde")], indirect=["family"])
def test_trajectory_round_trip_then_recompute_is_exact(family, model, cond, sde_type, tmp_path):
    trajectory = rollout(family, model, cond, sde_type=sde_type)
    path = trajectory.save(tmp_path / f"{family.name}.safetensors")
    loaded = Trajectory.load(path)
    assert loaded.model_family == family.name and dict(loaded.family_options) == dict(trajectory.family_options)
    assert loaded.guidance_scale == family.guidance_scale
    assert {k: loaded.family_options[k] for k in family.cfg_options} == dict(family.cfg_options)
    assert torch.equal(loaded.latents, trajectory.latents)
    assert torch.equal(recompute(family, model, loaded) - trajectory.log_probs, torch.zeros(4, 3))


def test_recompute_in_micro_batches_of_two_is_exact(family, model, cond):
    """In batch-invariant mode a trainer micro-batch of 2 reproduces a rollout of 4 bit for bit. (The default
    mode promises it only for the same batch composition: MKL picks kernels by CPU and shape.)"""
    model = batch_invariant(model, family.adapter.FAMILY)
    trajectory = rollout(family, model, cond)
    for rows in ([0, 1], [2, 3], [3, 0]):
        assert torch.equal(recompute(family, model, trajectory.select(rows)), trajectory.log_probs[rows])


def test_recompute_step_carries_gradients_to_the_transformer(family, cond):
    model = family.load()  # its own copy: the shared one must not collect gradients
    trajectory = rollout(family, model, cond)
    step = family.gradient_step
    log_prob = recompute_step_log_prob(model, trajectory, step)
    assert log_prob.requires_grad and torch.equal(log_prob.detach(), trajectory.log_probs[:, step])
    log_prob.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert family.trained_weight(model).grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- bad inputs
def test_cfg_without_negative_prompt_is_refused(family, model, cond):
    """SD3's CFG (guidance_scale > 1) and FLUX's true CFG (true_cfg_scale > 1) need the negative prompt;
    FLUX's embedded guidance does not."""
    positive = {k: v for k, v in cond.items() if not k.startswith("negative")}
    with pytest.raises(ValueError, match="no negative prompt"):
        rollout(family, model, positive, **{family.cfg_key: family.cfg[family.cfg_key]})
    rollout(family, model, positive, **{family.cfg_key: 1.0})  # no CFG: no negative needed


def test_missing_pooled_projections_is_refused(family, model, cond):
    no_pooled = {k: v for k, v in cond.items() if k != "pooled_prompt_embeds"}
    with pytest.raises(ValueError, match="pooled_prompt_embeds"):
        rollout(family, model, no_pooled)


def _malformed_conditioning(family: Family) -> list:
    """(key, value, error, match): each family's tiny transformer takes text 32 wide and pooled 16 wide."""
    specific = {
        "sd3": [
            ("prompt_embeds", torch.zeros(3, 16, 32), ValueError, "3 rows for 4 samples"),
            ("prompt_embeds", torch.zeros(4, 16, 32, dtype=torch.bfloat16), TypeError, "float32"),
        ],
        "flux": [
            ("negative_prompt_embeds", torch.zeros(2, 16, 32), ValueError, "2 rows for 4 samples"),
            ("pooled_prompt_embeds", torch.zeros(4, 16, dtype=torch.float16), TypeError, "float32"),
        ],
    }
    return [
        ("prompt_embeds", torch.zeros(4, 16, 24), ValueError, "joint_attention_dim"),
        ("pooled_prompt_embeds", torch.zeros(4, 8), ValueError, "pooled_projection_dim"),
        *specific[family.name],
        ("prompt_embeds_mask", torch.ones(4, 16, dtype=torch.int64), ValueError, "no text mask"),
    ]


@pytest.mark.parametrize(
    ("family", "key", "value", "error", "match"), _cases(_malformed_conditioning), indirect=["family"]
)
def test_malformed_conditioning_is_refused(family, model, cond, key, value, error, match):
    with pytest.raises(error, match=match):
        rollout(family, model, {**cond, key: value})


def test_collate_refuses_re_padding_text(family, cond):
    """SD3 and FLUX attend to padding (no text mask): requests of different text widths must not be zero-padded."""
    one = {k: v[:1] for k, v in cond.items()}
    wider = {k: (torch.cat([v, v.new_zeros(1, 4, v.shape[2])], dim=1) if v.dim() == 3 else v) for k, v in one.items()}
    collate = family.adapter.collate_conditioning
    assert torch.equal(collate([one, one])["prompt_embeds"], cond["prompt_embeds"][[0, 0]])
    with pytest.raises(ValueError, match="attends to padding"):
        collate([one, wider])
    with pytest.raises(ValueError, match="attends to padding"):
        collate([one, one], width=32)


# ---------------------------------------------------------------------------------------------- tiny models
def test_tiny_model_is_a_pure_function_of_the_seed(family):
    state = torch.random.get_rng_state()
    first, again, other = family.load(seed=3), family.load(seed=3), family.load(seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's global RNG is untouched
    assert all(
        torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values(), strict=False)
    )
    assert not torch.equal(first.proj_out.weight, other.proj_out.weight)
    assert torch.equal(family.load(seed=3, dtype=torch.bfloat16).proj_out.weight, first.proj_out.weight.bfloat16())


def test_tiny_prompt_encoder_shapes_and_determinism(family):
    encoder = family.prompt_encoder()
    embeds, pooled = encoder.encode(PROMPTS)
    assert embeds.shape == (4, 16, family.config["joint_attention_dim"]) and embeds.dtype == torch.float32
    assert pooled.shape == (4, family.config["pooled_projection_dim"]) and pooled.dtype == torch.float32
    again, pooled_again = family.prompt_encoder().encode(PROMPTS)
    assert torch.equal(embeds, again) and torch.equal(pooled, pooled_again)
    assert not torch.equal(pooled[0], pooled[1])
    with pytest.raises(ValueError, match="narrower than the longest prompt"):
        encoder.encode(["word " * 20])
