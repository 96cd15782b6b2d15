"""The Wan family (video): diffusers parity outside the window (one expert, two experts, CFG, the per-token
timestep), bit-exact rollout → recompute of 5-D latents, Wan 2.2's expert switch recorded and reproduced one
step late, the step-wise and batch-invariant paths across the boundary, the trajectory file, a real model
directory, and bad inputs. The tiny model: 13 frames of 64x64 px (latents (16, 4, 8, 8)), a few ms a forward."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
from rollout_args import rollout_args
from safetensors.torch import load_file, save_file

from rollout_consistency.adapters import Trajectory, recompute_step_log_prob, wan
from rollout_consistency.adapters.batch_invariance import batch_invariant
from rollout_consistency.adapters.pitfalls import StockLateExpertSwitch, apply_injection
from rollout_consistency.adapters.stepwise import EngineSettings, StepwiseRequest, run_stepwise
from rollout_consistency.adapters.tiny import load_wan, tiny_wan_prompt_encoder
from rollout_consistency.adapters.trainer import trainer_experts
from rollout_consistency.schedulers import SDEWindow

PROMPTS = ["a red cat", "a dog in the garden at night", "sky", "photo of a small blue house near the river"]
SEEDS = [1, 2, 3, 4]
VIDEO = {"height": 64, "width": 64, "num_frames": 13}
BOUNDARY = 0.875  # Wan2.2-T2V-A14B's
# At 6 steps (shift 5) the schedule is 1000, 953, 883 | 771, 562, 24: steps 0-2 take `transformer`, 3-5 `transformer_2`.
HIGH, LOW = "transformer", "transformer_2"
SWITCH_STEP = 3


@pytest.fixture(scope="module")
def model():
    return load_wan()


@pytest.fixture(scope="module")
def experts():
    return load_wan(boundary_ratio=BOUNDARY)


@pytest.fixture(scope="module")
def cond():
    return tiny_wan_prompt_encoder().conditioning(PROMPTS, [""] * len(PROMPTS))


def rollout(model, cond, **kwargs):
    """The standard rollout of these tests (6 steps, window 1..3 across the boundary, CFG 4 / 3), `kwargs` overriding."""
    args = dict(
        num_inference_steps=6,
        seeds=SEEDS,
        window=SDEWindow(start=1, size=3, num_steps=6),
        noise_level=0.7,
        guidance_scale=4.0,
        guidance_scale_2=3.0,
        **VIDEO,
    )
    args.update(kwargs)
    return wan.rollout(model, cond, **rollout_args(args))


def recompute(model, trajectory):
    with torch.no_grad():
        return wan.recompute_log_probs(model, trajectory)


@pytest.mark.parametrize(
    ("two_experts", "guidance_scale", "guidance_scale_2", "expand_timesteps"),
    [(False, 1.0, None, False), (False, 5.0, None, False), (True, 4.0, 3.0, False), (False, 5.0, None, True)],
    ids=["one-expert", "one-expert-cfg", "two-experts-cfg", "expand-timesteps"],
)
def test_ode_steps_match_wan_pipeline_bit_for_bit(
    model, experts, cond, two_experts, guidance_scale, guidance_scale_2, expand_timesteps
):
    """Outside the window the adapter is diffusers' WanPipeline to the last bit in float32: initial noise from
    per-sample generators, timestep σ·1000 as is (one per token with expand_timesteps), CFG of two forwards,
    and with two experts the switch at t >= 875 (steps 0-1 high noise, 2-3 low at 5 steps) with each expert's
    CFG scale."""
    num_steps = 5
    components = (
        dict(transformer=experts.transformer, transformer_2=experts.transformer_2, boundary_ratio=BOUNDARY)
        if two_experts
        else dict(transformer=model, expand_timesteps=expand_timesteps)
    )
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        scheduler=FlowMatchEulerDiscreteScheduler(**wan.WAN_SCHEDULER_CONFIG),
        **components,
    )
    pipe.set_progress_bar_config(disable=True)
    seen = {}

    def capture(pipeline, i, t, tensors):
        seen[i] = tensors["latents"].clone()
        return {}

    extra = {} if guidance_scale_2 is None else {"guidance_scale_2": guidance_scale_2}
    pipe(
        prompt_embeds=cond["prompt_embeds"],
        negative_prompt_embeds=cond["negative_prompt_embeds"],
        guidance_scale=guidance_scale,
        num_inference_steps=num_steps,
        output_type="latent",
        generator=[torch.Generator().manual_seed(s) for s in SEEDS],
        callback_on_step_end=capture,
        **extra,
        **VIDEO,
    )
    trajectory = rollout(
        experts if two_experts else model,
        cond,
        num_inference_steps=num_steps,
        window=SDEWindow(start=num_steps - 1, size=1, num_steps=num_steps),
        guidance_scale=guidance_scale,
        guidance_scale_2=guidance_scale_2,
        expand_timesteps=expand_timesteps,
    )
    assert trajectory.latents.shape == (4, 2, 16, 4, 8, 8)  # (B, W+1, C, F, h, w)
    assert torch.equal(trajectory.latents[:, 0], seen[num_steps - 2])
    assert trajectory.experts == ((LOW if two_experts else HIGH,),) * 4


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_two_expert_rollout_then_recompute_is_exact_and_records_the_switch(experts, cond, sde_type):
    trajectory = rollout(experts, cond, sde_type=sde_type)
    assert trajectory.experts == ((HIGH, HIGH, LOW),) * 4  # window steps 1, 2, 3
    assert trainer_experts(experts, trajectory) == trajectory.experts
    assert torch.equal(recompute(experts, trajectory) - trajectory.log_probs, torch.zeros(4, 3))


def test_a_micro_batch_across_the_boundary_recomputes_exactly(experts, cond):
    """Two prompt groups on either side of the boundary in one recompute forward (rows at steps 1 and 3): each
    expert runs the whole batch and each row is taken from its own, so every row's forward is a forward of 4 as
    in the rollout; bit for bit in the default mode (as sub-batches of 2 the rows took other kernels, 1.2e-7)."""
    windows = [SDEWindow(1, 2, 6)] * 2 + [SDEWindow(3, 2, 6)] * 2
    trajectory = rollout(experts, cond, window=windows, prompt_groups=[0, 0, 1, 1])
    assert [row[0] for row in trajectory.experts] == [HIGH, HIGH, LOW, LOW]
    assert torch.equal(recompute(experts, trajectory), trajectory.log_probs)


def test_bf16_weights_with_fp32_storage_is_exact(cond):
    bf16 = load_wan(dtype=torch.bfloat16, boundary_ratio=BOUNDARY)
    trajectory = rollout(bf16, cond)
    assert all(t.dtype == torch.float32 for t in (trajectory.latents, trajectory.log_probs, trajectory.final_latents))
    assert torch.equal(recompute(bf16, trajectory), trajectory.log_probs)


def test_the_switch_is_the_pipelines_comparison_in_float32(experts):
    """`transformer` for t >= boundary_ratio · 1000 (the boundary itself is high noise), `transformer_2` below."""
    t = torch.tensor([1000.0, 875.0, torch.nextafter(torch.tensor(875.0), torch.tensor(0.0)).item(), 24.4])
    assert experts.expert_names(t) == (HIGH, HIGH, LOW, LOW)
    assert wan.expert_names(load_wan(), t) == (HIGH,) * 4  # one expert: `transformer` throughout


def test_the_experts_differ_and_cfg_uses_each_experts_scale(experts, cond):
    """A step scored by the wrong expert must show: the tiny experts have different weights. Below the boundary
    CFG takes guidance_scale_2."""
    latents = torch.randn(4, 16, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    low = torch.full((4,), 500.0)
    with torch.no_grad():
        by_low = wan.velocity(experts.transformer_2, latents, low, cond, 1.0, options=VIDEO)
        by_high = wan.velocity(experts.transformer, latents, low, cond, 1.0, options=VIDEO)
        assert torch.equal(wan.velocity(experts, latents, low, cond, 1.0, options=VIDEO), by_low)
        assert (by_low - by_high).abs().max() > 1e-2
        neg = {"prompt_embeds": cond["negative_prompt_embeds"]}
        uncond = wan.velocity(experts, latents, low, neg, 1.0, options=VIDEO)
        guided = wan.velocity(experts, latents, low, cond, 4.0, options={**VIDEO, "guidance_scale_2": 3.0})
    assert torch.equal(guided, uncond + 3.0 * (by_low - uncond))


def test_late_expert_switch_shows_at_the_switch_step_only_and_its_fix_is_exact(experts, cond):
    """The stock off-by-one (`i <= n_high`): the first low-noise step still runs `transformer`. Re-scored by the
    trainer's correct switch, exactly that step differs; the records name both experts there."""
    setup = wan.FAMILY.scheduler_setup(wan.WAN_SCHEDULER_CONFIG, 6, experts, VIDEO)
    late = apply_injection(
        "expert-switch", scheduler=setup.scheduler(), transformer=experts, windows=[], request_ids=[]
    ).transformer
    assert isinstance(late, StockLateExpertSwitch)
    stock = rollout(late, cond, window=SDEWindow(start=2, size=3, num_steps=6))  # steps 2, 3, 4
    assert stock.experts == ((HIGH, HIGH, LOW),) * 4  # step 3 still high noise
    assert trainer_experts(experts, stock) == ((HIGH, LOW, LOW),) * 4
    log_ratio = recompute(experts, stock) - stock.log_probs
    assert bool((log_ratio[:, 1].abs() > 1e-3).all())  # the switch step: another network
    assert torch.equal(log_ratio[:, [0, 2]], torch.zeros(4, 2))  # elsewhere the same computation, bit for bit
    fixed = rollout(experts, cond, window=SDEWindow(start=2, size=3, num_steps=6))
    assert torch.equal(recompute(experts, fixed), fixed.log_probs)
    with pytest.raises(ValueError, match="two experts"):
        StockLateExpertSwitch(load_wan(), setup.timesteps())


def test_stepwise_across_the_boundary_equals_request_level_in_batch_invariant_mode(experts, cond):
    """Requests join two steps apart, so one engine forward holds rows on both sides of the boundary (each
    expert runs the batch, each row takes its own expert's output). Batch-invariant: the same bits as the request-level rollout, experts included,
    and any trainer micro-batch reproduces them."""
    invariant = batch_invariant(experts, wan.FAMILY)
    windows = [SDEWindow(1, 3, 6), SDEWindow(1, 3, 6), SDEWindow(2, 3, 6), SDEWindow(2, 3, 6)]
    reference = rollout(invariant, cond, window=windows, prompt_groups=[0, 0, 1, 1])
    requests = [
        StepwiseRequest(
            f"r{i}",
            seed=seed,
            conditioning={k: v[i : i + 1] for k, v in cond.items()},
            window=windows[i],
            prompt_group=reference.prompt_groups[i],
            arrival=(0, 0, 2, 2)[i],
        )
        for i, seed in enumerate(SEEDS)
    ]
    stepwise = run_stepwise(
        wan.FAMILY,
        invariant,
        requests,
        scheduler_setup=reference.scheduler,
        sampling=reference.sampling,
        options=reference.family_options,
        engine=EngineSettings(max_num_seqs=4),
    )
    for name in ("latents", "log_probs", "timesteps", "final_latents"):
        assert torch.equal(getattr(stepwise, name), getattr(reference, name)), name
    assert stepwise.experts == reference.experts == ((HIGH, HIGH, LOW),) * 2 + ((HIGH, LOW, LOW),) * 2
    for rows in ([0, 2], [1], [3, 0, 2]):  # micro-batches whose forwards mix experts
        assert torch.equal(recompute(invariant, reference.select(rows)), reference.log_probs[rows])


def test_trajectory_file_round_trip_and_files_without_experts(experts, cond, tmp_path):
    """7-D latents and the experts record survive save/load bit for bit; a file without the `experts` metadata
    (every file written before it existed: the format version is unchanged) reads with experts None."""
    trajectory = rollout(experts, cond, sde_type="dance_sde")
    path = trajectory.save(tmp_path / "wan.safetensors")
    loaded = Trajectory.load(path)
    assert loaded.experts == trajectory.experts and torch.equal(loaded.latents, trajectory.latents)
    assert torch.equal(recompute(experts, loaded), trajectory.log_probs)
    assert loaded.select([2, 0]).experts == (trajectory.experts[2], trajectory.experts[0])

    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        metadata = json.loads(handle.read(header_len))["__metadata__"]
    assert metadata["format_version"] == "1"
    older = tmp_path / "older.safetensors"
    save_file(load_file(path), older, metadata={k: v for k, v in metadata.items() if k != "experts"})
    old = Trajectory.load(older)
    assert old.experts is None and torch.equal(old.log_probs, trajectory.log_probs)

    with pytest.raises(ValueError, match="one tuple of 3 expert names per sample"):
        Trajectory(**{**_fields(trajectory), "experts": ((HIGH,),) * 4}).validate()


def _fields(trajectory):
    return {name: getattr(trajectory, name) for name in trajectory.__dataclass_fields__}


def test_recompute_step_carries_gradients_to_the_expert_of_the_step(cond):
    experts = load_wan(boundary_ratio=BOUNDARY)  # its own copy: the shared one must not collect gradients
    trajectory = rollout(experts, cond)
    log_prob = recompute_step_log_prob(experts, trajectory, 2)  # window step 2 = schedule step 3: low noise
    assert torch.equal(log_prob.detach(), trajectory.log_probs[:, 2])
    log_prob.sum().backward()
    assert experts.transformer_2.proj_out.weight.grad.abs().sum() > 0
    assert experts.transformer.proj_out.weight.grad is None  # the high-noise expert took no part


def test_a_model_directory_loads_one_or_two_experts(experts, tmp_path):
    single = tmp_path / "wan21"
    load_wan(seed=5).save_pretrained(single / "transformer")
    loaded = load_wan(single)
    assert type(loaded).__name__ == "WanTransformer3DModel"
    with pytest.raises(ValueError, match="holds one transformer"):
        load_wan(single, boundary_ratio=0.9)

    pair = tmp_path / "wan22"
    experts.transformer.save_pretrained(pair / "transformer")
    experts.transformer_2.save_pretrained(pair / "transformer_2")
    with pytest.raises(ValueError, match="no boundary_ratio"):
        load_wan(pair)
    (pair / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": BOUNDARY}))
    loaded = load_wan(pair)
    assert isinstance(loaded, wan.WanExperts) and loaded.boundary_ratio == BOUNDARY
    assert torch.equal(loaded.transformer_2.proj_out.weight, experts.transformer_2.proj_out.weight)
    assert load_wan(pair, boundary_ratio=0.9).boundary_ratio == 0.9  # the argument overrides the index


def test_a_unipc_scheduler_config_is_read_as_its_flow_shift(model):
    """Released Wan directories ship UniPC's config (`flow_shift`); the flow-matching schedule takes it as `shift`."""
    unipc = {"num_train_timesteps": 1000, "flow_shift": 3.0, "solver_order": 2, "prediction_type": "flow_prediction"}
    setup = wan.FAMILY.scheduler_setup(unipc, 6, model, VIDEO)
    assert dict(setup.config) == {"num_train_timesteps": 1000, "shift": 3.0}
    shifted = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    shifted.set_timesteps(6)
    assert torch.equal(setup.timesteps(), shifted.timesteps.float())


# ---------------------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"num_frames": 14}, "num_frames - 1 must be a multiple of vae_scale_factor_temporal = 4"),
        ({"height": 56}, "multiples of vae_scale_factor_spatial"),
        ({"width": 8 * 2 * 65}, "RoPE table holds 64 positions"),
    ],
)
def test_video_sizes_the_pipeline_would_round_are_refused(model, cond, settings, match):
    with pytest.raises(ValueError, match=match):
        rollout(model, cond, **settings)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"prompt_embeds_mask": torch.ones(4, 16, dtype=torch.int64)}, ValueError, "no text mask"),
        ({"prompt_embeds": torch.zeros(4, 16, 24)}, ValueError, "text_dim is 32"),
        ({"prompt_embeds": torch.zeros(4, 16, 32, dtype=torch.bfloat16)}, TypeError, "float32"),
        ({"negative_prompt_embeds": torch.zeros(2, 16, 32)}, ValueError, "2 rows for 4 samples"),
    ],
)
def test_malformed_conditioning_is_refused(model, cond, change, error, match):
    with pytest.raises(error, match=match):
        rollout(model, {**cond, **change})


def test_cfg_without_negative_prompt_and_bad_experts_are_refused(model, cond):
    positive = {"prompt_embeds": cond["prompt_embeds"]}
    with pytest.raises(ValueError, match="no negative prompt"):
        rollout(model, positive)
    rollout(model, positive, guidance_scale=1.0)  # no CFG: no negative needed
    with pytest.raises(ValueError, match="do not fit this Wan transformer"):
        wan.velocity(model, torch.zeros(4, 16, 8, 8), torch.full((4,), 500.0), positive, 1.0, options=VIDEO)
    with pytest.raises(ValueError, match="boundary_ratio must be a number in"):
        wan.WanExperts(model, model, 1.5)
    with pytest.raises(ValueError, match="Unknown Wan expert"):
        wan.WanExperts(model, model, 0.5)(
            hidden_states=torch.zeros(1, 16, 4, 8, 8),
            timestep=torch.full((1,), 500.0),
            encoder_hidden_states=cond["prompt_embeds"][:1],
            experts=["transformer_3"],
        )


def test_collate_refuses_re_padding_text(cond):
    one = {k: v[:1] for k, v in cond.items()}
    wider = {k: torch.cat([v, v.new_zeros(1, 4, v.shape[2])], dim=1) for k, v in one.items()}
    assert torch.equal(wan.collate_conditioning([one, one])["prompt_embeds"], cond["prompt_embeds"][[0, 0]])
    with pytest.raises(ValueError, match="attends to padding"):
        wan.collate_conditioning([one, wider])


def test_a_bf16_directory_load_keeps_the_modules_diffusers_keeps_in_fp32(tmp_path):
    """A user's `WanPipeline.from_pretrained(torch_dtype=bfloat16)` keeps Wan's norms, time embedder and RoPE in
    float32 (`_keep_in_fp32_modules`); the checker's loader must build the same model, not round them to bf16."""
    from diffusers import WanTransformer3DModel

    from rollout_consistency.adapters.tiny.wan import save_tiny_wan_directory

    directory = save_tiny_wan_directory(tmp_path / "wan", boundary_ratio=None)
    ours = wan.load_transformer(directory, dtype=torch.bfloat16, device="cpu")
    users = WanTransformer3DModel.from_pretrained(directory, subfolder="transformer", torch_dtype=torch.bfloat16)
    kept = {name for name, p in users.named_parameters() if p.dtype == torch.float32}
    assert kept and any("norm" in name for name in kept)  # the test needs modules diffusers keeps in fp32
    for (name, mine), theirs in zip(ours.state_dict().items(), users.state_dict().values(), strict=True):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), name
