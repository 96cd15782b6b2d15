"""The vLLM-omni backend: settings transport, fail-closed decoding, order mapping, trajectory envelope, the
per-request engine functions (run here on the diffusers transformer, bit for bit against the PyTorch
rollouts), the clear error without vLLM-omni, and the no-import guarantee.

The tests that start a vLLM-omni engine need CUDA and skip here (see the end of the file, `make test-gpu`).
Nothing of vLLM is mocked; these CPU tests exercise the plain functions the vLLM-omni pipeline class calls,
and tests/test_vllm_omni_cpu.py runs the class itself under vLLM-omni's model runner on the CPU.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rollout_args import rollout_args

from rollout_consistency.adapters import BatchRequests, SamplingSettings, qwen_image, recompute_log_probs, stepwise
from rollout_consistency.adapters import vllm_omni as vo
from rollout_consistency.adapters.batch_invariance import batch_invariant
from rollout_consistency.adapters.pitfalls import MixedDtypeBatchError
from rollout_consistency.adapters.qwen_image import QWEN_IMAGE_SCHEDULER_CONFIG
from rollout_consistency.adapters.rope import QwenImageTransformerTxtSeqLens
from rollout_consistency.adapters.tiny import TinyPromptEncoder, load_qwen_image
from rollout_consistency.adapters.tiny.qwen_image import TINY_QWEN_IMAGE_CONFIG, save_tiny_qwen_image_directory
from rollout_consistency.adapters.trajectory import TrajectoryFormatError
from rollout_consistency.schedulers import SDEWindow, SDEWindowSchedule

ROOT = Path(__file__).resolve().parent.parent
MODULES = ("protocol", "engine_checks", "worker", "envelope", "client", "errors")
PROMPTS = ["a red cat", "a dog in the garden at night", "sky", "photo of a small blue house near the river"]
SEEDS = [11, 12, 13, 14]
GROUPS = [0, 0, 1, 1]
WINDOW = SDEWindow(start=1, size=3, num_steps=6)
HEIGHT = WIDTH = 64
NEEDS_ENGINE = (
    "needs a CUDA GPU and the vllm extra (vLLM-omni's engine); run `make test-gpu` there, see docs/vllm-omni.md"
)


@pytest.fixture(scope="module")
def model():
    return load_qwen_image()


@pytest.fixture(scope="module")
def encoder():
    return TinyPromptEncoder()


@pytest.fixture(scope="module")
def setup(model):
    return qwen_image.FAMILY.scheduler_setup(QWEN_IMAGE_SCHEDULER_CONFIG, 6, model, {"height": HEIGHT, "width": WIDTH})


def _options():
    return {"height": HEIGHT, "width": WIDTH, "vae_scale_factor": 8, "mask_text_padding": True}


def _view(model):
    return vo.TransformerView(
        model, in_channels=model.config.in_channels, joint_attention_dim=model.config.joint_attention_dim
    )


def _build(setup, cond, **overrides):
    kwargs = dict(
        scheduler_setup=setup,
        seeds=SEEDS,
        window=WINDOW,
        noise_level=0.7,
        guidance_scale=3.0,
        options=_options(),
        prompt_groups=GROUPS,
        global_step=3,
    )
    kwargs.update(overrides)
    return vo.build_requests(cond, **rollout_args(kwargs))


def _engine(transformer, prompts, extra_args, arrivals=None, max_num_seqs=4):
    """The engine's loop over the plain functions: admit, one batched forward, per-request steps, retire.
    (What vLLM-omni's runner does around the pipeline's prepare_encode/denoise_step/step_scheduler/post_decode.)"""
    arrivals = arrivals or [0] * len(prompts)
    waiting = list(range(len(prompts)))
    running, payloads, engine_step = [], [], 0
    with torch.no_grad():
        while waiting or running:
            while waiting and len(running) < max_num_seqs and arrivals[waiting[0]] <= engine_step:
                request = vo.decode_request(prompts[waiting.pop(0)], extra_args)
                running.append(vo.start_request(request, request.conditioning, transformer, device="cpu"))
            noise_pred = vo.batch_noise_pred(transformer, running)
            for row, rollout in enumerate(running):
                vo.advance_request(rollout, noise_pred[row : row + 1])
                assert rollout.state.latents.dtype == torch.float32
            for rollout in [r for r in running if r.finished]:
                running.remove(rollout)
                payloads.append(vo.trajectory_to_payload(vo.finish_request(rollout), rollout.request.request))
            engine_step += 1
    return payloads


def _collect(payloads, prompts):
    # Completion order as the engine reports it, with Omni.generate's "{i}_{uuid}" request ids.
    items = [(f"{p['request']['sample_index']}_req", p) for p in payloads]
    return vo.collect_trajectories(vo.order_by_sample_index(items, len(prompts)), prompts)


# ---------------------------------------------------------------------------------- import guarantees
def test_importing_the_packages_imports_no_vllm():
    code = (
        "import sys, rollout_consistency.adapters, rollout_consistency.gate.sides.backends, rollout_consistency.gate.check, rollout_consistency.adapters.vllm_omni\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'vllm_omni') "
        "or m == 'rollout_consistency.adapters.vllm_omni.pipeline')\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_package_serves_every_public_name_of_its_modules():
    """`rollout_consistency.adapters.vllm_omni` is the import path: each module's public names are the package's."""
    modules = [importlib.import_module(f"{vo.__name__}.{name}") for name in MODULES]
    assert {name for module in modules for name in module.__all__} >= set(vo.__all__)
    for module in modules:
        for name in module.__all__:
            assert getattr(vo, name) is getattr(module, name), f"{module.__name__}.{name}"


@pytest.mark.skipif(vo.vllm_omni_available(), reason="vLLM-omni is installed here")
def test_without_vllm_omni_the_backend_names_the_extra_at_use(tmp_path, setup):
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(vo.VllmOmniUnavailableError, match=r"rollout-consistency\[vllm\]"):
        vo.VllmOmniRollout(tmp_path)
    with pytest.raises(ImportError, match=r"rollout-consistency\[vllm\]"):
        vo.rollout(qwen_image.FAMILY, None, None, scheduler_setup=setup)
    # The pipeline shell is the only module that needs vLLM at import time.
    with pytest.raises(ImportError):
        importlib.import_module("rollout_consistency.adapters.vllm_omni.pipeline")


@pytest.mark.skipif(not vo.vllm_omni_available() or torch.cuda.is_available(), reason="needs vLLM-omni and no GPU")
def test_with_vllm_omni_but_no_gpu_the_backend_names_the_missing_device(tmp_path):
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(vo.VllmOmniUnavailableError, match="needs a CUDA device"):
        vo.VllmOmniRollout(tmp_path)


def test_engine_start_checks_model_directory_and_config_first(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model_index.json"):
        vo.VllmOmniRollout(tmp_path)
    from rollout_consistency import CheckConfig
    from rollout_consistency.gate.sides.shared import BackendError
    from rollout_consistency.gate.sides.vllm_omni_rollout import vllm_omni_engine_arguments

    config = CheckConfig(rollout_backend="vllm-omni", device="cuda")
    with pytest.raises(BackendError, match="model_path"):
        vllm_omni_engine_arguments(config.sides)
    arguments = vllm_omni_engine_arguments(replace(config, model_path=str(tmp_path), sde_window_size=3).sides)
    assert arguments["model_path"] == str(tmp_path) and arguments["window_schedule"].window_size == 3
    with pytest.raises(ValueError, match="dtype"):
        vo.VllmOmniRollout(tmp_path, dtype="bf16")


# ------------------------------------------------------------------------------ settings transport
def test_settings_round_trip_through_plain_types(encoder, setup):
    cond = encoder.conditioning(PROMPTS, [" "] * 4)
    schedule = SDEWindowSchedule("random", num_steps=6, window_size=3, window_range=(0, 5))
    windows = [schedule.window(seed=7, global_step=3, prompt_group=g) for g in GROUPS]
    prompts, extra = _build(setup, cond, window=windows, launcher_seed=7, window_schedule=schedule)
    # Everything but the embedding tensors is plain JSON (what msgpack carries unchanged).
    extra = json.loads(json.dumps(extra))
    for index, prompt in enumerate(prompts):
        plain = {k: v for k, v in prompt.items() if not isinstance(v, torch.Tensor)}
        prompt = {**prompt, **json.loads(json.dumps(plain))}
        request = vo.decode_request(prompt, extra)
        assert request.batch.scheduler == setup
        assert request.batch.window_schedule == schedule
        assert (request.batch.noise_level, request.batch.sde_type, request.batch.guidance_scale) == (0.7, "sde", 3.0)
        assert request.batch.text_width == cond["prompt_embeds"].shape[1]
        assert request.request == vo.RequestSettings(
            sample_index=index,
            seed=SEEDS[index],
            prompt_group=GROUPS[index],
            global_step=3,
            window=windows[index],
            launcher_seed=7,
        )
        assert request.window == windows[index]
        for name, tensor in cond.items():
            assert torch.equal(request.conditioning[name], tensor[index : index + 1])
        assert prompts[index]["prompt_embeds"].shape == cond["prompt_embeds"].shape[1:]  # per prompt: (L, D)


def test_window_is_derived_from_launcher_seed_step_and_group(setup, encoder):
    """No explicit window: the engine draws it from the request's (launcher seed, global step, prompt group)."""
    cond = encoder.conditioning(PROMPTS)
    schedule = SDEWindowSchedule("random", num_steps=6, window_size=2)
    prompts, extra = _build(
        setup,
        cond,
        window=None,
        launcher_seed=5,
        window_schedule=schedule,
        global_step=9,
        guidance_scale=1.0,
        prompt_groups=[0, 0, 3, 3],
    )
    derived = []
    for prompt in prompts:
        assert prompt["additional_information"][vo.PAYLOAD_KEY]["request"]["window"] is None
        request = vo.decode_request(prompt, extra)
        assert request.window == schedule.window(seed=5, global_step=9, prompt_group=request.request.prompt_group)
        derived.append(request.window)
    assert derived[0] == derived[1] and derived[2] == derived[3]


def test_both_carriers_work_and_must_agree(setup, encoder):
    cond = encoder.conditioning(PROMPTS, [" "] * 4)
    prompts, extra = _build(setup, cond)
    block = prompts[0]["additional_information"][vo.PAYLOAD_KEY]
    # AsyncOmni style: everything in the request's own extra_args.
    async_extra = {vo.PAYLOAD_KEY: {**extra[vo.PAYLOAD_KEY], "request": block["request"]}}
    bare_prompt = {k: v for k, v in prompts[0].items() if k != "additional_information"}
    assert vo.decode_request(bare_prompt, async_extra).request == vo.decode_request(prompts[0], extra).request
    # The same block in both places is fine; two different ones are refused.
    both = copy.deepcopy(prompts[0])
    both["additional_information"][vo.PAYLOAD_KEY]["batch"] = extra[vo.PAYLOAD_KEY]["batch"]
    assert vo.decode_request(both, extra).batch == vo.decode_request(prompts[0], extra).batch
    both["additional_information"][vo.PAYLOAD_KEY]["batch"] = {**extra[vo.PAYLOAD_KEY]["batch"], "noise_level": 0.5}
    with pytest.raises(ValueError, match="differs"):
        vo.decode_request(both, extra)


def _mutate(path, value):
    def apply(prompt, extra):
        target = {"request": prompt["additional_information"][vo.PAYLOAD_KEY], "batch": extra[vo.PAYLOAD_KEY]}
        node = target[path[0]]
        for key in path[1:-1]:
            node = node[key]
        if value is KeyError:
            del node[path[-1]]
        else:
            node[path[-1]] = value

    return apply


@pytest.mark.parametrize(
    "mutate, message",
    [
        (_mutate(("request", "request"), KeyError), "no 'request' block"),
        (_mutate(("batch", "batch"), KeyError), "no 'batch' block"),
        (_mutate(("request", "version"), 2), "payload version"),
        (_mutate(("batch", "extra"), 1), "unknown keys"),
        (_mutate(("request", "request", "seed"), 1.5), "'seed' must be an int"),
        (_mutate(("request", "request", "seed"), True), "'seed' must be an int"),
        (_mutate(("request", "request", "prompt_group"), KeyError), "missing \\['prompt_group'\\]"),
        (_mutate(("request", "request", "colour"), "red"), "unknown \\['colour'\\]"),
        (_mutate(("batch", "batch", "noise_level"), 0.0), "nothing to check"),
        (_mutate(("batch", "batch", "noise_level"), float("nan")), "finite"),
        (_mutate(("batch", "batch", "sde_type"), "ode"), "sde_type"),
        (_mutate(("batch", "batch", "model_family"), "flux"), "no vLLM-omni pipeline"),
        (_mutate(("batch", "batch", "options", "height"), 60), "multiples"),
        (_mutate(("request", "request", "window"), [4, 3, 6]), "does not fit"),
        (_mutate(("request", "request", "window"), [0, 3, 8]), "8-step schedule"),
        (_mutate(("request", "request", "window"), None), "No SDE window"),
        (
            _mutate(
                ("batch", "batch", "window_schedule"),
                {"kind": "fixed", "num_steps": 6, "window_size": 3, "window_range": [0, 6], "stride": 1, "every": 1},
            ),
            "draw windows differently",
        ),
    ],
)
def test_malformed_settings_fail_closed(setup, encoder, mutate, message):
    prompts, extra = _build(setup, encoder.conditioning(PROMPTS, [" "] * 4), launcher_seed=1)
    prompt, extra = copy.deepcopy(prompts[1]), copy.deepcopy(extra)
    mutate(prompt, extra)
    with pytest.raises(ValueError, match=message):
        vo.decode_request(prompt, extra)


def test_missing_settings_fail_closed_except_for_the_warm_up(setup):
    with pytest.raises(ValueError, match="build_requests"):
        vo.decode_request({"prompt": "a cat"}, {})
    with pytest.raises(ValueError, match="build_requests"):
        vo.decode_request("a cat", None)
    # vLLM-omni's own warm-up request ("dummy run", its extra_args) may pass without settings.
    assert vo.decode_request({"prompt": "dummy run"}, {"cfg_text_scale": 1.0}, allow_missing=True) is None


def test_schedule_without_launcher_seed_is_refused(setup, encoder):
    schedule = SDEWindowSchedule("random", num_steps=6, window_size=3)
    with pytest.raises(ValueError, match="launcher_seed"):
        _build(setup, encoder.conditioning(PROMPTS), guidance_scale=1.0, window_schedule=schedule)


def test_sampling_params_that_contradict_the_settings_are_refused(setup, encoder):
    prompts, extra = _build(setup, encoder.conditioning(PROMPTS, [" "] * 4))
    request = vo.decode_request(prompts[0], extra)
    fine = dict(
        num_inference_steps=6,
        height=HEIGHT,
        width=WIDTH,
        num_outputs_per_prompt=1,
        has_latents=False,
        has_custom_schedule=False,
        vae_scale_factor=8,
    )
    vo.check_sampling_params(request, **fine)
    vo.check_sampling_params(request, **{**fine, "num_inference_steps": None, "height": None, "width": None})
    for change, message in [
        ({"num_inference_steps": 8}, "num_inference_steps"),
        ({"height": 128}, "height"),
        ({"num_outputs_per_prompt": 2}, "one request per rollout"),
        ({"has_latents": True}, "latents"),
        ({"has_custom_schedule": True}, "sigmas"),
        ({"vae_scale_factor": 16}, "vae_scale_factor"),
    ]:
        with pytest.raises(ValueError, match=message):
            vo.check_sampling_params(request, **{**fine, **change})


def test_engine_settings_the_pipeline_refuses():
    vo.check_engine_settings(sequence_parallel_size=None, cache_backend="none")
    for kwargs, message in [
        ({"cfg_parallel_size": 2}, "one GPU"),
        ({"tensor_parallel_size": 2}, "one GPU"),
        ({"cache_backend": "tea_cache"}, "cache_backend"),
        ({"guidance_embeds": True}, "text-to-image"),
        ({"quantized": True}, "quantiz"),
    ]:
        with pytest.raises(ValueError, match=message):
            vo.check_engine_settings(**kwargs)


def test_engine_kwargs():
    kwargs = vo.engine_kwargs(max_num_seqs=4)
    assert kwargs["custom_pipeline_args"] == {
        "pipeline_class": "rollout_consistency.adapters.vllm_omni.pipeline.RolloutQwenImagePipeline"
    }
    assert kwargs["enforce_eager"] is True and kwargs["cache_backend"] == "none"
    assert kwargs["request_batch_max_wait_ms"] == 1000.0  # one wave per call in request mode
    assert vo.engine_kwargs(max_num_seqs=4, step_execution=True)["request_batch_max_wait_ms"] == 0.0
    assert vo.engine_kwargs(attention_backend="TORCH_SDPA")["diffusion_attention_config"] == {"default": "TORCH_SDPA"}
    assert vo.engine_kwargs(engine_options={"custom_pipeline_args": {"x": 1}})["custom_pipeline_args"]["x"] == 1
    with pytest.raises(ValueError, match="pipeline class"):
        vo.engine_kwargs(engine_options={"custom_pipeline_args": {"pipeline_class": "stock.Pipeline"}})
    with pytest.raises(ValueError, match="max_num_seqs"):
        vo.engine_kwargs(max_num_seqs=0)
    # The qualified name resolves to this package's pipeline module.
    module, _, name = vo.PIPELINE_CLASS.rpartition(".")
    assert importlib.util.find_spec(module) is not None
    assert f"class {name}(" in (ROOT / "adapters" / "vllm_omni" / "pipeline.py").read_text()


# ------------------------------------------------------------------------------ engine functions
@pytest.mark.parametrize("sde_type, guidance", [("sde", 3.0), ("cps", 1.0), ("dance_sde", 3.0)])
def test_request_wave_equals_torch_rollout_bit_for_bit(model, encoder, setup, sde_type, guidance):
    """The engine's per-request functions reproduce the PyTorch rollout draw for draw: same seeds, same noise,
    same windows, same forward (shared text width, >= 2 rows), float32 throughout."""
    cond = encoder.conditioning(PROMPTS, [" "] * 4 if guidance > 1 else None, pad_to=12)
    reference = qwen_image.rollout(
        model,
        cond,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=6,
        requests=BatchRequests(seeds=SEEDS, windows=WINDOW, prompt_groups=GROUPS, global_step=3),
        sampling=SamplingSettings(noise_level=0.7, sde_type=sde_type, guidance_scale=guidance),
    )
    prompts, extra = _build(setup, cond, sde_type=sde_type, guidance_scale=guidance)
    payloads = _engine(_view(model), prompts, extra)
    trajectory = _collect(payloads[::-1], prompts)  # completion order reversed on purpose
    for name in ("latents", "log_probs", "timesteps", "final_latents"):
        assert getattr(trajectory, name).dtype == torch.float32
        assert torch.equal(getattr(trajectory, name), getattr(reference, name)), name
    assert trajectory.seeds == tuple(SEEDS) and trajectory.prompt_groups == tuple(GROUPS)
    assert trajectory.windows == (WINDOW,) * 4 and trajectory.provenance["path"] == "vllm-omni"
    with torch.no_grad():
        assert torch.equal(recompute_log_probs(model, trajectory), trajectory.log_probs)


def test_continuous_batching_equals_the_torch_stepwise_engine(model, encoder, setup):
    """Requests joining mid-flight (forwards mixing steps) match rollout_consistency.adapters.stepwise with the same arrivals."""
    cond = encoder.conditioning(PROMPTS, [" "] * 4, pad_to=12)
    windows = [SDEWindow(0, 2, 6), SDEWindow(0, 2, 6), SDEWindow(3, 2, 6), SDEWindow(3, 2, 6)]
    arrivals = [0, 0, 2, 2]
    prompts, extra = _build(setup, cond, window=windows)
    trajectory = _collect(_engine(_view(model), prompts, extra, arrivals=arrivals), prompts)
    requests = [
        stepwise.StepwiseRequest(
            f"r{i}",
            seed=SEEDS[i],
            conditioning={k: v[i : i + 1] for k, v in cond.items()},
            window=windows[i],
            prompt_group=GROUPS[i],
            arrival=arrivals[i],
            global_step=3,
        )
        for i in range(4)
    ]
    reference = stepwise.run_stepwise(
        qwen_image.FAMILY,
        model,
        requests,
        scheduler_setup=setup,
        sampling=SamplingSettings(noise_level=0.7, guidance_scale=3.0),
        options=_options(),
        engine=stepwise.EngineSettings(max_num_seqs=4, text_width=12),
    )
    for name in ("latents", "log_probs", "timesteps", "final_latents"):
        assert torch.equal(getattr(trajectory, name), getattr(reference, name)), name


class _RecordingTransformer(QwenImageTransformerTxtSeqLens):
    """The real diffusers transformer, remembering the text RoPE lengths and text widths it was given."""

    def forward(self, *args, txt_seq_lens=None, **kwargs):
        self.seen.append((list(txt_seq_lens), int(kwargs["encoder_hidden_states"].shape[1])))
        return super().forward(*args, txt_seq_lens=txt_seq_lens, **kwargs)


def test_rope_length_is_the_shared_padded_width_and_stored_conditioning_has_it(model, encoder, setup):
    recording = _RecordingTransformer(**TINY_QWEN_IMAGE_CONFIG)
    recording.load_state_dict(model.state_dict())
    recording.eval()
    recording.seen = []
    cond = encoder.conditioning(PROMPTS)  # widths 3..9 valid tokens, padded to 9 for the batch
    mask_sums = cond["prompt_embeds_mask"].sum(dim=1).tolist()
    assert len(set(mask_sums)) > 1
    prompts, extra = _build(setup, cond, guidance_scale=1.0, text_width=16)
    # Staggered arrivals give forwards of 2, 3 and 4 rows: batch-invariant mode keeps each row's bits.
    engine_model = batch_invariant(recording, qwen_image.FAMILY)
    trajectory = _collect(_engine(_view(engine_model), prompts, extra, arrivals=[0, 0, 1, 3]), prompts)
    assert recording.seen and all(lengths == [16] * len(lengths) and width == 16 for lengths, width in recording.seen)
    assert trajectory.conditioning["prompt_embeds"].shape[1] == 16
    assert torch.equal(trajectory.conditioning["prompt_embeds_mask"].sum(dim=1), torch.tensor(mask_sums))
    with torch.no_grad():  # the trainer recomputes the rollout's exact computation
        trainer = batch_invariant(model, qwen_image.FAMILY)
        assert torch.equal(recompute_log_probs(trainer, trajectory), trajectory.log_probs)


def test_bf16_transformer_keeps_every_request_float32(encoder, setup):
    """A bf16 forward with late joiners: no "Mixed dtypes in latents batch", float32 stored, exact recompute."""
    model = load_qwen_image(dtype=torch.bfloat16)
    cond = encoder.conditioning(PROMPTS, pad_to=12)
    prompts, extra = _build(setup, cond, guidance_scale=1.0)
    trajectory = _collect(_engine(_view(model), prompts, extra, arrivals=[0, 0, 1, 1]), prompts)
    assert trajectory.latents.dtype == trajectory.log_probs.dtype == trajectory.final_latents.dtype == torch.float32
    # Stored samples are not on the bf16 grid (the stock bug rounds them).
    assert not torch.equal(trajectory.latents, trajectory.latents.to(torch.bfloat16).float())
    with torch.no_grad():
        assert torch.equal(recompute_log_probs(model, trajectory), trajectory.log_probs)


def test_scheduler_step_refuses_low_precision(model, encoder, setup):
    prompts, extra = _build(setup, encoder.conditioning(PROMPTS), guidance_scale=1.0)
    request = vo.decode_request(prompts[0], extra)
    rollout = vo.start_request(request, request.conditioning, _view(model), device="cpu")
    with pytest.raises(TypeError, match="float32"):
        vo.advance_request(rollout, torch.zeros_like(rollout.state.latents, dtype=torch.bfloat16))
    rollout.state.latents = rollout.state.latents.to(torch.bfloat16)  # the stock step-wise bug
    other = vo.start_request(request, request.conditioning, _view(model), device="cpu")
    with pytest.raises(MixedDtypeBatchError, match="Mixed dtypes in latents batch"):
        vo.batch_noise_pred(_view(model), [rollout, other])
    with pytest.raises(ValueError, match="stopped at step 0"):
        vo.finish_request(other)


def test_requests_with_other_forward_settings_are_not_batched(model, encoder, setup):
    cond = encoder.conditioning(PROMPTS)
    prompts_a, extra_a = _build(setup, cond, guidance_scale=1.0)
    prompts_b, extra_b = _build(setup, cond, guidance_scale=1.0, text_width=20)
    a, b = vo.decode_request(prompts_a[0], extra_a), vo.decode_request(prompts_b[1], extra_b)
    states = [vo.start_request(r, r.conditioning, _view(model), device="cpu") for r in (a, b)]
    with pytest.raises(ValueError, match="separate generate calls"):
        vo.batch_noise_pred(_view(model), states)


def test_transformer_view_is_the_module(model, encoder):
    view = _view(model)
    cond = encoder.conditioning(PROMPTS)
    latents = torch.randn((4, 16, 16), generator=torch.Generator().manual_seed(0))
    t = torch.full((4,), 500.0)
    with torch.no_grad():
        direct = qwen_image.velocity(model, latents, t, cond, 1.0, options=_options())
        viewed = qwen_image.velocity(view, latents, t, cond, 1.0, options=_options())
    assert torch.equal(direct, viewed)
    assert list(view.parameters()) == list(model.parameters())


# ---------------------------------------------------------------------------- envelope and order
@pytest.fixture(scope="module")
def engine_output(model, encoder, setup):
    """One engine run's trajectory payloads (completion order) and the prompts that asked for them."""
    prompts, extra = _build(setup, encoder.conditioning(PROMPTS, pad_to=12), guidance_scale=1.0)
    return _engine(_view(model), prompts, extra), prompts


def test_envelope_round_trip_is_exact(engine_output):
    payloads, _prompts = engine_output
    payload = payloads[0]
    # The keys vLLM-omni copies onto OmniRequestOutput.trajectory_latents / _timesteps / _log_probs.
    assert {"latents", "timesteps", "log_probs"} <= set(payload)
    assert all(t.device.type == "cpu" for t in (payload["latents"], payload["log_probs"], *payload["tensors"].values()))
    json.dumps(payload["fields"])  # plain types
    json.dumps(payload["request"])
    trajectory = vo.trajectory_from_payload(payload)
    again = vo.trajectory_from_payload(
        vo.trajectory_to_payload(trajectory, vo.RequestSettings.from_payload(payload["request"]))
    )
    for name in ("latents", "log_probs", "timesteps"):
        assert torch.equal(getattr(again, name), payload[name])
    assert torch.equal(again.final_latents, payload["tensors"]["final_latents"])
    assert again.scheduler == trajectory.scheduler and again.windows == trajectory.windows
    envelope = vo.output_envelope("IMAGE", payload)
    assert envelope["payload"]["image"] == "IMAGE" and envelope["payload"]["trajectory"]["format"] == vo.ENVELOPE_FORMAT
    assert envelope["metadata"]["trajectory"]["type"] == "denoising"


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.update(format="bagel"), "not a rollout-consistency payload"),
        (lambda p: p.update(version=9), "version"),
        (lambda p: p.update(latents=p["latents"].to(torch.bfloat16)), "float32"),
        (lambda p: p["fields"].pop("seeds"), "'seeds' is missing"),
        (lambda p: p.pop("tensors"), "incomplete"),
        (lambda p: p.update(log_probs=p["log_probs"][:, :1]), "not a valid trajectory"),
    ],
)
def test_bad_envelopes_are_refused(engine_output, damage, message):
    payloads, _ = engine_output
    payload = copy.deepcopy(payloads[0])
    damage(payload)
    with pytest.raises(TrajectoryFormatError, match=message):
        vo.trajectory_from_payload(payload)


def test_completion_order_is_mapped_back_and_checked():
    payloads = [{"request": {"sample_index": i}, "id": i} for i in range(4)]
    done = [(f"{i}_u{i}", payloads[i]) for i in (2, 0, 3, 1)]
    assert [p["id"] for p in vo.order_by_sample_index(done, 4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"sample\(s\) \[1\]"):
        vo.order_by_sample_index(done[:3], 4)
    with pytest.raises(ValueError, match="Two outputs"):
        vo.order_by_sample_index([*done, ("retry", payloads[2])], 4)
    with pytest.raises(ValueError, match="carries the trajectory of sample 2"):
        vo.order_by_sample_index([("1_u", payloads[2])], 4)
    with pytest.raises(ValueError, match="outside"):
        vo.order_by_sample_index([("x", {"request": {"sample_index": 7}})], 4)
    with pytest.raises(ValueError, match="no echoed sample_index"):
        vo.order_by_sample_index([("0_u", {})], 4)


def test_a_trajectory_for_another_request_is_refused(engine_output):
    payloads, prompts = engine_output
    by_index = {p["request"]["sample_index"]: p for p in payloads}
    swapped = [by_index[1], by_index[0], by_index[2], by_index[3]]
    with pytest.raises(ValueError, match="Sample 0"):
        vo.collect_trajectories(swapped, prompts)


# ------------------------------------------------------------------ a tiny Qwen-Image model directory
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_qwen_image_directory(tmp_path_factory.mktemp("tiny-qwen-image"))


def test_tiny_model_directory_is_what_both_sides_load(tiny_model_dir, model):
    """The directory the GPU tests hand to vLLM-omni: diffusers loads it, the trainer gets the tiny weights."""
    from diffusers import QwenImagePipeline

    assert {p.name for p in tiny_model_dir.iterdir()} >= {
        "model_index.json",
        "transformer",
        "text_encoder",
        "tokenizer",
        "vae",
        "scheduler",
    }
    loaded = load_qwen_image(tiny_model_dir)
    assert all(
        torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values(), strict=False)
    )
    pipeline = QwenImagePipeline.from_pretrained(tiny_model_dir)
    embeds, _ = pipeline.encode_prompt(["a red cat"], max_sequence_length=32)
    assert embeds.shape == (1, 32, TINY_QWEN_IMAGE_CONFIG["joint_attention_dim"])
    image = pipeline(prompt="a red cat", height=HEIGHT, width=WIDTH, num_inference_steps=2, output_type="pt").images
    assert image.shape == (1, 3, HEIGHT, WIDTH) and bool(torch.isfinite(image).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiny_model_directory_saves_every_component_in_the_engine_dtype(tmp_path, dtype):
    """vLLM-omni's loader casts only the transformer and the VAE to the engine dtype; the text encoder must be
    saved in it (a float32 text encoder under a bf16 engine fails its start-up warm-up request)."""
    from safetensors import safe_open

    path = save_tiny_qwen_image_directory(tmp_path, dtype=dtype)
    saved_as = {torch.bfloat16: "BF16", torch.float32: "F32"}[dtype]  # safetensors' dtype names
    for component in ("transformer", "text_encoder", "vae"):
        files = sorted((path / component).glob("*.safetensors"))
        assert files, component
        for file in files:
            with safe_open(str(file), framework="pt") as tensors:
                dtypes = {tensors.get_slice(name).get_dtype() for name in tensors.keys()}  # noqa: SIM118
            assert dtypes == {saved_as}, (component, dtypes)


# ---------------------------------------------------------------------------- GPU: vLLM-omni engine
#: A full-size model directory to use instead of the tiny one (a path only: never seeds anything).
_MODEL_DIR = os.environ.get("ROLLOUT_CONSISTENCY_QWEN_IMAGE_DIR")
needs_engine = pytest.mark.skipif(not vo.vllm_omni_available() or not torch.cuda.is_available(), reason=NEEDS_ENGINE)


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory):
    if _MODEL_DIR is not None:
        return Path(_MODEL_DIR)
    # In the engine's dtype (bf16, the default): vLLM-omni casts only the transformer and the VAE.
    return save_tiny_qwen_image_directory(tmp_path_factory.mktemp("tiny-qwen-image-gpu"), dtype=torch.bfloat16)


@needs_engine
def test_pipeline_module_imports_with_vllm_omni():
    module = importlib.import_module("rollout_consistency.adapters.vllm_omni.pipeline")
    from vllm_omni.diffusion.models.qwen_image import QwenImagePipeline

    cls = module.RolloutQwenImagePipeline
    assert issubclass(cls, QwenImagePipeline) and cls.supports_request_batch and cls.supports_step_execution
    for name in ("prepare_encode", "denoise_step", "step_scheduler", "post_decode", "forward"):
        assert getattr(cls, name) is not getattr(QwenImagePipeline, name), name


@needs_engine
@pytest.mark.parametrize("step_execution", [False, True])
def test_engine_rollout_agrees_with_the_torch_trainer(gpu_model_dir, step_execution):
    """vLLM-omni rollouts (bf16) re-scored by the PyTorch trainer (bf16): float32 trajectories in request
    order, and log-probs within the kernel floor (docs/vllm-omni.md)."""
    from rollout_consistency import CheckConfig, adapters
    from rollout_consistency.adapters.families import load_scheduler_config
    from rollout_consistency.gate.sides.backends import pipeline_settings

    path = str(gpu_model_dir)
    size = 64 if _MODEL_DIR is None else 256
    config = CheckConfig(
        model_path=path,
        rollout_backend="vllm-omni",
        device="cuda",
        rollout_dtype="bfloat16",
        trainer_dtype="bfloat16",
        height=size,
        width=size,
        num_inference_steps=8,
        step_execution=step_execution,
        max_num_seqs=4,
    )
    family, settings = qwen_image.FAMILY, pipeline_settings(config)
    trainer = family.load_transformer(path, dtype=torch.bfloat16, device="cuda")
    options = family.options(settings)
    setup = family.scheduler_setup(load_scheduler_config(path), 8, trainer, options)
    with torch.no_grad():
        cond = family.load_prompt_encoder(path, "cuda", settings)(PROMPTS, None)
    window = SDEWindow(2, 3, 8)
    with vo.VllmOmniRollout(path, step_execution=step_execution, max_num_seqs=4) as engine:
        trajectory = engine.rollout(
            qwen_image.FAMILY,
            None,
            cond,
            scheduler_setup=setup,
            requests=BatchRequests(seeds=SEEDS, windows=window, prompt_groups=GROUPS),
            sampling=SamplingSettings(noise_level=0.7),
            options=options,
        )
    assert trajectory.seeds == tuple(SEEDS) and trajectory.latents.dtype == torch.float32
    assert trajectory.provenance["execution"] == ("step" if step_execution else "request")
    with torch.no_grad():
        trainer_log_probs = adapters.recompute_log_probs(trainer, trajectory.to("cuda")).cpu()
    ppo_kl = (trajectory.log_probs - trainer_log_probs).mean().abs().item()
    assert ppo_kl < 1e-3, ppo_kl


@needs_engine
def test_step1_check_with_the_vllm_omni_backend(gpu_model_dir):
    """The checker end to end: `rollout_backend="vllm-omni"` starts the engine (its registered factory,
    rollout_consistency.gate.sides.vllm_omni_rollout, with `vllm_omni_engine_arguments`) and gates it with the kernel profile."""
    from rollout_consistency import run_step1_check

    size = 64 if _MODEL_DIR is None else 256
    report = run_step1_check(
        model_path=str(gpu_model_dir),
        rollout_backend="vllm-omni",
        device="cuda",
        rollout_dtype="bfloat16",
        trainer_dtype="bfloat16",
        height=size,
        width=size,
        num_inference_steps=6,
        step_execution=True,
        max_num_seqs=4,
        progress=False,
    )
    assert report.passed, report.reasons
