"""The doctor's step fit on each side's own schedule and at the CFG stage: a shift recovered only where a base the
field builds from reproduces every sigma; a side's table reproduced on its own shifted schedule, or with its own CFG
combination (diffusers' guidance_rescale, a renorm, predictions rounded to bfloat16); and evidence that says only
what the replay measured (each template with a case where its claim would be false)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from rollout_consistency.gate.diagnosis import sigma_schedules, step_fit
from rollout_consistency.gate.diagnosis.localise import Localisation, StageDiff
from rollout_consistency.gate.diagnosis.localised_causes import from_localisation

STEPS = 4


def diffusers_sigmas(**config) -> list[float]:
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    if config.get("use_dynamic_shifting"):
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / STEPS, STEPS), mu=1.0)
    else:
        scheduler.set_timesteps(STEPS)
    return [float(s) for s in scheduler.sigmas]


def sd3_time_shift(shift, t):  # DanceGRPO's
    return (shift * t) / (1 + (shift - 1) * t)


def by_step(sigmas) -> dict[int, float]:
    return dict(enumerate(sigmas[:STEPS]))


@pytest.mark.parametrize(
    ("sigmas", "shift"),
    [
        (diffusers_sigmas(shift=3.0), 3.0),  # SD3's static shift
        (diffusers_sigmas(shift=1.0), 1.0),
        (diffusers_sigmas(use_dynamic_shifting=True), math.e),  # FLUX's dynamic shifting, mu 1
        ([float(s) for s in sd3_time_shift(3.0, torch.linspace(1, 0, STEPS + 1))], 3.0),
    ],
)
def test_a_shift_is_recovered_where_a_base_reproduces_every_sigma(sigmas, shift):
    recovered = sigma_schedules.recover_shift(by_step(sigmas), STEPS)
    assert recovered is not None and recovered[0] == pytest.approx(shift, rel=1e-5)


def test_no_shift_is_claimed_for_a_schedule_built_another_way():
    # Qwen-Image's terminal stretch, one perturbed entry, a single informative entry: no base reproduces them all.
    stretched = diffusers_sigmas(use_dynamic_shifting=True, shift_terminal=0.02)
    perturbed = diffusers_sigmas(shift=3.0)
    perturbed[2] += 1e-4
    for sigmas in (stretched, perturbed):
        assert sigma_schedules.recover_shift(by_step(sigmas), STEPS) is None
        assert "shift" not in sigma_schedules.describe(by_step(sigmas), STEPS, 1)
    assert sigma_schedules.recover_shift({0: 1.0, 1: 0.9}, STEPS) is None


# ----------------------------------------------------------------------------------------------------
def combine(cond, uncond, change: dict) -> torch.Tensor:
    """The combined prediction as users' code computes it (written here, apart from the step fit's own maths)."""
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

    if change.get("rounding") == "outputs":
        cond, uncond = cond.to(torch.bfloat16), uncond.to(torch.bfloat16)
    v = uncond + 4.5 * (cond - uncond)
    if "guidance_rescale" in change:
        v = rescale_noise_cfg(v.view(1, -1), cond.view(1, -1), guidance_rescale=change["guidance_rescale"]).view(-1)
    if "cfg_renorm" in change:
        v = v * (change["cfg_renorm"] * cond.norm() / v.norm())
    if "cfg_renorm_max" in change:  # Lumina's renorm_cfg
        max_new_norm = change["cfg_renorm_max"] * cond.norm()
        if v.norm() >= max_new_norm:
            v = v * (max_new_norm / v.norm())
    return v.double()


def make_units(change: dict, sigmas, *, seed: int = 0) -> list[step_fit.UnitData]:
    """Units whose log-probs are those of the SDE step at noise level 0.7 on `sigmas` time-shifted by
    ``change["shift"]`` (if given), with the prediction combined as `change` says."""
    generator = torch.Generator().manual_seed(seed)
    units = []
    shifted = sigma_schedules.shift_schedule(sigmas, change.get("shift", 1.0))
    for _ in range(3):
        for step in range(1, STEPS):
            x = torch.randn(64, generator=generator, dtype=torch.float64)
            cond, uncond = (torch.randn(64, generator=generator, dtype=torch.float64) for _ in range(2))
            v = combine(cond, uncond, change)
            a, b, std = step_fit.transition(shifted[step], shifted[step + 1], shifted[1], 0.7, "sde")
            mean = a * x + b * v
            x_next = mean + std * torch.randn(64, generator=generator, dtype=torch.float64)
            log_prob = float(
                -((x_next - mean) ** 2).mean() / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
            )
            units.append(step_fit.UnitData(x, (cond, uncond), (1, 16, 4), x_next, step, log_prob))
    return units


PLAN = diffusers_sigmas(shift=3.0)
BASE = step_fit.StepSettings(0.7, "sde", guidance=4.5)


def test_the_step_fit_reproduces_a_side_on_its_own_shifted_schedule():
    fit = step_fit.fit_side(make_units({"shift": 0.4}, PLAN), BASE, PLAN)
    assert fit.baseline_error > 1e-3  # on the plan's schedule the side is not reproduced
    assert fit.settings.shift == pytest.approx(0.4, rel=1e-4) and fit.error < 1e-7, fit


@pytest.mark.parametrize(
    "change",
    [dict(guidance_rescale=0.7), dict(cfg_renorm=8.0), dict(cfg_renorm_max=5.7), dict(rounding="outputs")],
    ids=lambda c: next(iter(c)),
)
def test_the_step_fit_finds_the_sides_cfg_combination(change):
    units = make_units(change, PLAN)
    if "cfg_renorm_max" in change:  # a clamp that holds some units and not others: no one scale reproduces it
        ratios = [float(combine(*u.outputs, {}).norm() / u.outputs[0].norm()) for u in units]
        assert min(ratios) < 5.7 < max(ratios), ratios
    fit = step_fit.fit_side(units, BASE, PLAN)
    assert fit.error < 1e-7 < fit.baseline_error, fit
    for name, value in change.items():
        assert getattr(fit.settings, name) == (value if isinstance(value, str) else pytest.approx(value, rel=1e-3))


# ----------------------------------------------------------------------------------------------------
# Evidence: each template, and a case where its claim would be false.
def fitted(settings: step_fit.StepSettings, error: float) -> dict:
    return step_fit.SideFit(settings, error, error, 8, relative_error=error).to_dict()


def diagnosis(rollout, trainer, *, passes=(2, 2), config=None, rounded=None, sigmas=PLAN):
    facts = {
        "source": "replay of both sides' own code",
        "compared_forwards": 16,
        "passes": {"rollout": [passes[0]], "trainer": [passes[1]]},
        "replay": {"rollout_max_abs": 0.0, "trainer_max_abs": 0.0},
        "step_fit": {
            "rollout": rollout,
            "trainer": trainer,
            "disagreement": 1e-3,
            "rollout_next_rounded": rounded,
            "sigmas": sigmas,
        },
    }
    return from_localisation(Localisation(stages=(), facts=facts), config or {})


def test_an_unreproduced_table_claims_no_sample_it_did_not_see():
    # The trainer's table is not reproduced: the replay did not see what the trainer scored, so no line may say it.
    found = diagnosis(fitted(BASE, 1e-8), fitted(BASE, 5e-4))
    text = " ".join(found.evidence)
    assert found.cause == "different-computation"
    assert "no candidate setting tried (" in text
    assert "other than the one" not in text and "stepped on" not in text and "bfloat16 values" not in text


def test_a_rounded_sample_is_claimed_only_where_the_replay_measured_it():
    measured = diagnosis(fitted(BASE, 5e-4), fitted(BASE, 1e-8), rounded="bfloat16")
    assert measured.cause == "bf16-latents"
    assert any("are all exactly bfloat16 values" in e for e in measured.evidence)
    unmeasured = diagnosis(fitted(BASE, 5e-4), fitted(BASE, 1e-8), config={"rollout_dtype": "float32"})
    assert unmeasured.cause == "different-computation"
    assert not any("bfloat16 values" in e or "dtype" in e for e in unmeasured.evidence)


def test_the_cfg_stage_line_says_which_part_differs_and_only_with_two_passes():
    trainer = dataclasses.replace(BASE, guidance_rescale=0.7)
    found = diagnosis(fitted(BASE, 1e-8), fitted(trainer, 1e-8))
    line = next(e for e in found.evidence if e.startswith("CFG stage"))
    assert found.cause == "guidance-mismatch"
    assert "conditional and unconditional predictions agree bit for bit" in line and "(guidance_rescale)" in line
    assert "the trainer's uncond + 4.5·(cond − uncond), rescaled by guidance_rescale 0.7" in line
    # One forward per step (DanceGRPO's embedded guidance): there is no conditional / unconditional pair to speak of.
    single = dataclasses.replace(BASE, guidance=None)
    found = diagnosis(
        fitted(single, 1e-8), fitted(dataclasses.replace(single, rounding="outputs"), 1e-8), passes=(1, 1)
    )
    assert found.cause == "prediction-precision"
    assert not any("conditional" in e or "CFG" in e for e in found.evidence)
    assert any(
        "the rollout's is unrounded, the trainer's rounded to bfloat16 before the step" in e for e in found.evidence
    )
    # Another cause (a noise level): no line about the CFG stage.
    found = diagnosis(fitted(BASE, 1e-8), fitted(dataclasses.replace(BASE, noise_level=0.8), 1e-8))
    assert found.cause == "noise-level-mismatch" and not any("CFG stage" in e for e in found.evidence)


def test_the_fitted_schedules_name_a_shift_only_where_it_is_recovered():
    dance = [float(s) for s in sd3_time_shift(3.0, torch.linspace(1, 0, STEPS + 1))]
    found = diagnosis(fitted(BASE, 1e-8), fitted(dataclasses.replace(BASE, shift=1 / 3), 1e-8), sigmas=dance)
    line = next(e for e in found.evidence if e.startswith("the step's sigmas"))
    assert found.cause == "schedule-shift"
    assert "the rollout's from shift 3 over linspace(1, 0, 5)" in line and "the trainer's from shift 1 over" in line
    # SD3's static shift: a third of its odds is not diffusers' shift-1 schedule (another base): no shift claimed.
    found = diagnosis(fitted(BASE, 1e-8), fitted(dataclasses.replace(BASE, shift=1 / 3), 1e-8))
    line = next(e for e in found.evidence if e.startswith("the step's sigmas"))
    assert "the rollout's from shift 3 over" in line and "the trainer's from σ₁=" in line, line
    # On Qwen-Image's stretched schedule no base reproduces the sigmas: the line quotes them, it claims no shift.
    stretched = diffusers_sigmas(use_dynamic_shifting=True, shift_terminal=0.02)
    facts_fit = dict(rollout=fitted(BASE, 1e-8), trainer=fitted(dataclasses.replace(BASE, shift=1.5), 1e-8))
    loc = Localisation(
        stages=(),
        facts={
            "passes": {"rollout": [2], "trainer": [2]},
            "step_fit": {**facts_fit, "disagreement": 1e-3, "sigmas": stretched},
        },
    )
    found = from_localisation(loc, {})
    line = next(e for e in found.evidence if e.startswith("the step's sigmas"))
    assert found.cause == "schedule-shift" and " shift " not in line and "σ₁=" in line, line


def test_timesteps_of_two_schedules_are_a_shift_only_where_the_sigmas_say_so():
    def cause(rollout, trainer):
        fed = {"steps": STEPS, "rollout": by_step(rollout), "trainer": by_step(trainer)}
        facts = {
            "passes": {"rollout": [2], "trainer": [2]},
            "fed_sigmas": {k: v if k == "steps" else {str(i): s for i, s in v.items()} for k, v in fed.items()},
        }
        stage = StageDiff("inputs.timestep", 100.0, 0.1, step=1, row=0)
        return from_localisation(Localisation(stages=(stage,), facts=facts), {})

    found = cause(diffusers_sigmas(shift=3.0), diffusers_sigmas(shift=1.0))
    assert found.cause == "schedule-shift"
    line = next(e for e in found.evidence if "different schedules" in e)
    assert "the rollout's sigmas from shift 3 over" in line and "the trainer's from shift 1 over" in line
    # Timesteps rounded to bfloat16 on one side are no shift: nothing is read into them.
    stretched = diffusers_sigmas(use_dynamic_shifting=True, shift_terminal=0.02)
    rounded = [float(torch.tensor(v).bfloat16()) for v in stretched]
    found = cause(stretched, rounded)
    assert found.cause == "model-input" and not any("shift" in e for e in found.evidence)


def _schedule_guard_reason(trainer_scheduler, asked: float) -> str:
    """The check's ``schedule`` reason for a trainer whose scheduler is asked for `asked` (its real error)."""
    from rollout_consistency.gate.judging.verdict import unscorable_reason
    from rollout_consistency.schedulers import TimestepNotInScheduleError

    with pytest.raises(TimestepNotInScheduleError) as raised:
        trainer_scheduler.step_sigmas(torch.tensor([asked, asked]), 2)
    return unscorable_reason("trainer_backend 'actor.py:make_trainer'", raised.value.missing, raised.value.schedule)


def test_the_schedule_guard_names_the_shift_each_side_was_set_up_with():
    """A trainer whose scheduler cannot look up the rollout's timesteps scored nothing; its `schedule` reason is
    read back to which mu (dynamic shifting) or shift each side's schedule was built with — named only where the
    rebuilt schedule holds every timestep — or to what could not be told."""
    from rollout_consistency.adapters import get_family
    from rollout_consistency.gate.diagnosis.schedule_guard import from_schedule_guard
    from rollout_consistency.schedulers import SchedulerSetup

    qwen = dict(get_family("qwen-image").scheduler_config)
    settings = {"model_family": "qwen-image", "num_inference_steps": STEPS}
    rollout = SchedulerSetup.for_pipeline(qwen, STEPS, image_seq_len=4).build()
    stored = [float(t) for t in rollout.timesteps[1:3]]
    # The actor's mu from the sequence length before packing (16 tokens, not 4).
    actor = SchedulerSetup.for_pipeline(qwen, STEPS, image_seq_len=16).build()
    found = from_schedule_guard(_schedule_guard_reason(actor, stored[0]), settings, stored)
    assert found.cause == "schedule-shift" and found.kind == "guard", found
    assert "qwen-image's scheduler with mu 0.4873 (calculate_shift of 4 image tokens)" in found.evidence[1]
    assert "the trainer's with mu 0.4879 (calculate_shift of 16 image tokens)" in found.evidence[1]
    # A static shift (SD3's 3.0, the trainer's config left at 1.0), over diffusers' own set_timesteps(N).
    sd3 = dict(get_family("sd3").scheduler_config)
    rollout = SchedulerSetup(sd3, STEPS).build()
    stored = [float(t) for t in rollout.timesteps[1:]]
    trainer = SchedulerSetup({**sd3, "shift": 1.0}, STEPS).build()
    found = from_schedule_guard(_schedule_guard_reason(trainer, stored[0]), {**settings, "model_family": "sd3"}, stored)
    assert found.cause == "schedule-shift", found
    assert "sd3's scheduler with shift 3 over set_timesteps(4); the trainer's with shift 1 over" in found.evidence[1]
    # The trainer's scheduler holds the rollout's schedule, but it asks for a timestep rounded to bfloat16.
    rollout = SchedulerSetup.for_pipeline(qwen, STEPS, image_seq_len=4).build()
    stored = [float(t) for t in rollout.timesteps[1:3]]
    rounded = float(torch.tensor(stored[0]).bfloat16().float())
    found = from_schedule_guard(_schedule_guard_reason(rollout, rounded), settings, stored)
    assert found.cause == "model-input" and "is in the trainer's schedule" in found.evidence[1], found
    # Another number of steps: no mu of the config gives the trainer's 6 timesteps; said, not guessed.
    six = SchedulerSetup.for_pipeline(qwen, 6, image_seq_len=4).build()
    found = from_schedule_guard(_schedule_guard_reason(six, stored[0]), settings, stored)
    assert found.cause == "different-computation", found
    assert "not recovered: the trainer's timesteps are of no mu of qwen-image's scheduler config" in found.evidence[1]
    # Not a schedule reason at all.
    assert from_schedule_guard("trainer_backend 'x': something else", settings, stored) is None
