"""FlowMatchSDEDiscreteScheduler: maths against independent references, the fp32 contract, errors."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_consistency.schedulers import SDE_TYPES, FlowMatchSDEDiscreteScheduler

SHAPE = (3, 4, 6, 6)


def make_scheduler(num_steps: int = 10, shift: float = 3.0) -> FlowMatchSDEDiscreteScheduler:
    scheduler = FlowMatchSDEDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    return scheduler


def tensors(seed: int, shape=SHAPE) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def generators(seed: int, batch: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 1000 + i) for i in range(batch)]


def reference_transition(x, v, sigma, sigma_next, sigma_max, noise_level, sde_type):
    """The SDE transition of docs/scheduler.md, written out independently in float64: (mean, std of the Gaussian)."""
    x, v = x.double(), v.double()
    s, s1 = float(sigma), float(sigma_next)
    dt = s1 - s
    if sde_type == "sde":
        std_dev = noise_level * math.sqrt(s / (1 - (sigma_max if s == 1 else s)))
        mean = x * (1 + std_dev**2 * dt / (2 * s)) + v * (1 + std_dev**2 * (1 - s) / (2 * s)) * dt
        return mean, std_dev * math.sqrt(-dt)
    if sde_type == "cps":
        std = s1 * math.sin(noise_level * math.pi / 2)
        x0, x1 = x - s * v, x + (1 - s) * v
        return x0 * (1 - s1) + x1 * math.sqrt(s1**2 - std**2), std
    score = -(x - (x - s * v) * (1 - s)) / s**2
    return x + dt * v - 0.5 * noise_level**2 * score * dt, noise_level * math.sqrt(s - s1)


def reference_log_prob(prev, mean, std, sde_type):
    d = prev.double() - mean
    if sde_type == "cps":
        return (-(d**2)).flatten(1).mean(1)
    density = -(d**2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return density.flatten(1).mean(1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**20),
    step_index=st.integers(0, 9),
    noise_level=st.floats(0.05, 1.0),
    sde_type=st.sampled_from(SDE_TYPES),
    shift=st.sampled_from([1.0, 3.0]),
)
def test_sampled_log_prob_is_the_gaussian_density(seed, step_index, noise_level, sde_type, shift):
    scheduler = make_scheduler(shift=shift)
    x, v = tensors(seed)
    t = scheduler.timesteps[step_index]
    out = scheduler.sample_previous_step(
        v, t, x, noise_level=noise_level, sde_type=sde_type, generator=generators(seed, SHAPE[0])
    )
    sigma, sigma_next = scheduler.sigmas[step_index], scheduler.sigmas[step_index + 1]
    mean, std = reference_transition(x, v, sigma, sigma_next, scheduler.sigmas[1].item(), noise_level, sde_type)
    if std == 0:  # cps on the last step: deterministic
        assert torch.equal(out.prev_sample, out.prev_sample_mean)
        assert torch.all(out.log_prob == 0)
        return
    # fp32 against float64: two roundings of terms as large as |x| + |v|.
    atol = 1e-6 * (x.abs() + v.abs()).max().item()
    torch.testing.assert_close(out.prev_sample_mean.double(), mean, rtol=1e-5, atol=atol)
    torch.testing.assert_close(out.prev_sample_std.double(), torch.full((SHAPE[0],), std, dtype=torch.float64))
    expected = reference_log_prob(out.prev_sample, mean, std, sde_type)
    assert out.log_prob.dtype == torch.float32 and out.log_prob.shape == (SHAPE[0],)
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=2e-5, atol=2e-5 + 10 * atol / std)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    step_index=st.integers(0, 9),
    noise_level=st.floats(0.01, 1.0),
    sde_type=st.sampled_from(SDE_TYPES),
    include_normalizer=st.booleans(),
)
def test_scoring_a_drawn_sample_reproduces_its_log_prob_bit_for_bit(
    seed, step_index, noise_level, sde_type, include_normalizer
):
    scheduler = make_scheduler()
    x, v = tensors(seed)
    t = scheduler.timesteps[step_index]
    kwargs = dict(noise_level=noise_level, sde_type=sde_type, include_normalizer=include_normalizer)
    drawn = scheduler.sample_previous_step(v, t, x, generator=generators(seed, SHAPE[0]), **kwargs)
    scored = scheduler.sample_previous_step(v, t, x, prev_sample=drawn.prev_sample, **kwargs)
    assert torch.equal(drawn.log_prob, scored.log_prob)
    assert torch.equal(drawn.prev_sample_mean, scored.prev_sample_mean)
    # The trainer scores it with a graph to its model output.
    trained = scheduler.sample_previous_step(v.requires_grad_(), t, x, prev_sample=drawn.prev_sample, **kwargs)
    assert torch.equal(trained.log_prob.detach(), drawn.log_prob)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**20), step_index=st.integers(0, 9), shift=st.sampled_from([1.0, 3.0, 7.5]))
def test_noise_level_zero_is_diffusers_euler_step(seed, step_index, shift):
    ours, stock = make_scheduler(shift=shift), FlowMatchEulerDiscreteScheduler(shift=shift)
    stock.set_timesteps(10)
    x, v = tensors(seed)
    t = ours.timesteps[step_index]
    out = ours.step(v, t, x, noise_level=0.0)
    stock._step_index = step_index  # diffusers keeps a step counter; point it at the same step
    expected = stock.step(v, t, x).prev_sample
    assert torch.equal(out.prev_sample, expected)
    assert out.log_prob is None
    assert torch.all(out.prev_sample_std == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_low_precision_inputs_give_fp32_outputs_and_no_downcast(dtype, sde_type):
    scheduler = make_scheduler()
    x, v = tensors(1)
    x_low, v_low = x.to(dtype), v.to(dtype)
    t = scheduler.timesteps[2]
    out = scheduler.step(v_low, t, x_low, noise_level=0.7, sde_type=sde_type, generator=generators(1, 3))
    for tensor in (out.prev_sample, out.log_prob, out.prev_sample_mean, out.prev_sample_std):
        assert tensor.dtype == torch.float32
    # Same values as the explicit fp32 call: the step upcast and never rounded its result back.
    ref = scheduler.step(
        v_low.float(), t, x_low.float(), noise_level=0.7, sde_type=sde_type, generator=generators(1, 3)
    )
    assert torch.equal(out.prev_sample, ref.prev_sample)
    assert not torch.equal(out.prev_sample, out.prev_sample.to(dtype).float())


@pytest.mark.parametrize("argument", ["model_output", "sample", "prev_sample"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_strict_entry_point_rejects_non_fp32(argument, dtype):
    scheduler = make_scheduler()
    x, v = tensors(2)
    args = {"model_output": v, "sample": x, "prev_sample": x.clone()}
    args[argument] = args[argument].to(dtype)
    with pytest.raises(TypeError, match=rf"`{argument}` is torch\.\w+, expected torch.float32.*\.float\(\)"):
        scheduler.sample_previous_step(
            args["model_output"],
            scheduler.timesteps[0],
            args["sample"],
            noise_level=0.7,
            prev_sample=args["prev_sample"],
        )


@pytest.mark.parametrize(
    "argument, drop_in",
    [("model_output", False), ("sample", False), ("prev_sample", False), ("model_output", True), ("sample", True)],
    ids=["model_output", "sample", "prev_sample", "model_output-diffusers-call", "sample-diffusers-call"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_step_never_casts_a_wider_input_down(argument, dtype, drop_in):
    # float32 is the contract: `step` upcasts bf16/fp16 exactly, but rounding a float64 input to float32 would
    # score another sample than the one given, so it refuses, naming the cast, as the strict entry point does.
    scheduler = make_scheduler()
    x, v = tensors(2)
    args = {"model_output": v, "sample": x, "prev_sample": None if drop_in else x.clone()}
    args[argument] = args[argument].to(dtype)
    keywords = {} if drop_in else {"noise_level": 0.7, "prev_sample": args["prev_sample"]}
    with pytest.raises(
        TypeError, match=rf"`{argument}` is {dtype}; .*never casts a tensor down.*`{argument}\.float\(\)`"
    ):
        scheduler.step(args["model_output"], scheduler.timesteps[0], args["sample"], **keywords)
    assert scheduler.step_index is None  # refused before stepping


def test_a_wider_timestep_off_the_schedule_is_not_rounded_onto_it():
    # Exact lookup: a float64 timestep 1e-9 off a float32 schedule value (which float32 would round back onto it)
    # is not in the schedule; the same value in float64 exactly is.
    scheduler = make_scheduler()
    x, v = tensors(5)
    exact = float(scheduler.timesteps[3])
    near = exact + 1e-9
    assert float(torch.tensor(near, dtype=torch.float32)) == exact
    reference = scheduler.sample_previous_step(v, scheduler.timesteps[3], x, noise_level=0.7, prev_sample=x)
    for timestep in (exact, torch.tensor(exact, dtype=torch.float64), torch.full((3,), exact, dtype=torch.float64)):
        out = scheduler.sample_previous_step(v, timestep, x, noise_level=0.7, prev_sample=x)
        assert torch.equal(out.log_prob, reference.log_prob)
    for timestep in (
        near,
        torch.tensor(near, dtype=torch.float64),
        [near] * 3,
        torch.full((3,), near, dtype=torch.float64),
    ):
        with pytest.raises(ValueError, match=r"are not in the schedule.*kept in float32"):
            scheduler.sample_previous_step(v, timestep, x, noise_level=0.7, prev_sample=x)


def test_stock_bf16_stored_sample_biases_log_ratio_and_patched_path_is_exact():
    """The known pitfall 'precision loss in stored latents', at the scheduler level.

    Stock: the rollout scores its fp32 draw, then stores prev_sample cast to the model's bf16; the trainer
    re-scores the stored (rounded) sample. Rounding moves the sample off its draw, which lowers its
    density on average: log_ratio = logp_trainer - logp_rollout is systematically negative.
    """
    scheduler = make_scheduler(num_steps=10)
    batch = 8
    x, v = tensors(3, shape=(batch, 16, 64, 64))
    log_ratios_stock, log_ratios_patched = [], []
    for step_index in range(10):
        t = scheduler.timesteps[step_index]
        rollout = scheduler.sample_previous_step(v, t, x, noise_level=0.7, generator=generators(step_index, batch))
        # rollout-consistency: ignore[low-precision-latents] diffusers' stock bf16 step, reproduced on purpose
        stored_stock = rollout.prev_sample.to(torch.bfloat16)  # diffusers' step: .to(model_output.dtype)
        trainer_stock = scheduler.step(v, t, x, noise_level=0.7, prev_sample=stored_stock)
        trainer_patched = scheduler.sample_previous_step(v, t, x, noise_level=0.7, prev_sample=rollout.prev_sample)
        log_ratios_stock.append(trainer_stock.log_prob - rollout.log_prob)
        log_ratios_patched.append(trainer_patched.log_prob - rollout.log_prob)
    stock, patched = torch.stack(log_ratios_stock).double(), torch.stack(log_ratios_patched)
    assert torch.all(patched == 0)
    # The bias (rounding variance / step variance) dominates where the step's std is small: the last step.
    assert torch.all(stock[-1] < -1e-3)
    # Over the whole trajectory: negative on average, by a large fraction of a 1e-4 clip band.
    assert stock.mean() < -1e-5
    assert (stock < 0).double().mean() > 0.5


def test_per_sample_timesteps_equal_separate_calls():
    scheduler = make_scheduler()
    x, v = tensors(4)
    indices = [0, 5, 9]
    t = scheduler.timesteps[indices]
    batched = scheduler.sample_previous_step(v, t, x, noise_level=0.5, generator=generators(4, 3))
    for row, index in enumerate(indices):
        single = scheduler.sample_previous_step(
            v[row : row + 1],
            scheduler.timesteps[index],
            x[row : row + 1],
            noise_level=0.5,
            generator=[generators(4, 3)[row]],
        )
        assert torch.equal(batched.prev_sample[row], single.prev_sample[0])
        assert torch.equal(batched.log_prob[row], single.log_prob[0])


def test_log_prob_reduction_rounding_is_far_below_1e7_relative():
    scheduler = make_scheduler()
    x, v = tensors(5, shape=(2, 16, 128, 128))
    t = scheduler.timesteps[3]
    out = scheduler.sample_previous_step(v, t, x, noise_level=0.7, generator=generators(5, 2))
    d = out.prev_sample.double() - out.prev_sample_mean.double()
    std = out.prev_sample_std.double()
    exact = (-(d**2).flatten(1).mean(1) / (2 * std**2)) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    relative = ((out.log_prob.double() - exact) / exact).abs().max().item()
    assert relative < 1e-7  # the final fp32 rounding (~6e-8) bounds it; the reduction adds ~1e-10


def test_gradient_reaches_model_output_only_through_the_mean():
    scheduler = make_scheduler()
    x, v = tensors(6)
    drawn = scheduler.sample_previous_step(v, scheduler.timesteps[1], x, noise_level=0.7, generator=generators(6, 3))
    v_train = v.clone().requires_grad_(True)
    prev = drawn.prev_sample.clone().requires_grad_(True)
    out = scheduler.sample_previous_step(v_train, scheduler.timesteps[1], x, noise_level=0.7, prev_sample=prev)
    out.log_prob.sum().backward()
    assert v_train.grad is not None and torch.isfinite(v_train.grad).all() and v_train.grad.abs().sum() > 0
    assert prev.grad is None
    assert torch.equal(out.log_prob.detach(), drawn.log_prob)


def test_drop_in_for_diffusers_configs(tmp_path):
    stock = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9)
    stock.save_pretrained(tmp_path / "scheduler")
    loaded = FlowMatchSDEDiscreteScheduler.from_pretrained(tmp_path, subfolder="scheduler")
    from_config = FlowMatchSDEDiscreteScheduler.from_config(stock.config)
    for scheduler in (loaded, from_config):
        assert isinstance(scheduler, FlowMatchSDEDiscreteScheduler)
        scheduler.set_timesteps(8, mu=0.7)
        stock.set_timesteps(8, mu=0.7)
        assert torch.equal(scheduler.sigmas, stock.sigmas) and torch.equal(scheduler.timesteps, stock.timesteps)
    custom = FlowMatchSDEDiscreteScheduler()
    custom.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25])
    assert custom.timesteps.numel() == 4 and custom.sigmas[-1] == 0


def test_clear_errors():
    scheduler = make_scheduler()
    x, v = tensors(7)
    t = scheduler.timesteps[0]
    with pytest.raises(ValueError, match="not in the schedule"):
        scheduler.step(v, t + 0.5, x, noise_level=0.7)
    with pytest.raises(ValueError, match="end of the schedule"):
        scheduler.step(v, 0.0, x, noise_level=0.7)
    with pytest.raises(ValueError, match="Unknown sde_type 'ode'"):
        scheduler.step(v, t, x, noise_level=0.7, sde_type="ode")
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="noise_level must be a finite number >= 0"):
            scheduler.step(v, t, x, noise_level=bad)
    with pytest.raises(ValueError, match="`model_output` has shape"):
        scheduler.step(v[:, :2], t, x, noise_level=0.7)
    with pytest.raises(ValueError, match="`prev_sample` has shape"):
        scheduler.step(v, t, x, noise_level=0.7, prev_sample=x[:2])
    with pytest.raises(ValueError, match="one per sample"):
        scheduler.step(v, scheduler.timesteps[:2], x, noise_level=0.7)
    with pytest.raises(RuntimeError, match="set_timesteps"):
        FlowMatchSDEDiscreteScheduler().step(v, 1000.0, x, noise_level=0.7)


def test_per_sample_noise_is_diffusers_randn_tensor_draw():
    """One generator per sample draws what diffusers' pipelines draw (`randn_tensor` with a generator list)."""
    from diffusers.utils.torch_utils import randn_tensor

    scheduler = make_scheduler()
    x, v = tensors(8)
    t = scheduler.timesteps[2]
    out = scheduler.sample_previous_step(v, t, x, noise_level=0.7, generator=generators(8, 3))
    noise = randn_tensor(x.shape, generator=generators(8, 3), dtype=torch.float32)
    expected = torch.addcmul(out.prev_sample_mean, noise, out.prev_sample_std.view(3, 1, 1, 1))
    assert torch.equal(out.prev_sample, expected)
    with pytest.raises(ValueError, match="2 generators for a batch of 3"):
        scheduler.sample_previous_step(v, t, x, noise_level=0.7, generator=generators(8, 2))


def test_cps_last_step_is_deterministic_with_finite_gradient():
    scheduler = make_scheduler()
    x, v = tensors(9)
    v = v.requires_grad_(True)
    out = scheduler.sample_previous_step(
        v, scheduler.timesteps[-1], x, noise_level=0.5, sde_type="cps", generator=generators(9, 3)
    )
    assert torch.equal(out.prev_sample, out.prev_sample_mean.detach()) and torch.all(out.log_prob == 0)
    out.log_prob.sum().backward()
    assert torch.isfinite(v.grad).all()


@pytest.mark.parametrize("mode", ["plain", "inference"])
def test_a_schedule_changed_in_place_is_read_again(mode):
    """The step caches the schedule's floats; an in-place change of `timesteps` / `sigmas` must be seen. Under
    torch.inference_mode (vLLM-omni's runner sets schedulers up there) the tensors track no version counter."""
    context = torch.inference_mode() if mode == "inference" else torch.no_grad()
    with context:
        scheduler = make_scheduler(num_steps=6)
        x, v = tensors(0)
        t = scheduler.timesteps[2]
        before = scheduler.sample_previous_step(v, t, x, prev_sample=x, noise_level=0.7).log_prob
        scheduler.sigmas[3] = scheduler.sigmas[3] * 0.5  # the next sigma of step 2, changed in place
        after = scheduler.sample_previous_step(v, t, x, prev_sample=x, noise_level=0.7).log_prob
        scheduler.sigmas[3] = scheduler.sigmas[3] * 2.0
        again = scheduler.sample_previous_step(v, t, x, prev_sample=x, noise_level=0.7).log_prob
    assert not torch.equal(before, after)
    assert torch.equal(before, again)
