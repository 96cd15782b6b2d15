"""Known stock behaviours reproduced beside their fixes (adapters side).

Each test runs the stock reproduction (a `rollout_consistency.adapters.pitfalls` wrapper) and the default (fixed) path on the
same model, seeds and conditioning, and asserts the pitfall's signature on one and exactness on the other.
"""

from __future__ import annotations

import random

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from rollout_args import rollout_args, stepwise_args

from rollout_consistency.adapters import (
    INJECTION_NAMES,
    BatchRequests,
    SamplingSettings,
    apply_injection,
    qwen_image,
    recompute_log_probs,
)
from rollout_consistency.adapters.pitfalls import (
    MixedDtypeBatchError,
    StockMaskSumRope,
    StockModelDtypeLatents,
    StockRoundedLatents,
    stock_per_request_window,
)
from rollout_consistency.adapters.rope import padded_txt_seq_lens, stock_mask_sum_txt_seq_lens
from rollout_consistency.adapters.stepwise import StepwiseRequest, run_stepwise
from rollout_consistency.adapters.tiny import TinyPromptEncoder, load_qwen_image
from rollout_consistency.schedulers import SDEWindow, draw_sde_window

CLIP = 1e-4  # a public clip range (Flow-GRPO's)

# The bf16 bias is E[δ²]/(2σ²) per element (δ the bf16 rounding of the stored sample, σ the step's noise
# std) against a zero-mean cross term of size rms(δ)/(σ·sqrt(n)) over n latent elements. A 1024² Qwen-Image
# has n = 262144 and shows the bias at any noise level; the tiny model at 256 px has n = 4096, so these
# tests use a small step std (late window, noise_level 0.1) where the bias dominates, as at full size.
BIAS_SETTINGS = dict(height=256, width=256, num_inference_steps=12, noise_level=0.1)
BIAS_WINDOW = SDEWindow(start=8, size=4, num_steps=12)
PROMPTS = ["a red cat sitting", "a dog in the garden at night"] * 2


@pytest.fixture(scope="module")
def model_bf16():
    return load_qwen_image(dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def model():
    return load_qwen_image()


@pytest.fixture(scope="module")
def encoder():
    return TinyPromptEncoder()


def _clip_fractions(log_ratio: torch.Tensor) -> tuple[float, float]:
    ratio = log_ratio.double().exp()
    return float((ratio - 1 > CLIP).double().mean()), float((1 - ratio > CLIP).double().mean())


def test_injection_names_apply_and_unknown_names_are_refused(model):
    setup = qwen_image.FAMILY.scheduler_setup(
        qwen_image.QWEN_IMAGE_SCHEDULER_CONFIG, 4, model, {"height": 64, "width": 64}
    )
    windows = [SDEWindow(1, 2, 4)] * 2
    applied = {
        name: apply_injection(
            name, scheduler=setup.scheduler(), transformer=model, windows=windows, request_ids=["a", "b"]
        )
        for name in INJECTION_NAMES
        if name != "expert-switch"  # a model with two experts (Wan 2.2) only: tests/test_wan_adapter.py
    }
    assert isinstance(applied["bf16-latents"].scheduler, StockRoundedLatents)
    assert isinstance(applied["stepwise-bf16"].scheduler, StockModelDtypeLatents)
    assert isinstance(applied["mask-sum-rope"].transformer, StockMaskSumRope)
    assert len(applied["per-request-window"].windows) == 2
    with pytest.raises(ValueError, match="Unknown injection"):
        apply_injection("bf16", scheduler=setup.scheduler(), transformer=model, windows=windows, request_ids=["a", "b"])


# ------------------------------------------------------------------------------------ bf16 latents
def test_bf16_truncated_latents_bias_low_and_clip_only_low(model_bf16, encoder):
    cond = encoder.conditioning(PROMPTS)
    args = dict(seeds=list(range(4)), window=BIAS_WINDOW, denoise_to_end=False, **BIAS_SETTINGS)
    rounded = StockRoundedLatents(_setup(model_bf16, cond).scheduler(), torch.bfloat16)
    stock = qwen_image.rollout(model_bf16, cond, scheduler=rounded, **rollout_args(args))
    fixed = qwen_image.rollout(model_bf16, cond, **rollout_args(args))
    with torch.no_grad():
        stock_ratio = recompute_log_probs(model_bf16, stock) - stock.log_probs
        fixed_ratio = recompute_log_probs(model_bf16, fixed) - fixed.log_probs
    # Stock: every (sample, step) log-ratio is negative — ratio_mean below 1, all clipping on the lower side.
    assert (stock_ratio < 0).all()
    higher, lower = _clip_fractions(stock_ratio)
    assert higher == 0.0 and lower > 0.5
    assert stock.provenance["injection"] == "bf16-latents"
    # Fix: the same rollout kept in float32 is re-scored exactly.
    assert torch.equal(fixed_ratio, torch.zeros_like(fixed_ratio))
    # The stored latents were rounded to bf16 values (held in float32), the fixed ones are not.
    assert torch.equal(stock.latents, stock.latents.to(torch.bfloat16).float())
    assert not torch.equal(fixed.latents, fixed.latents.to(torch.bfloat16).float())


def test_bf16_latents_injection_is_a_no_op_on_fp32_weights(model, encoder):
    cond = encoder.conditioning(PROMPTS[:2])
    trajectory = qwen_image.rollout(
        model,
        cond,
        requests=BatchRequests(seeds=(0, 1), windows=SDEWindow(1, 2, 4)),
        sampling=SamplingSettings(noise_level=0.7),
        num_inference_steps=4,
        height=64,
        width=64,
        scheduler=StockRoundedLatents(
            qwen_image.FAMILY.scheduler_setup(
                qwen_image.QWEN_IMAGE_SCHEDULER_CONFIG, 4, model, {"height": 64, "width": 64}
            ).scheduler(),
            torch.float32,
        ),
    )
    with torch.no_grad():
        assert torch.equal(recompute_log_probs(model, trajectory), trajectory.log_probs)


# ------------------------------------------------------------------------------------ step-wise bf16
def _bias_requests(cond, arrivals):
    return [
        StepwiseRequest(
            f"r{i}", seed=i, conditioning={k: v[i : i + 1] for k, v in cond.items()}, window=BIAS_WINDOW, arrival=a
        )
        for i, a in enumerate(arrivals)
    ]


def _stepwise_bf16(common):
    return StockModelDtypeLatents(common["scheduler_setup"].scheduler(), torch.bfloat16)


def _setup(model, cond):
    return qwen_image.rollout(
        model,
        {k: v[:2] for k, v in cond.items()},
        **rollout_args(dict(seeds=[0, 1], window=BIAS_WINDOW, denoise_to_end=False, **BIAS_SETTINGS)),
    ).scheduler


def test_stepwise_bf16_state_biases_low_and_fp32_state_is_exact(model_bf16, encoder):
    cond = encoder.conditioning(PROMPTS, pad_to=8)
    options = {"height": 256, "width": 256, "vae_scale_factor": 8, "mask_text_padding": True}
    common = dict(
        scheduler_setup=_setup(model_bf16, cond), noise_level=0.1, options=options, max_num_seqs=4, text_width=8
    )
    requests = _bias_requests(cond, [0] * 4)
    stock = run_stepwise(
        qwen_image.FAMILY, model_bf16, requests, scheduler=_stepwise_bf16(common), **stepwise_args(common)
    )
    fixed = run_stepwise(qwen_image.FAMILY, model_bf16, requests, **stepwise_args(common))
    with torch.no_grad():
        stock_ratio = recompute_log_probs(model_bf16, stock) - stock.log_probs
        fixed_ratio = recompute_log_probs(model_bf16, fixed) - fixed.log_probs
    assert (stock_ratio < 0).all()
    higher, lower = _clip_fractions(stock_ratio)
    assert higher == 0.0 and lower > 0.5
    assert torch.equal(fixed_ratio, torch.zeros_like(fixed_ratio))


def test_stepwise_bf16_state_fails_when_an_fp32_request_joins(model_bf16, encoder):
    cond = encoder.conditioning(PROMPTS[:3], pad_to=8)
    options = {"height": 64, "width": 64, "vae_scale_factor": 8, "mask_text_padding": True}
    window = SDEWindow(1, 2, 4)
    requests = [
        StepwiseRequest(
            f"r{i}", seed=i, conditioning={k: v[i : i + 1] for k, v in cond.items()}, window=window, arrival=a
        )
        for i, a in enumerate([0, 0, 1])
    ]
    setup = qwen_image.rollout(
        model_bf16,
        {k: v[:2] for k, v in cond.items()},
        requests=BatchRequests(seeds=(0, 1), windows=window),
        sampling=SamplingSettings(noise_level=0.7),
        num_inference_steps=4,
        height=64,
        width=64,
    ).scheduler
    common = dict(scheduler_setup=setup, noise_level=0.7, options=options, text_width=8)
    with pytest.raises(MixedDtypeBatchError, match="Mixed dtypes in latents batch"):
        run_stepwise(qwen_image.FAMILY, model_bf16, requests, scheduler=_stepwise_bf16(common), **stepwise_args(common))
    fixed = run_stepwise(
        qwen_image.FAMILY, model_bf16, requests, **stepwise_args(common)
    )  # same arrivals, fp32 state: fine
    with torch.no_grad():
        assert torch.equal(recompute_log_probs(model_bf16, fixed), fixed.log_probs)


# ------------------------------------------------------------------------------------ RoPE lengths
def test_txt_seq_lens_subclass_is_diffusers_forward_with_padded_lengths(model, encoder):
    reference = QwenImageTransformer2DModel(**dict(model.config)).eval()
    reference.load_state_dict(model.state_dict())
    embeds, mask = encoder.encode(["a red cat", "a dog in the garden at night"], pad_to=12)
    inputs = dict(
        hidden_states=torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0)),
        encoder_hidden_states=embeds,
        timestep=torch.tensor([0.5, 0.25]),
        img_shapes=[[(1, 4, 4)]] * 2,
        return_dict=False,
    )
    with torch.no_grad():
        for attention_mask in (mask, None):
            expected = reference(**inputs, encoder_hidden_states_mask=attention_mask)[0]
            ours = model(**inputs, encoder_hidden_states_mask=attention_mask, txt_seq_lens=padded_txt_seq_lens(embeds))[
                0
            ]
            assert torch.equal(ours, expected)
            assert torch.equal(model(**inputs, encoder_hidden_states_mask=attention_mask)[0], expected)
    assert padded_txt_seq_lens(embeds) == [12, 12]
    assert stock_mask_sum_txt_seq_lens(mask) == [3, 7]


def _rope_case(model, encoder, width, mask_text_padding):
    """Short prompts (2 tokens) padded to `width` — the width of a longer prompt they were batched with."""
    cond = encoder.conditioning(["a cat"] * 4, pad_to=width)
    args = dict(
        height=64,
        width=64,
        num_inference_steps=6,
        seeds=[1, 2, 3, 4],
        window=SDEWindow(0, 5, 6),
        noise_level=0.7,
        mask_text_padding=mask_text_padding,
        denoise_to_end=False,
    )
    stock = qwen_image.rollout(StockMaskSumRope(model), cond, **rollout_args(args))
    fixed = qwen_image.rollout(model, cond, **rollout_args(args))
    with torch.no_grad():
        stock_ratio = recompute_log_probs(model, stock) - stock.log_probs
        fixed_ratio = recompute_log_probs(model, fixed) - fixed.log_probs
    return stock_ratio, fixed_ratio


def test_mask_sum_rope_error_grows_with_prompt_length(model, encoder):
    """Padded text keys attended (an attention kernel without a key-padding mask): RoPE lengths from
    mask.sum() leave the positions past the valid tokens unrotated, and the step-1 log-ratio grows with the
    width of the longer prompt the short one was padded to. The padded-width rule is exact at every width."""
    errors = []
    for width in (2, 4, 16, 64):
        stock_ratio, fixed_ratio = _rope_case(model, encoder, width, mask_text_padding=False)
        assert torch.equal(fixed_ratio, torch.zeros_like(fixed_ratio))
        errors.append(float(stock_ratio.abs().mean()))
    assert errors[0] == 0.0  # no padding past the valid tokens: mask.sum() == width, nothing to get wrong
    assert 0 < errors[1] < errors[2] < errors[3], errors
    assert errors[3] > 1e-5  # a large fraction of a 1e-4 clip band


def test_mask_sum_rope_is_invisible_under_an_exact_key_padding_mask(model, encoder):
    """With diffusers' key-padding mask the unrotated positions are never attended: bit-identical. The
    pitfall needs padded keys to reach attention (see test above); the fix is right in both cases."""
    stock_ratio, fixed_ratio = _rope_case(model, encoder, 64, mask_text_padding=True)
    assert torch.equal(stock_ratio, torch.zeros_like(stock_ratio))
    assert torch.equal(fixed_ratio, torch.zeros_like(fixed_ratio))


def test_mask_sum_rope_needs_a_model_that_takes_txt_seq_lens(model, encoder):
    reference = QwenImageTransformer2DModel(**dict(model.config)).eval()
    cond = encoder.conditioning(["a cat"] * 2, pad_to=4)
    with pytest.raises(ValueError, match="txt_seq_lens"):
        qwen_image.rollout(
            StockMaskSumRope(reference),
            cond,
            height=64,
            width=64,
            num_inference_steps=3,
            requests=BatchRequests(seeds=(1, 2), windows=SDEWindow(0, 1, 3)),
            sampling=SamplingSettings(noise_level=0.7),
        )


# ------------------------------------------------------------------------------------ SDE windows
def test_per_request_windows_disagree_within_a_prompt_group_and_group_windows_agree():
    rng = random.Random(1234)  # the stock draw is unseeded; a fixed rng keeps this test deterministic
    stock = [stock_per_request_window(f"group0-rollout{i}", num_steps=16, window_size=4, rng=rng) for i in range(8)]
    assert len({w.start for w in stock}) > 1  # rollouts of one prompt: noise at different timesteps
    # Fix: the window is a pure function of (launcher seed, global step, prompt group) — same for every
    # rollout of the group, in any process, on any rank.
    fixed = [draw_sde_window(seed=42, global_step=7, prompt_group=0, num_steps=16, window_size=4) for _ in range(8)]
    assert len(set(fixed)) == 1
    groups = {
        draw_sde_window(seed=42, global_step=7, prompt_group=g, num_steps=16, window_size=4).start for g in range(16)
    }
    assert len(groups) > 1  # different groups still explore different windows


def test_per_request_window_injection_shows_in_the_trajectory(model, encoder):
    cond = encoder.conditioning(["a red cat"] * 8)
    window = draw_sde_window(seed=42, global_step=0, prompt_group=0, num_steps=12, window_size=2)
    args = dict(
        height=32,
        width=32,
        num_inference_steps=12,
        seeds=list(range(8)),
        window=window,
        noise_level=0.7,
        prompt_groups=[0] * 8,
        denoise_to_end=False,
    )
    fixed = qwen_image.rollout(model, cond, **rollout_args(args))
    assert set(fixed.windows) == {window}
    # The stock draw is unseeded: 8 rollouts land on one start with probability 11^-7; retry once anyway.
    for _ in range(2):
        stock_windows = apply_injection(
            "per-request-window",
            scheduler=None,
            transformer=model,
            windows=[window] * 8,
            request_ids=[f"r{i}" for i in range(8)],
        ).windows
        stock = qwen_image.rollout(model, cond, **rollout_args({**args, "window": stock_windows}))
        if len(set(stock.windows)) > 1:
            break
    assert len(set(stock.windows)) > 1
    with pytest.raises(ValueError, match="different SDE windows"):
        _ = stock.window
    with torch.no_grad():  # the step-1 ratio cannot see it: the trainer re-scores the stored steps exactly
        assert torch.equal(recompute_log_probs(model, stock), stock.log_probs)
