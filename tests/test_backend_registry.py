"""The backend registry: a built-in backend is one module plus one registration, and the settings, the sides
and the command line read the registration (rollout_consistency.gate.backend_registry)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from rollout_consistency import CheckConfig, ConfigError, run_step1_check
from rollout_consistency.gate import BackendEntry, backend_names, register_backend
from rollout_consistency.gate.backend_registry import default_profile, get_backend, unregister_backend

QUICK = dict(progress=False, num_prompts=2, num_images_per_prompt=2, rollout_batch_size=2)
CALLS: list[tuple[int, ...]] = []


class CountingRollout:
    """A rollout backend for the tests: the built-in torch rollout, recording the seeds of each batch."""

    in_process = True

    def rollout(self, backend, conditioning, requests, sampling):
        from rollout_consistency.gate.sides.torch_rollout import TorchRollout

        CALLS.append(tuple(requests.seeds))
        return TorchRollout().rollout(backend, conditioning, requests, sampling)


def start_counting(config):
    return CountingRollout()


def _refuse_step_execution(config) -> str | None:
    return "rollout_backend 'counting' is request-level only: drop step_execution." if config.step_execution else None


COUNTING = BackendEntry(
    name="counting",
    side="rollout",
    factory=f"{__name__}:start_counting",
    summary="the torch rollout, counted",
    default_profile="implementation",
    check=_refuse_step_execution,
)


@pytest.fixture
def counting():
    register_backend(COUNTING)
    yield COUNTING
    unregister_backend("rollout", "counting")  # the test's own registration, not a user's
    CALLS.clear()


def test_the_built_in_backends_are_registrations():
    assert backend_names("rollout") == ("torch", "vllm-omni") and backend_names("trainer") == ("torch",)
    assert default_profile("torch") == "exact" and default_profile("vllm-omni") == "kernel"
    assert default_profile("my_pkg.sides:rollout") == "exact"  # a plug-in spec is not a registered name
    vllm = get_backend("rollout", "vllm-omni")
    assert vllm.factory == "rollout_consistency.gate.sides.vllm_omni_rollout:start"
    settings = SimpleNamespace(trajectory=None, device="cpu", batch_invariant=False, inject=None)
    assert "needs CUDA" in vllm.check(settings)
    assert vllm.check(SimpleNamespace(**{**vars(settings), "trajectory": "dump.safetensors"})) is None


def test_settings_read_the_registry(counting):
    """A name is valid once registered; the backend's own rule and its default profile come with it."""
    with pytest.raises(ConfigError, match=r"'nope'; expected one of torch, vllm-omni, counting\."):
        CheckConfig(rollout_backend="nope")
    config = CheckConfig(rollout_backend="counting")
    assert config.resolved_profile == "implementation"
    with pytest.raises(ConfigError, match="request-level only: drop step_execution"):
        CheckConfig(rollout_backend="counting", step_execution=True)
    with pytest.raises(ConfigError, match="needs CUDA"):  # the built-in vllm-omni rule, from its registration
        CheckConfig(rollout_backend="vllm-omni")
    assert CheckConfig(rollout_backend="pkg.module:factory").rollout_backend == "pkg.module:factory"


def test_the_sides_build_the_registered_factory(counting):
    report = run_step1_check(rollout_backend="counting", **QUICK)
    assert report.passed, report.reasons
    assert len(CALLS) == 2  # one call per rollout batch of the plan
    assert sorted(seed for batch in CALLS for seed in batch) == sorted(s.seed for s in report.samples)
    assert report.tolerance.profile == "implementation"


def test_a_factory_that_cannot_be_loaded_is_a_usage_error():
    from rollout_consistency.gate.sides.shared import BackendError

    register_backend(dataclasses.replace(COUNTING, name="missing", factory="no_such_package_here:start"))
    try:
        with pytest.raises(BackendError, match="'no_such_package_here:start' cannot be loaded"):
            run_step1_check(rollout_backend="missing", **QUICK)
    finally:
        unregister_backend("rollout", "missing")


def test_the_command_line_lists_the_registered_backends(counting, capsys):
    from rollout_consistency.cli import main

    assert main(["check", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    for name in backend_names("rollout"):
        assert f"{name} ({get_backend('rollout', name).summary})" in text
    assert "counting (the torch rollout, counted)" in text and "'package.module:factory'" in text


def test_a_registration_is_checked():
    with pytest.raises(ValueError, match="colon marks a plug-in"):
        BackendEntry(name="a:b", side="rollout", factory="m:f", summary="")
    with pytest.raises(ValueError, match="side must be one of rollout, trainer"):
        BackendEntry(name="x", side="both", factory="m:f", summary="")
    with pytest.raises(ValueError, match=r"'package\.module:function'"):
        BackendEntry(name="x", side="rollout", factory="m.f", summary="")
    with pytest.raises(ValueError, match="already registered"):
        register_backend(dataclasses.replace(get_backend("rollout", "torch"), summary="another"))
    assert register_backend(get_backend("rollout", "torch")) is get_backend("rollout", "torch")  # same: no-op
