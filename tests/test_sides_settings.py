"""The sides read their own frozen settings (`SidesSettings`, rollout_consistency.gate.sides.settings), built once from
the `CheckConfig` with every value resolved; user code still receives the `CheckConfig` itself, bound by the check."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from rollout_consistency import CheckConfig
from rollout_consistency.gate.backend_registry import BackendEntry, register_backend, scoped_backends
from rollout_consistency.gate.config import FIELD_NAMES, SETTINGS
from rollout_consistency.gate.plugin_request import RolloutRequest
from rollout_consistency.gate.sides import plugins
from rollout_consistency.gate.sides.backends import build_backend, start_backend
from rollout_consistency.gate.sides.plan import make_plan
from rollout_consistency.gate.sides.settings import (
    ExecutionSettings,
    ModelSettings,
    SampleSettings,
    SidesSettings,
)

PARTS = (ModelSettings, SampleSettings, ExecutionSettings)
#: The sides' fields that are no `CheckConfig` field: derived from several (each resolved in `CheckConfig.sides`).
DERIVED = {"measures_floor", "floor_variants", "num_samples"}
#: What a test factory received, by side (the factories below run in this process).
RECEIVED: dict[str, object] = {}


def keep_argument(config):
    """A registered rollout backend's factory of the tests: keeps what it was called with."""
    RECEIVED["registered"] = config
    from rollout_consistency.gate.sides.torch_rollout import TorchRollout

    return TorchRollout()


def test_the_sides_settings_hold_resolved_values():
    config = CheckConfig(
        prompts=("a dog", "two birds"),
        num_prompts=3,
        num_images_per_prompt=3,
        sde_window_size="all",
        num_inference_steps=5,
        rollout_batch_size=3,
        micro_batch_size=1,
        profile="calibrated",
        trainer_step_implementation="flow-grpo",
    )
    sides = config.sides
    assert sides.sampling.prompts == ("a dog", "two birds", "a dog") == config.resolved_prompts
    assert sides.sampling.num_samples == 9 == config.num_samples
    assert sides.sampling.sde_window_size == 5 == config.resolved_window_size  # "all": every step
    assert sides.execution.micro_batch_size == 1 == config.resolved_micro_batch_size
    assert sides.model.measures_floor and sides.model.calibration_attention is None
    # the floor's sources besides the kernel, as the judging's tolerance model names them for these settings
    assert dict(sides.model.floor_variants) == {
        "batch composition": {"micro_batch_size": 3},
        "implementation": {"implementation": "reference"},
    }
    exact = CheckConfig(rollout_batch_size=2).sides
    assert exact.execution.micro_batch_size == 2 and not exact.model.measures_floor  # None: the rollout batch
    assert dict(exact.model.floor_variants) == {}  # no floor: nothing measured


def test_each_sides_field_is_a_check_config_fact():
    """The sides' objects declare no setting of their own: every field is a `CheckConfig` field (its default,
    bounds and help in its `Setting`) or one of the few derived from several, and none has a default."""
    for part in PARTS:
        for field in dataclasses.fields(part):
            assert field.name in FIELD_NAMES or field.name in DERIVED, f"{part.__name__}.{field.name}"
            assert field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    read = {f.name for part in PARTS for f in dataclasses.fields(part)}
    # what the sides do not read: the judging's, the Ray placement (the check's), the run's own switches
    assert set(SETTINGS) - read == {
        "num_prompts",  # resolved into `prompts`
        "clip_ratio_low",
        "clip_ratio_high",
        "profile",  # resolved into `measures_floor` and `floor_variants`
        "thresholds",
        "calibration_multiple",
        "trajectory",
        "workers",
        "ray_address",
        "ray_timeout_s",
        "progress",
    }


def test_the_sides_settings_travel_to_a_worker_whole():
    """Pickled (a Ray actor receives them so): equal, and the bound user arguments still hand on the config."""
    config = CheckConfig(model_family="sd3", seed=7, sde_window_range=(1, 5))
    sides = config.sides
    copy = pickle.loads(pickle.dumps(sides))
    assert copy == sides and isinstance(copy, SidesSettings)
    assert copy.user_code.registered_factory(lambda received: received) == config
    assert copy.user_code.plugin_factory(lambda config: config) == config
    assert make_plan(copy) == make_plan(sides)


def test_user_code_receives_the_check_config(tmp_path):
    """A plug-in's factory, a registered backend's factory and a rollout request carry the `CheckConfig` (the
    contracts), a built-in backend's factory the sides' settings."""
    plugin = tmp_path / "sides_seen.py"
    plugin.write_text(
        "SEEN = {}\ndef make_rollout(config):\n    SEEN['plugin'] = config\n    return lambda request: request\n"
    )
    config = CheckConfig(rollout_backend=f"{plugin}:make_rollout", num_prompts=1, progress=False)
    sides = config.sides
    backend = build_backend(sides)
    seen = backend.plugins.rollout.__globals__["SEEN"]
    assert seen["plugin"] is config
    request = plugins.make_request(backend, make_plan(sides)[0], conditioning={})
    assert isinstance(request, RolloutRequest) and request.config is config
    assert request.seeds == tuple(s.seed for s in make_plan(sides)[0].samples)

    with scoped_backends():
        register_backend(BackendEntry("kept", "rollout", f"{__name__}:keep_argument", "keeps its argument"))
        kept = CheckConfig(rollout_backend="kept")
        start_backend(kept.sides, "rollout")
        assert RECEIVED.pop("registered") is kept
        builtin = register_backend(
            BackendEntry("kept-sides", "rollout", f"{__name__}:keep_argument", "as a built-in", receives="sides")
        )
        start_backend(CheckConfig(rollout_backend=builtin.name).sides, "rollout")
        assert isinstance(RECEIVED.pop("registered"), SidesSettings)
    with pytest.raises(ValueError, match="receives must be one of config, sides"):
        BackendEntry("x", "rollout", "pkg.mod:start", "x", receives="everything")


@pytest.mark.parametrize(("micro_batch_size", "rows"), [(None, 4), (2, 2)])
def test_the_trainer_cuts_the_resolved_micro_batches(micro_batch_size, rows):
    """The trainer's forwards see the settings' micro-batch (None: the whole rollout batch), as a GRPO trainer's
    ``train_batch_size`` cuts a rollout batch, whatever the rollout's own batch was."""
    from rollout_consistency.gate.sides.backends import rollout_trajectory
    from rollout_consistency.gate.sides.trainer import torch_log_probs

    sides = CheckConfig(num_prompts=2, rollout_batch_size=4, micro_batch_size=micro_batch_size).sides
    backend = build_backend(sides)
    trajectory = rollout_trajectory(backend, make_plan(sides)[0])
    seen: list[int] = []
    hook = backend.trainer_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        table = torch_log_probs(backend, trajectory, sides.model.trainer_attention)
    finally:
        hook.remove()
    assert table.shape == (4, sides.sampling.sde_window_size)
    assert seen == [rows] * (4 // rows) * sides.sampling.sde_window_size
