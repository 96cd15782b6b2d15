"""rollout_consistency.gate.config: names users know, YAML/TOML files, precedence, clear errors."""

from __future__ import annotations

import re

import pytest

from rollout_consistency.gate.config import CheckConfig, ConfigError, load_config, read_config_file


def test_defaults_are_the_offline_tiny_check():
    config = CheckConfig()
    assert config.model_family == "qwen-image" and config.model_path is None
    assert config.rollout_backend == config.trainer_backend == "torch"
    assert config.resolved_profile == "exact"
    assert config.num_samples == 8 and len(config.resolved_prompts) == 4
    assert config.resolved_micro_batch_size == config.rollout_batch_size


def test_profile_defaults_to_kernel_for_vllm_omni():
    assert CheckConfig(rollout_backend="vllm-omni", device="cuda").resolved_profile == "kernel"


def test_yaml_toml_and_json_give_the_same_config(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "noise_level: 0.8\nsde_type: cps\nsde_window_size: 3\nsde_window_range: [1, 5]\n"
        "clip_ratio: 1e-5\nprofile: kernel\nthresholds:\n  ppo_kl: 5e-5\n  pg_clipfrac: off\n"
    )
    (tmp_path / "c.toml").write_text(
        'noise_level = 0.8\nsde_type = "cps"\nsde_window_size = 3\nsde_window_range = [1, 5]\n'
        'clip_ratio = 1e-5\nprofile = "kernel"\n[thresholds]\nppo_kl = 5e-5\npg_clipfrac = "off"\n'
    )
    (tmp_path / "c.json").write_text(
        '{"noise_level": 0.8, "sde_type": "cps", "sde_window_size": 3, "sde_window_range": [1, 5], '
        '"clip_ratio": 1e-5, "profile": "kernel", "thresholds": {"ppo_kl": 5e-5, "pg_clipfrac": "off"}}'
    )
    a, b = load_config(tmp_path / "c.yaml"), load_config(tmp_path / "c.toml")
    assert a == b == load_config(tmp_path / "c.json")
    assert a.clip_ratio == 1e-5 and a.sde_window_range == (1, 5)  # PyYAML's "1e-5" string is accepted
    assert a.thresholds == {"ppo_kl": 5e-5, "pg_clipfrac": None}


def test_check_table_and_flag_precedence(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[check]\nnoise_level = 0.5\nseed = 7\n[check.thresholds]\nppo_kl = 1e-4\napprox_kl = 1e-9\n")
    config = load_config(path, seed=11, thresholds={"ppo_kl": 2e-4})
    assert config.noise_level == 0.5 and config.seed == 11
    assert config.thresholds == {"ppo_kl": 2e-4, "approx_kl": 1e-9}  # per-metric merge


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"noise_levl": 0.7}, "unknown setting 'noise_levl'. Did you mean 'noise_level'"),
        ({"clip_range": 1e-4}, "calls that setting 'clip_ratio'"),
        ({"noise-level": 0.7}, "Did you mean 'noise_level'"),
        ({"zzz": 1}, "unknown setting 'zzz'"),
        ({"sde_type": "SDE"}, "Did you mean 'sde'"),
        ({"noise_level": "high"}, "'noise_level' must be a finite number"),
        ({"noise_level": 0.0}, "nothing to check"),
        ({"num_inference_steps": 2.5}, "must be an integer"),
        ({"step_execution": "yes"}, "true or false"),
        ({"sde_window_size": 9}, "exceeds num_inference_steps"),
        ({"sde_window_range": [3, 2]}, "sde_window_range"),
        ({"micro_batch_size": 3}, "divide rollout_batch_size"),
        ({"thresholds": {"ppo_kll": 1}}, "Did you mean 'ppo_kl'"),
        ({"thresholds": {"ppo_kl": -1}}, ">= 0"),
        ({"profile": "exactly"}, "Did you mean 'exact'"),
        ({"inject": "bf16"}, "bf16-latents"),
        ({"rollout_backend": "vllm-omni"}, "needs CUDA"),
        ({"prompts": "a cat"}, "list of non-empty strings"),
        ({"trajectory": "t.safetensors", "inject": "bf16-latents"}, "trajectory mode"),
    ],
)
def test_bad_settings_name_the_fix(settings, match):
    with pytest.raises(ConfigError, match=match):
        CheckConfig.from_mapping(settings)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_config_file(tmp_path / "nope.yaml")
    (tmp_path / "c.ini").write_text("")
    with pytest.raises(ConfigError, match=r"\.yaml, \.yml, \.toml or \.json"):
        read_config_file(tmp_path / "c.ini")
    (tmp_path / "twice.json").write_text('{"seed": 1, "seed": 2}')
    with pytest.raises(ConfigError, match="'seed' is given twice"):
        read_config_file(tmp_path / "twice.json")
    (tmp_path / "bad.json").write_text('{"seed": }')
    with pytest.raises(ConfigError, match="could not be parsed"):
        read_config_file(tmp_path / "bad.json")
    (tmp_path / "bad.toml").write_text("noise_level = = 1")
    with pytest.raises(ConfigError, match="could not be parsed"):
        read_config_file(tmp_path / "bad.toml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        read_config_file(tmp_path / "list.yaml")
    (tmp_path / "typo.yaml").write_text("sde_windows_size: 2\n")
    with pytest.raises(
        ConfigError, match=r"typo.yaml: unknown setting 'sde_windows_size'. Did you mean 'sde_window_size'"
    ):
        read_config_file(tmp_path / "typo.yaml")
    assert read_config_file(_empty(tmp_path)) == {}


def _empty(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    return path


def test_replace_validates_and_to_dict_is_json_able():
    import json

    config = CheckConfig().replace(prompts=["a", "b"], sde_window_range=[0, 3])
    assert config.prompts == ("a", "b") and config.resolved_prompts == ("a", "b", "a", "b")
    json.dumps(config.to_dict())
    with pytest.raises(ConfigError, match="Did you mean 'seed'"):
        config.replace(sed=1)
    assert CheckConfig.from_mapping(config.to_dict()) == config


def test_name_lists_agree_with_the_modules_they_mirror():
    """config keeps torch-free copies of these names; they must not drift from the modules that define them."""
    from rollout_consistency.adapters.pitfalls import INJECTION_NAMES
    from rollout_consistency.gate.config import INJECTIONS, SDE_TYPES, WINDOW_KINDS
    from rollout_consistency.schedulers import SDE_TYPES as SCHEDULER_SDE_TYPES
    from rollout_consistency.schedulers.sde_window import WINDOW_KINDS as SCHEDULER_WINDOW_KINDS

    assert INJECTIONS == INJECTION_NAMES
    assert SDE_TYPES == SCHEDULER_SDE_TYPES and WINDOW_KINDS == SCHEDULER_WINDOW_KINDS


def test_a_plugin_file_named_in_a_config_file_is_found_beside_the_config_file(tmp_path, monkeypatch):
    """`rollout_backend = "sides.py:make_rollout"` in configs/step1.toml names configs/sides.py, wherever the
    command runs from; module specs and absolute paths are kept as written."""
    folder = tmp_path / "configs"
    (folder / "sub").mkdir(parents=True)
    for name in ("sides.py", "sub/trainer.py"):
        (folder / name).write_text("def make(config): ...\n")
    absolute = f"{folder / 'sides.py'}:make_rollout"
    elsewhere = tmp_path / "ci-job"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a CI job runs from another folder
    (folder / "step1.toml").write_text(
        'rollout_backend = "sides.py:make_rollout"\ntrainer_backend = "sub/trainer.py:make"\n'
        'weight_sync = "my_pkg.sync:load"\n'
    )
    (folder / "step1.yaml").write_text(f"rollout_backend: {absolute}\ntrainer_backend: ./sub/trainer.py:make\n")
    toml, yaml = load_config(folder / "step1.toml"), load_config(folder / "step1.yaml")
    assert toml.rollout_backend == absolute == yaml.rollout_backend
    assert toml.trainer_backend == f"{folder / 'sub' / 'trainer.py'}:make" == yaml.trainer_backend
    assert toml.weight_sync == "my_pkg.sync:load"  # a module spec is imported, not a path
    # On the command line (an override, not the file) a relative path stays relative to the working directory.
    assert load_config(folder / "step1.toml", trainer_backend="t.py:make").trainer_backend == "t.py:make"


def test_a_plugin_file_missing_beside_the_config_file_names_the_path_tried_and_its_folder(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sides.py").write_text("def make(config): ...\n")  # where the user thought the path pointed
    (folder / "step1.toml").write_text('trainer_backend = "sides.py:make"\n')
    with pytest.raises(ConfigError) as error:
        load_config(folder / "step1.toml")
    message = str(error.value)
    assert f"trainer_backend 'sides.py:make': {folder / 'sides.py'} does not exist" in message
    assert f"relative to the config file's folder, {folder}" in message
    assert f"sides.py is in the working directory: write its path relative to {folder}" in message
    assert "\n" not in message


def test_a_plugin_file_missing_on_the_command_line_names_the_working_directory(tmp_path, monkeypatch):
    from rollout_consistency.safeguards.object_spec import SpecError, load_object

    monkeypatch.chdir(tmp_path)
    tried = re.escape(str(tmp_path / "sides.py"))
    with pytest.raises(SpecError, match=rf"looked for {tried}: relative to the working directory"):
        load_object("sides.py:make")
    with pytest.raises(SpecError, match=rf"the working directory {re.escape(str(tmp_path))} first"):
        load_object("no_such_sides_module:make")


# ----------------------------------------------------------------------------------------------------
# One place per setting's facts: each field's `Setting` generates its coercion, its checks, BOUNDS and the flag.
def _check_parser():
    import argparse

    from rollout_consistency.commands import check

    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    return {a.dest: a for a in parser._actions}


def test_every_setting_has_its_facts_and_its_annotation_agrees():
    """Every field carries a `Setting` whose kind matches the field's annotation (the integer fields are one
    derived fact: `INT_FIELDS`), and `optional` exactly where the annotation allows None."""
    import dataclasses

    from rollout_consistency.gate.config import INT_FIELDS, KINDS, SETTINGS, SPEC_FIELDS

    by_annotation = {"int": "int", "float": "float", "bool": "bool", "str": "str", "int | str": "window_size"}
    fields = dataclasses.fields(CheckConfig)
    assert list(SETTINGS) == [f.name for f in fields]
    for f in fields:
        setting = SETTINGS[f.name]
        assert setting.kind in KINDS and setting.help, f.name
        base = f.type.removesuffix(" | None")
        assert by_annotation.get(base, setting.kind) == setting.kind, (f.name, f.type, setting.kind)
        assert setting.optional == f.type.endswith(" | None"), f.name
        assert (f.default is None) <= setting.optional, f.name
    assert "micro_batch_size" in INT_FIELDS and "seed" in INT_FIELDS and "sde_window_size" not in INT_FIELDS
    assert SPEC_FIELDS == ("rollout_backend", "trainer_backend", "weight_sync")


def test_a_field_without_its_setting_is_refused():
    import dataclasses

    from rollout_consistency.gate.config import settings_of

    planted = dataclasses.make_dataclass("Planted", [("seed", int, dataclasses.field(default=1))])
    with pytest.raises(TypeError, match=r"Planted.seed has no Setting"):
        settings_of(planted)


def test_the_check_command_flags_are_generated_from_the_settings():
    """Each setting is one flag whose help, type and choices are its `Setting`'s (a flag dropped, a help or a
    type written elsewhere, fails here)."""
    import argparse

    from rollout_consistency.gate.config import SETTINGS

    actions = _check_parser()
    for name, setting in SETTINGS.items():
        action = actions.get(name)
        assert action is not None, f"no flag for {name}"
        assert action.option_strings[0] == (setting.flag or "--" + name.replace("_", "-")), name
        assert action.help.startswith(setting.help), name
        if setting.kind == "bool":
            assert isinstance(action, argparse.BooleanOptionalAction), name
        elif setting.choices and not setting.spec:
            assert tuple(action.choices) == tuple(setting.choices), name
        elif setting.kind in ("int", "float", "str"):
            assert action.type is {"int": int, "float": float, "str": str}[setting.kind], name
    assert set(actions) >= set(SETTINGS)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--num-prompts", "3", "--no-progress", "--clip-ratio", "2e-4"], {"num_prompts": 3, "clip_ratio": 2e-4}),
        (["--sde-window-size", "all", "--sde-window-range", "0", "6"], {"sde_window_size": "all"}),
        (["--micro-batch-size", "2", "--profile", "kernel"], {"micro_batch_size": 2, "profile": "kernel"}),
        (["--prompt", "a", "--prompt", "b", "--threshold", "ppo_kl=off"], {"prompts": ("a", "b")}),
        (["--weight-sync", "pkg.mod:sync", "--boundary-ratio", "0.5"], {"weight_sync": "pkg.mod:sync"}),
    ],
)
def test_generated_flags_build_the_config(argv, expected):
    import argparse

    from rollout_consistency.commands import check

    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    config = check.config_from_args(parser.parse_args(argv))
    assert {name: getattr(config, name) for name in expected} == expected


def _beyond(name: str, high: float) -> dict:
    """Settings with `name` just above its bound (and what lets that value reach the bound check)."""
    value = high + 1 if isinstance(high, int) else high * 2
    extra = {"micro_batch_size": {"batch_invariant": True}}.get(name, {})
    return {name: value, **extra}


def test_every_bound_is_checked_and_documented():
    """Each `Setting.bounds` refuses the value above it with the documented message, and docs/checker.md's table
    names exactly the bounded settings (a bound dropped or added on one side only fails here)."""
    from pathlib import Path

    from rollout_consistency.gate.config import BOUNDS, SETTINGS

    assert {name: s.bounds for name, s in SETTINGS.items() if s.bounds is not None} == BOUNDS
    for name, (_low, high) in BOUNDS.items():
        if name == "sde_window_size":  # above num_inference_steps' own bound: refused as exceeding it
            continue
        with pytest.raises(ConfigError, match=rf"setting '{name}' is .*; it must lie in \["):
            CheckConfig(**_beyond(name, high))
    text = (Path(__file__).resolve().parents[1] / "docs" / "checker.md").read_text()
    table = text[text.index("| setting | bounds |") :].split("\n\n")[0]
    documented = set(re.findall(r"`(\w+)`", table))
    assert documented == set(BOUNDS)
    numeric = {name for name, s in SETTINGS.items() if s.kind in ("int", "float", "window_size")}
    assert numeric == set(BOUNDS), "every numeric setting has a bound"


def test_minimum_and_positive_are_checked_from_the_settings():
    from rollout_consistency.gate.config import SETTINGS

    for name, setting in SETTINGS.items():
        if setting.minimum is not None and name != "sde_window_size":
            with pytest.raises(ConfigError, match=rf"setting '{name}' must be >= {setting.minimum:g}, got"):
                CheckConfig(**{name: int(setting.minimum) - 1})
        if setting.positive:
            with pytest.raises(ConfigError, match=rf"setting '{name}' must be > 0, got 0"):
                CheckConfig(**{name: 0.0})
    with pytest.raises(ConfigError, match="setting 'sde_window_size' must be >= 1, got 0"):
        CheckConfig(sde_window_size=0)
