"""Checkpoint-recompute consistency (consistency/training/checkpoint_check.py, consistency/training/checkpointing.py)."""

from __future__ import annotations

import functools
import itertools
import json

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from rollout_consistency.training.checkpoint_check import check_checkpointing
from rollout_consistency.training.checkpointing import checkpoint
from rollout_consistency.training.rng_state import isolated_rng
from rollout_consistency.training.toy_denoiser import (
    ToyDenoiser,
    rng_unsafe_checkpoint,
    toy_case,
    toy_flow_matching_batch,
)

TORCH_NON_REENTRANT = functools.partial(torch_checkpoint, use_reentrant=False)
TORCH_REENTRANT = functools.partial(torch_checkpoint, use_reentrant=True)


def run_case(checkpoint_fn, dropout=0.1, seed=0, **kwargs):
    case = toy_case(seed=seed, dropout=dropout)
    return check_checkpointing(
        case["module"],
        case["inputs"],
        checkpoint_fn,
        segments=case["segments"],
        loss_fn=case["loss_fn"],
        seed=seed,
        **kwargs,
    )


# ----------------------------------------------------------------------------------------------
# the pitfall and the fix


def test_rng_unsafe_helper_fails_with_dropout() -> None:
    report = run_case(rng_unsafe_checkpoint, dropout=0.1)
    assert not report.passed and report.verdict == "FAIL"
    assert report.checkpoint_calls == 3  # one per block
    # The forward is identical (it ran under no_grad from the same RNG state); only gradients differ.
    assert report.loss_reference == report.loss_checkpointed
    assert report.global_relative_diff > 1e-2
    wrong = [g.name for g in report.gradients if not g.within_tolerance]
    assert any(name.startswith("blocks.0.") for name in wrong)
    assert all(g.missing_in is None for g in report.gradients)
    assert any("does not restore the RNG state" in reason for reason in report.reasons)
    assert "rollout_consistency.training.checkpointing.checkpoint" in report.reasons[0]


@pytest.mark.parametrize(
    "checkpoint_fn",
    [TORCH_NON_REENTRANT, TORCH_REENTRANT, checkpoint],
    ids=["torch-non-reentrant", "torch-reentrant", "consistency"],
)
def test_torch_checkpoint_passes_with_dropout(checkpoint_fn) -> None:
    report = run_case(checkpoint_fn, dropout=0.3)
    assert report.passed, report.format()
    assert report.checkpoint_calls == 3
    assert report.max_relative_diff <= 1e-6
    assert report.baseline_max_relative_diff == 0.0


def test_without_dropout_even_the_unsafe_helper_agrees() -> None:
    # The pitfall needs randomness inside the segment; this pins down what the check measures.
    report = run_case(rng_unsafe_checkpoint, dropout=0.0)
    assert report.passed and report.bitwise_equal


@pytest.mark.parametrize("seed", [0, 1])
def test_failure_grows_with_dropout_probability(seed: int) -> None:
    probabilities = [0.0, 0.02, 0.1, 0.3, 0.6]
    sizes = [run_case(rng_unsafe_checkpoint, dropout=p, seed=seed).global_relative_diff for p in probabilities]
    assert sizes[0] == 0.0
    assert all(a < b for a, b in itertools.pairwise(sizes)), sizes
    assert sizes[1] > 1e-3  # even 2% dropout is far beyond rounding


def test_swap_in_helper_is_bit_exact_on_cpu() -> None:
    report = run_case(checkpoint, dropout=0.3, rtol=0.0)
    assert report.passed and report.bitwise_equal


def _grads_of_one_training_step(checkpoint_fn, seed: int = 3) -> dict[str, torch.Tensor]:
    with isolated_rng(seed):
        model = ToyDenoiser(dropout=0.25, checkpoint_fn=checkpoint_fn)
        x_t, t, target = toy_flow_matching_batch(torch.Generator().manual_seed(seed), batch_size=16)
        nn.functional.mse_loss(model(x_t, t), target).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_swap_in_helper_matches_uncheckpointed_gradients_bit_for_bit() -> None:
    # Independent of check_checkpointing: the model calls the helper itself, as in training.
    reference = _grads_of_one_training_step(None)
    checkpointed = _grads_of_one_training_step(checkpoint)
    assert reference.keys() == checkpointed.keys()
    for name in reference:
        assert torch.equal(reference[name].view(torch.int32), checkpointed[name].view(torch.int32)), name
    broken = _grads_of_one_training_step(rng_unsafe_checkpoint)
    assert not torch.equal(reference["blocks.0.fc1.weight"], broken["blocks.0.fc1.weight"])


def test_swap_in_helper_gives_parameter_grads_when_no_input_requires_grad() -> None:
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    checkpoint(layer, x).sum().backward()
    assert layer.weight.grad is not None
    expected = layer.weight.grad.clone()
    layer.zero_grad()
    layer(x).sum().backward()
    assert torch.equal(expected, layer.weight.grad)


def test_swap_in_helper_passes_keyword_arguments_and_nested_outputs() -> None:
    def segment(x, *, scale):
        return {"y": x * scale, "pair": (x.sin(), x.cos())}

    x = torch.randn(3, requires_grad=True)
    out = checkpoint(segment, x, scale=torch.tensor(2.0))
    (out["y"].sum() + out["pair"][0].sum()).backward()
    assert torch.allclose(x.grad, 2.0 + x.detach().cos())


@pytest.mark.parametrize("option", ["use_reentrant", "preserve_rng_state"])
def test_swap_in_helper_refuses_the_options_it_fixes(option: str) -> None:
    with pytest.raises(TypeError, match=f"remove {option}"):
        checkpoint(nn.Linear(2, 2), torch.randn(1, 2), **{option: True})


# ----------------------------------------------------------------------------------------------
# ways of switching checkpointing on


def test_set_checkpointing_hook_of_a_model_with_its_own_switch() -> None:
    case = toy_case(dropout=0.2)

    def set_checkpointing(module, fn):
        module.checkpoint_fn = fn

    broken = check_checkpointing(
        case["module"],
        case["inputs"],
        rng_unsafe_checkpoint,
        set_checkpointing=set_checkpointing,
        loss_fn=case["loss_fn"],
    )
    fixed = check_checkpointing(
        case["module"], case["inputs"], checkpoint, set_checkpointing=set_checkpointing, loss_fn=case["loss_fn"]
    )
    assert broken.mode == "set_checkpointing" and not broken.passed
    assert fixed.passed and fixed.bitwise_equal and fixed.checkpoint_calls == 3
    assert case["module"].checkpoint_fn is None  # switched off again


def _tiny_unet(dropout: float):
    from diffusers import UNet2DModel

    with isolated_rng(0):
        return UNet2DModel(
            sample_size=8,
            in_channels=3,
            out_channels=3,
            layers_per_block=1,
            block_out_channels=(8, 16),
            down_block_types=("DownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "UpBlock2D"),
            norm_num_groups=4,
            dropout=dropout,
        )


def _unet_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"sample": torch.randn(2, 3, 8, 8, generator=generator), "timestep": torch.tensor([10, 500])}


def test_diffusers_model_uses_its_own_gradient_checkpointing() -> None:
    # A real diffusers UNet with dropout in its resnets, checkpointed through enable_gradient_checkpointing.
    unet = _tiny_unet(dropout=0.2)
    broken = check_checkpointing(unet, _unet_inputs(), rng_unsafe_checkpoint)
    fixed = check_checkpointing(unet, _unet_inputs(), checkpoint)
    reentrant = check_checkpointing(unet, _unet_inputs(), TORCH_REENTRANT)
    assert broken.mode == fixed.mode == "diffusers"
    assert not broken.passed and broken.checkpoint_calls > 0
    assert fixed.passed and fixed.bitwise_equal
    # Reentrant backward accumulates in another order: not bit-exact, but at rounding level.
    assert reentrant.passed and reentrant.max_relative_diff < 1e-6
    assert not unet.is_gradient_checkpointing


def test_diffusers_model_with_checkpointing_already_on_is_refused() -> None:
    unet = _tiny_unet(dropout=0.1)
    unet.enable_gradient_checkpointing()
    with pytest.raises(ValueError, match="disable_gradient_checkpointing"):
        check_checkpointing(unet, _unet_inputs())


def test_default_segments_are_the_direct_children() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 4))
    report = check_checkpointing(model, torch.randn(5, 4), rng_unsafe_checkpoint)
    assert report.segments == ("0", "1", "2")
    # No segment input requires grad: the unsafe (reentrant-style) helper cuts the graph, so the
    # checkpointed run has no gradient at all; that is a failure, not an error.
    assert all(g.missing_in == "checkpointed" for g in report.gradients) and len(report.gradients) == 4
    assert not report.passed
    assert check_checkpointing(model, torch.randn(5, 4), checkpoint).passed


# ----------------------------------------------------------------------------------------------
# failing closed


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")
def test_reentrant_checkpoint_losing_parameter_gradients_is_caught() -> None:
    case = toy_case(dropout=0.0)
    report = check_checkpointing(
        case["module"], case["inputs"], TORCH_REENTRANT, segments=["proj_in", "blocks.*"], loss_fn=case["loss_fn"]
    )
    assert not report.passed
    assert {g.name for g in report.gradients if g.missing_in == "checkpointed"} == {"proj_in.weight", "proj_in.bias"}
    assert any("use_reentrant=False" in reason for reason in report.reasons)


def test_segments_never_called_fail_instead_of_passing_vacuously() -> None:
    class WithUnused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    report = check_checkpointing(WithUnused(), torch.randn(2, 4), checkpoint, segments=["unused"])
    assert report.checkpoint_calls == 0
    assert not report.passed and "never called" in report.reasons[0]


def test_unreproducible_reference_step_fails() -> None:
    class Drifting(nn.Module):
        """Each forward adds a growing offset: no seed makes two runs agree."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.layer(x) * (1.0 + 1e-3 * self.calls)

    report = check_checkpointing(Drifting(), torch.randn(2, 4), checkpoint, segments=["layer"])
    assert not report.passed
    assert report.baseline_max_relative_diff > 1e-6
    assert any("does not reproduce itself" in reason for reason in report.reasons)


def test_a_crash_under_checkpointing_is_a_failed_check() -> None:
    def exploding(function, *args):
        raise RuntimeError("helper bug")

    report = check_checkpointing(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4), exploding)
    assert not report.passed and len(report.reasons) == 1
    assert "raised RuntimeError: helper bug" in report.reasons[0]


def test_torch_checkpoint_error_on_a_recompute_of_another_shape_is_a_failed_check() -> None:
    class ShapeShifting(nn.Module):
        """The third call (the recompute in backward, with baseline=False) sees half the batch."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.layer(x if self.calls != 3 else x[:1])

    model = nn.Sequential(ShapeShifting())
    report = check_checkpointing(model, torch.randn(2, 4), checkpoint, baseline=False)
    assert not report.passed
    assert "CheckpointError" in report.reasons[0]


def test_non_finite_reference_loss_fails() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    report = check_checkpointing(model, torch.randn(2, 4), checkpoint, loss_fn=lambda out: out.sum() * float("nan"))
    assert not report.passed and any("not finite" in reason for reason in report.reasons)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"segments": ["nope.*"]}, "matches no submodule"),
        ({"segments": ["blocks.*"], "set_checkpointing": lambda m, fn: None}, "not both"),
        ({"segments": ["blocks.*"], "loss_fn": lambda out: out}, "scalar"),
        ({"segments": ["blocks.*"], "loss_fn": lambda out: out.detach().sum()}, "does not depend"),
        ({"segments": ["blocks.*"], "rtol": -1.0}, ">= 0"),
    ],
)
def test_bad_arguments_name_the_fix(kwargs, message) -> None:
    case = toy_case()
    with pytest.raises(ValueError, match=message):
        check_checkpointing(case["module"], case["inputs"], checkpoint, **kwargs)


# ----------------------------------------------------------------------------------------------
# side effects and report


def test_check_leaves_module_grads_buffers_modes_and_rng_untouched() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.Linear(8, 2))
    model.eval()
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    x = torch.randn(6, 4, requires_grad=True)

    torch.manual_seed(11)
    expected_next = torch.rand(3)
    torch.manual_seed(11)
    report = check_checkpointing(model, x, checkpoint, segments=["1", "3"], rtol=0.0)
    assert torch.equal(torch.rand(3), expected_next)

    assert report.passed and report.bitwise_equal  # BatchNorm statistics updated twice are reset between runs
    assert "input" in {g.name for g in report.gradients}  # input tensors that require grad are compared
    assert not model.training and not any(m.training for m in model.modules())
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 7.0))
    assert model[3].weight.grad is None and x.grad is None
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name
    assert "forward" not in vars(model[1])  # un-patched


def test_report_is_json_serialisable_and_readable() -> None:
    report = run_case(rng_unsafe_checkpoint, dropout=0.1)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["verdict"] == "FAIL" and data["passed"] is False
    assert data["gradients"][0]["name"] == report.gradients[0].name
    text = report.format(top=3)
    assert "FAIL" in text and report.gradients[0].name in text and "reason:" in text
