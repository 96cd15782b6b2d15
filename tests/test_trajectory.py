"""Trajectory: validation, bit-exact safetensors round trip, clear errors for damaged files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from rollout_consistency.adapters import (
    BatchRequests,
    SamplingSettings,
    Trajectory,
    TrajectoryFormatError,
    qwen_image,
    stack_trajectories,
)
from rollout_consistency.adapters.tiny import TinyPromptEncoder, load_qwen_image
from rollout_consistency.adapters.trajectory import tensors_sha256
from rollout_consistency.schedulers import SchedulerSetup, SDEWindow

REQUESTS = BatchRequests(
    seeds=(11, 12), windows=(SDEWindow(start=1, size=3, num_steps=6),) * 2, prompt_groups=(0, 1), global_step=5
)
SAMPLING = SamplingSettings(noise_level=0.7, guidance_scale=3.0)


@pytest.fixture(scope="module")
def trajectory() -> Trajectory:
    model = load_qwen_image()
    cond = TinyPromptEncoder().conditioning(["a red cat", "a dog in the garden at night"], [" ", " "])
    return qwen_image.rollout(
        model, cond, height=32, width=32, num_inference_steps=6, requests=REQUESTS, sampling=SAMPLING
    )


def _tensors_equal(a: Trajectory, b: Trajectory) -> None:
    assert torch.equal(a.latents, b.latents) and a.latents.dtype == b.latents.dtype == torch.float32
    assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a.timesteps, b.timesteps)
    assert a.conditioning.keys() == b.conditioning.keys()
    for key in a.conditioning:
        assert torch.equal(a.conditioning[key], b.conditioning[key])
        assert a.conditioning[key].dtype == b.conditioning[key].dtype
    assert (a.final_latents is None) == (b.final_latents is None)
    if a.final_latents is not None:
        assert torch.equal(a.final_latents, b.final_latents)


def test_rollout_trajectory_is_fp32_and_valid(trajectory):
    assert trajectory.latents.shape == (2, 4, 4, 16)
    assert trajectory.log_probs.shape == trajectory.timesteps.shape == (2, 3)
    assert trajectory.conditioning["prompt_embeds_mask"].dtype == torch.int64
    assert trajectory.window == SDEWindow(start=1, size=3, num_steps=6)
    expected = trajectory.scheduler.timesteps()[1:4]
    assert torch.equal(trajectory.timesteps, expected.expand(2, 3))
    assert trajectory.validate() is trajectory


def test_sampling_and_requests_round_trip_through_the_file(trajectory, tmp_path):
    """`.sampling` / `.requests` give back what the rollout was given, before and after save/load."""
    loaded = Trajectory.load(trajectory.save(tmp_path / "settings.safetensors"))
    assert trajectory.sampling == loaded.sampling == SAMPLING
    assert trajectory.requests == loaded.requests == REQUESTS
    assert isinstance(loaded.sampling, SamplingSettings) and isinstance(loaded.requests, BatchRequests)


def test_settings_are_frozen_and_hold_tuples():
    requests = BatchRequests(seeds=[1, 2], windows=[SDEWindow(0, 1, 2)] * 2, prompt_groups=[0, 0])
    assert requests.seeds == (1, 2) and requests.prompt_groups == (0, 0)
    assert requests.windows == (SDEWindow(0, 1, 2),) * 2
    assert BatchRequests(seeds=[1], windows=SDEWindow(0, 1, 2)).windows == SDEWindow(0, 1, 2)  # one for all
    with pytest.raises(AttributeError):
        requests.global_step = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        SAMPLING.noise_level = 0.1  # type: ignore[misc]


def test_round_trip_is_bit_exact(trajectory, tmp_path):
    path = trajectory.save(tmp_path / "sub" / "traj.safetensors")
    loaded = Trajectory.load(path)
    _tensors_equal(trajectory, loaded)
    for name in (
        "windows",
        "noise_level",
        "sde_type",
        "guidance_scale",
        "seeds",
        "prompt_groups",
        "global_step",
        "model_family",
        "include_normalizer",
    ):
        assert getattr(loaded, name) == getattr(trajectory, name), name
    assert loaded.scheduler.to_json_dict() == trajectory.scheduler.to_json_dict()
    assert torch.equal(loaded.scheduler.timesteps(), trajectory.scheduler.timesteps())
    assert dict(loaded.family_options) == dict(trajectory.family_options)
    # Saving what was loaded and loading it again changes nothing (safetensors orders the header metadata
    # arbitrarily, so files are compared by content, not bytes).
    _tensors_equal(Trajectory.load(loaded.save(tmp_path / "again.safetensors")), trajectory)


def test_truncated_file_is_a_clear_error(trajectory, tmp_path):
    data = trajectory.save(tmp_path / "t.safetensors").read_bytes()
    for cut in (4, 100, len(data) - 1):
        (tmp_path / "cut.safetensors").write_bytes(data[:cut])
        with pytest.raises(TrajectoryFormatError, match="truncated"):
            Trajectory.load(tmp_path / "cut.safetensors")


def test_corrupted_data_is_caught_by_checksum(trajectory, tmp_path):
    data = bytearray(trajectory.save(tmp_path / "t.safetensors").read_bytes())
    data[-5] ^= 0x10  # flip one bit inside the tensor data
    (tmp_path / "bad.safetensors").write_bytes(bytes(data))
    with pytest.raises(TrajectoryFormatError, match="checksum"):
        Trajectory.load(tmp_path / "bad.safetensors")


def test_corrupted_header_is_a_clear_error(trajectory, tmp_path):
    data = bytearray(trajectory.save(tmp_path / "t.safetensors").read_bytes())
    data[9] = ord("#")
    (tmp_path / "bad.safetensors").write_bytes(bytes(data))
    with pytest.raises(TrajectoryFormatError, match="not valid JSON"):
        Trajectory.load(tmp_path / "bad.safetensors")


def test_other_safetensors_file_is_rejected(tmp_path):
    save_file({"weight": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(TrajectoryFormatError, match="not a rollout-consistency trajectory"):
        Trajectory.load(tmp_path / "model.safetensors")


def _rewrite(trajectory: Trajectory, path, **changes) -> None:
    """Write a file in the trajectory format with some tensors replaced (a buggy writer)."""
    tensors, fields_ = trajectory.to_parts()
    tensors.update(changes)
    metadata = {"format": "rollout-consistency/trajectory", "format_version": "1", "sha256": tensors_sha256(tensors)}
    metadata.update({name: json.dumps(value) for name, value in fields_.items()})
    save_file(tensors, str(path), metadata=metadata)


def test_wrong_dtype_in_file_is_rejected(trajectory, tmp_path):
    _rewrite(trajectory, tmp_path / "bf16.safetensors", latents=trajectory.latents.to(torch.bfloat16))
    with pytest.raises(TrajectoryFormatError, match=r"latents.*bfloat16.*float32"):
        Trajectory.load(tmp_path / "bf16.safetensors")
    _rewrite(trajectory, tmp_path / "f64.safetensors", log_probs=trajectory.log_probs.double())
    with pytest.raises(TrajectoryFormatError, match=r"log_probs.*float64"):
        Trajectory.load(tmp_path / "f64.safetensors")
    mask_key = "conditioning.prompt_embeds_mask"
    _rewrite(
        trajectory, tmp_path / "mask.safetensors", **{mask_key: trajectory.conditioning["prompt_embeds_mask"].int()}
    )
    with pytest.raises(TrajectoryFormatError, match="int64"):
        Trajectory.load(tmp_path / "mask.safetensors")


def test_missing_metadata_field_is_rejected(trajectory, tmp_path):
    tensors, fields_ = trajectory.to_parts()
    metadata = {"format": "rollout-consistency/trajectory", "format_version": "1", "sha256": tensors_sha256(tensors)}
    metadata.update({k: json.dumps(v) for k, v in fields_.items() if k != "seeds"})
    save_file(tensors, str(tmp_path / "m.safetensors"), metadata=metadata)
    with pytest.raises(TrajectoryFormatError, match="'seeds' is missing"):
        Trajectory.load(tmp_path / "m.safetensors")


def test_future_version_is_rejected(trajectory, tmp_path):
    data = trajectory.save(tmp_path / "t.safetensors").read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_len])
    header["__metadata__"]["format_version"] = "9"
    raw = json.dumps(header).encode()
    (tmp_path / "v9.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + header_len :])
    with pytest.raises(TrajectoryFormatError, match="version '9'"):
        Trajectory.load(tmp_path / "v9.safetensors")


def test_validate_rejects_bad_fields(trajectory):
    from dataclasses import replace

    with pytest.raises(TypeError, match="float32 only"):
        replace(trajectory, latents=trajectory.latents.to(torch.bfloat16).float().half()).validate()
    bad = trajectory.log_probs.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        replace(trajectory, log_probs=bad).validate()
    with pytest.raises(ValueError, match="W\\+1"):
        replace(trajectory, latents=trajectory.latents[:, :3]).validate()
    shifted = trajectory.timesteps.clone()
    shifted[1, 2] = shifted[1, 1]  # a stale step-index mapping
    with pytest.raises(ValueError, match="stale step-index"):
        replace(trajectory, timesteps=shifted).validate()
    with pytest.raises(ValueError, match="one per sample"):
        replace(trajectory, seeds=(1,)).validate()
    with pytest.raises(ValueError, match="noise_level"):
        replace(trajectory, noise_level=0.0).validate()
    with pytest.raises(ValueError, match="3-step"):
        replace(trajectory, windows=(SDEWindow(0, 3, 3),) * 2).validate()


def test_window_property_requires_a_shared_window(trajectory):
    from dataclasses import replace

    mixed = replace(trajectory, windows=(SDEWindow(1, 3, 6), SDEWindow(2, 3, 6)))
    with pytest.raises(ValueError, match="different SDE windows"):
        _ = mixed.window


def test_select_and_stack_restore_the_batch(trajectory):
    parts = [trajectory.select([0]), trajectory.select([1])]
    stacked = stack_trajectories(parts, qwen_image.FAMILY)
    _tensors_equal(stacked, trajectory)
    assert stacked.seeds == trajectory.seeds and stacked.windows == trajectory.windows


def test_scheduler_setup_round_trip_is_exact():
    setup = SchedulerSetup.for_pipeline(
        {
            "use_dynamic_shifting": True,
            "base_shift": 0.5,
            "max_shift": 0.9,
            "base_image_seq_len": 256,
            "max_image_seq_len": 8192,
            "time_shift_type": "exponential",
            "shift_terminal": 0.02,
        },
        num_inference_steps=7,
        image_seq_len=1024,
    )
    again = SchedulerSetup.from_json_dict(json.loads(json.dumps(setup.to_json_dict())))
    assert torch.equal(again.build().timesteps, setup.build().timesteps)
    assert torch.equal(again.build().sigmas, setup.build().sigmas)
    with pytest.raises(ValueError, match="mu"):
        SchedulerSetup(config={"use_dynamic_shifting": True}, num_inference_steps=4)
