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
from typing import ClassVar, Literal

import torch
from diffusers.configuration_utils import register_to_config
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from diffusers.utils import BaseOutput

SDE_TYPES = ("sde", "cps", "dance_sde")

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


class TimestepNotInScheduleError(ValueError):
    """A step asked for at timesteps this scheduler's schedule does not hold (exact float32 equality).

    Attributes: `missing`, the values asked for that are not in it; `schedule`, the scheduler's timesteps (both
    tuples of Python floats, the float32 values exactly): what a caller needs to say which schedule a stored
    timestep came from.
    """

    def __init__(self, message: str, missing: tuple[float, ...], schedule: tuple[float, ...]) -> None:
        super().__init__(message)
        self.missing = missing
        self.schedule = schedule


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
            Standard deviation of the noise actually added to `prev_sample_mean`: the transition's std, the
            number in `log_prob`'s Gaussian (0 for a deterministic step). For `"sde"` this is
            `std_dev_t·sqrt(−dt)`, NOT Flow-GRPO's `std_dev_t`.
        std_dev_t (`torch.Tensor` of shape `(B,)`, float32):
            Flow-GRPO's `std_dev_t`, the per-unit-time noise scale its trainers reuse in their KL term
            (`‖Δmean‖² / (2·std_dev_t²)`): `η·sqrt(σ/(1−σ̃))` for `"sde"` (so `prev_sample_std =
            std_dev_t·sqrt(−dt)`), `σ'·sin(ηπ/2)` for `"cps"` (equal to `prev_sample_std`), `η` for
            `"dance_sde"` (`prev_sample_std = η·sqrt(−dt)`); 0 for a deterministic step.
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor | None
    prev_sample_mean: torch.Tensor
    prev_sample_std: torch.Tensor
    std_dev_t: torch.Tensor | None = None


@dataclass(frozen=True)
class _ScheduleLookup:
    """A scheduler's `timesteps` and `sigmas` as Python floats, for the per-call lookup of a step's sigmas."""

    timesteps: torch.Tensor  # the tensors it was built from (held, so that `is` identifies them)
    sigmas: torch.Tensor
    # Their in-place version counters at build time, or, for inference tensors (which track no version: a
    # scheduler set up under torch.inference_mode, as vLLM-omni's runner does), copies compared by value.
    versions: tuple[int, int] | tuple[torch.Tensor, torch.Tensor]
    schedule: tuple[float, ...]
    pairs: dict[float, tuple[float, float]]  # timestep value -> (σ, σ'), first occurrence as diffusers
    sigma_max: float  # sigmas[1]: Flow-GRPO's stand-in for σ = 1
    terminal: float  # the timestep value of the schedule's end

    @classmethod
    def build(cls, timesteps: torch.Tensor, sigmas: torch.Tensor, num_train_timesteps: int) -> _ScheduleLookup:
        schedule = tuple(timesteps.to(torch.float32).tolist())
        values = sigmas.to(torch.float32).tolist()
        # Exact equality, as diffusers' `index_for_timestep`: a timestep that drifted through a dtype
        # round-trip is a consistency bug to report, not to paper over with a nearest match.
        pairs = {value: (values[i], values[i + 1]) for i, value in reversed(list(enumerate(schedule)))}
        return cls(
            timesteps=timesteps,
            sigmas=sigmas,
            versions=_versions(timesteps, sigmas),
            schedule=schedule,
            pairs=pairs,
            sigma_max=values[1] if len(values) > 1 else values[0],
            terminal=values[-1] * num_train_timesteps,
        )

    def describes(self, timesteps: torch.Tensor, sigmas: torch.Tensor) -> bool:
        if timesteps is not self.timesteps or sigmas is not self.sigmas:
            return False
        if isinstance(self.versions[0], torch.Tensor):
            return torch.equal(timesteps, self.versions[0]) and torch.equal(sigmas, self.versions[1])
        return (timesteps._version, sigmas._version) == self.versions


def _versions(timesteps: torch.Tensor, sigmas: torch.Tensor) -> tuple[int, int] | tuple[torch.Tensor, torch.Tensor]:
    if timesteps.is_inference() or sigmas.is_inference():
        return timesteps.clone(), sigmas.clone()
    return timesteps._version, sigmas._version


class FlowMatchSDEDiscreteScheduler(FlowMatchEulerDiscreteScheduler):
    """Flow-matching Euler scheduler with SDE steps and log-probabilities for RL.

    Configuration is that of [`~diffusers.FlowMatchEulerDiscreteScheduler`] plus two keys, `noise_level`
    (default 0: the Euler step) and `sde_type` (default `"sde"`), the defaults of [`step`] when a call
    does not give them. Any saved FlowMatchEuler scheduler config loads with `from_config` /
    `from_pretrained(path, subfolder="scheduler")`, and a stock diffusers pipeline runs unchanged with
    this scheduler swapped in (`pipe.scheduler = FlowMatchSDEDiscreteScheduler.from_config(pipe.scheduler.config)`).
    Only the default, non-stochastic-sampling config is supported by the SDE steps:
    `stochastic_sampling=True` and `invert_sigmas=True` are rejected at `step`.

    Guarantees:
        * `prev_sample`, `prev_sample_mean`, `log_prob` and `prev_sample_std` are float32 (inputs are
          float32, or bfloat16/float16 upcast by `step`; wider inputs are refused, never cast down).
        * With the same inputs, scoring a given `prev_sample` reproduces the log-probability that was
          returned when that sample was drawn, bit for bit.
        * `noise_level=0` is the Euler (ODE) step and matches diffusers' step for float32 inputs.
        * The noise is drawn in float32 from `generator` only (one generator, or one per sample).
    Not guaranteed:
        * Bit-equality across devices or across torch versions (kernels differ).
    """

    # Schedulers a pipeline may swap for this one (and back) through `from_config`: the same config keys.
    _compatibles: ClassVar[list[str]] = ["FlowMatchEulerDiscreteScheduler", "FlowMatchHeunDiscreteScheduler"]

    @register_to_config
    def __init__(
        self,
        num_train_timesteps: int = 1000,
        shift: float = 1.0,
        use_dynamic_shifting: bool = False,
        base_shift: float | None = 0.5,
        max_shift: float | None = 1.15,
        base_image_seq_len: int = 256,
        max_image_seq_len: int = 4096,
        invert_sigmas: bool = False,
        shift_terminal: float | None = None,
        use_karras_sigmas: bool = False,
        use_exponential_sigmas: bool = False,
        use_beta_sigmas: bool = False,
        time_shift_type: Literal["exponential", "linear"] = "exponential",
        stochastic_sampling: bool = False,
        noise_level: float = 0.0,
        sde_type: str = "sde",
    ):
        _check_noise_settings(noise_level, sde_type)
        super().__init__(
            num_train_timesteps=num_train_timesteps,
            shift=shift,
            use_dynamic_shifting=use_dynamic_shifting,
            base_shift=base_shift,
            max_shift=max_shift,
            base_image_seq_len=base_image_seq_len,
            max_image_seq_len=max_image_seq_len,
            invert_sigmas=invert_sigmas,
            shift_terminal=shift_terminal,
            use_karras_sigmas=use_karras_sigmas,
            use_exponential_sigmas=use_exponential_sigmas,
            use_beta_sigmas=use_beta_sigmas,
            time_shift_type=time_shift_type,
            stochastic_sampling=stochastic_sampling,
        )

    def step(
        self,
        model_output: torch.Tensor,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        s_churn: float = 0.0,
        s_tmin: float = 0.0,
        s_tmax: float = float("inf"),
        s_noise: float = 1.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        per_token_timesteps: torch.Tensor | None = None,
        return_dict: bool = True,
        *,
        noise_level: float | None = None,
        sde_type: str | None = None,
        prev_sample: torch.Tensor | None = None,
        include_normalizer: bool = True,
    ) -> FlowMatchSDESchedulerOutput | tuple:
        """One denoising step from `timestep` to the next timestep of the schedule.

        The positional signature and keywords are those of diffusers' `FlowMatchEulerDiscreteScheduler.step`,
        so a stock pipeline calls it unchanged; `noise_level`, `sde_type`, `prev_sample` and
        `include_normalizer` are keyword-only additions. Low-precision inputs (bfloat16, float16) are upcast
        to float32 when `noise_level` is given (use [`sample_previous_step`] to reject anything that is not
        float32 instead); wider ones (float64) are refused, never cast down.

        `step_index` advances by one per call as in diffusers (initialised on the first call from
        `begin_index` or the timestep). The sigmas are those of `timesteps[step_index]` when that is the
        given timestep, else those of the timestep's exact value (a trainer may pass timesteps in any order,
        or one per sample).

        Args:
            model_output (`torch.Tensor` of shape `(B, ...)`):
                The velocity predicted by the transformer (noise_pred) at `sample`.
            timestep (`float`, 0-d tensor, or `torch.Tensor` of shape `(B,)`):
                Current timestep(s); each must be one of `self.timesteps` exactly. A per-sample tensor lets
                one batch hold samples at different steps.
            sample (`torch.Tensor` of shape `(B, ...)`):
                The current latents `x` at `timestep`.
            s_churn, s_tmin, s_tmax, s_noise, per_token_timesteps:
                diffusers' keywords. They have no meaning for this step (diffusers' FlowMatchEuler step
                ignores the first four too); accepted at their defaults, a `ValueError` otherwise.
            generator (`torch.Generator` or list of `B` generators, *optional*):
                Source of the float32 noise when a sample is drawn. A list draws each sample from its own
                generator, so a sample's noise does not depend on its batch-mates.
            return_dict (`bool`, defaults to `True`):
                Return a [`FlowMatchSDESchedulerOutput`] rather than its `to_tuple()` (which, as diffusers'
                outputs, leaves out `None` fields: no `log_prob` for a deterministic step).
            noise_level (`float`, *optional*, defaults to `config.noise_level`):
                SDE noise level (Flow-GRPO's `noise_level`, DanceGRPO's eta). `0` is the Euler ODE step.
            sde_type (`str`, *optional*, defaults to `config.sde_type`):
                One of `"sde"` (Flow-GRPO), `"cps"` (coefficient-preserving), `"dance_sde"` (DanceGRPO).
            prev_sample (`torch.Tensor` of shape `(B, ...)`, *optional*):
                A sample to score instead of drawing one (the trainer's recompute path). It is detached:
                gradients reach the model only through the transition mean.
            include_normalizer (`bool`, defaults to `True`):
                Include the Gaussian normaliser `-log(std) - log(2π)/2` in `log_prob` (`"sde"` and
                `"dance_sde"`; `"cps"` has none). It cancels in log-ratios whenever both sides use the
                same noise settings.

        Returns:
            [`FlowMatchSDESchedulerOutput`], or its `to_tuple()`.

        Raises:
            TypeError: a `model_output`, `sample` or `prev_sample` wider than float32 (float64) or not a float
                (the fix: `.float()`); or called the diffusers way (no `noise_level`) with a `sample` or
                `model_output` that is not float32: a stock low-precision pipeline, which would store the
                rounded latents (or crash inside its transformer on the float32 result). Use the rollout
                adapters instead.
            ValueError: a diffusers keyword set to a value this step cannot honour, or a bad setting.
        """
        _check_diffusers_keywords(s_churn, s_tmin, s_tmax, s_noise, per_token_timesteps)
        _check_no_downcast(model_output=model_output, sample=sample, prev_sample=prev_sample)
        if noise_level is None:
            # The diffusers calling convention: the loop feeds `prev_sample` back to the transformer as is.
            _check_drop_in_dtypes(model_output, sample)
            noise_level = self.config.noise_level
        if sde_type is None:
            sde_type = self.config.sde_type
        model_output, sample, prev_sample = (
            None if t is None else t.float() for t in (model_output, sample, prev_sample)
        )
        sigma_pairs = None
        scalar = torch.as_tensor(timestep).numel() == 1
        if scalar and getattr(self, "num_inference_steps", None) is not None:
            value = float(timestep)
            if self.step_index is None and bool((self.timesteps == value).any()):
                self._init_step_index(timestep)  # diffusers' own initialisation (begin_index, repeated values)
            index = self.step_index
            # diffusers steps by its counter; where the counter's timestep is the one given (always, in a
            # pipeline) its sigmas are used, which also resolves repeated timestep values as diffusers does.
            # Anything else goes through the exact-value lookup and its errors.
            if index is not None and index + 1 < len(self.sigmas) and self.timesteps[index].item() == value:
                sigma_pairs = [(self.sigmas[index].item(), self.sigmas[index + 1].item())] * sample.shape[0]
        out = self._sde_step(
            model_output,
            timestep,
            sample,
            noise_level=noise_level,
            sde_type=sde_type,
            prev_sample=prev_sample,
            generator=generator,
            include_normalizer=include_normalizer,
            return_dict=return_dict,
            sigma_pairs=sigma_pairs,
        )
        if self.step_index is not None:
            self._step_index += 1  # diffusers' counter; it has no public setter
        return out

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

    def step_sigmas(self, timestep: float | torch.Tensor, batch_size: int) -> list[tuple[float, float]]:
        """Sigmas `(σ, σ')` of the current and next timestep for each of `batch_size` samples.

        Returned as Python floats holding the float32 schedule values exactly: the per-step scalar maths
        runs on a handful of numbers, where tensor ops would cost more than the latent-sized work.

        Raises:
            TimestepNotInScheduleError: a timestep that is not exactly one of `self.timesteps` (a `ValueError`).
            ValueError: a batch-size mismatch.
        """
        lookup = self._lookup()
        # Python floats of the given values, unrounded: a float64 timestep off the float32 schedule value is not
        # rounded onto it (that drift is what the exact lookup reports).
        if isinstance(timestep, (int, float)) or (isinstance(timestep, torch.Tensor) and timestep.numel() == 1):
            requested = [float(timestep)] * batch_size
        else:
            values = timestep if isinstance(timestep, torch.Tensor) else torch.as_tensor(timestep, dtype=torch.float64)
            requested = [float(value) for value in values.reshape(-1).tolist()]
            if len(requested) != batch_size:
                raise ValueError(
                    f"`timestep` has {len(requested)} entries for a batch of {batch_size}: pass one timestep, or one "
                    f"per sample (shape ({batch_size},))."
                )
        missing = [value for value in requested if value not in lookup.pairs]
        if missing:
            if lookup.terminal in missing:
                raise ValueError(
                    f"timestep {lookup.terminal:g} is the end of the schedule: there is no step after it "
                    f"({len(lookup.schedule)} steps were set)."
                )
            raise TimestepNotInScheduleError(
                f"timestep(s) {missing} are not in the schedule ({len(lookup.schedule)} steps, "
                f"{lookup.schedule[0]:.6g} … {lookup.schedule[-1]:.6g}). Pass values taken from `scheduler.timesteps` "
                f"after the same `set_timesteps(...)` call, kept in float32.",
                tuple(missing),
                tuple(lookup.schedule),
            )
        return [lookup.pairs[value] for value in requested]

    def _lookup(self) -> _ScheduleLookup:
        """The schedule as Python floats, rebuilt only when `timesteps` or `sigmas` change (a step would otherwise
        convert both tensors on every call)."""
        if getattr(self, "num_inference_steps", None) is None or self.timesteps is None:
            raise RuntimeError("Call `set_timesteps(...)` before stepping the scheduler.")
        lookup = self.__dict__.get("_schedule_lookup")
        if lookup is None or not lookup.describes(self.timesteps, self.sigmas):
            lookup = _ScheduleLookup.build(self.timesteps, self.sigmas, self.config.num_train_timesteps)
            self.__dict__["_schedule_lookup"] = lookup
        return lookup

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
        sigma_pairs: list[tuple[float, float]] | None = None,
    ) -> FlowMatchSDESchedulerOutput | tuple:
        _check_noise_settings(noise_level, sde_type)
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
        step_sigmas = self.step_sigmas(timestep, batch) if sigma_pairs is None else sigma_pairs
        view = (batch,) + (1,) * (sample.dim() - 1)

        if noise_level == 0:
            # Exactly diffusers' Euler update: dt is the float32 difference of the float32 sigmas (the
            # double difference of two floats is exact, so rounding it once to float32 is the same).
            dt = torch.tensor([s_next - s for s, s_next in step_sigmas], dtype=torch.float32)
            mean = sample + dt.to(sample.device).view(view) * model_output
            std = torch.zeros(batch, dtype=torch.float32, device=sample.device)
            return self._output(mean if prev_sample is None else prev_sample, None, mean, std, std, return_dict)

        # One transition per distinct (σ, σ') pair (a batch is usually one step), in float64 on Python floats.
        sigma_max = self._lookup().sigma_max
        transitions: dict[tuple[float, float], tuple[float, ...]] = {}
        for pair in step_sigmas:
            if pair not in transitions:
                transitions[pair] = _transition(*pair, sigma_max, noise_level, sde_type)
        a, b, std, scale, offset, std_dev_t = zip(*(transitions[pair] for pair in step_sigmas), strict=True)
        # Per-row scalars, two small tensors: the float32 factors the latent-sized ops use, and the float64
        # log-density `scale · Σ(x' − mean)² + offset` (the mean over the non-batch elements folded into scale).
        numel = sample[0].numel()
        factors = torch.tensor([a, b, std, std_dev_t], dtype=torch.float32).to(sample.device)
        density = torch.tensor(
            [[s / numel for s in scale], offset if include_normalizer else [0.0] * batch], dtype=torch.float64
        ).to(sample.device)
        # Every transition is linear in (x, v): mean = a·x + b·v with per-sample scalars, two passes over
        # memory. In-place on a fresh tensor is autograd-safe: the product's backward does not need it.
        mean = torch.mul(sample, factors[0].view(view)).addcmul_(model_output, factors[1].view(view))
        if prev_sample is None:
            noise = _standard_normal(sample.shape, generator, sample.device)
            # Written over the noise (no further latent-sized buffer); the noise is not needed afterwards.
            prev_sample = torch.addcmul(mean.detach(), noise, factors[2].view(view), out=noise)
        chunk_norms = _residual_chunk_norms(prev_sample.detach(), mean)
        sum_sq = chunk_norms.to(torch.float64).square().sum(dim=1)
        log_prob = sum_sq.mul(density[0]).add(density[1]).to(torch.float32)
        return self._output(prev_sample, log_prob, mean, factors[2], factors[3], return_dict)

    @staticmethod
    def _output(prev_sample, log_prob, mean, std, std_dev_t, return_dict):
        out = FlowMatchSDESchedulerOutput(
            prev_sample=prev_sample, log_prob=log_prob, prev_sample_mean=mean, prev_sample_std=std, std_dev_t=std_dev_t
        )
        # diffusers' contract: the tuple form is the output's `to_tuple()` (None fields left out).
        return out if return_dict else out.to_tuple()


def _transition(
    sigma: float, sigma_next: float, sigma_max: float, noise_level: float, sde_type: str
) -> tuple[float, float, float, float, float, float]:
    """One sample's transition `(a, b, std, scale, offset, std_dev_t)`, in float64.

    The mean is `a·x + b·v` (the transition of docs/scheduler.md, rearranged), so the only float32 roundings on the latent are
    the two of `a·x + b·v`:
      sde:       std_dev = η·sqrt(σ / (1 − σ̃)), σ̃ = σ_max if σ == 1 else σ;
                 a = 1 + std_dev²·dt/(2σ),  b = (1 + std_dev²(1−σ)/(2σ))·dt,  std = std_dev·sqrt(−dt)
      cps:       std = σ'·sin(ηπ/2), k = sqrt(σ'² − std²); x̂0 = x − σv, x̂1 = x + (1−σ)v
                 mean = x̂0(1−σ') + x̂1·k  →  a = (1−σ') + k,  b = −σ(1−σ') + (1−σ)k
      dance_sde: score = −(x − x̂0(1−σ))/σ² = −(x + (1−σ)v)/σ; mean = x + dt·v − ½η²·score·dt
                 →  a = 1 + ½η²dt/σ,  b = dt + ½η²dt(1−σ)/σ,  std = η·sqrt(σ − σ')
    `scale` and `offset` make the log-density of a residual r = x' − mean: `scale·r² + offset` per element, i.e.
    `-1/(2·std²)` and the normaliser `-log(std) - log(2π)/2` (`cps`: `-1` and 0, its `-(x' − mean)²`); the last
    entry is Flow-GRPO's `std_dev_t` (see `FlowMatchSDESchedulerOutput`).
    """
    dt = sigma_next - sigma
    if sde_type == "sde":
        std_dev = noise_level * math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma)))
        a = 1 + std_dev**2 * dt / (2 * sigma)
        b = (1 + std_dev**2 * (1 - sigma) / (2 * sigma)) * dt
        std = std_dev * math.sqrt(-dt)
    elif sde_type == "cps":
        std = sigma_next * math.sin(noise_level * math.pi / 2)
        k = math.sqrt(max(sigma_next**2 - std**2, 0.0))
        a = (1 - sigma_next) + k
        b = -sigma * (1 - sigma_next) + (1 - sigma) * k
        return a, b, std, -1.0, 0.0, std
    else:  # dance_sde
        half_eta_sq = 0.5 * noise_level**2
        a = 1 + half_eta_sq * dt / sigma
        b = dt + half_eta_sq * dt * (1 - sigma) / sigma
        std = noise_level * math.sqrt(sigma - sigma_next)
        std_dev = noise_level
    return a, b, std, -0.5 / std**2, -math.log(std) - _HALF_LOG_2PI, std_dev


def _check_noise_settings(noise_level: float, sde_type: str) -> None:
    if sde_type not in SDE_TYPES:
        raise ValueError(f"Unknown sde_type {sde_type!r}; expected one of {', '.join(SDE_TYPES)}.")
    if not math.isfinite(noise_level) or noise_level < 0:
        raise ValueError(f"noise_level must be a finite number >= 0, got {noise_level!r}.")


def _check_diffusers_keywords(
    s_churn: float, s_tmin: float, s_tmax: float, s_noise: float, per_token_timesteps: torch.Tensor | None
) -> None:
    """diffusers' keywords are accepted at their defaults; a value this step cannot honour is an error, not ignored."""
    given = {
        "s_churn": (s_churn, 0.0),
        "s_tmin": (s_tmin, 0.0),
        "s_tmax": (s_tmax, float("inf")),
        "s_noise": (s_noise, 1.0),
    }
    for name, (value, default) in given.items():
        if value != default:
            raise ValueError(
                f"FlowMatchSDEDiscreteScheduler.step: {name}={value!r} has no meaning for a flow-matching SDE step; "
                f"drop it (set the noise with noise_level=... and sde_type=...)."
            )
    if per_token_timesteps is not None:
        raise ValueError(
            "FlowMatchSDEDiscreteScheduler.step: per_token_timesteps is not supported; pass one timestep, or one "
            "per sample (shape (B,)), or use diffusers' FlowMatchEulerDiscreteScheduler for per-token schedules."
        )


def _check_no_downcast(**tensors: torch.Tensor | None) -> None:
    """`step` upcasts low-precision floats to float32 (exact); a wider or non-float tensor would be rounded or
    converted on the way in, and the sample it scores would no longer be the one given: refuse it instead."""
    for name, tensor in tensors.items():
        if tensor is not None and (not tensor.is_floating_point() or tensor.element_size() > 4):
            raise TypeError(
                f"FlowMatchSDEDiscreteScheduler.step: `{name}` is {tensor.dtype}; this scheduler computes in float32 "
                f"and never casts a tensor down (stored latents and log-probs are float32). Pass `{name}.float()`."
            )


def _check_drop_in_dtypes(model_output: torch.Tensor, sample: torch.Tensor) -> None:
    """A stock pipeline in low precision feeds `prev_sample` straight back to its transformer: this step returns
    float32 (it never rounds a stored sample), which the transformer's first layer would refuse one step later.
    Stop here, at the first step, and name what keeps latents float32 around a low-precision forward."""
    for name, tensor in (("sample", sample), ("model_output", model_output)):
        if tensor.dtype != torch.float32:
            raise TypeError(
                f"FlowMatchSDEDiscreteScheduler.step: `{name}` is {tensor.dtype} in a stock-pipeline call (no "
                f"noise_level=): this scheduler returns float32 latents and never rounds them back, so a "
                f"{tensor.dtype} pipeline cannot feed them on; run the rollout adapter instead "
                f"(rollout_consistency.adapters.qwen_image.rollout / sd3.rollout / flux.rollout: float32 latents, "
                f"{tensor.dtype} forward), or run the pipeline in float32."
            )


def _standard_normal(
    shape: torch.Size, generator: torch.Generator | list[torch.Generator] | None, device: torch.device
) -> torch.Tensor:
    """Float32 standard normal noise, drawn on the generator's device and moved to `device`.

    A list draws row `i` from `generator[i]` straight into its slice of one buffer: the same values as
    diffusers' `randn_tensor` (per-row draws, then `torch.cat`) without the second latent-sized copy.
    """
    if not isinstance(generator, list):
        draw_device = generator.device if generator is not None else device
        return torch.randn(shape, generator=generator, device=draw_device, dtype=torch.float32).to(device)
    if len(generator) != shape[0]:
        raise ValueError(f"{len(generator)} generators for a batch of {shape[0]}: pass one per sample, or one.")
    noise = torch.empty(shape, dtype=torch.float32, device=generator[0].device)
    for row, row_generator in zip(noise, generator, strict=False):
        torch.randn(shape[1:], generator=row_generator, dtype=torch.float32, device=noise.device, out=row)
    return noise.to(device)


def _residual_chunk_norms(prev_sample: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Norms of `prev_sample − mean` over chunks of `gcd(numel, 512)` elements of each row: `(B, chunks)`, float32.

    The reduction behind `log_prob`. The differences compared downstream are ~1e-6 of values ~1, so its own
    rounding must stay far below 1e-7 relative: a float32 sum over the whole latent would add ~6e-8, and a
    float64 sum would materialise a float64 copy of the latent. Instead: one float32 pass computing the norms
    of chunks of <= 512 elements (~1e-7 relative each, independent), whose squares the caller sums in float64
    (~7e-9 relative overall). The norm's backward is finite at zero (cps on its last step).
    """
    batch = prev_sample.shape[0]
    residual = (prev_sample - mean).reshape(batch, -1)
    return torch.linalg.vector_norm(residual.view(batch, -1, math.gcd(residual.shape[1], 512)), dim=2)
