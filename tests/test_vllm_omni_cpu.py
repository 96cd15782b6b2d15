"""The rollout pipeline class under vLLM-omni's own `DiffusionModelRunner`, on the CPU.

vLLM-omni 0.30.0 and vLLM 0.30.0 are installed without their CUDA dependencies (tests/requirements-vllm-cpu.txt,
installed by `make test`); tests/vllm_cpu_shims.py replaces the platform's device hooks (imported by
tests/conftest.py before anything of vLLM-omni). Everything else is vLLM-omni's: its config and loader
build `RolloutQwenImagePipeline` from the tiny model directory (its own Qwen-Image transformer, SDPA
attention), its runner drives request waves (`execute_model_batch`) and step batches (`execute_stepwise`),
its warm-up request is the engine's own, and its transport (`pack/unpack_diffusion_output_shm`,
`OmniMsgpackEncoder/Decoder`) carries the prompts and the trajectory envelope.

Not exercised here: the CUDA kernels (FlashAttention, fused Triton QK-norm + RoPE, cuBLAS), the multi-process
engine (`Omni`, ZMQ, worker processes). Those are the GPU tests (`make test-gpu`, docs/vllm-omni.md).
"""

from __future__ import annotations

import importlib.util
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_consistency.adapters import BatchRequests, SamplingSettings, qwen_image, recompute_log_probs
from rollout_consistency.adapters import vllm_omni as vo
from rollout_consistency.adapters.qwen_image import QWEN_IMAGE_SCHEDULER_CONFIG
from rollout_consistency.adapters.tiny import TinyPromptEncoder, load_qwen_image
from rollout_consistency.adapters.tiny.qwen_image import save_tiny_qwen_image_directory
from rollout_consistency.gate.tables.api import gate
from rollout_consistency.schedulers import SDEWindow

if not all(importlib.util.find_spec(name) for name in ("vllm", "vllm_omni")):
    pytest.skip(
        "vllm-omni / vllm not installed: `make test` installs them without CUDA (tests/requirements-vllm-cpu.txt)",
        allow_module_level=True,
    )
if torch.cuda.is_available():
    pytest.skip(
        "a GPU is present: vLLM-omni runs on its CUDA platform here, see the GPU tests (make test-gpu)",
        allow_module_level=True,
    )

from vllm.config import set_current_vllm_config
from vllm.v1.engine.exceptions import EngineGenerateError
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.distributed import parallel_state
from vllm_omni.diffusion.forward_context import set_forward_context
from vllm_omni.diffusion.ipc import pack_diffusion_output_shm, unpack_diffusion_output_shm
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched.interface import (
    CachedRequestData,
    DiffusionSchedulerOutput,
    NewRequestData,
)
from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config
from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
from vllm_omni.distributed.omni_connectors.utils.serialization import (
    OmniMsgpackDecoder,
    OmniMsgpackEncoder,
)
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

PROMPTS = ["a red cat", "a dog in the garden at night", "sky", "photo of a small blue house near the river"]
SEEDS = [11, 12, 13, 14]
GROUPS = [0, 0, 1, 1]
WINDOW = SDEWindow(start=1, size=3, num_steps=6)
HEIGHT = WIDTH = 64
TEXT_WIDTH = 12


# ------------------------------------------------------------------------------------------ the runner
@dataclass(frozen=True)
class CpuEngine:
    """vLLM-omni's runner with the pipeline loaded, and the contexts its worker wraps every call in."""

    runner: DiffusionModelRunner
    od_config: OmniDiffusionConfig
    vllm_config: Any

    @contextmanager
    def context(self):
        """The contexts `DiffusionWorker` enters around every call into its runner."""
        with (
            set_forward_context(vllm_config=self.vllm_config, omni_diffusion_config=self.od_config),
            set_current_vllm_config(self.vllm_config),
        ):
            yield

    def warm_up(self) -> DiffusionOutput:
        """The engine's own start-up request (`DiffusionEngine._dummy_run`: 512x512, 2 steps, no settings), run
        the way the engine's mode runs requests: a step loop, or a request wave."""
        holder = type("EngineConfig", (), {"od_config": self.od_config})()
        request = DiffusionEngine._make_dummy_request(
            holder, height=512, width=512, guidance_scale=0.0, num_inference_steps=2
        )
        if self.od_config.step_execution:
            return self.step_batches([request], arrivals=[0])[request.request_id]
        return self.request_wave([request])[0]

    def request_wave(self, requests: list[OmniDiffusionRequest]) -> list[DiffusionOutput]:
        """One request-mode wave (`execute_model_batch` → the pipeline's `forward`), outputs in request order."""
        with self.context():
            batch = self.runner.execute_model_batch(_scheduled(requests, []), self.od_config)
        return [batch[r.request_id].result for r in requests]

    def step_batches(self, requests: list[OmniDiffusionRequest], arrivals: list[int], max_num_seqs: int = 4):
        """Step mode as vLLM-omni's scheduler drives it: admit arrivals, one `execute_stepwise` per engine step
        (new + cached requests), retire finished ones. Returns {request_id: DiffusionOutput}, in completion order."""
        waiting = list(zip(arrivals, requests, strict=True))
        running: list[str] = []
        finished: set[str] = set()
        results: dict[str, DiffusionOutput] = {}
        step = 0
        while waiting or running:
            new = []
            while waiting and len(running) + len(new) < max_num_seqs and waiting[0][0] <= step:
                new.append(waiting.pop(0)[1])
            with self.context():
                output = self.runner.execute_stepwise(_scheduled(new, running, finished, step))
            finished = set()
            running += [r.request_id for r in new]
            for item in output.runner_outputs:
                if item.finished:
                    results[item.request_id] = item.result
                    running.remove(item.request_id)
                    finished.add(item.request_id)
            step += 1
            assert step < 100, "the step loop does not finish"
        return results


def _scheduled(new, running, finished=(), step=0) -> DiffusionSchedulerOutput:
    return DiffusionSchedulerOutput(
        step_id=step,
        scheduled_new_reqs=[NewRequestData(request_id=r.request_id, req=r) for r in new],
        scheduled_cached_reqs=CachedRequestData(request_ids=list(running)),
        finished_req_ids=set(finished),
        num_running_reqs=len(new) + len(running),
        num_waiting_reqs=0,
    )


@pytest.fixture(scope="module")
def process_group():
    """The worker's torch.distributed group (gloo, world size 1), as `DiffusionWorker.init_device` sets it up."""
    od_config = OmniDiffusionConfig.from_kwargs(dtype="float32")
    vllm_config = create_diffusion_vllm_config(torch.device("cpu"), od_config)
    env = {"MASTER_ADDR": "localhost", "MASTER_PORT": str(od_config.master_port), "RANK": "0", "WORLD_SIZE": "1"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        with (
            set_forward_context(vllm_config=vllm_config, omni_diffusion_config=od_config),
            set_current_vllm_config(vllm_config),
        ):
            parallel_state.init_distributed_environment(world_size=1, rank=0)
            parallel_state.initialize_model_parallel()
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def start_engine(model_dir: Path, **engine_args: Any) -> CpuEngine:
    """What `Omni(model_dir, **engine_kwargs(...))` does in its worker, in this process: the same config
    (`OmniDiffusionConfig.from_kwargs` + `enrich_config`), the custom-pipeline load, the same runner."""
    kwargs = vo.engine_kwargs(**engine_args)
    od_config = OmniDiffusionConfig.from_kwargs(model=str(model_dir), **kwargs)
    od_config.enrich_config()
    vllm_config = create_diffusion_vllm_config(torch.device("cpu"), od_config)
    runner = DiffusionModelRunner(vllm_config=vllm_config, od_config=od_config, device=torch.device("cpu"))
    engine = CpuEngine(runner, od_config, vllm_config)
    with engine.context():
        runner.load_model(
            load_format="custom_pipeline", custom_pipeline_name=kwargs["custom_pipeline_args"]["pipeline_class"]
        )
    return engine


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory):
    return save_tiny_qwen_image_directory(tmp_path_factory.mktemp("tiny-fp32"), dtype=torch.float32)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return save_tiny_qwen_image_directory(tmp_path_factory.mktemp("tiny-bf16"), dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fp32_engine(process_group, fp32_dir):
    return start_engine(fp32_dir, dtype="float32", max_num_seqs=4)


@pytest.fixture(scope="module")
def fp32_step_engine(process_group, fp32_dir):
    return start_engine(fp32_dir, dtype="float32", step_execution=True, max_num_seqs=4)


@pytest.fixture(scope="module")
def bf16_engine(process_group, bf16_dir):
    return start_engine(bf16_dir, dtype="bfloat16", max_num_seqs=4)


@pytest.fixture(scope="module")
def model():
    return load_qwen_image()


@pytest.fixture(scope="module")
def setup(model):
    return qwen_image.FAMILY.scheduler_setup(QWEN_IMAGE_SCHEDULER_CONFIG, 6, model, {"height": HEIGHT, "width": WIDTH})


def _options():
    return {"height": HEIGHT, "width": WIDTH, "vae_scale_factor": 8, "mask_text_padding": True}


def _conditioning(guidance):
    return TinyPromptEncoder().conditioning(PROMPTS, [" "] * 4 if guidance > 1 else None, pad_to=TEXT_WIDTH)


def _requests(setup, cond, *, guidance=3.0, window=WINDOW, **overrides):
    """The client's requests as `VllmOmniRollout.rollout` sends them, through vLLM-omni's serialiser (the
    stage client's msgpack hop), with `Omni.generate`'s `"{i}_{uuid}"` ids."""
    prompts, extra_args = vo.build_requests(
        cond,
        scheduler_setup=setup,
        requests=BatchRequests(seeds=SEEDS, windows=window, prompt_groups=GROUPS, global_step=3),
        sampling=SamplingSettings(noise_level=0.7, guidance_scale=guidance),
        options=_options(),
        text_width=TEXT_WIDTH,
        **overrides,
    )
    kwargs = vo.sampling_params_kwargs(
        scheduler_setup=setup, options=_options(), guidance_scale=guidance, extra_args=extra_args
    )
    encoder, decoder = OmniMsgpackEncoder(), OmniMsgpackDecoder()
    requests = [
        OmniDiffusionRequest(
            prompt=decoder.decode(encoder.encode(prompt)),
            sampling_params=OmniDiffusionSamplingParams(**kwargs),
            request_id=f"{i}_{uuid.uuid4()}",
        )
        for i, prompt in enumerate(prompts)
    ]
    return requests, prompts


def _transported(output: DiffusionOutput) -> DiffusionOutput:
    """The worker → executor hop (shared memory for large tensors) and the stage → client msgpack hop."""
    output = unpack_diffusion_output_shm(pack_diffusion_output_shm(output))
    encoder, decoder = OmniMsgpackEncoder(), OmniMsgpackDecoder()
    return replace(output, output=decoder.decode(encoder.encode(output.output)))


def _trajectory(outputs: list[tuple[str, DiffusionOutput]], prompts):
    items = []
    for request_id, output in outputs:
        assert output.error is None, output.error
        items.append((request_id, _transported(output).output["payload"]["trajectory"]))
    return vo.collect_trajectories(vo.order_by_sample_index(items, len(prompts)), prompts)


def _torch_rollout(model, cond, guidance, sde_type="sde"):
    return qwen_image.rollout(
        model,
        cond,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=6,
        requests=BatchRequests(seeds=SEEDS, windows=WINDOW, prompt_groups=GROUPS, global_step=3),
        sampling=SamplingSettings(noise_level=0.7, sde_type=sde_type, guidance_scale=guidance),
    )


# --------------------------------------------------------------------------------------------- tests
def test_the_runner_builds_the_pipeline_class_and_the_warm_up_takes_the_stock_path(fp32_engine, fp32_step_engine):
    from rollout_consistency.adapters.vllm_omni.pipeline import RolloutQwenImagePipeline

    for engine in (fp32_engine, fp32_step_engine):
        pipeline = engine.runner.pipeline
        assert type(pipeline) is RolloutQwenImagePipeline
        assert next(pipeline.transformer.parameters()).dtype == torch.float32
        output = engine.warm_up()
        assert output.error is None and isinstance(output.output, torch.Tensor)  # the stock image, no trajectory


def test_a_bf16_engine_starts_on_the_tiny_directory_saved_in_its_dtype(bf16_engine, bf16_dir):
    """Regression (defect a): vLLM-omni casts only the transformer and the VAE to the engine dtype; the text
    encoder keeps its saved dtype and the stock warm-up draws its latents in it. The tiny directory saved in
    float32 made a bf16 engine's warm-up fail ("mat1 and mat2 must have the same dtype"); saved in the
    engine's dtype, it runs."""
    pipeline = bf16_engine.runner.pipeline
    components = (pipeline.transformer, pipeline.text_encoder, pipeline.vae)
    assert {next(c.parameters()).dtype for c in components} == {torch.bfloat16}
    output = bf16_engine.warm_up()
    assert output.error is None, output.error


@pytest.mark.parametrize("guidance", [3.0, 1.0], ids=["cfg", "no-cfg"])
def test_request_mode_equals_the_torch_rollout_bit_for_bit(fp32_engine, model, setup, guidance):
    """float32: vLLM-omni's runner and transformer reproduce `qwen_image.rollout` bit for bit (same seeds, draws,
    windows, text width and batch composition), through vLLM-omni's transport; the trainer's recompute of the
    returned trajectories is exact (the step-1 check at the `exact` profile)."""
    cond = _conditioning(guidance)
    requests, prompts = _requests(setup, cond, guidance=guidance)
    outputs = fp32_engine.request_wave(requests)
    trajectory = _trajectory([(r.request_id, o) for r, o in zip(requests, outputs, strict=True)][::-1], prompts)
    reference = _torch_rollout(model, cond, guidance)
    for name in ("latents", "log_probs", "timesteps", "final_latents"):
        assert getattr(trajectory, name).dtype == torch.float32
        assert torch.equal(getattr(trajectory, name), getattr(reference, name)), name
    assert trajectory.seeds == tuple(SEEDS) and trajectory.provenance["execution"] == "request"
    with torch.no_grad():
        trainer = recompute_log_probs(model, trajectory)
    report = gate(
        trajectory.log_probs, trainer, timesteps=trajectory.timesteps, profile="exact", compute_dtype="float32"
    )
    assert report.passed, report.reasons


def test_the_envelope_survives_vllm_omnis_serialiser_bit_for_bit(fp32_engine, setup):
    requests, _ = _requests(setup, _conditioning(3.0))
    output = fp32_engine.request_wave(requests[:2])[0]
    sent = output.output["payload"]["trajectory"]
    got = _transported(output).output["payload"]["trajectory"]
    assert got["format"] == vo.ENVELOPE_FORMAT and got["fields"] == sent["fields"]
    tensors = [(name, got[name], sent[name]) for name in ("latents", "log_probs", "timesteps")]
    tensors += [(name, got["tensors"][name], value) for name, value in sent["tensors"].items()]
    for name, a, b in tensors:
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got["latents"].dtype == torch.float32


def test_step_mode_with_requests_joining_at_step_2(fp32_step_engine, model, setup):
    """Continuous batching: two requests join at engine step 2, so forwards mix requests at different steps.
    Each request's rows then run in other batch compositions than the trainer's, so the figures are gated
    (float32 `kernel` profile), not compared bit for bit."""
    cond = _conditioning(3.0)
    windows = [SDEWindow(0, 2, 6), SDEWindow(0, 2, 6), SDEWindow(3, 2, 6), SDEWindow(3, 2, 6)]
    requests, prompts = _requests(setup, cond, window=windows)
    results = fp32_step_engine.step_batches(requests, arrivals=[0, 0, 2, 2])
    assert list(results)[:2] == [requests[0].request_id, requests[1].request_id]  # the joiners finish last
    trajectory = _trajectory(list(results.items()), prompts)
    assert trajectory.provenance["execution"] == "step" and trajectory.windows == tuple(windows)
    with torch.no_grad():
        trainer = recompute_log_probs(model, trajectory)
    report = gate(
        trajectory.log_probs, trainer, timesteps=trajectory.timesteps, profile="kernel", compute_dtype="float32"
    )
    assert report.passed, report.reasons
    overall = report.metrics.overall
    print(f"fp32 step mode vs fp32 trainer: approx_kl {overall.approx_kl:.3g}, max |dlogp| {overall.max_abs_dlogp:.3g}")


def test_a_bf16_engine_passes_the_kernel_profile_against_a_bf16_trainer(bf16_engine, bf16_dir, setup):
    """bf16 on both sides, different transformer implementations (vLLM-omni's vs diffusers'): not bit-exact,
    within the `kernel` profile's bf16 limits."""
    cond = _conditioning(3.0)
    requests, prompts = _requests(setup, cond)
    outputs = bf16_engine.request_wave(requests)
    trajectory = _trajectory([(r.request_id, o) for r, o in zip(requests, outputs, strict=True)], prompts)
    assert trajectory.latents.dtype == torch.float32
    trainer_model = load_qwen_image(bf16_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        trainer = recompute_log_probs(trainer_model, trajectory)
    report = gate(
        trajectory.log_probs, trainer, timesteps=trajectory.timesteps, profile="kernel", compute_dtype="bfloat16"
    )
    assert report.passed, report.reasons
    overall = report.metrics.overall
    print(
        f"bf16 CPU engine vs bf16 trainer: approx_kl {overall.approx_kl:.3g}, max |dlogp| {overall.max_abs_dlogp:.3g}"
    )


def test_a_request_with_bad_settings_fails_alone_and_names_itself(fp32_engine, fp32_step_engine, setup):
    cond = _conditioning(3.0)
    requests, _ = _requests(setup, cond)
    bad = requests[1].prompt["additional_information"][vo.PAYLOAD_KEY]["request"]
    bad["version"] = 99
    outputs = fp32_engine.request_wave(requests[:2])
    assert outputs[0].error is None and outputs[0].output["payload"]["trajectory"]["request"]["sample_index"] == 0
    assert outputs[1].error.startswith(f"request {requests[1].request_id}: ") and "version" in outputs[1].error
    # A request without any settings (a plain prompt) is refused too, in step mode as well.
    plain = OmniDiffusionRequest(
        prompt={"prompt": "a red cat"},
        sampling_params=OmniDiffusionSamplingParams(height=HEIGHT, width=WIDTH, num_inference_steps=6),
        request_id=f"0_{uuid.uuid4()}",
    )
    result = fp32_step_engine.step_batches([plain], arrivals=[0])[plain.request_id]
    assert result.error and plain.request_id in result.error, result.error


# ---------------------------------------------------------------------- the client: failed requests
class _OmniAfterAFailedRequest:
    """`vllm_omni.Omni` as vLLM-omni 0.30.0's `Omni.generate` behaves when a request fails: it raises vLLM's
    `EngineGenerateError` with the request's error text and closes the engine before re-raising
    (entrypoints/omni.py). The multi-process `Omni` itself cannot start here; the error text is the one the
    real runner returned for a bad request (the test above)."""

    def __init__(self, error_text: str):
        self.error_text = error_text
        self.calls = 0
        self.closed = 0

    def generate(self, prompts, sampling_params, use_tqdm=False):
        self.calls += 1
        self.close()
        raise EngineGenerateError(self.error_text)

    def close(self):
        self.closed += 1


@pytest.fixture(scope="module")
def real_error_text(fp32_engine, setup):
    requests, _ = _requests(setup, _conditioning(3.0))
    requests[0].prompt["additional_information"][vo.PAYLOAD_KEY]["request"]["version"] = 99
    return fp32_engine.request_wave(requests[:1])[0].error


def _client(model_dir, omni):
    return vo.VllmOmniRollout(model_dir, dtype="float32", max_num_seqs=4, engine=omni)


def _rollout_call(client, setup):
    return client.rollout(
        qwen_image.FAMILY,
        None,
        _conditioning(3.0),
        scheduler_setup=setup,
        requests=BatchRequests(seeds=SEEDS, windows=WINDOW, prompt_groups=GROUPS),
        sampling=SamplingSettings(noise_level=0.7, guidance_scale=3.0),
        options=_options(),
    )


def test_a_failed_request_is_named_and_the_closed_engine_is_never_reused(fp32_dir, real_error_text, setup):
    """Regression (defect b): the error used to escape as vLLM's EngineGenerateError (the `output.error` branch
    never ran) and every later call went to the engine vLLM-omni had closed."""
    omni = _OmniAfterAFailedRequest(real_error_text)
    client = _client(fp32_dir, omni)
    with pytest.raises(vo.VllmOmniRequestError, match=r"sample 0 \(seed 11, request 0_") as failed:
        _rollout_call(client, setup)
    assert "version" in str(failed.value) and isinstance(failed.value.__cause__, EngineGenerateError)
    assert client.closed
    with pytest.raises(vo.VllmOmniEngineClosedError, match="shut it down after a failed request"):
        _rollout_call(client, setup)
    assert omni.calls == 1 and omni.closed >= 1


def test_the_check_turns_a_failed_request_into_a_fail_naming_it(fp32_dir, real_error_text):
    """Through the checker: the batch whose request failed, and every batch after it (closed engine), FAIL with
    the reason, instead of the check crashing."""
    from rollout_consistency import CheckConfig
    from rollout_consistency.gate.sides.backends import build_backend, run_batch
    from rollout_consistency.gate.sides.plan import make_plan
    from rollout_consistency.gate.sides.vllm_omni_rollout import VllmOmniSide

    config = CheckConfig(
        num_prompts=2, num_images_per_prompt=2, rollout_batch_size=2, num_inference_steps=6, height=HEIGHT, width=WIDTH
    )
    backend = replace(
        build_backend(config.sides),
        rollout_engine=VllmOmniSide(_client(fp32_dir, _OmniAfterAFailedRequest(real_error_text))),
    )
    first, second = (run_batch(backend, batch) for batch in make_plan(config.sides))
    assert first.problems and "sample 0 (seed" in first.problems[0] and "version" in first.problems[0]
    assert second.problems and "closed" in second.problems[0]
