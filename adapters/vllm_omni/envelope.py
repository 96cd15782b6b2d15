# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The trajectory envelope: how a request's trajectory travels back from vLLM-omni's worker to the client.

In the worker, `post_decode` returns [`output_envelope`] of the decoded image and [`trajectory_to_payload`];
vLLM-omni's Qwen-Image post-process hands the payload through to
`OmniRequestOutput.multimodal_output["trajectory"]`. On the client, [`order_by_sample_index`] maps the outputs'
completion order back to request order and [`trajectory_from_payload`] rebuilds each float32 `Trajectory`.
The payload is exact: CPU tensors and plain fields, no dtype change, refused unless its format
([`ENVELOPE_FORMAT`]) and version are ours.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout_consistency.adapters.trajectory import Trajectory, TrajectoryFormatError

from .protocol import PAYLOAD_VERSION, PIPELINE_CLASS, RequestSettings

__all__ = [
    "ENVELOPE_FORMAT",
    "order_by_sample_index",
    "output_envelope",
    "trajectory_from_payload",
    "trajectory_to_payload",
]

#: `format` of the trajectory payload in the output envelope (and in its metadata group "trajectory").
ENVELOPE_FORMAT = "rollout-consistency/vllm-omni-trajectory"


def trajectory_to_payload(trajectory: Trajectory, request: RequestSettings) -> dict[str, Any]:
    """The envelope's `payload["trajectory"]`: CPU tensors plus plain fields, exact (no dtype change).

    `latents` (B, W+1, S, C), `timesteps` (B, W) and `log_probs` (B, W) are the keys vLLM-omni copies onto
    `OmniRequestOutput.trajectory_latents / trajectory_timesteps / trajectory_log_probs`; the whole mapping
    lands in `OmniRequestOutput.multimodal_output["trajectory"]`.
    """
    tensors, fields_ = trajectory.to_parts()
    # The three standard keys at the top level (vLLM-omni copies them onto the request output); the rest
    # of the tensors (final latents, conditioning) travel under "tensors".
    payload: dict[str, Any] = {
        "format": ENVELOPE_FORMAT,
        "version": PAYLOAD_VERSION,
        **{name: tensors.pop(name) for name in ("latents", "log_probs", "timesteps")},
        "tensors": tensors,
        "fields": fields_,
        "request": request.to_payload(),
    }
    return payload


def trajectory_from_payload(payload: Mapping[str, Any]) -> Trajectory:
    """Inverse of [`trajectory_to_payload`]: the validated [`Trajectory`].

    Raises:
        TrajectoryFormatError: not our payload, another version, a missing field, or a tensor that is not float32
            (nothing is cast: a low-precision tensor means the engine kept a rounded copy).
    """
    if not isinstance(payload, Mapping) or payload.get("format") != ENVELOPE_FORMAT:
        found = payload.get("format") if isinstance(payload, Mapping) else type(payload).__name__
        raise TrajectoryFormatError(
            f"The output's trajectory is not a rollout-consistency payload (format {found!r}): was the engine started "
            f"with custom_pipeline_args={{'pipeline_class': {PIPELINE_CLASS!r}}}?"
        )
    if payload.get("version") != PAYLOAD_VERSION:
        raise TrajectoryFormatError(
            f"Trajectory payload version {payload.get('version')!r}; this client reads {PAYLOAD_VERSION}. Install the same "
            f"rollout-consistency version on the client and the engine."
        )
    try:
        tensors = {name: payload[name] for name in ("latents", "log_probs", "timesteps")}
        tensors.update(payload["tensors"])
        fields_ = payload["fields"]
    except (KeyError, TypeError) as error:
        raise TrajectoryFormatError(f"The trajectory payload is incomplete or invalid: {error!r}") from error
    return Trajectory.from_parts(tensors, fields_, source="vLLM-omni trajectory payload")


def output_envelope(image: Any, trajectory_payload: Mapping[str, Any]) -> dict[str, Any]:
    """What `post_decode` returns as `DiffusionOutput.output`: vLLM-omni's output envelope.

    The Qwen-Image post-process turns `payload["image"]` into PIL images and passes `payload["trajectory"]`
    through; never return the trajectory alone (an output without an image is dropped).
    """
    return {
        "payload": {"image": image, "trajectory": dict(trajectory_payload)},
        "metadata": {"trajectory": {"type": "denoising", "format": ENVELOPE_FORMAT, "version": PAYLOAD_VERSION}},
    }


def order_by_sample_index(items: Sequence[tuple[str, Mapping[str, Any]]], count: int) -> list[Mapping[str, Any]]:
    """Put `(request_id, trajectory payload)` pairs, in completion order, back in request order.

    The order comes from each payload's echoed `request.sample_index`; `Omni.generate`'s request ids
    (`"{i}_{uuid}"`) must agree with it.

    Raises:
        ValueError: a missing, duplicated or out-of-range sample, or an id that contradicts its payload.
    """
    ordered: list[Mapping[str, Any] | None] = [None] * count
    for request_id, payload in items:
        try:
            index = payload["request"]["sample_index"]
        except (KeyError, TypeError) as error:
            raise ValueError(
                f"Output {request_id!r} has no echoed sample_index: not a rollout-consistency payload."
            ) from error
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
            raise ValueError(f"Output {request_id!r} echoes sample_index {index!r}, outside 0..{count - 1}.")
        prefix = str(request_id).split("_", 1)[0]
        if prefix.isdigit() and int(prefix) != index:
            raise ValueError(f"Output {request_id!r} (request {prefix}) carries the trajectory of sample {index}.")
        if ordered[index] is not None:
            raise ValueError(f"Two outputs carry sample {index}.")
        ordered[index] = payload
    missing = [i for i, payload in enumerate(ordered) if payload is None]
    if missing:
        raise ValueError(f"No trajectory came back for sample(s) {missing} of {count}.")
    return ordered  # type: ignore[return-value]
