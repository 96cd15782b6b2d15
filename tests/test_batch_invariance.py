"""Batch-invariant mode (rollout_consistency.adapters.batch_invariance): every sample's rollout and recomputed
log-probs are bit-identical whatever its batch-mates, batch size, micro-batch size, position or step-wise
arrival pattern — every family (Wan as Wan 2.2's two experts), CFG on and off. Tiny sizes (32 px, 4 steps, 5
frames) keep this file fast."""

from __future__ import annotations

import pytest
import torch
from rollout_args import rollout_args
from sd3_flux_cases import FAMILIES

from rollout_consistency.adapters import BatchRequests, SamplingSettings, qwen_image, recompute_step_log_prob, wan
from rollout_consistency.adapters.batch_invariance import BatchInvariant, batch_invariant, is_batch_invariant
from rollout_consistency.adapters.qwen_image import QWEN_IMAGE_SCHEDULER_CONFIG
from rollout_consistency.adapters.stepwise import EngineSettings, StepwiseRequest, run_stepwise
from rollout_consistency.adapters.tiny import TinyPromptEncoder, load_qwen_image, load_wan, tiny_wan_prompt_encoder
from rollout_consistency.schedulers import SDEWindow

PROMPTS = ["a red cat", "a dog in the garden at night", "sky", "photo of a small blue house near the river"]
SEEDS = [1, 2, 3, 4]
STEPS = 4
WINDOW = SDEWindow(start=1, size=2, num_steps=STEPS)


class Case:
    """One family as these tests drive it: its adapter module, model, conditioning and CFG settings."""

    def __init__(self, name: str):
        self.name = name
        self.video: dict = {}
        if name == "wan":  # two experts: at 4 steps the window's steps 1, 2 fall on both sides of the boundary
            self.adapter, self.model = wan, load_wan(boundary_ratio=0.875)
            self.cond = tiny_wan_prompt_encoder().conditioning(PROMPTS, [""] * 4)
            self.cfg_on, self.cfg_key = {"guidance_scale": 4.0, "guidance_scale_2": 3.0}, "guidance_scale"
            self.video = {"num_frames": 5}
        elif name == "qwen-image":
            self.adapter, self.model = qwen_image, load_qwen_image()
            self.cond = TinyPromptEncoder().conditioning(PROMPTS, [" "] * 4, pad_to=12)
            self.cfg_on, self.cfg_key = {"guidance_scale": 3.0}, "guidance_scale"
        else:
            family = FAMILIES[name]
            self.adapter, self.model = family.adapter, family.load()
            self.cond = family.conditioning(PROMPTS, [""] * 4)
            self.cfg_on, self.cfg_key = dict(family.cfg), family.cfg_key

    def settings(self, cfg: bool) -> dict:
        return {**self.cfg_on, self.cfg_key: self.cfg_on[self.cfg_key] if cfg else 1.0}

    def rollout(self, model, rows, cfg: bool):
        cond = {k: v[rows] for k, v in self.cond.items()}
        return self.adapter.rollout(
            model,
            cond,
            height=32,
            width=32,
            num_inference_steps=STEPS,
            **self.video,
            **rollout_args(
                {"seeds": [SEEDS[r] for r in rows], "window": WINDOW, "noise_level": 0.7, **self.settings(cfg)}
            ),
        )

    def recompute(self, model, trajectory):
        with torch.no_grad():
            return self.adapter.recompute_log_probs(model, trajectory)


@pytest.fixture(scope="module", params=["qwen-image", "sd3", "flux", "wan"])
def case(request) -> Case:
    return Case(request.param)


@pytest.mark.parametrize("cfg", [False, True], ids=["cfg-off", "cfg-on"])
def test_every_micro_batch_and_order_gives_the_same_bits(case, cfg):
    model = batch_invariant(case.model, case.adapter.FAMILY)
    full = case.rollout(model, [0, 1, 2, 3], cfg)
    for micro in (1, 2, 3, 4):
        parts = [list(range(s, min(s + micro, 4))) for s in range(0, 4, micro)]
        recomputed = torch.cat([case.recompute(model, full.select(rows)) for rows in parts])
        assert torch.equal(recomputed, full.log_probs), f"micro-batch {micro}"
    # Shuffled order and another batch size: the rollout itself gives each sample the same bits.
    shuffled = case.rollout(model, [3, 0, 2], cfg)
    for name in ("latents", "log_probs", "final_latents"):
        assert torch.equal(getattr(shuffled, name), getattr(full, name)[[3, 0, 2]]), name
    assert torch.equal(case.recompute(model, shuffled.select([1, 2])), full.log_probs[[0, 2]])


def test_staggered_stepwise_arrivals_give_the_request_level_bits(case):
    model = batch_invariant(case.model, case.adapter.FAMILY)
    reference = case.rollout(model, [0, 1, 2, 3], True)
    requests = [
        StepwiseRequest(
            f"r{i}",
            seed=SEEDS[i],
            conditioning={k: v[i : i + 1] for k, v in case.cond.items()},
            window=WINDOW,
            arrival=a,
        )
        for i, a in enumerate((0, 1, 1, 3))
    ]
    stepwise = run_stepwise(
        case.adapter.FAMILY,
        model,
        requests,
        scheduler_setup=reference.scheduler,
        sampling=reference.sampling,
        options=reference.family_options,
        engine=EngineSettings(max_num_seqs=3),
    )
    for name in ("latents", "log_probs", "final_latents"):
        assert torch.equal(getattr(stepwise, name), getattr(reference, name)), name
    assert torch.equal(case.recompute(model, stepwise.select([2])), reference.log_probs[[2]])


def test_default_mode_differs_where_this_machines_kernels_are_batch_variant(case):
    """Negative control: without the mode, single-row micro-batches re-score a rollout of 4 with other kernels
    on machines whose GEMM/attention kernels depend on the batch; the mode then closes a real gap."""
    full = case.rollout(case.model, [0, 1, 2, 3], True)
    single = torch.cat([case.recompute(case.model, full.select([i])) for i in range(4)])
    gap = float((single - full.log_probs).abs().max())
    if gap == 0:
        pytest.skip(f"{case.name}: this machine's kernels are batch-invariant here (micro-batch 1 vs 4: max |dlogp| 0)")
    assert gap < 1e-4  # rounding-level, not a bug
    model = batch_invariant(case.model, case.adapter.FAMILY)
    invariant = case.rollout(model, [0, 1, 2, 3], True)
    assert torch.equal(torch.cat([case.recompute(model, invariant.select([i])) for i in range(4)]), invariant.log_probs)


def test_the_proxy_is_the_transformer_with_the_same_parameters_and_gradients():
    model = load_qwen_image()
    proxy = batch_invariant(model, "qwen-image")
    assert is_batch_invariant(proxy) and not is_batch_invariant(model)
    assert proxy.config is model.config and list(proxy.parameters()) == list(model.parameters())
    assert batch_invariant(proxy, qwen_image.FAMILY).module is model  # no proxy of a proxy
    cond = TinyPromptEncoder().conditioning(PROMPTS[:2], pad_to=12)
    rollout = qwen_image.rollout(
        proxy,
        cond,
        height=32,
        width=32,
        num_inference_steps=STEPS,
        requests=BatchRequests(seeds=(1, 2), windows=WINDOW),
        sampling=SamplingSettings(noise_level=0.7),
    )
    log_prob = recompute_step_log_prob(proxy, rollout, 1)
    assert torch.equal(log_prob.detach(), rollout.log_probs[:, 1])
    log_prob.sum().backward()
    assert model.proj_out.weight.grad is not None and model.proj_out.weight.grad.abs().sum() > 0


def test_bad_uses_are_one_line_errors():
    model = load_qwen_image()
    proxy = BatchInvariant(model, frozenset({"hidden_states", "timestep"}))
    with pytest.raises(TypeError, match="by keyword"):
        proxy(torch.zeros(1, 4, 16))
    with pytest.raises(ValueError, match="different batch sizes"):
        proxy(hidden_states=torch.zeros(2, 4, 16), timestep=torch.zeros(3))
    with pytest.raises(ValueError, match="none of the per-row inputs"):
        proxy(encoder_hidden_states=torch.zeros(2, 4, 16))
    # Step-wise: text padded to the running batch's widest would depend on the batch-mates.
    cond = TinyPromptEncoder().conditioning(PROMPTS[:2])
    requests = []
    for i in range(2):
        own = {k: v[i : i + 1] for k, v in cond.items()}
        length = int(own["prompt_embeds_mask"].sum())
        own = {k: v[:, :length] for k, v in own.items()}
        requests.append(StepwiseRequest(f"r{i}", seed=i, conditioning=own, window=WINDOW))
    setup = qwen_image.FAMILY.scheduler_setup(QWEN_IMAGE_SCHEDULER_CONFIG, STEPS, model, {"height": 32, "width": 32})
    with pytest.raises(ValueError, match=r"Pass engine=EngineSettings\(text_width="):
        run_stepwise(
            qwen_image.FAMILY,
            batch_invariant(model, qwen_image.FAMILY),
            requests,
            scheduler_setup=setup,
            sampling=SamplingSettings(noise_level=0.7),
            options={"height": 32, "width": 32},
        )
