"""FlowMatchSDEDiscreteScheduler as a drop-in for diffusers' FlowMatchEulerDiscreteScheduler.

Part 1 binds the checks of diffusers' shared scheduler test mixin (tests/schedulers/test_schedulers.py,
`SchedulerCommonTest`) to both classes, with FlowMatchEuler's timesteps (values from `scheduler.timesteps`;
FlowMatchEuler refuses integer indices): every check that passes with diffusers' class must pass with ours.
Part 2 runs the stock QwenImagePipeline, StableDiffusion3Pipeline and FluxPipeline on the tiny models with
our scheduler swapped in: fp32 latents bit for bit equal to diffusers' scheduler at the default settings; in
bf16 a one-line error at the first step naming the rollout adapter.
"""

from __future__ import annotations

import inspect
import tempfile
import warnings

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from sd3_flux_cases import FAMILIES, PROMPTS, SEEDS, SIZE

from rollout_consistency.adapters.tiny import TinyPromptEncoder, load_qwen_image, load_qwen_image_scheduler_config
from rollout_consistency.schedulers import FlowMatchSDEDiscreteScheduler

CLASSES = [FlowMatchEulerDiscreteScheduler, FlowMatchSDEDiscreteScheduler]
NUM_STEPS = 10
CONFIGS = [{"num_train_timesteps": 1000, "shift": 1.0}, {"shift": 3.0}, {"shift": 3.0, "shift_terminal": 0.02}]


def dummy_sample() -> torch.Tensor:
    """The mixin's `dummy_sample`: a (4, 3, 8, 8) ramp in [0, 1)."""
    batch, channels, height, width = 4, 3, 8, 8
    return torch.arange(batch * channels * height * width, dtype=torch.float32).reshape(
        channels, height, width, batch
    ).permute(3, 0, 1, 2) / (batch * channels * height * width)


def make(cls, num_steps: int | None = NUM_STEPS, **config):
    scheduler = cls(**{"num_train_timesteps": 1000, "shift": 1.0, **config})
    if num_steps is not None:
        scheduler.set_timesteps(num_steps)
    return scheduler


# ---------------------------------------------------------------------------------------------------- part 1
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_step_shape(cls):
    scheduler = make(cls)
    sample = dummy_sample()
    residual = 0.1 * sample
    output_0 = scheduler.step(residual, scheduler.timesteps[0], sample).prev_sample
    output_1 = scheduler.step(residual, scheduler.timesteps[1], sample).prev_sample
    assert output_0.shape == sample.shape == output_1.shape


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_from_save_pretrained_and_over_configs(cls, config):
    """The mixin's `test_from_save_pretrained` / `check_over_configs`: a saved and reloaded scheduler steps alike."""
    scheduler = make(cls, None, **config)
    with tempfile.TemporaryDirectory() as directory:
        scheduler.save_config(directory)
        reloaded = cls.from_pretrained(directory)
    for each in (scheduler, reloaded):
        each.set_timesteps(NUM_STEPS)
    sample = dummy_sample()
    for index in (0, 5):
        t = scheduler.timesteps[index]
        output = scheduler.step(0.1 * sample, t, sample, generator=torch.manual_seed(0)).prev_sample
        new_output = reloaded.step(0.1 * sample, t, sample, generator=torch.manual_seed(0)).prev_sample
        assert torch.equal(output, new_output)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_from_pretrained(cls):
    scheduler = make(cls, None)
    with tempfile.TemporaryDirectory() as directory:
        scheduler.save_pretrained(directory)
        reloaded = cls.from_pretrained(directory)
    config = dict(scheduler.config)
    del config["_use_default_values"]
    assert config == reloaded.config


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_scheduler_outputs_equivalence(cls):
    """`return_dict=False` returns the output's `to_tuple()` (checked at the SDE setting too, for ours)."""
    settings = [{}] if cls is FlowMatchEulerDiscreteScheduler else [{}, {"noise_level": 0.7}]
    for extra in settings:
        sample = dummy_sample()
        scheduler = make(cls)
        as_dict = scheduler.step(0.1 * sample, scheduler.timesteps[0], sample, generator=torch.manual_seed(0), **extra)
        scheduler.set_timesteps(NUM_STEPS)
        as_tuple = scheduler.step(
            0.1 * sample, scheduler.timesteps[0], sample, generator=torch.manual_seed(0), return_dict=False, **extra
        )
        assert isinstance(as_tuple, tuple)
        assert len(as_tuple) == len(as_dict.to_tuple())
        for left, right in zip(as_tuple, as_dict.to_tuple(), strict=True):
            assert torch.equal(left, right)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_compatibles(cls):
    scheduler = make(cls, None)
    assert all(c is not None for c in scheduler.compatibles)
    if cls is FlowMatchSDEDiscreteScheduler:
        assert FlowMatchEulerDiscreteScheduler in scheduler.compatibles
    for compatible in scheduler.compatibles:
        other = compatible.from_config(scheduler.config)
        assert other is not None
        back = cls.from_config(other.config)
        back_config = {k: v for k, v in back.config.items() if k in scheduler.config}
        assert back_config == dict(scheduler.config)
        diff = {k for k in back.config if k not in scheduler.config}
        assert diff.isdisjoint(inspect.signature(cls.__init__).parameters)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_deprecated_kwargs(cls):
    has_kwargs = "kwargs" in inspect.signature(cls.__init__).parameters
    assert has_kwargs == (len(cls._deprecated_kwargs) > 0)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_getattr_is_correct(cls):
    scheduler = make(cls, None)
    scheduler.dummy_attribute = 5
    scheduler.register_to_config(test_attribute=5)
    assert scheduler.dummy_attribute == 5
    with pytest.warns(FutureWarning):
        assert scheduler.test_attribute == 5
    with pytest.raises(AttributeError, match=f"'{cls.__name__}' object has no attribute 'does_not_exist'"):
        scheduler.does_not_exist  # noqa: B018


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_step_index_advances_as_diffusers(cls):
    scheduler = make(cls)
    sample = dummy_sample()
    assert scheduler.step_index is None
    for index in range(3):
        scheduler.step(0.1 * sample, scheduler.timesteps[index], sample)
        assert scheduler.step_index == index + 1
    scheduler.set_timesteps(NUM_STEPS)
    scheduler.set_begin_index(4)
    scheduler.step(0.1 * sample, scheduler.timesteps[4], sample)
    assert scheduler.step_index == 5


def test_default_settings_are_diffusers_euler_bit_for_bit_over_a_schedule():
    stock, ours = make(FlowMatchEulerDiscreteScheduler, shift=3.0), make(FlowMatchSDEDiscreteScheduler, shift=3.0)
    x_stock = x_ours = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    for t in stock.timesteps:
        v = torch.sin(3 * x_stock + t / 1000)  # any deterministic "model"
        x_stock = stock.step(v, t, x_stock, return_dict=False)[0]
        x_ours = ours.step(v, t, x_ours, return_dict=False)[0]
        assert torch.equal(x_stock, x_ours)


def test_noise_level_and_sde_type_are_config_keys_overridable_per_call():
    scheduler = FlowMatchSDEDiscreteScheduler(shift=3.0, noise_level=0.7, sde_type="cps")
    assert scheduler.config.noise_level == 0.7 and scheduler.config.sde_type == "cps"
    assert FlowMatchSDEDiscreteScheduler.from_config(scheduler.config).config.sde_type == "cps"
    assert FlowMatchSDEDiscreteScheduler().config.noise_level == 0
    scheduler.set_timesteps(NUM_STEPS)
    x = dummy_sample()
    t = scheduler.timesteps[2]
    by_config = scheduler.step(0.1 * x, t, x, generator=torch.manual_seed(3))
    explicit = scheduler.sample_previous_step(
        0.1 * x, t, x, noise_level=0.7, sde_type="cps", generator=torch.manual_seed(3)
    )
    assert torch.equal(by_config.prev_sample, explicit.prev_sample) and torch.equal(
        by_config.log_prob, explicit.log_prob
    )
    ode = scheduler.step(0.1 * x, t, x, noise_level=0.0)
    assert ode.log_prob is None and torch.all(ode.prev_sample_std == 0)
    with pytest.raises(ValueError, match="Unknown sde_type"):
        FlowMatchSDEDiscreteScheduler(sde_type="ode")
    with pytest.raises(ValueError, match="noise_level must be"):
        FlowMatchSDEDiscreteScheduler(noise_level=-1.0)


@pytest.mark.parametrize(
    ("keyword", "value"),
    [("s_churn", 0.5), ("s_tmin", 0.1), ("s_tmax", 10.0), ("s_noise", 0.9), ("per_token_timesteps", torch.ones(4))],
)
def test_diffusers_keywords_accepted_at_defaults_rejected_otherwise(keyword, value):
    scheduler = make(FlowMatchSDEDiscreteScheduler)
    x = dummy_sample()
    t = scheduler.timesteps[0]
    defaults = dict(s_churn=0.0, s_tmin=0.0, s_tmax=float("inf"), s_noise=1.0, per_token_timesteps=None)
    scheduler.step(0.1 * x, t, x, **defaults)
    # positionally too: diffusers' order
    scheduler.step(0.1 * x, scheduler.timesteps[1], x, 0.0, 0.0, float("inf"), 1.0, None, None, True)
    with pytest.raises(ValueError, match=rf"^FlowMatchSDEDiscreteScheduler\.step: {keyword}") as error:
        scheduler.step(0.1 * x, scheduler.timesteps[2], x, **{keyword: value})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_std_dev_t_is_flow_grpo_std_and_prev_sample_std_the_noise_scale(sde_type):
    scheduler = make(FlowMatchSDEDiscreteScheduler, shift=3.0)
    x = dummy_sample()
    for index in (0, 4, NUM_STEPS - 1):
        t = scheduler.timesteps[index]
        out = scheduler.sample_previous_step(
            0.1 * x, t, x, noise_level=0.7, sde_type=sde_type, generator=torch.manual_seed(0)
        )
        sigma, sigma_next = scheduler.sigmas[index].double(), scheduler.sigmas[index + 1].double()
        scale = 1.0 if sde_type == "cps" else torch.sqrt(sigma - sigma_next)  # sqrt(-dt)
        torch.testing.assert_close(out.prev_sample_std.double(), out.std_dev_t.double() * scale, rtol=1e-6, atol=0)
        if sde_type == "sde":
            sigma_max = scheduler.sigmas[1].double()
            expected = 0.7 * torch.sqrt(sigma / (1 - (sigma_max if index == 0 else sigma)))
            torch.testing.assert_close(out.std_dev_t.double(), expected.expand(4), rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------- part 2
def _qwen_pipeline(transformer):
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**load_qwen_image_scheduler_config()),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
    )


def _stock_case(name: str, dtype: torch.dtype):
    """(pipeline, call kwargs) for a stock diffusers pipeline on the tiny model in `dtype`."""
    if name == "qwen_image":
        pipe = _qwen_pipeline(load_qwen_image(dtype=dtype))
        cond = TinyPromptEncoder().conditioning(PROMPTS[:2], [" "] * 2)
        cfg = {"true_cfg_scale": 3.0}
    else:
        family = FAMILIES[name]
        pipe = family.pipeline(family.load(dtype=dtype))
        cond = family.conditioning(PROMPTS[:2], [""] * 2)
        cfg = dict(family.cfg)
    # A stock low-precision pipeline gets its embeddings from a low-precision text encoder.
    cond = {k: v.to(dtype) if v.is_floating_point() else v for k, v in cond.items()}
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(**cond, **cfg, num_inference_steps=3, output_type="latent", **SIZE)
    return pipe, kwargs


def _run(pipe, kwargs):
    generator = [torch.Generator().manual_seed(seed) for seed in SEEDS[:2]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pipe(**kwargs, generator=generator).images


@pytest.mark.parametrize("name", ["qwen_image", "sd3", "flux"])
def test_stock_pipeline_fp32_swap_is_bit_identical(name):
    pipe, kwargs = _stock_case(name, torch.float32)
    stock = _run(pipe, kwargs)
    pipe.scheduler = FlowMatchSDEDiscreteScheduler.from_config(pipe.scheduler.config)
    swapped = _run(pipe, kwargs)
    assert stock.dtype == swapped.dtype == torch.float32
    assert torch.equal(stock, swapped)
    # and with the SDE on (config key), the same pipeline runs and the latents differ
    pipe.scheduler = FlowMatchSDEDiscreteScheduler.from_config(pipe.scheduler.config, noise_level=0.7)
    noisy = _run(pipe, kwargs)
    assert noisy.shape == stock.shape and not torch.equal(noisy, stock)


@pytest.mark.parametrize("name", ["qwen_image", "sd3", "flux"])
def test_stock_pipeline_bf16_swap_stops_at_first_step_naming_the_adapter(name):
    pipe, kwargs = _stock_case(name, torch.bfloat16)
    assert _run(pipe, kwargs).dtype == torch.bfloat16  # diffusers' own scheduler runs (and rounds latents)
    pipe.scheduler = FlowMatchSDEDiscreteScheduler.from_config(pipe.scheduler.config)
    forwards = []
    handle = pipe.transformer.register_forward_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(TypeError, match=r"stock-pipeline call.*adapters\.qwen_image\.rollout") as error:
            _run(pipe, kwargs)
    finally:
        handle.remove()
    assert "\n" not in str(error.value)
    assert pipe.scheduler.step_index is None  # stopped at the first step, before stepping
    assert len(forwards) <= 2  # one step's forwards (two with true CFG run as two calls)


@pytest.mark.parametrize("family", ["qwen-image", "sd3", "flux", "wan"])
def test_each_tiny_model_has_the_scheduler_config_the_checker_runs_it_with(family, tmp_path):
    """`tiny.load_<family>_scheduler_config()` is the config the checker's tiny run uses (the family's released
    one); saved as a model directory's `scheduler/` it is what `from_pretrained(..., subfolder="scheduler")` and
    the loader with that path read back."""
    from rollout_consistency.adapters import get_family, tiny

    name = family.replace("-", "_")
    load = getattr(tiny, f"load_{name}_scheduler_config")
    config = load()
    assert config == dict(get_family(family).scheduler_config)
    FlowMatchSDEDiscreteScheduler(**config).save_pretrained(tmp_path / "scheduler")
    read = FlowMatchSDEDiscreteScheduler.from_pretrained(tmp_path, subfolder="scheduler")
    assert all(read.config[key] == value for key, value in config.items())
    assert {k: v for k, v in load(tmp_path).items() if k in config} == config
    assert load() is not load()  # a copy: the caller may edit it
