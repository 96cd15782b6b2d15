"""The step-1 check on the Wan family end to end (CPU, tiny, offline): Wan 2.2's two experts pass exactly with
the `experts` guard listed, the late expert switch (`--inject expert-switch`) FAILs naming the step and both
experts with the doctor's `expert-switch` first and its fix passes, and a saved Wan trajectory is re-scored
(trajectory mode), failing when the trainer holds one expert throughout."""

from __future__ import annotations

import json

import pytest
import torch

from rollout_consistency import CheckConfig, run_step1_check
from rollout_consistency.adapters import BatchRequests, SamplingSettings, wan
from rollout_consistency.adapters.tiny import load_wan, tiny_wan_prompt_encoder
from rollout_consistency.cli import main
from rollout_consistency.schedulers import SDEWindow

SMALL = dict(num_prompts=2, num_images_per_prompt=2, rollout_batch_size=4, progress=False)
TWO_EXPERTS = dict(model_family="wan", boundary_ratio=0.875, guidance_scale=4.0, guidance_scale_2=3.0)


def test_two_experts_pass_exactly_with_the_experts_guard():
    report = run_step1_check(CheckConfig(**TWO_EXPERTS, sde_window_range=(2, 5), **SMALL))
    assert report.passed, report.reasons
    assert report.metrics.overall.max_abs_dlogp == 0.0
    guard = {c.name: c for c in report.verdict.checks}["experts"]
    assert guard.kind == "guard" and guard.passed
    used = {row["timestep"]: (*row["rollout"], *row["trainer"]) for row in report.run["experts"]}
    assert set(used.values()) == {("transformer", "transformer"), ("transformer_2", "transformer_2")}
    assert all(names[0] == ("transformer" if t >= 875 else "transformer_2") for t, names in used.items())


def test_late_expert_switch_fails_naming_the_step_and_both_experts_and_its_fix_passes():
    report = run_step1_check(CheckConfig(inject="expert-switch", **SMALL))
    assert not report.passed
    (reason,) = [r for r in report.reasons if r.startswith("experts:")]
    assert "step 3 (t=771.431): rollout transformer, trainer transformer_2 (4 samples)" in reason
    assert report.diagnosis[0]["cause"] == "expert-switch"
    assert "boundary_ratio" in report.diagnosis[0]["fix"]
    at_switch = [s for s in report.metrics.by_timestep if s.values.max_abs_dlogp > 0]
    assert [round(s.timestep, 3) for s in at_switch] == [771.431]  # the other steps agree bit for bit

    fixed = run_step1_check(CheckConfig(model_family="wan", boundary_ratio=0.875, sde_window_range=(2, 5), **SMALL))
    assert fixed.passed, fixed.reasons


def test_stepwise_staggered_batch_invariant_wan_passes_on_the_cli(capsys):
    """Requests two per engine step: forwards hold rows on both sides of the boundary; batch-invariant mode keeps
    every sample's bits, so a trainer micro-batch of 1 reproduces them."""
    args = ["check", "--model-family", "wan", "--boundary-ratio", "0.875", "--step-execution", "--stagger-arrivals"]
    args += ["--batch-invariant", "--micro-batch-size", "1", "--num-prompts", "2", "--no-progress"]
    assert main(args) == 0, capsys.readouterr().out
    assert "experts ok" in capsys.readouterr().out


@pytest.fixture(scope="module")
def saved_wan_trajectory(tmp_path_factory):
    experts = load_wan(boundary_ratio=0.875)
    cond = tiny_wan_prompt_encoder(max_length=32).conditioning(["a red cat", "a red cat"], ["", ""])
    trajectory = wan.rollout(
        experts,
        cond,
        height=32,
        width=32,
        num_frames=13,
        num_inference_steps=6,
        guidance_scale_2=3.0,
        requests=BatchRequests(seeds=(7, 8), windows=SDEWindow(2, 2, 6), prompt_groups=(0, 0)),
        sampling=SamplingSettings(noise_level=0.7, sde_type="dance_sde", guidance_scale=4.0),
    )
    return trajectory.save(tmp_path_factory.mktemp("wan") / "wan.safetensors")


def test_trajectory_mode_rescores_a_wan_file_and_fails_a_one_expert_trainer(saved_wan_trajectory, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    args = ["check", "--trajectory", str(saved_wan_trajectory), "--no-progress"]
    assert main([*args, "--boundary-ratio", "0.875", "--json", str(report_path)]) == 0, capsys.readouterr().out
    assert json.loads(report_path.read_text())["run"]["experts"][-1]["trainer"] == ["transformer_2"]
    capsys.readouterr()
    # No boundary_ratio: the trainer's tiny model is one expert, `transformer` at every step (as a training
    # adapter that loads only the high-noise expert).
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "step 3 (t=771.431): rollout transformer_2, trainer transformer (2 samples)" in out
    assert "[expert-switch]" in out


def test_wan_conditioning_is_fixed_width_and_the_file_stays_float32(saved_wan_trajectory):
    from rollout_consistency.adapters import Trajectory

    loaded = Trajectory.load(saved_wan_trajectory)
    assert set(loaded.conditioning) == {"prompt_embeds", "negative_prompt_embeds"}
    assert loaded.conditioning["prompt_embeds"].shape == (2, 32, 32)
    assert all(t.dtype == torch.float32 for t in (loaded.latents, loaded.log_probs, loaded.timesteps))
    assert loaded.experts == (("transformer", "transformer_2"),) * 2
