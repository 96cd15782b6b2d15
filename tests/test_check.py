"""run_step1_check end to end on the tiny real models: clean setups pass, each pitfall fails with its
signature and its fix passes, kernels, trajectory mode, Ray workers (one Ray session), fail-closed paths."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys

import numpy as np
import pytest
import torch

import rollout_consistency.gate.check as check_module
from rollout_consistency import CheckConfig, ConfigError, Report, run_step1_check
from rollout_consistency.gate.check import injection_settings
from rollout_consistency.gate.sides.backends import BackendError, run_batch

QUICK = dict(progress=False, num_prompts=2, num_images_per_prompt=2, rollout_batch_size=2)


def failed(report: Report) -> set[str]:
    return {c.name for c in report.verdict.checks if not c.passed}


def assert_bit_exact_pass(report: Report) -> None:
    assert report.passed, report.format_table()
    overall = report.metrics.overall
    assert overall.max_abs_dlogp == 0 and overall.ratio_mean == 1 and overall.ppo_kl == 0
    assert overall.count == report.metrics.num_samples * report.metrics.num_positions > 0


# ---------------------------------------------------------------------------------------------- clean
def test_default_check_passes_exact_and_fills_the_report():
    report = run_step1_check(progress=False)
    assert_bit_exact_pass(report)
    assert report.tolerance.profile == "exact" and report.metrics.num_samples == 8
    assert [s.index for s in report.samples] == list(range(8))
    # Rollouts of a prompt group share the window drawn from the launcher's seed.
    for group in range(4):
        starts = {s.window_start for s in report.samples if s.prompt_group == group}
        assert len(starts) == 1
    assert report.run["mode"] == "in-process" and report.run["forwards"]["trainer"] > 0
    assert report.precision is not None and "differences" in report.precision
    assert report.config["model_family"] == "qwen-image"


@pytest.mark.parametrize("family", ["qwen-image", "sd3", "flux", "wan"])
@pytest.mark.parametrize("step_execution", [False, True], ids=["request-level", "step-wise"])
def test_clean_tiny_families_pass_exact(family, step_execution):
    report = run_step1_check(model_family=family, step_execution=step_execution, max_num_seqs=2, **QUICK)
    assert_bit_exact_pass(report)


def test_clean_setup_with_cfg_and_micro_batches_passes_exact():
    """Trainer micro-batches of 2 under rollout batches of 4 are another batch composition: `exact` is promised
    there in batch-invariant mode (on any CPU), not in the default mode (docs/checker.md)."""
    report = run_step1_check(
        true_cfg_scale=4.0,
        rollout_batch_size=4,
        micro_batch_size=2,
        sde_type="cps",
        batch_invariant=True,
        progress=False,
    )
    assert_bit_exact_pass(report)
    assert report.run["forwards"]["trainer"] == 2 * (8 // 2) * 2  # CFG doubles the forwards


def test_batch_invariant_micro_batches_that_do_not_divide_the_batch_pass_exact():
    """--batch-invariant --micro-batch-size 3 under rollout batches of 4 (micro-batches of 3 and 1): any size
    gives the same bits, so the divisibility rule of the default mode does not apply."""
    report = run_step1_check(rollout_batch_size=4, micro_batch_size=3, batch_invariant=True, progress=False)
    assert_bit_exact_pass(report)
    with pytest.raises(ConfigError, match="must divide rollout_batch_size 4"):
        run_step1_check(rollout_batch_size=4, micro_batch_size=3, progress=False)


def test_same_seeds_give_identical_reports():
    a = run_step1_check(noise_level=0.5, **QUICK)
    b = run_step1_check(noise_level=0.5, **QUICK)
    assert a.results_dict() == b.results_dict()
    c = run_step1_check(noise_level=0.5, seed=43, **QUICK)
    assert [s.seed for s in c.samples] != [s.seed for s in a.samples]


# ---------------------------------------------------------------------------------------------- pitfalls
def test_bf16_latents_fails_with_the_design_signature_and_its_fix_passes():
    report = run_step1_check(inject="bf16-latents", clip_ratio=1e-4, **QUICK)
    o = report.metrics.overall
    # The bf16-latent signature: ratio_mean below 1, clipping inflated and all of it on the lower side.
    assert o.ratio_mean < 1 and o.ppo_kl > 0
    assert o.pg_clipfrac_higher == 0 and o.pg_clipfrac_lower > 0
    assert {"ratio_mean", "ppo_kl", "pg_clipfrac_lower"} <= failed(report)
    assert any("bf16-latents" in n for n in report.notes)
    fixed = run_step1_check(**injection_settings("bf16-latents"), clip_ratio=1e-4, **QUICK)
    assert fixed.config["rollout_dtype"] == "bfloat16"
    assert_bit_exact_pass(fixed)
    assert fixed.mismatch.overall.k3_kl == 0 and fixed.mismatch.overall.ess == 1


def test_the_check_reports_the_mismatch_statistics_of_llm_trainers(tmp_path):
    """Reported beside the gated metrics (never gated), in the table, the JSON and the JUnit properties."""
    report = run_step1_check(inject="bf16-latents", **QUICK)
    stats, o = report.mismatch, report.metrics.overall
    assert stats.overall.count == o.count and stats.overall.max_abs_dlogp == pytest.approx(o.max_abs_dlogp)
    assert stats.overall.bias < 0 and stats.overall.bias_ci_high < 0  # the trainer's log-probs sit lower
    assert stats.overall.k3_kl > 0 and stats.overall.ess < 1
    assert len(stats.by_timestep) == len(report.metrics.by_timestep)
    assert "mismatch statistics" in report.format_table()
    assert Report.from_json(report.to_json()).mismatch == stats
    report.write_junit(tmp_path / "r.xml")
    assert 'name="mismatch.overall.k3_kl"' in (tmp_path / "r.xml").read_text()


def test_stepwise_bf16_fails_with_the_same_signature_and_its_fix_passes():
    report = run_step1_check(inject="stepwise-bf16", **QUICK)
    o = report.metrics.overall
    assert report.config["step_execution"] is True
    assert o.ratio_mean < 1 and o.pg_clipfrac_higher == 0 and o.pg_clipfrac_lower > 0
    assert_bit_exact_pass(run_step1_check(**injection_settings("stepwise-bf16"), **QUICK))


def test_stepwise_bf16_mixed_dtype_batch_is_a_fail_not_a_crash():
    # Staggered arrivals: a fresh float32 request joins running bf16 ones, which the stock engine cannot batch.
    settings = {**QUICK, "rollout_batch_size": 4}
    report = run_step1_check(inject="stepwise-bf16", stagger_arrivals=True, **settings)
    assert not report.passed and {"rollout", "nonempty"} <= failed(report)
    assert "Mixed dtypes in latents batch" in " ".join(report.reasons)
    assert_bit_exact_pass(run_step1_check(**injection_settings("stepwise-bf16"), stagger_arrivals=True, **settings))


def test_continuous_batching_with_staggered_arrivals_passes_exact():
    report = run_step1_check(
        step_execution=True, stagger_arrivals=True, max_num_seqs=4, rollout_batch_size=4, progress=False
    )
    assert_bit_exact_pass(report)


def test_mask_sum_rope_fails_and_its_fix_passes():
    report = run_step1_check(inject="mask-sum-rope", **QUICK)
    assert not report.passed and {"ppo_kl", "max_abs_dlogp"} <= failed(report)
    assert report.metrics.overall.max_abs_dlogp > 1e-6  # far above rounding: a different RoPE, not a kernel
    assert_bit_exact_pass(run_step1_check(**injection_settings("mask-sum-rope"), **QUICK))


def test_per_request_window_fails_structurally():
    report = run_step1_check(inject="per-request-window", num_prompts=2, num_images_per_prompt=4, progress=False)
    # The ratio stays 1 (the trainer re-scores the stored steps); the windows guard catches it.
    assert report.metrics.overall.max_abs_dlogp == 0
    assert "windows" in failed(report)
    assert "different SDE windows" in " ".join(report.reasons) or "did not use the window" in " ".join(report.reasons)


def test_per_request_window_injection_is_repeatable():
    """The reproduction draws each request's window from a generator seeded by the batch's seeds: the same check
    gives the same windows and figures twice (the stock code's own generator saw no seed; ours is the demo)."""
    settings = dict(inject="per-request-window", num_prompts=2, num_images_per_prompt=4, progress=False)
    first, second = run_step1_check(**settings), run_step1_check(**settings)
    starts = [sample.window_start for sample in first.samples]
    assert starts == [sample.window_start for sample in second.samples]
    assert len(set(starts)) > 1 and first.reasons == second.reasons


def test_per_request_window_on_the_stepwise_path_fails_too():
    report = run_step1_check(
        inject="per-request-window", step_execution=True, num_prompts=2, num_images_per_prompt=4, progress=False
    )
    assert "windows" in failed(report)


# ---------------------------------------------------------------------------------------------- kernels
def test_cross_kernel_fails_exact_passes_kernel_and_calibrated(monkeypatch):
    """Native vs math SDPA: `kernel` and `calibrated` pass; `exact` fails exactly when the two kernels differ on
    this machine (on some CPUs they agree bit for bit in this setting). The positive control that exists on
    every machine is an explicit perturbation of a few ULP of the real log-probs: `exact` fails it, `kernel`
    passes it."""
    settings = dict(rollout_attention="_native_math", trainer_attention="native", **QUICK)
    exact = run_step1_check(profile="exact", **settings)
    measured = exact.metrics.overall.max_abs_dlogp
    assert measured < 1e-5  # rounding-level: a kernel, not a bug
    assert exact.passed == (measured == 0) and ("max_abs_dlogp" in failed(exact)) == (measured > 0)
    kernel = run_step1_check(profile="kernel", **settings)
    assert kernel.passed, kernel.format_table()
    calibrated = run_step1_check(profile="calibrated", **settings)
    assert calibrated.passed, calibrated.format_table()
    floor = calibrated.tolerance.floor
    # The floor (trainer native vs trainer math on the stored inputs) is the rollout-vs-trainer difference itself:
    # the math-kernel rollout's log-prob of a stored step is the math-kernel trainer's.
    assert floor is not None and floor.max_abs_dlogp == measured
    assert calibrated.tolerance.limits["max_abs_dlogp"] == pytest.approx(4 * floor.max_abs_dlogp)

    # Positive control on every machine: the trainer's log-probs moved by 4 ULP (float32), same kernels.
    real = check_module.run_batch

    def four_ulp_off(backend, batch):
        result = real(backend, batch)
        moved = result.trainer_log_probs
        for _ in range(4):
            moved = np.nextafter(moved, np.float32(np.inf), dtype=np.float32)
        return dataclasses.replace(result, trainer_log_probs=moved)

    monkeypatch.setattr(check_module, "run_batch", four_ulp_off)
    control = run_step1_check(profile="exact", **QUICK)
    assert 0 < control.metrics.overall.max_abs_dlogp < 1e-5
    assert not control.passed and "max_abs_dlogp" in failed(control)
    assert run_step1_check(profile="kernel", **QUICK).passed


def test_calibrated_still_catches_a_real_bug():
    report = run_step1_check(profile="calibrated", inject="mask-sum-rope", **QUICK)
    assert not report.passed and "max_abs_dlogp" in failed(report)


def test_threshold_overrides_apply():
    # kernel profile: two attention kernels are not promised to agree bit for bit (the exact profile's guard).
    report = run_step1_check(
        rollout_attention="_native_math",
        profile="kernel",
        thresholds={
            "max_abs_dlogp": 1e-3,
            "mean_abs_dlogp": 1e-3,
            "ppo_kl": 1e-3,
            "ratio_mean": 1e-3,
            "ratio_std": 1e-3,
            "approx_kl": 1e-3,
        },
        **QUICK,
    )
    assert report.passed and report.tolerance.overridden
    assert report.tolerance.limits["max_abs_dlogp"] == 1e-3 and report.tolerance.limits["ppo_kl"] == 1e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the engine would start")
def test_vllm_omni_backend_without_the_package_or_a_gpu_names_the_fix(tmp_path):
    # Without vLLM-omni: the extra to install. With it (as `make test` installs it) but no GPU: the device.
    installed = importlib.util.find_spec("vllm_omni") is not None and importlib.util.find_spec("vllm") is not None
    fix = "needs a CUDA device" if installed else r"pip install 'rollout-consistency\[vllm\]'"
    with pytest.raises(BackendError, match=fix):
        run_step1_check(rollout_backend="vllm-omni", device="cuda", model_path=str(tmp_path), **QUICK)
    with pytest.raises(ConfigError, match="needs CUDA"):
        run_step1_check(rollout_backend="vllm-omni", **QUICK)
    with pytest.raises(ConfigError, match="rollout_backend 'torch'"):
        run_step1_check(rollout_backend="vllm-omni", device="cuda", inject="bf16-latents", **QUICK)


def test_unknown_attention_backend_is_a_usage_error():
    with pytest.raises(ConfigError, match="Did you mean '_native_math'"):
        run_step1_check(trainer_attention="_native_mat", **QUICK)


# ---------------------------------------------------------------------------------------------- trajectory mode
def _save_trajectory(tmp_path, name="t.safetensors", windows=None):
    from rollout_consistency import adapters
    from rollout_consistency.schedulers import draw_sde_window

    model = adapters.tiny.load_qwen_image(seed=0)
    encoder = adapters.tiny.TinyPromptEncoder(32, seed=0)
    window = windows or draw_sde_window(seed=1, global_step=0, prompt_group=0, num_steps=6, window_size=2)
    trajectory = adapters.qwen_image.rollout(
        model,
        encoder.conditioning(["a red cube", "a cat on a mat", "a dog", "a blue house"]),
        height=32,
        width=32,
        num_inference_steps=6,
        requests=adapters.BatchRequests(seeds=[1, 2, 3, 4], windows=window, prompt_groups=[0, 0, 1, 1]),
        sampling=adapters.SamplingSettings(noise_level=0.7),
    )
    path = tmp_path / name
    trajectory.save(path)
    return trajectory, path


def test_trajectory_mode_passes_a_clean_dump_and_names_a_corrupted_step(tmp_path):
    trajectory, path = _save_trajectory(tmp_path)
    report = run_step1_check(trajectory=str(path), progress=False)
    assert_bit_exact_pass(report)
    assert report.metrics.num_samples == 4 and any("trajectory" in n for n in report.notes)

    log_probs = trajectory.log_probs.clone()
    log_probs[2, 1] += 1e-4
    bad = dataclasses.replace(trajectory, log_probs=log_probs)
    bad.save(tmp_path / "bad.safetensors")
    report = run_step1_check(trajectory=str(tmp_path / "bad.safetensors"), progress=False)
    assert not report.passed
    check = next(c for c in report.verdict.checks if c.name == "max_abs_dlogp")
    assert check.steps == (1,) and report.metrics.by_sample[2].values.max_abs_dlogp > 0
    assert report.metrics.by_sample[0].values.max_abs_dlogp == 0


def test_trajectory_mode_of_a_vllm_omni_dump_needs_no_engine_and_keeps_the_kernel_profile(tmp_path):
    """A dump is re-scored by the trainer alone: naming the vLLM-omni rollout must not start (or require) it."""
    _, path = _save_trajectory(tmp_path)
    report = run_step1_check(trajectory=str(path), rollout_backend="vllm-omni", progress=False)
    assert report.passed and report.to_dict()["config"]["profile"] == "kernel"


def test_trajectory_mode_fails_split_group_windows(tmp_path):
    from rollout_consistency.schedulers import SDEWindow

    # Prompt group 0 split over two windows, as a per-request window draw does.
    windows = [SDEWindow(0, 2, 6), SDEWindow(3, 2, 6), SDEWindow(1, 2, 6), SDEWindow(1, 2, 6)]
    _, path = _save_trajectory(tmp_path, windows=windows)
    report = run_step1_check(trajectory=str(path), progress=False)
    assert report.metrics.overall.max_abs_dlogp == 0  # re-scoring is exact; the split is structural
    assert failed(report) == {"windows"}
    assert "group 0: starts [0, 3]" in report.reasons[0]


def test_trajectory_mode_bad_files_are_usage_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        run_step1_check(trajectory=str(tmp_path / "missing.safetensors"), progress=False)
    (tmp_path / "junk.safetensors").write_bytes(b"not a trajectory")
    with pytest.raises(ConfigError, match=r"junk.safetensors"):
        run_step1_check(trajectory=str(tmp_path / "junk.safetensors"), progress=False)


# ---------------------------------------------------------------------------------------------- fail closed
def test_nonfinite_trainer_output_fails(monkeypatch):
    real = check_module.run_batch

    def poisoned(backend, batch):
        result = real(backend, batch)
        trainer = result.trainer_log_probs.copy()
        trainer[0, 0] = np.nan
        return dataclasses.replace(result, trainer_log_probs=trainer)

    monkeypatch.setattr(check_module, "run_batch", poisoned)
    report = run_step1_check(**QUICK)
    assert not report.passed and "finite" in failed(report)
    batches = report.metrics.num_samples // QUICK["rollout_batch_size"]  # one NaN per batch
    assert report.mismatch.overall.count == report.metrics.overall.count - batches  # the statistics skip them
    assert report.mismatch.overall.max_abs_dlogp == 0


def test_missing_window_step_on_the_trainer_side_fails(monkeypatch):
    real = check_module.run_batch

    def truncated(backend, batch):
        result = real(backend, batch)
        return dataclasses.replace(result, trainer_log_probs=result.trainer_log_probs[:, :1].copy())

    monkeypatch.setattr(check_module, "run_batch", truncated)
    report = run_step1_check(**QUICK)
    assert not report.passed and "shapes" in failed(report) and report.metrics is None


def test_a_calibration_floor_of_another_shape_fails(monkeypatch):
    real = check_module.run_batch

    def short_floor(backend, batch):
        result = real(backend, batch)
        return dataclasses.replace(result, floor_log_probs=result.floor_log_probs[:1].copy())

    monkeypatch.setattr(check_module, "run_batch", short_floor)
    report = run_step1_check(profile="calibrated", **QUICK)
    assert not report.passed and "calibration" in failed(report)
    assert "floor cannot be compared" in " ".join(report.reasons)


# ---------------------------------------------------------------------------------------------- Ray
def _kill_batch_one(backend, batch):
    """Stands in for a worker that dies (segfault, OOM kill) on batch 1 — a real process exit."""
    if batch.index == 1:
        os._exit(3)
    return run_batch(backend, batch)


@pytest.fixture
def by_value(ray_session):
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray_session.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_one_and_two_ray_workers_give_the_in_process_report(ray_session):
    settings = dict(
        num_prompts=3, num_images_per_prompt=2, rollout_batch_size=2, progress=False, rollout_attention="_native_math"
    )  # non-zero figures, so equality means something
    local = run_step1_check(**settings)
    one = run_step1_check(workers=1, ray_address="auto", **settings)
    two = run_step1_check(workers=2, **settings)
    assert (one.run["mode"], one.run["workers"]) == ("ray", 1) and (two.run["mode"], two.run["workers"]) == ("ray", 2)
    assert local.metrics.overall.max_abs_dlogp > 0
    assert one.results_dict() == two.results_dict() == local.results_dict()


def test_a_worker_that_dies_is_retried_then_fails_naming_the_shard(ray_session, by_value, monkeypatch):
    monkeypatch.setattr(check_module, "run_batch", _kill_batch_one)
    report = run_step1_check(workers=2, num_prompts=3, num_images_per_prompt=2, rollout_batch_size=2, progress=False)
    assert not report.passed and failed(report) == {"workers"}
    (reason,) = report.reasons
    assert "shard 1 failed after 2 attempt(s)" in reason and "rollout batch 1 (samples 2-3" in reason
    assert report.metrics.num_samples == 4  # batches 0 and 2 still compared, and bit-exact
    assert report.metrics.overall.max_abs_dlogp == 0


def test_no_samples_is_impossible_to_configure():
    with pytest.raises(ConfigError, match="'num_prompts' must be >= 1"):
        CheckConfig(num_prompts=0)


def test_an_exact_fail_at_rounding_level_under_mixed_batch_compositions_names_batch_invariant(monkeypatch):
    """A few-ULP difference under `exact` with trainer micro-batches other than the rollout batch says it may come
    from batch composition and names --batch-invariant; with one batch composition it does not (the same
    4-ULP perturbation on every machine)."""
    real = check_module.run_batch

    def four_ulp_off(backend, batch):
        result = real(backend, batch)
        moved = result.trainer_log_probs
        for _ in range(4):
            moved = np.nextafter(moved, np.float32(np.inf), dtype=np.float32)
        return dataclasses.replace(result, trainer_log_probs=moved)

    monkeypatch.setattr(check_module, "run_batch", four_ulp_off)
    mixed = run_step1_check(**{**QUICK, "micro_batch_size": 1})
    assert not mixed.passed
    text = " ".join(mixed.reasons)
    assert "batch composition" in text and "--batch-invariant" in text and "micro-batches of 1" in text
    same = run_step1_check(**QUICK)
    assert not same.passed and "--batch-invariant" not in " ".join(same.reasons)
    # A real bug (far above rounding level) gets no such hint.
    monkeypatch.undo()
    bug = run_step1_check(inject="mask-sum-rope", **{**QUICK, "micro_batch_size": 1})
    assert not bug.passed and "--batch-invariant" not in " ".join(bug.reasons)
