# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Plug-in backends, weight fingerprints and the step-2 weight-sync check, end to end on the tiny model.

The plug-ins are the reference integrations under scripts/examples/ (a flow_grpo-style loop with a peft
LoRA policy, a verl-omni-style actor); every check compares the same code on the same float32 inputs, so
`exact` (bit for bit) is the contract.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollout_consistency import CheckConfig, run_step1_check
from rollout_consistency.gate.config import ConfigError
from rollout_consistency.gate.sides.plugins import compare_fingerprints, fingerprints, weights_fingerprint

EXAMPLES = Path(__file__).resolve().parents[1] / "scripts" / "examples"
FLOW_GRPO = f"{EXAMPLES / 'flow_grpo_style.py'}:"
VERL = f"{EXAMPLES / 'verl_omni_style.py'}:"
SMALL = dict(num_prompts=1, num_images_per_prompt=2, rollout_batch_size=2, num_inference_steps=4, progress=False)


def no_sync(trainer, rollout):
    """A weight sync that forgets to copy: the rollout keeps sampling the old policy."""


def test_plugin_trainer_passes_and_step2_load_state_dict_passes():
    report = run_step1_check(CheckConfig(trainer_backend=VERL + "make_trainer", weight_sync="load_state_dict", **SMALL))
    assert report.passed, report.reasons
    assert report.metrics.overall.max_abs_dlogp == 0.0
    weights = report.run["weights"]
    assert weights["rollout"]["sha256"] == weights["trainer"]["sha256"]
    step2 = report.run["step2"]
    assert step2["update_max_abs_dlogp"] > 0  # the update changed the policy: step 2 tested something
    assert step2["max_abs_dlogp"] == 0.0 and step2["status"] == "PASS"
    assert step2["weights_after"]["rollout"]["sha256"] != step2["weights_before"]["rollout"]["sha256"]


def test_plugin_trainer_off_by_one_entry_fails_exact():
    report = run_step1_check(CheckConfig(trainer_backend=VERL + "make_biased_trainer", **SMALL))
    assert not report.passed
    assert report.metrics.overall.max_abs_dlogp > 0
    assert any(r.startswith("max_abs_dlogp:") for r in report.reasons)


def test_stale_weights_rollout_fails_step2_naming_weight_sync():
    report = run_step1_check(CheckConfig(weight_sync=f"{__file__}:no_sync", **SMALL))
    assert not report.passed
    (reason,) = [r for r in report.reasons if r.startswith("weight_sync:")]
    assert "weight sync" in reason and "old policy" in reason
    assert report.run["step2"]["status"] == "FAIL" and report.run["step2"]["max_abs_dlogp"] > 0


def test_flow_grpo_lora_plugins_pass_with_peft_sync():
    pytest.importorskip("peft")
    report = run_step1_check(
        CheckConfig(
            rollout_backend=FLOW_GRPO + "make_rollout",
            trainer_backend=FLOW_GRPO + "make_trainer",
            weight_sync="peft",
            **SMALL,
        )
    )
    assert report.passed, report.reasons
    # Shuffled samples and per-sample timestep permutations re-score the stored steps bit for bit.
    assert report.metrics.overall.max_abs_dlogp == 0.0
    assert report.run["step2"]["sync_result"]["bound_modules"] > 0
    assert report.run["step2"]["rollout_lora"]["active"] > 0


def test_lora_bound_to_no_module_fails_naming_weight_sync():
    pytest.importorskip("peft")
    report = run_step1_check(
        CheckConfig(
            rollout_backend=FLOW_GRPO + "make_rollout_renamed_lora",
            trainer_backend=FLOW_GRPO + "make_trainer",
            weight_sync="peft",
            **SMALL,
        )
    )
    assert not report.passed
    (reason,) = [r for r in report.reasons if r.startswith("weight_sync:")]
    assert "weight sync 'peft' is broken" in reason and "no module" in reason
    assert report.run["step2"]["sync_result"]["bound_modules"] == 0


def test_fingerprints_flag_different_weights_and_skip_other_layouts():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    problems, _ = compare_fingerprints(fingerprints(a, b))
    assert problems and "different weights" in problems[0]
    b.load_state_dict(a.state_dict())
    assert compare_fingerprints(fingerprints(a, b))[0] == []
    problems, notes = compare_fingerprints(fingerprints(a, torch.nn.Linear(4, 3).to(torch.bfloat16)))
    assert problems == [] and "not compared" in notes[0]
    big = torch.nn.Linear(2048, 1024)  # > 2**20 elements: sampled + sum/norm, still sees one changed weight
    before = weights_fingerprint(big)
    with torch.no_grad():
        big.weight[1000, 17] += 1e-3
    after = weights_fingerprint(big)
    assert not before["exact"] and before["sha256"] != after["sha256"]


def test_bad_plugin_spec_is_a_one_line_usage_error():
    with pytest.raises(ConfigError, match="trainer_backend 'no_such_module:make'"):
        run_step1_check(CheckConfig(trainer_backend="no_such_module:make", **SMALL))
    with pytest.raises(ConfigError, match="weight_sync"):
        CheckConfig(weight_sync="rsync")


def test_cli_takes_a_plugin_spec(capsys):
    from rollout_consistency.cli import main

    args = ["check", "--trainer-backend", VERL + "make_trainer", "--num-prompts", "1", "--num-inference-steps", "4"]
    args += ["--num-images-per-prompt", "2", "--rollout-batch-size", "2", "--no-progress"]
    assert main(args) == 0
    assert "trainer_backend plug-in" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# a newcomer's first plug-in (issue 24): the template, one module for both sides, Flow-GRPO's SDE on every step


def test_plugin_template_writes_a_pair_that_passes(tmp_path, capsys):
    from rollout_consistency.cli import main

    path = tmp_path / "my_plugins.py"
    assert main(["plugin-template", str(path)]) == 0
    assert main(["plugin-template", str(path)]) == 2  # never overwritten
    assert "exists" in capsys.readouterr().err
    config = tmp_path / "step1.toml"  # Flow-GRPO's SDE on every step is one setting, in a config file too
    config.write_text('sde_window_size = "all"\nnum_prompts = 1\nnum_images_per_prompt = 2\nrollout_batch_size = 2\n')
    sides = ["--rollout-backend", f"{path}:make_rollout", "--trainer-backend", f"{path}:make_trainer"]
    small = ["check", "--no-progress", "--num-inference-steps", "3", *sides]
    assert main([*small, "--config", str(config), "--json", str(tmp_path / "r.json")]) == 0, capsys.readouterr()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["status"] == "PASS" and report["metrics"]["overall"]["max_abs_dlogp"] == 0.0
    assert [s["window_size"] for s in report["samples"]] == [3, 3]  # every step stored and re-scored
    # Without the setting the template says which one it needs, instead of a windows FAIL found by reading code.
    assert main([*small, "--num-prompts", "1", "--num-images-per-prompt", "1", "--rollout-batch-size", "1"]) == 2
    assert "run the check with --sde-window-size all" in capsys.readouterr().err


# What a newcomer breaks in each family's template: for SD3 the trainer scores the stored next sample rounded to
# bf16 (the newcomer trial's break); for FLUX its noise level is off by 10 %; for Wan 2.2 it loads only the
# high-noise expert (one network for every step). Qwen-Image's template (the default) is run and broken by
# test_plugin_template_writes_a_pair_that_passes and the localisation test below.
TEMPLATE_BREAKS = {
    "sd3": (
        'prev_sample=sample["next_latents"][:, j],',
        'prev_sample=sample["next_latents"][:, j].bfloat16().float(),',
    ),
    "flux": ("noise_level=self.config.noise_level,", "noise_level=self.config.noise_level * 1.1,"),
    "wan": (
        "        self.scheduler = setup.scheduler()\n",
        "        self.scheduler = setup.scheduler()\n        self.model = self.model.transformer\n",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TEMPLATE_BREAKS))
def test_plugin_template_of_each_family_passes_as_written_and_fails_when_broken(family, tmp_path, capsys):
    """`plugin-template --family F` writes a pair that PASSes bit for bit on F's tiny model (Wan: two experts, the
    `experts` guard compared step by step), and the same file with the trainer broken FAILs."""
    from rollout_consistency.cli import main

    path = tmp_path / f"{family.replace('-', '_')}_sides.py"
    assert main(["plugin-template", "--family", family, str(path)]) == 0
    assert f"--model-family {family}" in capsys.readouterr().err
    text = path.read_text()
    assert f'FAMILY = "{family}"' in text
    settings = dict(SMALL, num_inference_steps=3, sde_window_size="all", model_family=family)
    if family == "wan":
        settings.update(boundary_ratio=0.875, num_frames=5)  # timesteps 1000 | 834.7, 24.4: both experts
    config = CheckConfig(rollout_backend=f"{path}:make_rollout", trainer_backend=f"{path}:make_trainer", **settings)
    report = run_step1_check(config)
    assert report.passed and report.metrics.overall.max_abs_dlogp == 0.0, report.reasons
    checks = {c.name: c for c in report.verdict.checks}
    if family == "wan":
        assert checks["experts"].passed
        used = {name for row in report.run["experts"] for name in row["rollout"]}
        assert used == {"transformer", "transformer_2"}, report.run["experts"]
    else:
        assert "experts" not in checks  # no experts, nothing claimed
    written, broken = TEMPLATE_BREAKS[family]
    head, found, tail = text.rpartition(written)
    assert found and "class Trainer" in head  # the last one is the trainer's
    broken_path = tmp_path / f"broken_{path.name}"
    broken_path.write_text(head + broken + tail)
    report = run_step1_check(
        config.replace(rollout_backend=f"{broken_path}:make_rollout", trainer_backend=f"{broken_path}:make_trainer")
    )
    assert not report.passed and report.metrics.overall.max_abs_dlogp > 1e-3
    if family == "wan":
        assert not {c.name: c for c in report.verdict.checks}["experts"].passed
    top = report.diagnosis[0]
    if top["source"] == "localisation":  # the replay ran both plug-ins: its fix never says to run them again
        assert "--rollout-backend" not in top["fix"], top


def test_a_template_for_another_family_names_the_setting_it_needs(tmp_path, capsys):
    from rollout_consistency.cli import main

    path = tmp_path / "sd3_plugins.py"
    assert main(["plugin-template", "--family", "sd3", str(path)]) == 0
    sides = ["--rollout-backend", f"{path}:make_rollout", "--trainer-backend", f"{path}:make_trainer"]
    assert main(["check", "--no-progress", "--sde-window-size", "all", *sides]) == 2  # model_family qwen-image
    assert "run the check with --model-family sd3" in capsys.readouterr().err
    assert main(["plugin-template", "--family", "sdxl"]) == 2


def test_a_plugin_file_is_imported_once_with_its_folder_importable(tmp_path):
    """The issue's first and third tries: `import` of a neighbour failed, and the two sides got two copies of the
    file's module, so state the trainer read from the rollout was missing (an IndexError deep in user code)."""
    import sys

    from rollout_consistency.cli import main

    assert main(["plugin-template", str(tmp_path / "flow_plugins.py")]) == 0
    (tmp_path / "my_loop.py").write_text(
        "import flow_plugins  # a neighbour of this file\n"
        "ROLLOUTS = []\n"
        "def make_rollout(config):\n"
        "    ROLLOUTS.append(flow_plugins.Rollout(config))\n"
        "    return ROLLOUTS[-1]\n"
        "def make_trainer(config):\n"
        "    trainer = flow_plugins.Trainer(config)\n"
        "    assert trainer.model is ROLLOUTS[0].model  # one module: the rollout's state is there\n"
        "    return trainer\n"
    )
    spec = str(tmp_path / "my_loop.py")
    report = run_step1_check(
        CheckConfig(
            rollout_backend=f"{spec}:make_rollout",
            trainer_backend=f"{spec}:make_trainer",
            sde_window_size="all",
            **{**SMALL, "num_inference_steps": 2},
        )
    )
    assert report.passed, report.reasons
    assert sys.modules["my_loop"].__file__ == spec and len(sys.modules["my_loop"].ROLLOUTS) == 1


def test_a_trainer_plugin_that_exposes_no_model_runs_beside_the_built_in_rollout(tmp_path):
    """`model` is optional: the schedule comes from the checker's own model, not the plug-in's (a plug-in without
    one stopped the check with "could not run (AttributeError: 'NoneType' object has no attribute 'config')")."""
    (tmp_path / "scorer.py").write_text(
        "from rollout_consistency.adapters import recompute_log_probs\n"
        "from rollout_consistency.adapters.tiny import load_qwen_image\n"
        "POLICY = load_qwen_image(seed=0)\n"
        "def make(config):\n"
        "    return lambda batch, micro_batch_size: recompute_log_probs(POLICY, batch)\n"
    )
    for batch_invariant in (False, True):
        config = CheckConfig(trainer_backend=f"{tmp_path / 'scorer.py'}:make", batch_invariant=batch_invariant, **SMALL)
        report = run_step1_check(config)
        assert report.passed, report.reasons
        assert report.run["weights"]["trainer"] is None  # nothing to fingerprint: said, not guessed


def test_a_template_pair_with_sde_on_every_step_is_localised_when_it_fails(tmp_path, capsys):
    """A newcomer's first break of the template (the trainer's noise level off by 10 %), with `sde_window_size
    "all"`: the doctor replays both plug-ins and names the noise level (its replay once read the setting's
    "all" as a number and gave up with a TypeError)."""
    from rollout_consistency.cli import main

    path = tmp_path / "my_plugins.py"
    assert main(["plugin-template", str(path)]) == 0
    rollout_part, setting, trainer_part = path.read_text().rpartition("noise_level=self.config.noise_level,")
    assert setting and "class Trainer" in rollout_part  # the last one is the trainer's step
    path.write_text(rollout_part + "noise_level=self.config.noise_level * 1.1," + trainer_part)
    sides = ["--rollout-backend", f"{path}:make_rollout", "--trainer-backend", f"{path}:make_trainer"]
    argv = ["check", "--no-progress", "--num-inference-steps", "3", "--sde-window-size", "all", *sides]
    assert main([*argv, "--num-prompts", "1", "--rollout-batch-size", "2", "--json", str(tmp_path / "r.json")]) == 1
    top = json.loads((tmp_path / "r.json").read_text())["diagnosis"][0]
    assert top["cause"] == "noise-level-mismatch" and top["source"] == "localisation", top


@pytest.mark.parametrize("side", ["rollout", "trainer"])
def test_an_exception_in_a_plugin_call_is_one_line_naming_the_plugin_and_the_call(side, tmp_path, capsys):
    """A newcomer's first own plug-in died with "could not run (IndexError: ...)", naming neither the plug-in
    nor the call, and `--debug` then said "please report it" as if the bug were ours."""
    from rollout_consistency.cli import main

    assert main(["plugin-template", str(tmp_path / "pair.py")]) == 0
    capsys.readouterr()
    broken = {"rollout": "def rollout(request):\n    return [0][6]\n", "trainer": "def trainer(batch):\n    [0][6]\n"}
    (tmp_path / "mine.py").write_text(
        f"from pair import make_rollout, make_trainer\n{broken[side]}def make(config):\n    return {side}\n"
    )
    sides = {"rollout": f"{tmp_path}/pair.py:make_rollout", "trainer": f"{tmp_path}/pair.py:make_trainer"}
    sides[side] = f"{tmp_path}/mine.py:make"
    argv = ["check", "--no-progress", "--num-inference-steps", "3", "--sde-window-size", "all", "--num-prompts", "1"]
    argv += ["--rollout-batch-size", "2", "--rollout-backend", sides["rollout"], "--trainer-backend", sides["trainer"]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{side}_backend '{sides[side]}'" in err[0] and "raised IndexError: list index out of range" in err[0]
    assert f"{side}(" in err[0] and "your code" in err[0]
