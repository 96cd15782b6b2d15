# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The fp32 trajectory: what a rollout stores and a trainer re-scores, and its safetensors file.

Storage policy: every stored floating tensor is float32 (latents, log-probs, timesteps, conditioning);
integer masks are int64. Nothing is stored in the transformer's dtype: a bf16 latent rounds the sample the
rollout scored, and the trainer then scores a different point (the known pitfall "precision loss in stored
latents").

File format (one `.safetensors` file, little-endian, readable by any safetensors reader):

* tensors `latents` (B, W+1, *latent_shape) f32, `log_probs` (B, W) f32, `timesteps` (B, W) f32,
  optionally `final_latents` (B, *latent_shape) f32, and one `conditioning.<name>` per conditioning tensor;
* header metadata (string → string): `format` = `rollout-consistency/trajectory`, `format_version` = `1`,
  `sha256` (digest of every tensor's name, dtype, shape and bytes), and one JSON string per scalar field
  (`windows`, `noise_level`, `sde_type`, `guidance_scale`, `seeds`, `prompt_groups`, `global_step`,
  `model_family`, `scheduler`, `family_options`, `include_normalizer`, `provenance`), and `experts` for a model
  with experts by timestep (Wan 2.2): optional, so files without it (every image family's, and files written
  before it existed) read as before, with `experts` None.

`save` then `load` returns a trajectory whose tensors are bit-identical to the saved ones. A file that is
truncated, corrupted, of another format, or holds a non-float32 latent / log-prob / timestep raises
[`TrajectoryFormatError`] naming the problem; nothing is cast or repaired silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes

from rollout_consistency.safeguards.memory_budget import check_fits
from rollout_consistency.safeguards.paths import InputPathError, open_regular
from rollout_consistency.schedulers import SchedulerSetup, SDEWindow

from .settings import BatchRequests, SamplingSettings

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Trajectory",
    "TrajectoryFormatError",
    "read_header_metadata",
    "stack_trajectories",
    "tensors_sha256",
]

FORMAT_NAME = "rollout-consistency/trajectory"
FORMAT_VERSION = "1"
_COND_PREFIX = "conditioning."
_MASK_SUFFIX = "_mask"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


class TrajectoryFormatError(ValueError):
    """A trajectory file that cannot be read back exactly (truncated, corrupted, wrong format or dtype)."""


def _is_mask_key(name: str) -> bool:
    return name.endswith(_MASK_SUFFIX)


@dataclass(frozen=True, eq=False)
class Trajectory:
    """A batch of rollouts restricted to their SDE windows, in float32.

    Shapes: `B` samples, `W` window steps (the same window size for every sample), `latent_shape` the
    per-sample latent shape of the model family (Qwen-Image: packed `(seq, channels)`; Wan: the video's
    `(C, F, h, w)`, so `latents` is 7-D).

    Args:
        latents (`torch.Tensor` `(B, W+1, *latent_shape)`, float32): the sample entering each window step,
            then the output of the last window step. `latents[:, k+1]` is the sample drawn by step `k`.
        log_probs (`torch.Tensor` `(B, W)`, float32): the rollout's log-prob of each window step (scheduler
            convention: mean over non-batch dims).
        timesteps (`torch.Tensor` `(B, W)`, float32): exact schedule values of each sample's window steps.
        windows (`tuple[SDEWindow, ...]`): the window of each sample (`len == B`). Samples of one prompt group
            share a window; different groups may differ. `.window` gives the common window.
        noise_level (`float`): SDE noise level (> 0). sde_type (`str`): `"sde"`, `"cps"` or `"dance_sde"`.
        guidance_scale (`float`): true-CFG scale used by the forward (CFG on when > 1).
        seeds (`tuple[int, ...]`): per-sample seed of the initial noise and the SDE noise (see
            `rollout_consistency.adapters.rollout` for how a seed maps to draws).
        prompt_groups (`tuple[int, ...]`): per-sample prompt-group id. global_step (`int`): training step.
        conditioning (`Mapping[str, torch.Tensor]`): what the trainer feeds the model, batch-first: float32
            embeddings (e.g. `prompt_embeds` `(B, L, D)`) and int64 masks (names ending in `_mask`, `(B, L)`).
        model_family (`str`): `"qwen-image"`, `"sd3"`, `"flux"`, `"wan"` or a registered family.
        scheduler ([`SchedulerSetup`]): rebuilds the exact schedule.
        family_options (`Mapping[str, Any]`): JSON-able forward settings of the family (image size, ...).
        include_normalizer (`bool`): whether log-probs include the Gaussian normaliser.
        final_latents (`torch.Tensor` `(B, *latent_shape)`, float32, *optional*): fully denoised latents
            (for the reward); `None` when the rollout stopped after the window.
        provenance (`Mapping[str, str]`): free-form provenance (`path`: `request-level` / `step-wise`, ...).
        experts (`tuple[tuple[str, ...], ...]`, *optional*): for a model with experts by timestep (Wan 2.2's
            `transformer` / `transformer_2`), the expert that took each window step, per sample (`B` tuples of
            `W` names); `None` for a single-expert model.

    The read-only views `.sampling` ([`SamplingSettings`]) and `.requests` ([`BatchRequests`], per sample) give
    the settings back in the form a rollout takes them.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    timesteps: torch.Tensor
    windows: tuple[SDEWindow, ...]
    noise_level: float
    sde_type: str
    guidance_scale: float
    seeds: tuple[int, ...]
    prompt_groups: tuple[int, ...]
    global_step: int
    conditioning: Mapping[str, torch.Tensor]
    model_family: str
    scheduler: SchedulerSetup
    family_options: Mapping[str, Any] = field(default_factory=dict)
    include_normalizer: bool = True
    final_latents: torch.Tensor | None = None
    provenance: Mapping[str, str] = field(default_factory=dict)
    experts: tuple[tuple[str, ...], ...] | None = None

    # ---------------------------------------------------------------- derived views
    @property
    def batch_size(self) -> int:
        return int(self.latents.shape[0])

    @property
    def window_size(self) -> int:
        return int(self.log_probs.shape[1])

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.latents.shape[2:])

    @property
    def sampling(self) -> SamplingSettings:
        """The sampling settings of every step: `noise_level`, `sde_type`, `guidance_scale`, `include_normalizer`."""
        return SamplingSettings.of(self)

    @property
    def requests(self) -> BatchRequests:
        """The batch's samples, per sample: `seeds`, `windows` (one per sample), `prompt_groups`, `global_step`,
        and `denoise_to_end` (whether final latents are stored)."""
        return BatchRequests(
            seeds=self.seeds,
            windows=self.windows,
            prompt_groups=self.prompt_groups,
            global_step=self.global_step,
            denoise_to_end=self.final_latents is not None,
        )

    @property
    def window(self) -> SDEWindow:
        """The window shared by every sample; ValueError if samples have different windows."""
        first = self.windows[0]
        if any(w != first for w in self.windows):
            raise ValueError(
                f"Samples of this trajectory have different SDE windows ({sorted({w.start for w in self.windows})} "
                f"starts); use `.windows` (one per sample) instead of `.window`."
            )
        return first

    def step_indices(self) -> torch.Tensor:
        """Schedule index of each stored step, int64 `(B, W)`."""
        return torch.tensor([list(w.steps) for w in self.windows], dtype=torch.int64)

    # ---------------------------------------------------------------- checks
    def validate(self) -> Trajectory:
        """Check dtypes, shapes, finiteness and that every timestep is the schedule's value at its step.

        Returns `self` so that `Trajectory(...).validate()` chains. Raises ValueError / TypeError naming the
        field and the fix.
        """
        for name in ("latents", "log_probs", "timesteps", "final_latents"):
            tensor = getattr(self, name)
            if tensor is None and name == "final_latents":
                continue
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"Trajectory.{name} must be a torch.Tensor, got {type(tensor).__name__}.")
            if tensor.dtype != torch.float32:
                raise TypeError(
                    f"Trajectory.{name} is {tensor.dtype}; the trajectory stores float32 only. Keep the "
                    f"latents in float32 through the rollout (cast to the transformer's dtype only for its "
                    f"forward) rather than upcasting a rounded tensor here."
                )
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"Trajectory.{name} holds NaN or Inf values.")
        if self.latents.dim() < 3:
            raise ValueError(f"Trajectory.latents must be (B, W+1, *latent_shape); got {tuple(self.latents.shape)}.")
        batch, window_size = self.batch_size, self.window_size
        if batch < 1 or window_size < 1:
            raise ValueError(f"Empty trajectory: batch {batch}, window size {window_size}.")
        if self.log_probs.shape != (batch, window_size) or self.timesteps.shape != (batch, window_size):
            raise ValueError(
                f"log_probs {tuple(self.log_probs.shape)} and timesteps {tuple(self.timesteps.shape)} must both be "
                f"(B, W) = ({batch}, {window_size})."
            )
        if self.latents.shape[1] != window_size + 1:
            raise ValueError(
                f"latents hold {self.latents.shape[1]} samples per rollout for a window of {window_size} steps; "
                f"expected W+1 = {window_size + 1} (the input of each step plus the last step's output)."
            )
        if self.final_latents is not None and tuple(self.final_latents.shape) != (batch, *self.latent_shape):
            raise ValueError(
                f"final_latents {tuple(self.final_latents.shape)} must be (B, *latent_shape) = "
                f"{(batch, *self.latent_shape)}."
            )
        for name in ("windows", "seeds", "prompt_groups"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or len(value) != batch:
                raise ValueError(
                    f"Trajectory.{name} must be a tuple of {batch} entries (one per sample), got {value!r}."
                )
        for window in self.windows:
            if not isinstance(window, SDEWindow):
                raise TypeError(f"Trajectory.windows must hold SDEWindow objects, got {window!r}.")
            if window.size != window_size:
                raise ValueError(f"Window {window} has {window.size} steps but the trajectory stores {window_size}.")
            if window.num_steps != self.scheduler.num_inference_steps:
                raise ValueError(
                    f"Window {window} is for a {window.num_steps}-step schedule but the scheduler setup has "
                    f"{self.scheduler.num_inference_steps} steps."
                )
        # Seeds, prompt groups, training step and the sampling settings follow the rules a rollout's own do,
        # checked where those are (BatchRequests, SamplingSettings).
        self.requests  # noqa: B018
        self.sampling  # noqa: B018
        if not isinstance(self.model_family, str) or not self.model_family:
            raise ValueError(f"model_family must be a non-empty string, got {self.model_family!r}.")
        self._validate_conditioning()
        self._validate_timesteps()
        self._validate_experts()
        try:
            json.dumps(dict(self.family_options), allow_nan=False)
            json.dumps(dict(self.provenance), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise ValueError(f"family_options and provenance must be JSON-able: {error}") from error
        return self

    def _validate_conditioning(self) -> None:
        if not isinstance(self.conditioning, Mapping):
            raise TypeError("Trajectory.conditioning must be a mapping of name → tensor.")
        for name, tensor in self.conditioning.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"conditioning[{name!r}] must be a tensor, got {type(tensor).__name__}.")
            if tensor.dim() == 0 or tensor.shape[0] != self.batch_size:
                raise ValueError(
                    f"conditioning[{name!r}] has shape {tuple(tensor.shape)}; it must be batch-first with "
                    f"B = {self.batch_size} rows."
                )
            expected = torch.int64 if _is_mask_key(name) else torch.float32
            if tensor.dtype != expected:
                raise TypeError(
                    f"conditioning[{name!r}] is {tensor.dtype}, expected {expected} (embeddings are stored in "
                    f"float32, masks in int64)."
                )
            if expected == torch.float32 and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"conditioning[{name!r}] holds NaN or Inf values.")

    def _validate_experts(self) -> None:
        if self.experts is None:
            return
        if not isinstance(self.experts, tuple) or len(self.experts) != self.batch_size:
            raise ValueError(
                f"Trajectory.experts must be a tuple of {self.batch_size} entries (one per sample), got "
                f"{self.experts!r}."
            )
        for row in self.experts:
            if (
                not isinstance(row, tuple)
                or len(row) != self.window_size
                or not all(isinstance(name, str) and name for name in row)
            ):
                raise ValueError(
                    f"Trajectory.experts must hold one tuple of {self.window_size} expert names per sample (one per "
                    f"window step), got {row!r}."
                )

    def _validate_timesteps(self) -> None:
        schedule = self.scheduler.timesteps()
        expected = schedule[self.step_indices()]
        if not torch.equal(expected, self.timesteps.cpu()):
            bad = (expected != self.timesteps.cpu()).nonzero()[0].tolist()
            raise ValueError(
                f"timesteps[{bad[0]}, {bad[1]}] = {self.timesteps[bad[0], bad[1]].item()!r} is not the schedule's "
                f"value {expected[bad[0], bad[1]].item()!r} at step {self.windows[bad[0]].start + bad[1]}: the "
                f"stored timesteps, windows and scheduler setup disagree (a stale step-index mapping or a "
                f"timestep that went through a lower-precision dtype)."
            )

    # ---------------------------------------------------------------- conveniences
    def to(self, device: torch.device | str) -> Trajectory:
        """A copy with every tensor on `device` (dtypes unchanged)."""
        return replace(
            self,
            latents=self.latents.to(device),
            log_probs=self.log_probs.to(device),
            timesteps=self.timesteps.to(device),
            conditioning={k: v.to(device) for k, v in self.conditioning.items()},
            final_latents=None if self.final_latents is None else self.final_latents.to(device),
        )

    def select(self, indices: list[int] | range) -> Trajectory:
        """The sub-batch of the given sample indices (e.g. a trainer micro-batch)."""
        index = torch.as_tensor(list(indices), dtype=torch.int64)
        if index.numel() == 0:
            raise ValueError("select() needs at least one sample index.")
        picked = index.tolist()
        return replace(
            self,
            latents=self.latents[index.to(self.latents.device)],
            log_probs=self.log_probs[index.to(self.log_probs.device)],
            timesteps=self.timesteps[index.to(self.timesteps.device)],
            windows=tuple(self.windows[i] for i in picked),
            seeds=tuple(self.seeds[i] for i in picked),
            prompt_groups=tuple(self.prompt_groups[i] for i in picked),
            conditioning={k: v[index.to(v.device)] for k, v in self.conditioning.items()},
            final_latents=None
            if self.final_latents is None
            else self.final_latents[index.to(self.final_latents.device)],
            experts=None if self.experts is None else tuple(self.experts[i] for i in picked),
        )

    def stored_bytes(self) -> int:
        """Bytes of tensor data this trajectory stores (excluding the file header)."""
        tensors, _ = self.to_parts()
        return sum(t.numel() * t.element_size() for t in tensors.values())

    # ---------------------------------------------------------------- file I/O
    def to_parts(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """`(tensors, fields)`: the CPU tensors (conditioning under `conditioning.<name>`) and the JSON-able
        fields — what the file stores and what a vLLM-omni engine sends back. Inverse: [`from_parts`]."""
        tensors = {"latents": self.latents, "log_probs": self.log_probs, "timesteps": self.timesteps}
        if self.final_latents is not None:
            tensors["final_latents"] = self.final_latents
        for name in sorted(self.conditioning):  # sorted: the same trajectory always writes the same bytes
            tensors[_COND_PREFIX + name] = self.conditioning[name]
        fields_ = {
            "windows": [[w.start, w.size, w.num_steps] for w in self.windows],
            "noise_level": float(self.noise_level),
            "sde_type": self.sde_type,
            "guidance_scale": float(self.guidance_scale),
            "seeds": list(self.seeds),
            "prompt_groups": list(self.prompt_groups),
            "global_step": self.global_step,
            "model_family": self.model_family,
            "scheduler": self.scheduler.to_json_dict(),
            "family_options": dict(self.family_options),
            "include_normalizer": bool(self.include_normalizer),
            "provenance": dict(self.provenance),
        }
        if self.experts is not None:
            fields_["experts"] = [list(row) for row in self.experts]
        return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, fields_

    @classmethod
    def from_parts(cls, tensors: Mapping[str, torch.Tensor], fields_: Mapping[str, Any], *, source: str) -> Trajectory:
        """The validated trajectory of [`to_parts`]' output; nothing is cast.

        Raises:
            TrajectoryFormatError: a missing tensor or field, a latent / log-prob / timestep tensor that is not
                float32 (the writer kept a low-precision copy), or an invalid trajectory. `source` names where
                the parts came from, in the message.
        """
        for name in ("latents", "log_probs", "timesteps", "final_latents"):
            tensor = tensors.get(name)
            if tensor is not None and (not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32):
                raise TrajectoryFormatError(
                    f"{source}: tensor {name!r} is {getattr(tensor, 'dtype', type(tensor).__name__)}; trajectories "
                    f"store float32 only. The writer kept a low-precision copy — fix the rollout to keep and store "
                    f"float32 latents."
                )
        for name in ("latents", "log_probs", "timesteps"):
            if name not in tensors:
                raise TrajectoryFormatError(f"{source}: tensor {name!r} is missing.")
        missing = [name for name in _FIELDS if name not in fields_]
        if missing:
            raise TrajectoryFormatError(f"{source}: metadata field {missing[0]!r} is missing.")
        try:
            return cls(
                latents=tensors["latents"],
                log_probs=tensors["log_probs"],
                timesteps=tensors["timesteps"],
                windows=tuple(SDEWindow(start=s, size=n, num_steps=t) for s, n, t in fields_["windows"]),
                noise_level=float(fields_["noise_level"]),
                sde_type=fields_["sde_type"],
                guidance_scale=float(fields_["guidance_scale"]),
                seeds=tuple(fields_["seeds"]),
                prompt_groups=tuple(fields_["prompt_groups"]),
                global_step=fields_["global_step"],
                conditioning={
                    k[len(_COND_PREFIX) :]: v for k, v in sorted(tensors.items()) if k.startswith(_COND_PREFIX)
                },
                model_family=fields_["model_family"],
                scheduler=SchedulerSetup.from_json_dict(fields_["scheduler"]),
                family_options=dict(fields_["family_options"]),
                include_normalizer=bool(fields_["include_normalizer"]),
                final_latents=tensors.get("final_latents"),
                provenance=dict(fields_["provenance"]),
                experts=None if fields_.get("experts") is None else tuple(tuple(row) for row in fields_["experts"]),
            ).validate()
        except TrajectoryFormatError:
            raise
        except (TypeError, ValueError, KeyError) as error:
            raise TrajectoryFormatError(f"{source}: not a valid trajectory: {error}") from error

    def save(self, path: str | os.PathLike) -> Path:
        """Validate, then write atomically (temp file + rename) to `path`. Returns the path."""
        self.validate()
        tensors, fields_ = self.to_parts()
        metadata = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "sha256": tensors_sha256(tensors)}
        metadata.update({name: json.dumps(value, allow_nan=False) for name, value in fields_.items()})
        data = save_safetensors_bytes(tensors, metadata=metadata)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, device: torch.device | str = "cpu") -> Trajectory:
        """Read a trajectory written by [`save`], bit-exact, and validate it.

        Raises:
            FileNotFoundError: no such file.
            TrajectoryFormatError: truncated or corrupted file, another format or version, missing fields,
                non-float32 latents / log-probs / timesteps / embeddings, or a checksum mismatch.
        """
        path = Path(path)
        data = _read_checked_bytes(path)
        metadata = _read_header_metadata(data, path)
        try:
            tensors = load_safetensors_bytes(data)
        except Exception as error:  # safetensors raises its own SafetensorError / ValueError types
            raise TrajectoryFormatError(
                f"{path}: the safetensors body cannot be read ({error}); the file is corrupted or truncated — "
                f"re-export the trajectory from the rollout."
            ) from error
        unknown = sorted(name for name in tensors if name not in _TENSOR_NAMES and not name.startswith(_COND_PREFIX))
        if unknown:
            raise TrajectoryFormatError(
                f"{path}: unknown tensor {unknown[0]!r}; a trajectory holds {', '.join(_TENSOR_NAMES)} and "
                f"'conditioning.<name>' tensors. Rename it to 'conditioning.{unknown[0]}' if the model needs it."
            )
        if metadata.get("sha256") != tensors_sha256(tensors):
            raise TrajectoryFormatError(
                f"{path}: checksum mismatch — the tensor data changed after it was written (corruption or a "
                f"tool that rewrote the file). Re-export the trajectory from the rollout."
            )
        try:
            fields_ = {key: json.loads(metadata[key]) for key in (*_FIELDS, *_OPTIONAL_FIELDS) if key in metadata}
        except json.JSONDecodeError as error:
            raise TrajectoryFormatError(f"{path}: a metadata field is not valid JSON ({error}).") from error
        trajectory = cls.from_parts(tensors, fields_, source=str(path))
        return trajectory.to(device) if str(device) != "cpu" else trajectory


_FIELDS = tuple(
    f.name
    for f in fields(Trajectory)
    if f.name not in ("latents", "log_probs", "timesteps", "conditioning", "final_latents", "experts")
)
#: Metadata fields a file may lack (added after format version 1 was released, without changing it).
_OPTIONAL_FIELDS = ("experts",)


_TENSOR_NAMES = ("latents", "log_probs", "timesteps", "final_latents")


def read_header_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The validated header metadata of a trajectory file (format, version, fields as JSON strings), read
    without reading the tensor data. Raises FileNotFoundError or [`TrajectoryFormatError`]."""
    path = Path(path)
    with _open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        header_len = _header_length(prefix, size, path)
        return _read_header_metadata(prefix + handle.read(header_len), path, file_size=size)


def _open_regular(path: Path) -> Any:
    """`open(path, "rb")` with a one-line error for a directory, a symlink loop or an unreadable file."""

    if path.is_dir():
        raise TrajectoryFormatError(f"{path} is a directory; name the trajectory .safetensors file inside it.")
    try:
        return open_regular(path, "")  # never blocks: a FIFO or a device is refused
    except InputPathError as error:
        raise TrajectoryFormatError(str(error)) from error


def _header_length(prefix: bytes, size: int, path: Path) -> int:
    if len(prefix) < 8:
        raise TrajectoryFormatError(f"{path}: {size} bytes — too short to be a safetensors file (truncated?).")
    header_len = int.from_bytes(prefix, "little")
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
        raise TrajectoryFormatError(
            f"{path}: the header claims {header_len} bytes but the file has {size - 8} after the length "
            f"prefix; the file is truncated or not a safetensors file."
        )
    return header_len


def _read_checked_bytes(path: Path) -> bytes:
    """The whole file, read only after its header was validated and no larger than the header says."""
    with _open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        header_len = _header_length(prefix, size, path)
        head = prefix + handle.read(header_len)
        _read_header_metadata(head, path, file_size=size)  # raises before the data is read

        # The bytes, the tensors and the checksum's copies: refuse what cannot fit before reading it.
        check_fits(3 * size, f"loading the trajectory {path} ({size} bytes)", "check fewer samples per file")
        body = handle.read(size - len(head))
    if len(head) + len(body) != size:
        raise TrajectoryFormatError(f"{path}: the file changed size while it was read; write it completely first.")
    return head + body


def tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """The file format's `sha256` metadata: SHA-256 over (name, dtype, shape, bytes) of every tensor, in name order.

    A writer of its own trajectory files stores this; `Trajectory.load` recomputes it and rejects a mismatch.
    """
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _read_header_metadata(data: bytes, path: Path, file_size: int | None = None) -> dict[str, str]:
    """Parse the safetensors header ourselves so a damaged file gets a precise message.

    `data` holds at least the length prefix and the header; `file_size` is the file's size when `data` is
    not the whole file (default: ``len(data)``)."""
    file_size = len(data) if file_size is None else file_size
    if len(data) < 8:
        raise TrajectoryFormatError(f"{path}: {len(data)} bytes — too short to be a safetensors file (truncated?).")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > min(len(data), file_size):
        raise TrajectoryFormatError(
            f"{path}: the header claims {header_len} bytes but the file has {file_size - 8} after the length "
            f"prefix; the file is truncated or not a safetensors file."
        )
    try:
        header = json.loads(data[8 : 8 + header_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TrajectoryFormatError(
            f"{path}: the safetensors header is not valid JSON ({error}); the file is corrupted."
        ) from error
    if not isinstance(header, dict):
        raise TrajectoryFormatError(f"{path}: the safetensors header is not a JSON object; the file is corrupted.")
    metadata = header.get("__metadata__") or {}
    if metadata.get("format") != FORMAT_NAME:
        raise TrajectoryFormatError(
            f"{path}: not a rollout-consistency trajectory (header format {metadata.get('format')!r}, expected "
            f"{FORMAT_NAME!r}). Write trajectories with Trajectory.save()."
        )
    if metadata.get("format_version") != FORMAT_VERSION:
        raise TrajectoryFormatError(
            f"{path}: trajectory format version {metadata.get('format_version')!r}; this reader understands "
            f"{FORMAT_VERSION!r}. Upgrade rollout-consistency or re-export with this version."
        )
    try:
        end = max((int(info["data_offsets"][1]) for key, info in header.items() if key != "__metadata__"), default=0)
    except (TypeError, ValueError, KeyError, IndexError) as error:
        raise TrajectoryFormatError(f"{path}: a tensor entry of the header is malformed ({error!r}).") from error
    if 8 + header_len + end != file_size:
        raise TrajectoryFormatError(
            f"{path}: the header describes {end} bytes of tensor data but the file holds "
            f"{file_size - 8 - header_len}; the file is truncated or has trailing bytes."
        )
    return metadata


def stack_trajectories(trajectories: list[Trajectory], family: Any) -> Trajectory:
    """Concatenate trajectories of one family/schedule/settings along the batch.

    Conditioning is batched by `family.collate_conditioning` (the trajectories' `ModelFamily`, from
    `rollout_consistency.adapters.get_family(trajectory.model_family)`): Qwen-Image zero-pads texts of
    different lengths (its key-padding mask hides the padding), so step-wise rollouts of prompts of
    different lengths can be recomputed as one batch; SD3 and FLUX attend to padding and refuse texts of
    different widths. Raises ValueError if the settings differ.
    """
    if not trajectories:
        raise ValueError("stack_trajectories needs at least one trajectory.")
    first = trajectories[0]
    for other in trajectories[1:]:
        for name in ("noise_level", "sde_type", "guidance_scale", "global_step", "model_family", "include_normalizer"):
            if getattr(other, name) != getattr(first, name):
                raise ValueError(
                    f"Cannot stack trajectories with different {name}: {getattr(first, name)!r} vs "
                    f"{getattr(other, name)!r}."
                )
        if other.scheduler.to_json_dict() != first.scheduler.to_json_dict():
            raise ValueError("Cannot stack trajectories with different scheduler setups.")
        if dict(other.family_options) != dict(first.family_options):
            raise ValueError("Cannot stack trajectories with different family_options.")
        if set(other.conditioning) != set(first.conditioning):
            raise ValueError(
                f"Cannot stack trajectories with different conditioning keys: "
                f"{sorted(first.conditioning)} vs {sorted(other.conditioning)}."
            )
        if other.latents.shape[1:] != first.latents.shape[1:]:
            raise ValueError(
                f"Cannot stack trajectories with latents {tuple(first.latents.shape[1:])} and "
                f"{tuple(other.latents.shape[1:])} per sample."
            )
    if getattr(family, "name", first.model_family) != first.model_family:
        raise ValueError(
            f"Cannot stack {first.model_family!r} trajectories with the {family.name!r} family's collation."
        )
    conditioning = family.collate_conditioning([t.conditioning for t in trajectories], None)
    optional_final = [t.final_latents for t in trajectories]
    recorded = [t.experts for t in trajectories]
    return replace(
        first,
        latents=torch.cat([t.latents for t in trajectories]),
        log_probs=torch.cat([t.log_probs for t in trajectories]),
        timesteps=torch.cat([t.timesteps for t in trajectories]),
        windows=sum((t.windows for t in trajectories), ()),
        seeds=sum((t.seeds for t in trajectories), ()),
        prompt_groups=sum((t.prompt_groups for t in trajectories), ()),
        conditioning=conditioning,
        final_latents=None if any(f is None for f in optional_final) else torch.cat(optional_final),
        provenance=dict(first.provenance),
        experts=None if any(e is None for e in recorded) else sum(recorded, ()),
    )
