"""Step-wise (continuous-batching) rollout: equality with the request-level rollout, joins/leaves, recompute."""

from __future__ import annotations

import pytest
import torch

from rollout_consistency.adapters import BatchRequests, SamplingSettings, qwen_image, recompute_log_probs
from rollout_consistency.adapters.batch_invariance import batch_invariant
from rollout_consistency.adapters.pitfalls import MixedDtypeBatchError
from rollout_consistency.adapters.stepwise import (
    EngineSettings,
    StepwiseRequest,
    gather_latents,
    init_window_record,
    record_window_step,
    run_stepwise,
    shared_text_width,
)
from rollout_consistency.adapters.tiny import TinyPromptEncoder, load_qwen_image
from rollout_consistency.gate import gate
from rollout_consistency.schedulers import SDEWindow, draw_sde_window

PROMPTS = ["a red cat", "a dog in the garden at night", "sky", "photo of a small blue house near the river"]
OPTIONS = {"height": 64, "width": 64, "vae_scale_factor": 8, "mask_text_padding": True}
WINDOW = SDEWindow(start=1, size=3, num_steps=6)


@pytest.fixture(scope="module")
def model():
    return load_qwen_image()


@pytest.fixture(scope="module")
def encoder():
    return TinyPromptEncoder()


def _requests(cond, arrivals, windows=None, trim=False):
    requests = []
    for i, arrival in enumerate(arrivals):
        own = {k: v[i : i + 1] for k, v in cond.items()}
        if trim:  # each request keeps only its own tokens, as a server receives it
            for key in ("prompt_embeds", "negative_prompt_embeds"):
                length = int(own[key + "_mask"].sum())
                own[key], own[key + "_mask"] = own[key][:, :length], own[key + "_mask"][:, :length]
        window = WINDOW if windows is None else windows[i]
        requests.append(
            StepwiseRequest(
                f"req-{i}", seed=i + 1, conditioning=own, window=window, prompt_group=i // 2, arrival=arrival
            )
        )
    return requests


def _reference(model, cond, windows=None, guidance_scale=3.0):
    return qwen_image.rollout(
        model,
        cond,
        num_inference_steps=6,
        requests=BatchRequests(
            seeds=(1, 2, 3, 4), windows=WINDOW if windows is None else windows, prompt_groups=(0, 0, 1, 1)
        ),
        sampling=SamplingSettings(noise_level=0.7, guidance_scale=guidance_scale),
        height=64,
        width=64,
    )


def _stepwise(model, requests, reference, guidance_scale=3.0, **kwargs):
    return run_stepwise(
        qwen_image.FAMILY,
        model,
        requests,
        scheduler_setup=reference.scheduler,
        sampling=SamplingSettings(noise_level=0.7, guidance_scale=guidance_scale),
        options=OPTIONS,
        engine=EngineSettings(**kwargs),
    )


@pytest.mark.parametrize("arrivals", [(0, 0, 0, 0), (0, 0, 1, 1), (0, 0, 2, 2)])
def test_stepwise_equals_request_level_bit_for_bit(model, encoder, arrivals):
    """Same seeds, windows, conditioning and text width: bit-exact, even though requests join mid-flight and run
    at different steps inside one forward — in the default mode when every forward has the request-level batch
    composition (all arrive at once), in batch-invariant mode for any arrival pattern."""
    if len(set(arrivals)) > 1:
        model = batch_invariant(model, qwen_image.FAMILY)
    cond = encoder.conditioning(PROMPTS, [" "] * 4, pad_to=12)
    reference = _reference(model, cond)
    stepwise = _stepwise(model, _requests(cond, arrivals), reference, max_num_seqs=4, text_width=12)
    assert stepwise.provenance["path"] == "step-wise"
    assert torch.equal(stepwise.latents, reference.latents)
    assert torch.equal(stepwise.log_probs, reference.log_probs)
    assert torch.equal(stepwise.timesteps, reference.timesteps)
    assert torch.equal(stepwise.final_latents, reference.final_latents)
    with torch.no_grad():
        assert torch.equal(recompute_log_probs(model, stepwise), stepwise.log_probs)


def test_stepwise_with_per_group_windows_is_exact(model, encoder):
    windows = [draw_sde_window(seed=3, global_step=1, prompt_group=g, num_steps=6, window_size=2) for g in (0, 0, 1, 1)]
    cond = encoder.conditioning(PROMPTS, [" "] * 4, pad_to=12)
    reference = _reference(model, cond, windows=windows)
    stepwise = _stepwise(model, _requests(cond, (0, 0, 1, 1), windows=windows), reference, text_width=12)
    assert stepwise.windows == tuple(windows)
    assert torch.equal(stepwise.log_probs, reference.log_probs)
    with torch.no_grad():
        assert torch.equal(recompute_log_probs(model, stepwise), stepwise.log_probs)


def test_stepwise_cfg_with_trimmed_texts_recomputes_exactly(model, encoder):
    """Requests arrive with their own tokens only (the negative prompt narrower than the positive); the
    forwards pad both texts to `text_width`, and the trajectory stores them padded the same way, so the
    trainer's recompute runs the very same CFG forwards."""
    cond = encoder.conditioning(PROMPTS, [" "] * 4, pad_to=12)
    reference = _reference(model, cond)
    requests = _requests(cond, (0, 0, 0, 0), trim=True)
    assert (
        requests[3].conditioning["negative_prompt_embeds"].shape[1] < requests[3].conditioning["prompt_embeds"].shape[1]
    )
    stepwise = _stepwise(model, requests, reference, max_num_seqs=4, text_width=12)
    assert stepwise.conditioning["negative_prompt_embeds"].shape[1] == 12
    with torch.no_grad():
        assert torch.equal(recompute_log_probs(model, stepwise), stepwise.log_probs)


def test_stepwise_is_rounding_close_when_the_forward_differs(model, encoder):
    """Not batch-invariant cases, stated: (a) a request runs alone for some steps (max_num_seqs=3 and late
    arrivals: a single-row forward takes another CPU kernel); (b) text padded to the running batch's widest
    prompt, which changes as requests come and go (attention over a different number of masked keys rounds
    differently). What any CPU promises is float32 rounding of the same maths: the log-probs pass the gate's
    `implementation` profile (here they agree to ~1e-7) and the latents are `assert_close` in float32."""
    cond = encoder.conditioning(PROMPTS, [" "] * 4)
    reference = _reference(model, cond)
    for kwargs, trim in (
        ({"max_num_seqs": 3, "text_width": None}, True),
        ({"max_num_seqs": 4}, True),
        ({"max_num_seqs": 3, "text_width": 12}, False),
    ):
        source = encoder.conditioning(PROMPTS, [" "] * 4, pad_to=12) if not trim else cond
        stepwise = _stepwise(model, _requests(source, (0, 0, 1, 1), trim=trim), reference, **kwargs)
        with torch.no_grad():
            recomputed = recompute_log_probs(model, stepwise)
        for label, rollout, trainer in (
            ("stepwise vs request-level", reference.log_probs, stepwise.log_probs),
            ("trainer recompute", stepwise.log_probs, recomputed),
        ):
            report = gate(rollout, trainer, profile="implementation")
            assert report.passed, f"{kwargs} {label}:\n{report.format_table()}"
        torch.testing.assert_close(stepwise.latents, reference.latents)


def test_running_batch_respects_max_num_seqs_and_order(model, encoder):
    """Forwards of 2 against a request-level batch of 4: bit-exact in batch-invariant mode."""
    model = batch_invariant(model, qwen_image.FAMILY)
    cond = encoder.conditioning(PROMPTS, pad_to=12)
    reference = qwen_image.rollout(
        model,
        cond,
        num_inference_steps=6,
        requests=BatchRequests(seeds=(1, 2, 3, 4), windows=WINDOW),
        sampling=SamplingSettings(noise_level=0.7),
        height=64,
        width=64,
    )
    seen_batches = []
    original = qwen_image.FAMILY.velocity

    def counting_velocity(transformer, latents, *args, **kwargs):
        seen_batches.append(latents.shape[0])
        return original(transformer, latents, *args, **kwargs)

    from dataclasses import replace

    family = replace(qwen_image.FAMILY, velocity=counting_velocity)
    requests = _requests(cond, (0, 0, 2, 2))[::-1]  # submission order differs from seed order
    stepwise = run_stepwise(
        family,
        model,
        requests,
        scheduler_setup=reference.scheduler,
        sampling=SamplingSettings(noise_level=0.7),
        options=OPTIONS,
        engine=EngineSettings(max_num_seqs=2, text_width=12),
    )
    assert max(seen_batches) == 2 and sum(seen_batches) == 4 * 6
    assert stepwise.seeds == (4, 3, 2, 1)  # rows follow the submitted requests
    assert torch.equal(stepwise.log_probs, reference.log_probs.flip(0))


def test_bf16_model_stepwise_fp32_state_recomputes_exactly(encoder):
    model = load_qwen_image(dtype=torch.bfloat16)
    cond = encoder.conditioning(PROMPTS, [" "] * 4, pad_to=12)
    reference = _reference(model, cond)
    stepwise = _stepwise(model, _requests(cond, (0, 0, 1, 1)), reference, text_width=12)
    assert stepwise.latents.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(recompute_log_probs(model, stepwise), stepwise.log_probs)
    assert torch.equal(stepwise.log_probs, reference.log_probs)


def test_plain_functions_check_their_inputs():
    with pytest.raises(MixedDtypeBatchError, match="Mixed dtypes in latents batch"):
        gather_latents([torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="narrower"):
        shared_text_width([{"prompt_embeds": torch.zeros(1, 9, 4)}], fixed=8)
    assert shared_text_width([{"prompt_embeds": torch.zeros(1, 9, 4)}, {"prompt_embeds": torch.zeros(1, 3, 4)}]) == 9
    record = init_window_record(SDEWindow(2, 2, 5))
    with pytest.raises(ValueError, match="outside"):
        record_window_step(record, 1, torch.zeros(1, 3), torch.tensor(1.0), torch.zeros(1), torch.zeros(1, 3))
    with pytest.raises(TypeError, match="float32"):
        record_window_step(
            record, 2, torch.zeros(1, 3, dtype=torch.bfloat16), torch.tensor(1.0), torch.zeros(1), torch.zeros(1, 3)
        )
    with pytest.raises(ValueError, match="out of order"):
        record_window_step(record, 3, torch.zeros(1, 3), torch.tensor(1.0), torch.zeros(1), torch.zeros(1, 3))
