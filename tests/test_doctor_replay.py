"""The doctor's replay of the sides the user gave: hooks only, always removed, the user's model state untouched;
a side without a model falls back to the figures and says so; a trainer plug-in behind the built-in rollout is
replayed as itself (not the built-in trainer code on its model)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout_consistency import CheckConfig, Report, run_step1_check
from rollout_consistency.adapters import recompute_log_probs
from rollout_consistency.adapters.tiny import load_qwen_image
from rollout_consistency.gate.diagnosis.replay import core_names, preserved_state, record_calls, replay_batch
from rollout_consistency.gate.diagnosis.settings import DiagnosisSettings
from rollout_consistency.gate.sides.plan import make_plan

CORPUS = Path(__file__).resolve().parent / "doctor_corpus"
SMALL = dict(num_prompts=2, num_images_per_prompt=2, rollout_batch_size=4, num_inference_steps=4, progress=False)


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_record_calls_removes_its_hooks_even_when_the_forward_raises():
    model = load_qwen_image()
    before = _hooks(model)
    with pytest.raises(AttributeError), record_calls(model) as calls:
        model(hidden_states=torch.zeros(1, 4, 16))  # missing arguments: the user's forward fails
    assert _hooks(model) == before and calls == []


class TouchyTrainer:
    """A trainer plug-in that flips its model to train mode, unfreezes it and draws from every global RNG."""

    def __init__(self, config):
        self.model = load_qwen_image()
        self.model.requires_grad_(False)
        self.model.proj_out.requires_grad_(True)

    def __call__(self, trajectory, *, micro_batch_size):
        self.model.train()
        self.model.requires_grad_(True)
        torch.rand(3), np.random.rand(), random.random()
        return recompute_log_probs(self.model, trajectory)


def make_touchy_trainer(config):
    return TouchyTrainer(config)


def test_the_replay_leaves_the_users_model_and_rng_state_as_it_found_them():
    config = CheckConfig(trainer_backend=f"{__file__}:make_touchy_trainer", **SMALL)
    batch = make_plan(config.sides)[0]
    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    replay = replay_batch(DiagnosisSettings.from_config(config), batch)
    model = replay.trainer_model
    assert not any(m.training for m in model.modules())  # eval, as built, although the plug-in called .train()
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["proj_out.weight", "proj_out.bias"]
    assert _hooks(model) == 0 and _hooks(replay.rollout_model) == 0
    assert torch.equal(torch.get_rng_state(), states[0])
    assert np.array_equal(np.random.get_state()[1], states[1]) and random.getstate() == states[2]
    assert replay.trainer.calls and replay.rollout.calls  # it did watch both sides


def test_preserved_state_restores_on_an_exception():
    model = load_qwen_image()
    rng = torch.get_rng_state()
    with pytest.raises(RuntimeError), preserved_state([model]):
        model.train()
        torch.rand(5)
        raise RuntimeError("the user's code failed")
    assert not model.training and torch.equal(torch.get_rng_state(), rng)


class NoiseLevelTrainer:
    """A trainer plug-in behind the built-in rollout that re-scores with noise_level 0.8 (the rollout's is 0.7)."""

    def __init__(self, config):
        self.model = load_qwen_image()

    def __call__(self, trajectory, *, micro_batch_size):
        return recompute_log_probs(self.model, dataclasses.replace(trajectory, noise_level=0.8))


def make_noise_level_trainer(config):
    return NoiseLevelTrainer(config)


class Unwatched(NoiseLevelTrainer):
    def __init__(self, config):
        self.hidden = load_qwen_image()  # scores with a model it does not expose as `model`

    def __call__(self, trajectory, *, micro_batch_size):
        return recompute_log_probs(self.hidden, dataclasses.replace(trajectory, noise_level=0.8))


def make_unwatched_trainer(config):
    return Unwatched(config)


def test_a_trainer_plugin_behind_the_built_in_rollout_is_replayed_as_itself():
    # The replay once ran the built-in trainer code on the plug-in's model here and found no stage differing.
    report = run_step1_check(CheckConfig(trainer_backend=f"{__file__}:make_noise_level_trainer", **SMALL))
    top = report.diagnosis[0]
    assert not report.passed and top["cause"] == "noise-level-mismatch", top
    assert top["source"] == "localisation"
    fit = top["details"]["facts"]["step_fit"]
    assert fit["rollout"]["settings"]["noise_level"] == pytest.approx(0.7, rel=1e-4)
    assert fit["trainer"]["settings"]["noise_level"] == pytest.approx(0.8, rel=1e-4)


def test_a_side_without_a_model_falls_back_to_the_figures_and_says_so():
    report = run_step1_check(CheckConfig(trainer_backend=f"{__file__}:make_unwatched_trainer", **SMALL))
    assert not report.passed and report.diagnosis
    assert all(d["source"] != "localisation" for d in report.diagnosis)
    evidence = " ".join(e for d in report.diagnosis for e in d["evidence"])
    assert "not localised: the trainer plug-in exposes no `model`" in evidence


def test_a_model_of_two_experts_is_not_replayed_half_watched():
    # Wan 2.2's experts are two transformers in one module: hooks on the first alone would miss every forward of
    # the second, so the replay names the experts instead of comparing half the calls.
    config = CheckConfig(model_family="wan", boundary_ratio=0.875, **SMALL)
    found = replay_batch(DiagnosisSettings.from_config(config), make_plan(config.sides)[0])
    assert found == "the rollout's model holds 2 transformers (transformer, transformer_2: experts); the replay " + (
        "watches one transformer per side"
    )
    assert core_names(load_qwen_image()) == [""]


def test_a_batch_invariant_side_is_watched_as_the_side_calls_it():
    # The fixed-shape proxy runs the transformer on probe batches (a row repeated, rows negated) and pads chunks
    # with copies of a row: watched at the transformer, those looked like a second CFG pass (guidance-mismatch).
    report = run_step1_check(CheckConfig(inject="mask-sum-rope", batch_invariant=True, **SMALL))
    top = report.diagnosis[0]
    assert top["cause"] == "mask-sum-rope" and top["source"] == "localisation", top
    assert top["details"]["facts"]["passes"] == {"rollout": [1], "trainer": [1]}


def test_a_failed_experts_guard_is_not_replayed_over():
    # The experts guard records which network each side scored every step with: no replay is needed, and one
    # (here a trainer plug-in that also scores with another noise level) must not rank above that record.
    from rollout_consistency.gate.diagnosis.doctor import diagnose_check

    report = Report.from_json((Path(__file__).parent / "doctor_reports" / "expert-switch.json").read_text())
    config = CheckConfig(trainer_backend=f"{__file__}:make_noise_level_trainer", **{**SMALL, "num_prompts": 4})
    causes = diagnose_check(report, DiagnosisSettings.from_config(config), make_plan(config.sides)).diagnosis
    assert causes[0]["cause"] == "expert-switch", causes
    assert all(d["source"] != "localisation" for d in causes)
    assert "not localised: the experts guard records" in " ".join(e for d in causes for e in d["evidence"])


def test_a_replay_that_raises_leaves_a_figures_diagnosis():
    from rollout_consistency.gate.diagnosis.localise import localise_check

    config = CheckConfig(trainer_backend=f"{CORPUS / 'verl_omni_noise_level.py'}:make_trainer", **SMALL)
    found = localise_check(
        DiagnosisSettings.from_config(config.replace(num_inference_steps=5)), make_plan(config.sides)[0]
    )
    assert isinstance(found, str) and found.startswith("the replay of the sides' code raised"), found


def test_cfg_passes_are_paired_by_their_text_not_their_order():
    """The rollout runs CFG as one [negative; positive] forward, the trainer as two forwards, positive first: each
    trainer forward is compared with the rollout's pass of the same text."""
    from rollout_consistency.gate.diagnosis.call_match import match_calls, pair_passes
    from rollout_consistency.gate.diagnosis.replay import ModelCall

    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 8, generator=generator, dtype=torch.float64)
    negative, positive = torch.zeros(2, 4, dtype=torch.float64), torch.randn(2, 4, generator=generator).double()
    step = torch.full((4, 1), 500.0, dtype=torch.float64)

    def call(index, rows, text):
        inputs = {"inputs.latents": latents.repeat(rows // 2, 1), "inputs.timestep": step[:rows]}
        return ModelCall(index, rows, inputs={**inputs, "inputs.conditioning": text})

    rollout = [call(0, 4, torch.cat([negative, positive]))]
    trainer = [call(0, 2, positive), call(1, 2, negative)]
    matching = match_calls(rollout, trainer, n=2)
    assert sorted(matching.units) == [(0, 0), (1, 0)] and not matching.unmatched
    for unit in matching.units.values():
        pairs, left, extra = pair_passes(unit, rollout, trainer)
        assert len(pairs) == 2 and not left and not extra
        for r, t in pairs:
            mine = rollout[r.call].inputs["inputs.conditioning"][r.row]
            assert torch.equal(mine, trainer[t.call].inputs["inputs.conditioning"][t.row])
