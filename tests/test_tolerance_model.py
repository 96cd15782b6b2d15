# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The tolerance model: what each profile promises, measured on null cases and on every pitfall.

The sweeps run on 2 seeds at tiny sizes (scripts/measure_floors.py runs 20); the limits they are judged
against are the shipped profiles, and the calibrated floor is measured in the same run.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from rollout_consistency import CheckConfig, run_step1_check
from rollout_consistency.gate.judging.metrics import compute_metrics
from rollout_consistency.gate.judging.tolerance_model import (
    combine_floors,
    difference_sources,
    exact_notice,
    exact_promised,
    rounding_advice,
)
from rollout_consistency.gate.judging.tolerances import resolve_tolerance
from rollout_consistency.gate.judging.verdict import decide
from rollout_consistency.schedulers import SDE_TYPES, FlowMatchSDEDiscreteScheduler
from rollout_consistency.schedulers.flow_grpo_step import FlowGRPOStep

# The false-alarm sweep is scripts/measure_floors.py's harness, beside it in scripts/ (not part of the package).
_SPEC = importlib.util.spec_from_file_location(
    "floor_sweep", Path(__file__).resolve().parents[1] / "scripts" / "floor_sweep.py"
)
floor_sweep = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("floor_sweep", floor_sweep)
_SPEC.loader.exec_module(floor_sweep)

TINY = CheckConfig(num_prompts=2, num_images_per_prompt=2, rollout_batch_size=4, progress=False)


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_flow_grpo_step_is_the_same_maths_up_to_float32_rounding(sde_type):
    scheduler = FlowMatchSDEDiscreteScheduler()
    scheduler.set_timesteps(6)
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(3, 16, 8, generator=generator)
    velocity = torch.randn(3, 16, 8, generator=generator)
    for timestep in scheduler.timesteps[:-1]:
        ref = scheduler.sample_previous_step(
            velocity, timestep, sample, noise_level=0.7, sde_type=sde_type, generator=generator
        )
        alt = FlowGRPOStep(scheduler).sample_previous_step(
            velocity, timestep, sample, noise_level=0.7, sde_type=sde_type, prev_sample=ref.prev_sample
        )
        assert alt.log_prob.dtype == torch.float32 and alt.log_prob.shape == (3,)
        # A few float32 ULP of log-probs of order 1: same maths, other operation order.
        torch.testing.assert_close(alt.log_prob, ref.log_prob, rtol=0, atol=1e-6)
        torch.testing.assert_close(alt.prev_sample_std, ref.prev_sample_std, rtol=1e-6, atol=0)


def test_sources_say_when_exact_is_promised():
    assert (
        difference_sources(TINY.judging) == () and exact_promised(TINY.judging) and exact_notice(TINY.judging) is None
    )
    cases = {
        "kernel": TINY.replace(trainer_attention="_native_math"),
        "batch composition": TINY.replace(micro_batch_size=2),
        "implementation": TINY.replace(trainer_step_implementation="flow-grpo"),
        "dtype": TINY.replace(trainer_dtype="bfloat16"),
    }
    for name, config in cases.items():
        assert [s.name for s in difference_sources(config.judging)] == [name]
        assert not exact_promised(config.judging) and "NOT promised" in exact_notice(config.judging)
    assert "--batch-invariant" in exact_notice(cases["batch composition"].judging)
    assert "--profile implementation" in exact_notice(cases["implementation"].judging)
    # Step-wise execution changes the composition of the rollout's forwards.
    assert [s.name for s in difference_sources(TINY.replace(step_execution=True).judging)] == ["batch composition"]
    # A rounding-sized difference is explained; a bug-sized one is not excused.
    assert "batch composition" in rounding_advice(cases["batch composition"].judging, 1.2e-7)
    assert "not noise" in rounding_advice(TINY.judging, 1.2e-7)
    assert rounding_advice(cases["kernel"].judging, 1e-3) is None and rounding_advice(TINY.judging, math.nan) is None


def test_a_plugin_side_is_no_source_of_difference_and_the_notice_states_what_exact_rests_on():
    """docs/checker.md: plug-ins default to `exact`, right when both sides run the same PyTorch code; the notice
    says so (not "NOT promised ... the trainer PyTorch" when the trainer is the user's code too)."""
    pair = TINY.replace(rollout_backend="my_loop.py:make_rollout", trainer_backend="my_loop.py:make_trainer")
    assert pair.resolved_profile == "exact" and difference_sources(pair.judging) == () and exact_promised(pair.judging)
    notice = exact_notice(pair.judging)
    assert notice.startswith("exact holds only if both sides run the same code on the same kernels")
    assert "the rollout and the trainer are plug-ins, whose kernels the checker cannot see" in notice
    assert "NOT promised" not in notice and "PyTorch" not in notice and "--profile kernel" in notice
    trainer_only = TINY.replace(trainer_backend="my_loop.py:make_trainer")
    assert "the trainer is a plug-in, whose kernels" in exact_notice(trainer_only.judging)
    # A registered engine is a kernel source; the trainer is named as it is, PyTorch only when it is built in.
    engine = TINY.replace(rollout_backend="vllm-omni", device="cuda", trainer_backend="my_loop.py:make_trainer")
    (kernel,) = difference_sources(engine.judging)
    assert kernel.detail == "the rollout engine is vllm-omni, the trainer 'my_loop.py:make_trainer'"
    assert "NOT promised" in exact_notice(engine.judging) and "the trainer is a plug-in" in exact_notice(engine.judging)
    assert difference_sources(TINY.replace(rollout_backend="vllm-omni", device="cuda").judging)[0].detail.endswith(
        "the trainer PyTorch"
    )
    # A rounding-sized exact FAIL with a plug-in side names both readings.
    advice = rounding_advice(pair.judging, 1.2e-7)
    assert "kernels the checker cannot see" in advice and "not noise" in advice


def test_exact_fail_at_a_few_ulp_names_the_difference_before_any_figure():
    report = run_step1_check(TINY.replace(trainer_step_implementation="flow-grpo"))
    table = report.format_table()
    assert table.index("NOT promised") < table.index("ratio_mean")
    assert not report.passed and 0 < report.metrics.overall.max_abs_dlogp <= 1e-5
    (advice,) = [r for r in report.reasons if r.startswith("exact:")]
    assert "rounding-sized" in advice and "implementation" in advice and "--profile implementation" in advice
    assert run_step1_check(TINY.replace(trainer_step_implementation="flow-grpo", profile="implementation")).passed


def test_pooled_profiles_gate_the_pooled_figure_and_still_name_noisy_steps():
    rollout = torch.zeros(4, 2, dtype=torch.float32)
    trainer = rollout.clone()
    trainer[0, 1] = 3e-4  # one noisy cell of 4 samples: mean |dlogp| 7.5e-5 at step 1, 3.75e-5 pooled
    metrics = compute_metrics(rollout, trainer, micro_batch_size=4)
    assert decide(metrics, resolve_tolerance("kernel", {"mean_abs_dlogp": 5e-5, "ppo_kl": 5e-5})).passed
    exact = decide(metrics, resolve_tolerance("exact"))
    assert not exact.passed
    over = decide(metrics, resolve_tolerance("kernel", {"mean_abs_dlogp": 3e-5, "ppo_kl": 5e-5}))
    (reason,) = [r for r in over.reasons if r.startswith("mean_abs_dlogp")]
    assert "reported, not gated" in reason and "step 1" in reason


def test_floors_combine_conservatively():
    a = compute_metrics([[0.0, 0.0]], [[1e-7, -1e-7]]).overall
    b = compute_metrics([[0.0, 0.0]], [[2e-7, 2e-7]]).overall
    both = combine_floors([a, b])
    assert both.mean_abs_dlogp == pytest.approx(a.mean_abs_dlogp + b.mean_abs_dlogp)
    assert both.max_abs_dlogp == pytest.approx(3e-7)
    assert both.approx_kl >= a.approx_kl + b.approx_kl
    assert both.ppo_kl >= abs(a.ppo_kl) + abs(b.ppo_kl) - 1e-18


def test_calibrated_floor_measures_every_source_in_the_configuration():
    config = TINY.replace(
        profile="calibrated",
        trainer_attention="_native_math",
        micro_batch_size=1,
        trainer_step_implementation="flow-grpo",
    )
    report = run_step1_check(config)
    assert report.passed, report.reasons
    basis = report.tolerance.basis
    assert "kernel + batch composition + implementation" in basis
    assert sum("calibrated floor," in n for n in report.notes) == 3


def test_null_cases_have_no_false_alarm_under_kernel_and_calibrated():
    results = floor_sweep.sweep(floor_sweep.null_cases(), range(2), base=TINY)
    assert floor_sweep.problems_of(results) == [], floor_sweep.format_results(results)
    for result in results:
        assert result.seeds == 2 and set(result.fails) == set(floor_sweep.SWEEP_PROFILES)
        if result.case.settings["rollout_dtype"] == "float32" or "implementation" in result.case.name:
            # Float32 rounding only: the implementation profile holds too.
            assert result.fails["implementation"] == 0, floor_sweep.format_results(results)


@pytest.mark.parametrize("name", ["mask-sum-rope", "per-request-window"])
def test_every_fast_pitfall_fails_every_tolerant_profile(name):
    (result,) = floor_sweep.sweep(floor_sweep.pitfall_cases([name]), range(2), base=TINY)
    assert all(result.fails[p] == 2 for p in floor_sweep.MUST_FAIL), floor_sweep.format_results([result])


@pytest.mark.parametrize("name", ["bf16-latents", "stepwise-bf16"])
def test_bf16_pitfalls_fail_every_tolerant_profile(name):
    # 256 px (the injection's own settings): one seed and two samples keep it to a few seconds.
    base = CheckConfig(num_prompts=1, num_images_per_prompt=2, rollout_batch_size=2, progress=False)
    (result,) = floor_sweep.sweep([floor_sweep.Case(name, "pitfall", {"inject": name})], range(1), base=base)
    assert all(result.fails[p] == 1 for p in floor_sweep.MUST_FAIL), floor_sweep.format_results([result])
    assert result.max_load["kernel"] > 4  # far outside the kernel limits, not a near miss (~8 measured)


def test_pooled_bias_fails_only_beyond_its_sampling_noise():
    """A mean over 4 samples of kernel noise is not zero: the pooled bias check allows 3 standard errors of the
    mean over samples. A bug's bias (the same in every sample) of the same size still fails."""
    rollout = torch.zeros(4, 2, dtype=torch.float32)
    noisy = torch.tensor([[6e-4, 6e-4], [-2e-4, -2e-4], [1.5e-4, 1.5e-4], [-0.5e-4, -0.5e-4]])
    consistent = torch.full((4, 2), float(noisy.mean()))
    kernel = resolve_tolerance("kernel")
    for trainer, passes in ((noisy, True), (consistent, False)):
        metrics = compute_metrics(rollout, trainer, micro_batch_size=4)
        assert abs(metrics.overall.ppo_kl) > kernel.limits["ppo_kl"]  # over the bare limit either way
        verdict = decide(metrics, kernel)
        assert {c.name: c.passed for c in verdict.checks}["ppo_kl"] is passes, verdict.reasons
    assert not decide(compute_metrics(rollout, noisy, micro_batch_size=4), resolve_tolerance("exact")).passed


def test_kernel_limits_follow_the_narrowest_dtype_in_play():
    """The published kernel floor is bf16's; with both sides in float32 the limits are 8x tighter, so a small
    float32 pitfall the bf16 limits would let through (mask-sum-rope at seed 10: ~0.7 of them) still FAILs."""
    bf16, fp32 = resolve_tolerance("kernel"), resolve_tolerance("kernel", compute_dtype="float32")
    assert all(fp32.limits[m] < bf16.limits[m] for m in bf16.limits)
    assert CheckConfig(rollout_dtype="bfloat16", trainer_dtype="float32").compute_dtype == "bfloat16"
    report = run_step1_check(TINY.replace(profile="kernel", seed=10, inject="mask-sum-rope"))
    assert not report.passed and "float32 kernels" in report.tolerance.basis
    assert decide(report.metrics, bf16).passed  # the bf16 limits alone would have missed it
