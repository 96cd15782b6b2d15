# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Flow-matching SDE scheduler that returns fp32 samples and per-sample log-probabilities.

A drop-in subclass of diffusers' ``FlowMatchEulerDiscreteScheduler``: same config, same
``set_timesteps`` (sigmas / mu / shift), same ``from_pretrained(..., subfolder="scheduler")``. What it
changes is ``step``:

* every input is upcast to float32 and ``prev_sample`` is **never cast back** to the model's dtype
  (diffusers' own ``step`` casts it to ``model_output.dtype``; storing that bf16 sample and re-scoring it
  in the trainer is the "precision loss in stored latents" pitfall);
* it implements the stochastic steps of Flow-GRPO (``"sde"``), coefficient-preserving sampling
  (``"cps"``) and DanceGRPO (``"dance_sde"``), returning the log-probability of ``prev_sample`` reduced
  by the mean over all non-batch dimensions (shape ``(B,)``);
* given ``prev_sample`` it scores that sample instead of drawing one (the trainer's recompute path);
  the rollout path scores its own draw through the very same code, so rollout and recompute agree bit
  for bit in fp32;
* timesteps are looked up per sample by exact value (no hidden step counter), so a trainer may shuffle
  timesteps across a batch.

``sample_previous_step`` is the strict entry point: it refuses non-float32 tensors instead of casting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor

SDE_TYPES = ("sde", "cps", "dance_sde")

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass
class FlowMatchSDESchedulerOutput(BaseOutput):
    """Output of [`FlowMatchSDEDiscreteScheduler.step`].

    Args:
        prev_sample (`torch.Tensor` of shape `(B, ...)`, float32):
            The sample at the next (less noisy) timestep: drawn by the step, or the `prev_sample` that was
            passed in (then returned unchanged apart from the float32 upcast).
        log_prob (`torch.Tensor` of shape `(B,)`, float32, or `None`):
            Log-probability of `prev_sample` under the step's transition, averaged over all non-batch
            dimensions. `None` for a deterministic (`noise_level == 0`) step.
        prev_sample_mean (`torch.Tensor` of shape `(B, ...)`, float32):
            Mean of the transition. Carries the gradient to the model output when one is required.
        prev_sample_std (`torch.Tensor` of shape `(B,)`, float32):
            Standard deviation of the noise added to `prev_sample_mean` (0 for a deterministic step).
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor | None
    prev_sample_mean: torch.Tensor
    prev_sample_std: torch.Tensor


class FlowMatchSDEDiscreteScheduler(FlowMatchEulerDiscreteScheduler):
    """Flow-matching Euler scheduler with SDE steps and log-probabilities for RL.

    Configuration is exactly that of [`~diffusers.FlowMatchEulerDiscreteScheduler`] (this class adds no
    config keys), so any saved FlowMatchEuler scheduler config loads with `from_config` /
    `from_pretrained(path, subfolder="scheduler")`. Only the default, non-stochastic-sampling config is
    supported by the SDE steps: `stochastic_sampling=True` and `invert_sigmas=True` are rejected at `step`.

    Guarantees:
        * `prev_sample`, `prev_sample_mean`, `log_prob` and `prev_sample_std` are float32, whatever the
          dtype of the inputs.
        * With the same inputs, scoring a given `prev_sample` reproduces the log-probability that was
          returned when that sample was drawn, bit for bit.
        * `noise_level=0` is the Euler (ODE) step and matches diffusers' step for float32 inputs.
        * The noise is drawn in float32 from `generator` only (one generator, or one per sample).
    Not guaranteed:
        * Bit-equality across devices or across torch versions (kernels differ).
    """

    def step(
        self,
        model_output: torch.Tensor,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        *,
        noise_level: float,
        sde_type: str = "sde",
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        include_normalizer: bool = True,
        return_dict: bool = True,
    ) -> FlowMatchSDESchedulerOutput | tuple:
        """One denoising step from `timestep` to the next timestep of the schedule.

        Inputs of any floating dtype are upcast to float32 (use [`sample_previous_step`] to reject
        anything that is not float32 instead).

        Args:
            model_output (`torch.Tensor` of shape `(B, ...)`):
                The velocity predicted by the transformer (noise_pred) at `sample`.
            timestep (`float`, 0-d tensor, or `torch.Tensor` of shape `(B,)`):
                Current timestep(s); each must be one of `self.timesteps` exactly. A per-sample tensor lets
                one batch hold samples at different steps.
            sample (`torch.Tensor` of shape `(B, ...)`):
                The current latents `x` at `timestep`.
            noise_level (`float`):
                SDE noise level (Flow-GRPO's `noise_level`, DanceGRPO's eta). `0` is the Euler ODE step.
            sde_type (`str`, defaults to `"sde"`):
                One of `"sde"` (Flow-GRPO), `"cps"` (coefficient-preserving), `"dance_sde"` (DanceGRPO).
            prev_sample (`torch.Tensor` of shape `(B, ...)`, *optional*):
                A sample to score instead of drawing one (the trainer's recompute path). It is detached:
                gradients reach the model only through the transition mean.
            generator (`torch.Generator` or list of `B` generators, *optional*):
                Source of the float32 noise when a sample is drawn. A list draws each sample from its own
                generator, so a sample's noise does not depend on its batch-mates.
            include_normalizer (`bool`, defaults to `True`):
                Include the Gaussian normaliser `-log(std) - log(2π)/2` in `log_prob` (`"sde"` and
                `"dance_sde"`; `"cps"` has none). It cancels in log-ratios whenever both sides use the
                same noise settings.
            return_dict (`bool`, defaults to `True`):
                Return a [`FlowMatchSDESchedulerOutput`] rather than a tuple.

        Returns:
            [`FlowMatchSDESchedulerOutput`], or the tuple
            `(prev_sample, log_prob, prev_sample_mean, prev_sample_std)`.
        """
        model_output, sample, prev_sample = (
            None if t is None else t.float() for t in (model_output, sample, prev_sample)
        )
        return self._sde_step(
            model_output,
            timestep,
            sample,
            noise_level=noise_level,
            sde_type=sde_type,
            prev_sample=prev_sample,
            generator=generator,
            include_normalizer=include_normalizer,
            return_dict=return_dict,
        )

    def sample_previous_step(
        self,
        model_output: torch.Tensor,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        *,
        noise_level: float,
        sde_type: str = "sde",
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        include_normalizer: bool = True,
    ) -> FlowMatchSDESchedulerOutput:
        """Strict form of [`step`]: identical maths, but every tensor must already be float32.

        Raises:
            TypeError: `model_output`, `sample` or `prev_sample` is not float32. Nothing is cast down or up
                silently: the caller keeps latents in float32 and casts the transformer's output with
                `noise_pred.float()` before calling.
        """
        for name, tensor in (("model_output", model_output), ("sample", sample), ("prev_sample", prev_sample)):
            if tensor is not None and tensor.dtype != torch.float32:
                raise TypeError(
                    f"sample_previous_step: `{name}` is {tensor.dtype}, expected torch.float32. Keep latents "
                    f"in float32 (cast to the transformer's dtype only for its forward) and pass "
                    f"`{name}.float()`; a low-precision `{name}` silently biases the log-probability."
                )
        return self._sde_step(
            model_output,
            timestep,
            sample,
            noise_level=noise_level,
            sde_type=sde_type,
            prev_sample=prev_sample,
            generator=generator,
            include_normalizer=include_normalizer,
            return_dict=True,
        )

    def step_sigmas(self, timestep: float | torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmas `(σ, σ')` of the current and next timestep, each of shape `(batch_size,)`, float32.

        Raises:
            ValueError: a timestep that is not exactly one of `self.timesteps`, or a batch-size mismatch.
        """
        if getattr(self, "num_inference_steps", None) is None or self.timesteps is None:
            raise RuntimeError("Call `set_timesteps(...)` before stepping the scheduler.")
        schedule = self.timesteps.to(dtype=torch.float32)
        t = torch.as_tensor(timestep, dtype=torch.float32).to(schedule.device).reshape(-1)
        if t.numel() == 1:
            t = t.expand(batch_size)
        elif t.numel() != batch_size:
            raise ValueError(
                f"`timestep` has {t.numel()} entries for a batch of {batch_size}: pass one timestep, or one "
                f"per sample (shape ({batch_size},))."
            )
        # Exact equality, as diffusers' `index_for_timestep`: a timestep that drifted through a dtype
        # round-trip is a consistency bug to report, not to paper over with a nearest match.
        matches = t[:, None] == schedule[None, :]
        found = matches.any(dim=1)
        if not bool(found.all()):
            missing = t[~found].tolist()
            terminal = self.sigmas[-1].item() * self.config.num_train_timesteps
            if any(value == terminal for value in missing):
                raise ValueError(
                    f"timestep {terminal:g} is the end of the schedule: there is no step after it "
                    f"({schedule.numel()} steps were set)."
                )
            raise ValueError(
                f"timestep(s) {missing} are not in the schedule ({schedule.numel()} steps, "
                f"{schedule[0].item():.6g} … {schedule[-1].item():.6g}). Pass values taken from "
                f"`scheduler.timesteps` after the same `set_timesteps(...)` call, kept in float32."
            )
        index = matches.to(torch.int8).argmax(dim=1)
        sigmas = self.sigmas.to(device=schedule.device, dtype=torch.float32)
        return sigmas[index], sigmas[index + 1]

    # ------------------------------------------------------------------------------------------------
    def _sde_step(
        self,
        model_output: torch.Tensor,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        *,
        noise_level: float,
        sde_type: str,
        prev_sample: torch.Tensor | None,
        generator: torch.Generator | list[torch.Generator] | None,
        include_normalizer: bool,
        return_dict: bool,
    ) -> FlowMatchSDESchedulerOutput | tuple:
        if sde_type not in SDE_TYPES:
            raise ValueError(f"Unknown sde_type {sde_type!r}; expected one of {', '.join(SDE_TYPES)}.")
        if not math.isfinite(noise_level) or noise_level < 0:
            raise ValueError(f"noise_level must be a finite number >= 0, got {noise_level!r}.")
        if self.config.stochastic_sampling or self.config.invert_sigmas:
            raise ValueError(
                "FlowMatchSDEDiscreteScheduler supports neither `stochastic_sampling` nor `invert_sigmas`; "
                "load the scheduler config with both set to False."
            )
        if sample.dim() < 2:
            raise ValueError(f"`sample` must have a batch dimension and at least one more; got {tuple(sample.shape)}.")
        for name, tensor in (("model_output", model_output), ("prev_sample", prev_sample)):
            if tensor is not None and tensor.shape != sample.shape:
                raise ValueError(
                    f"`{name}` has shape {tuple(tensor.shape)} but `sample` has {tuple(sample.shape)}; "
                    f"they must match exactly (no broadcasting)."
                )

        batch = sample.shape[0]
        sigma, sigma_next = self.step_sigmas(timestep, batch)
        view = (batch,) + (1,) * (sample.dim() - 1)

        if noise_level == 0:
            # Exactly diffusers' Euler update (same operations, same rounding).
            dt = (sigma_next - sigma).to(sample.device).view(view)
            mean = sample + dt * model_output
            std = torch.zeros(batch, dtype=torch.float32, device=sample.device)
            return self._output(mean if prev_sample is None else prev_sample, None, mean, std, return_dict)

        sigma_max = self.sigmas[1].item()
        coef_sample, coef_output, std = _transition_coefficients(sigma, sigma_next, sigma_max, noise_level, sde_type)
        coef_sample, coef_output = coef_sample.to(sample.device).view(view), coef_output.to(sample.device).view(view)
        std = std.to(sample.device)
        # Every transition is linear in (x, v): mean = a·x + b·v with per-sample scalars, two passes over
        # memory. In-place on a fresh tensor is autograd-safe: the product's backward does not need it.
        mean = (sample * coef_sample).addcmul_(model_output, coef_output)

        if prev_sample is None:
            noise = randn_tensor(sample.shape, generator=generator, device=sample.device, dtype=torch.float32)
            prev_sample = torch.addcmul(mean.detach(), noise, std.view(view))
            del noise  # let the allocator reuse it for the residual
        log_prob = _reduced_log_prob(prev_sample.detach(), mean, std, sde_type, include_normalizer)
        return self._output(prev_sample, log_prob, mean, std, return_dict)

    @staticmethod
    def _output(prev_sample, log_prob, mean, std, return_dict):
        if not return_dict:
            return prev_sample, log_prob, mean, std
        return FlowMatchSDESchedulerOutput(
            prev_sample=prev_sample, log_prob=log_prob, prev_sample_mean=mean, prev_sample_std=std
        )


def _transition_coefficients(
    sigma: torch.Tensor, sigma_next: torch.Tensor, sigma_max: float, noise_level: float, sde_type: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample `(a, b, std)`, each `(B,)` float32, with transition mean `a·x + b·v` (DESIGN.md §2).

    Worked in float64 on `B` scalars so that the only float32 roundings on the latent are the two of
    `a·x + b·v`:
      sde:       std_dev = η·sqrt(σ / (1 − σ̃)), σ̃ = σ_max if σ == 1 else σ;
                 a = 1 + std_dev²·dt/(2σ),  b = (1 + std_dev²(1−σ)/(2σ))·dt,  std = std_dev·sqrt(−dt)
      cps:       std = σ'·sin(ηπ/2), k = sqrt(σ'² − std²); x̂0 = x − σv, x̂1 = x + (1−σ)v
                 mean = x̂0(1−σ') + x̂1·k  →  a = (1−σ') + k,  b = −σ(1−σ') + (1−σ)k
      dance_sde: score = −(x − x̂0(1−σ))/σ² = −(x + (1−σ)v)/σ; mean = x + dt·v − ½η²·score·dt
                 →  a = 1 + ½η²dt/σ,  b = dt + ½η²dt(1−σ)/σ,  std = η·sqrt(σ − σ')
    """
    s, s_next = sigma.double(), sigma_next.double()
    dt = s_next - s
    if sde_type == "sde":
        std_dev = noise_level * torch.sqrt(s / (1 - torch.where(s == 1, torch.full_like(s, sigma_max), s)))
        a = 1 + std_dev**2 * dt / (2 * s)
        b = (1 + std_dev**2 * (1 - s) / (2 * s)) * dt
        std = std_dev * torch.sqrt(-dt)
    elif sde_type == "cps":
        std = s_next * math.sin(noise_level * math.pi / 2)
        k = torch.sqrt(s_next**2 - std**2)
        a = (1 - s_next) + k
        b = -s * (1 - s_next) + (1 - s) * k
    else:  # dance_sde
        half_eta_sq = 0.5 * noise_level**2
        a = 1 + half_eta_sq * dt / s
        b = dt + half_eta_sq * dt * (1 - s) / s
        std = noise_level * torch.sqrt(s - s_next)
    return a.float(), b.float(), std.float()


def _reduced_log_prob(
    prev_sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, sde_type: str, include_normalizer: bool
) -> torch.Tensor:
    """Per-sample log-density averaged over non-batch dims, shape `(B,)`, float32.

    The differences compared downstream are ~1e-6 of values ~1, so the reduction's own rounding must stay
    far below 1e-7 relative. Squares are summed in float32 over chunks of at most 512 elements (~4e-9
    relative) and the chunk sums in float64; a float32 sum over the whole latent would add ~6e-8, and a
    float64 sum would materialise a float64 copy of the latent.
    """
    batch = prev_sample.shape[0]
    residual = (prev_sample - mean).reshape(batch, -1)
    numel = residual.shape[1]
    # Nothing to differentiate (rollout, no-grad recompute): square in place, one latent-sized buffer less.
    squares = residual.square() if residual.requires_grad else residual.square_()
    chunk_sums = squares.view(batch, -1, math.gcd(numel, 512)).sum(dim=2)
    mean_sq = chunk_sums.sum(dim=1, dtype=torch.float64) / numel
    if sde_type == "cps":
        return (-mean_sq).to(torch.float32)
    std64 = std.to(torch.float64)
    log_prob = -mean_sq / (2 * std64**2)
    if include_normalizer:
        log_prob = log_prob - torch.log(std64) - _HALF_LOG_2PI
    return log_prob.to(torch.float32)
