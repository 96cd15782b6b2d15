"""Settings travel as frozen objects, each checked once, where it is built: the sampling rules
(rollout_consistency.base.sampling_rules) behind `SamplingSettings` and `CheckConfig`, `BatchRequests`, the
step-wise `EngineSettings`, and the family options of a family's `rollout`."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from rollout_consistency import CheckConfig, ConfigError
from rollout_consistency.adapters import BatchRequests, SamplingSettings, qwen_image
from rollout_consistency.adapters.stepwise import EngineSettings, StepwiseRequest, init_window_record, window_trajectory
from rollout_consistency.adapters.tiny import TinyPromptEncoder, load_qwen_image
from rollout_consistency.base.sampling_rules import SDE_TYPES
from rollout_consistency.schedulers import SDE_TYPES as SCHEDULER_SDE_TYPES
from rollout_consistency.schedulers import SDEWindow

ROOT = Path(__file__).resolve().parents[1]
#: Where the sampling rules may be written out: their one home, and the scheduler's own `step` (where
#: noise_level 0 is the deterministic Euler step: a different rule for a different call).
RULE_HOMES = ("consistency/base/sampling_rules.py", "schedulers/")


def _names(node: ast.AST) -> set[str]:
    return {getattr(n, "id", None) or getattr(n, "attr", None) for n in ast.walk(node)} - {None}


def rule_sites(source: str) -> list[int]:
    """Lines where `source` compares a noise level with a number, or an SDE type against the list of SDE types."""
    sites = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        numeric = any(isinstance(s, ast.Constant) and isinstance(s.value, (int, float)) for s in sides)
        if numeric and any("noise_level" in _names(s) for s in sides):
            sites.append(node.lineno)
        if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and "SDE_TYPES" in _names(node):
            sites.append(node.lineno)
    return sites


def test_the_sampling_rules_are_written_once():
    """No module but the rules' home re-implements "noise_level > 0" or "sde_type in SDE_TYPES" (7 copies once)."""
    found = []
    for folder in ("consistency", "adapters", "schedulers", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "__pycache__" in rel or rel.startswith(RULE_HOMES):
                continue
            found += [f"{rel}:{line}" for line in rule_sites(path.read_text())]
    assert found == [], "check through SamplingSettings / sampling_problem instead:\n" + "\n".join(found)


def test_the_rule_finder_finds_a_copy():
    planted = "def f(sampling, noise_level, sde_type):\n    if not noise_level > 0:\n        pass\n"
    planted += "    if sampling.noise_level <= 0.0 or sde_type not in SDE_TYPES:\n        pass\n"
    assert rule_sites(planted) == [2, 4, 4]
    assert rule_sites("x = noise_level * 2\ny = sde_type == 'sde'\n") == []


def test_one_rule_one_message_for_the_settings_and_the_adapters():
    """A zero noise level is refused with the same words by the checker's settings, the adapters' settings, a
    trajectory and the vLLM-omni wire: they all ask `sampling_problem`."""
    words = "with noise_level 0 every step is a deterministic ODE step and carries no log-prob"
    with pytest.raises(ConfigError, match=words) as config_error:
        CheckConfig(noise_level=0.0)
    assert str(config_error.value).startswith("setting 'noise_level' is 0.0: ")
    for bad in (0, -0.5, float("nan"), float("inf"), "0.7", True):
        with pytest.raises(ValueError, match="'noise_level' is") as error:
            SamplingSettings(noise_level=bad)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"'sde_type' is 'SDE'; expected one of sde, cps, dance_sde. Did you mean"):
        SamplingSettings(noise_level=0.7, sde_type="SDE")
    with pytest.raises(ConfigError, match=r"setting 'sde_type' is 'SDE'; expected one of sde, cps, dance_sde"):
        CheckConfig(sde_type="SDE")
    with pytest.raises(ValueError, match="'guidance_scale' is nan"):
        SamplingSettings(noise_level=0.7, guidance_scale=float("nan"))
    assert SDE_TYPES == SCHEDULER_SDE_TYPES
    sampling = SamplingSettings(noise_level=1, guidance_scale=3)
    assert (sampling.noise_level, sampling.guidance_scale) == (1.0, 3.0) and isinstance(sampling.noise_level, float)


def test_a_trajectory_and_the_wire_check_their_sampling_through_sampling_settings():
    from rollout_consistency.adapters.vllm_omni import BatchSettings

    model = load_qwen_image(seed=0)
    cond = TinyPromptEncoder(32, seed=0).conditioning(["a red cube"])
    trajectory = qwen_image.rollout(
        model,
        cond,
        height=32,
        width=32,
        num_inference_steps=4,
        requests=BatchRequests(seeds=[1], windows=SDEWindow(1, 2, 4), denoise_to_end=False),
        sampling=SamplingSettings(noise_level=0.7),
    )
    assert trajectory.final_latents is None and trajectory.requests.denoise_to_end is False
    with pytest.raises(ValueError, match="nothing to check"):
        dataclasses.replace(trajectory, noise_level=0.0).validate()
    with pytest.raises(ValueError, match="global_step must be an int >= 0"):
        dataclasses.replace(trajectory, global_step=-1).validate()
    with pytest.raises(ValueError, match="nothing to check"):
        BatchSettings(
            scheduler=trajectory.scheduler,
            noise_level=0.0,
            sde_type="sde",
            guidance_scale=1.0,
            options={"height": 32, "width": 32},
        )


def test_batch_requests_check_their_samples():
    window = SDEWindow(1, 2, 6)
    assert BatchRequests(seeds=[3, 4], windows=window).groups == (0, 1)
    for kwargs, error, words in (
        (dict(seeds=[]), ValueError, "at least one sample"),
        (dict(seeds=[1.5]), TypeError, "seeds must hold ints"),
        (dict(seeds=[True]), TypeError, "seeds must hold ints"),
        (dict(seeds=[1, 2], prompt_groups=[0]), ValueError, "1 prompt groups for 2 seeds"),
        (dict(seeds=[1, 2], windows=(window,)), ValueError, "1 windows for 2 samples"),
        (dict(seeds=[1], windows=(3,)), TypeError, "Expected SDEWindow"),
        (dict(seeds=[1], global_step=-1), ValueError, "global_step must be an int >= 0"),
        (dict(seeds=[1], denoise_to_end=1), ValueError, "denoise_to_end must be True or False"),
    ):
        with pytest.raises(error, match=words):
            BatchRequests(**{"windows": window, **kwargs})


def test_stepwise_settings_and_one_request_trajectories():
    for kwargs, words in ((dict(max_num_seqs=0), "max_num_seqs"), (dict(text_width=0), "text_width")):
        with pytest.raises(ValueError, match=words):
            EngineSettings(**kwargs)
    window = SDEWindow(0, 1, 2)
    request = StepwiseRequest("r", seed=5, conditioning={}, window=window, prompt_group=2, global_step=7)
    assert request.requests == BatchRequests(seeds=(5,), windows=(window,), prompt_groups=(2,), global_step=7)
    record = init_window_record(window)
    record.inputs.append(torch.zeros(1, 3))
    record.log_probs.append(torch.zeros(1))
    record.timesteps.append(torch.zeros(1))
    record.last_output = torch.zeros(1, 3)
    other = BatchRequests(seeds=(5,), windows=SDEWindow(1, 1, 2))
    with pytest.raises(ValueError, match="one-sample BatchRequests"):
        window_trajectory(
            record,
            requests=other,
            sampling=SamplingSettings(noise_level=0.7),
            conditioning={},
            model_family="qwen-image",
            scheduler_setup=None,
            family_options={},
        )


def test_a_familys_rollout_takes_its_own_options_only():
    model = load_qwen_image(seed=0)
    cond = TinyPromptEncoder(32, seed=0).conditioning(["a red cube"])
    args = dict(
        num_inference_steps=4,
        requests=BatchRequests(seeds=[1], windows=SDEWindow(1, 2, 4), denoise_to_end=False),
        sampling=SamplingSettings(noise_level=0.7),
    )
    trajectory = qwen_image.rollout(model, cond, height=32, width=32, **args)
    # Stored as the family's pipeline call had them: every option, defaults filled in, typed as the defaults.
    assert trajectory.family_options == {"height": 32, "width": 32, "vae_scale_factor": 8, "mask_text_padding": True}
    with pytest.raises(ValueError, match=r"qwen-image has no option 'mask_text_paddin'; its options are height, width"):
        qwen_image.rollout(model, cond, height=32, width=32, mask_text_paddin=False, **args)
    with pytest.raises(ValueError, match="options need 'width'"):
        qwen_image.rollout(model, cond, height=32, **args)
