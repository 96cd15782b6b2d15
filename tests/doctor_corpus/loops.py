"""Three users' own sampling and training loops, as the doctor's corpus plugs them into the checker.

Each loop is written from scratch in the shape of a public trainer — its names, its loop structure, its data
layout, no sample ids where it has none — on the repository's tiny diffusers models (CPU, a few ms a forward):

* `flow_grpo` (SD3): a ``pipeline_with_logprob`` sampler that runs the SDE on every step, concatenates
  ``[negative, positive]`` for CFG in one forward and returns every latent and log-prob; a ``samples`` dict
  (``latents`` / ``next_latents`` / ``log_probs`` / ``timesteps`` / prompt embeddings) and a training loop whose
  ``compute_log_prob(transformer, pipeline, sample, j, embeds, pooled_embeds, config)`` re-scores step ``j``;
* `verl_omni` (Qwen-Image): a rollout adapter that samples the SDE only inside each request's window and hands
  over ``all_latents`` / ``all_timesteps`` with the prompt embeddings and masks, and a diffusion actor whose
  ``prepare_model_inputs`` (``timestep = timesteps[:, step] / 1000``) and ``forward_and_sample_previous_step``
  re-score micro-batch by micro-batch, step by step;
* `dance_grpo` (FLUX): a ``run_sample_step`` sampler that draws one sample per forward with DanceGRPO's
  ``flux_step`` (``sde_solver``), integer timesteps ``int(sigma * 1000)`` and an embedded guidance tensor, and a
  ``grpo_one_step`` trainer that visits each sample's timesteps in a permuted order.

Every class here is the *correct* loop; a corpus case (a file beside this one) subclasses one side and changes
one thing — the bug — in plain sight. Noise comes from generators seeded with the plan's per-sample seeds, so a
side re-run gives the same draws.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch

from rollout_consistency import CheckConfig
from rollout_consistency.adapters import get_family
from rollout_consistency.adapters.packing import pack_latents
from rollout_consistency.adapters.tiny import load_flux, load_qwen_image, load_sd3, tiny_sd3_prompt_encoder
from rollout_consistency.gate.sides.backends import pipeline_settings
from rollout_consistency.gate.sides.plugins import PluginRollout, RolloutRequest


def generators_for(seeds) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(int(seed)) for seed in seeds]


def randn_rows(shape, generators: list[torch.Generator]) -> torch.Tensor:
    """One standard-normal row per generator (what ``randn_tensor`` does with a list of generators)."""
    return torch.stack([torch.randn(shape[1:], generator=g, dtype=torch.float32) for g in generators])


def plan_scheduler(family_name: str, config: CheckConfig, transformer) -> Any:
    """The schedule the checker's plan uses for this family (a user gating their loop takes the same one)."""
    family = get_family(family_name)
    options = family.options(pipeline_settings(config))
    return family.scheduler_setup(dict(family.scheduler_config), config.num_inference_steps, transformer, options)


# ====================================================================================================
# flow_grpo (SD3): SDE on every step, CFG as one forward of [negative; positive].
def sde_step_with_logprob(scheduler, model_output, timestep, sample, noise_level=0.7, prev_sample=None, generator=None):
    """Flow-GRPO's SDE step: ``(prev_sample, log_prob, prev_sample_mean, std_dev_t)``, log_prob averaged over all
    but the batch dimension. ``timestep`` holds one value, or one per row."""
    model_output, sample = model_output.float(), sample.float()
    step_index = [scheduler.index_for_timestep(t) for t in timestep]
    sigma = scheduler.sigmas[step_index].view(-1, 1, 1, 1)
    sigma_prev = scheduler.sigmas[[i + 1 for i in step_index]].view(-1, 1, 1, 1)
    sigma_max = scheduler.sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma)))
    drift = 1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)
    prev_sample_mean = sample * (1 + std_dev_t**2 / (2 * sigma) * dt) + model_output * drift * dt
    scale = std_dev_t * torch.sqrt(-dt)
    if prev_sample is None:
        prev_sample = prev_sample_mean + scale * randn_rows(sample.shape, generator)
    log_prob = (
        -((prev_sample.detach().float() - prev_sample_mean) ** 2) / (2 * scale**2)
        - torch.log(scale)
        - math.log(math.sqrt(2 * math.pi))
    )
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), prev_sample_mean, std_dev_t


class TinySD3Pipeline:
    """What the loop touches of a ``StableDiffusion3Pipeline``: its transformer and its scheduler."""

    def __init__(self, config: CheckConfig) -> None:
        self.transformer = load_sd3(seed=0)
        self.scheduler = plan_scheduler("sd3", config, self.transformer).build()
        self.vae_scale_factor = 8


def flow_grpo_config(config: CheckConfig) -> SimpleNamespace:
    """flow_grpo's ml_collections config, the fields the loop reads."""
    return SimpleNamespace(
        resolution=config.height,
        sample=SimpleNamespace(
            num_steps=config.num_inference_steps,
            guidance_scale=config.guidance_scale,
            noise_level=config.noise_level,
        ),
        train=SimpleNamespace(cfg=config.guidance_scale > 1),
    )


@torch.no_grad()
def pipeline_with_logprob(
    pipeline,
    *,
    prompt_embeds,
    pooled_prompt_embeds,
    negative_prompt_embeds,
    negative_pooled_prompt_embeds,
    guidance_scale,
    generator,
    noise_level,
    height,
    width,
):
    do_classifier_free_guidance = guidance_scale > 1
    if do_classifier_free_guidance:
        prompt_embeds = torch.cat([negative_prompt_embeds, prompt_embeds], dim=0)
        pooled_prompt_embeds = torch.cat([negative_pooled_prompt_embeds, pooled_prompt_embeds], dim=0)
    channels = pipeline.transformer.config.in_channels
    shape = (len(generator), channels, height // pipeline.vae_scale_factor, width // pipeline.vae_scale_factor)
    latents = randn_rows(shape, generator)
    all_latents, all_log_probs = [latents], []
    for t in pipeline.scheduler.timesteps:
        latent_model_input = torch.cat([latents] * 2) if do_classifier_free_guidance else latents
        timestep = t.expand(latent_model_input.shape[0])
        noise_pred = pipeline.transformer(
            hidden_states=latent_model_input,
            timestep=timestep,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled_prompt_embeds,
            return_dict=False,
        )[0]
        noise_pred = noise_pred.to(prompt_embeds.dtype)
        if do_classifier_free_guidance:
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
        latents, log_prob, _, _ = sde_step_with_logprob(
            pipeline.scheduler, noise_pred.float(), t.unsqueeze(0), latents.float(), noise_level, generator=generator
        )
        all_latents.append(latents)
        all_log_probs.append(log_prob)
    return all_latents, all_log_probs


def negative_prompt_embeddings(config: CheckConfig):
    """flow_grpo encodes the empty negative prompt once and repeats it over every batch."""
    encoder = tiny_sd3_prompt_encoder(seed=0, max_length=config.max_sequence_length)
    return encoder.encode([""])


class FlowGRPOSampler:
    """The rollout: ``pipeline_with_logprob`` on the batch, packed into flow_grpo's ``samples`` dict."""

    def __init__(self, config: CheckConfig) -> None:
        self.config = flow_grpo_config(config)
        self.pipeline = TinySD3Pipeline(config)
        self.model = self.pipeline.transformer
        self.neg_prompt_embed, self.neg_pooled_prompt_embed = negative_prompt_embeddings(config)

    def sample(self, request: RolloutRequest):
        cond, n = request.conditioning, len(request.seeds)
        return pipeline_with_logprob(
            self.pipeline,
            prompt_embeds=cond["prompt_embeds"],
            pooled_prompt_embeds=cond["pooled_prompt_embeds"],
            negative_prompt_embeds=self.neg_prompt_embed.repeat(n, 1, 1),
            negative_pooled_prompt_embeds=self.neg_pooled_prompt_embed.repeat(n, 1),
            guidance_scale=self.config.sample.guidance_scale,
            generator=generators_for(request.seeds),
            noise_level=self.config.sample.noise_level,
            height=self.config.resolution,
            width=self.config.resolution,
        )

    def __call__(self, request: RolloutRequest) -> PluginRollout:
        latents, log_probs = self.sample(request)
        latents = torch.stack(latents, dim=1)  # (batch_size, num_steps + 1, C, h, w)
        log_probs = torch.stack(log_probs, dim=1)  # (batch_size, num_steps)
        timesteps = self.pipeline.scheduler.timesteps.repeat(len(request.seeds), 1)
        samples = {
            "prompt_embeds": request.conditioning["prompt_embeds"],
            "pooled_prompt_embeds": request.conditioning["pooled_prompt_embeds"],
            "timesteps": timesteps,
            "latents": latents[:, :-1],  # each entry is the latent before timestep t
            "next_latents": latents[:, 1:],  # each entry is the latent after timestep t
            "log_probs": log_probs,
        }
        return PluginRollout(
            log_probs=log_probs,
            timesteps=timesteps.float(),
            seeds=request.seeds,
            window_starts=tuple(w.start for w in request.windows),
            prompt_groups=request.prompt_groups,
            batch=samples,
        )


def compute_log_prob(transformer, pipeline, sample, j, embeds, pooled_embeds, config):
    """flow_grpo's trainer-side forward of step ``j`` of a micro-batch and its log-prob."""
    if config.train.cfg:
        noise_pred = transformer(
            hidden_states=torch.cat([sample["latents"][:, j]] * 2),
            timestep=torch.cat([sample["timesteps"][:, j]] * 2),
            encoder_hidden_states=embeds,
            pooled_projections=pooled_embeds,
            return_dict=False,
        )[0]
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred = noise_pred_uncond + config.sample.guidance_scale * (noise_pred_text - noise_pred_uncond)
    else:
        noise_pred = transformer(
            hidden_states=sample["latents"][:, j],
            timestep=sample["timesteps"][:, j],
            encoder_hidden_states=embeds,
            pooled_projections=pooled_embeds,
            return_dict=False,
        )[0]
    _, log_prob, _, _ = sde_step_with_logprob(
        pipeline.scheduler,
        noise_pred.float(),
        sample["timesteps"][:, j],
        sample["latents"][:, j].float(),
        prev_sample=sample["next_latents"][:, j].float(),
        noise_level=config.sample.noise_level,
    )
    return log_prob


class FlowGRPOTrainer:
    """The training loop's re-scoring: micro-batches of the ``samples`` dict, every timestep ``j`` of each."""

    def __init__(self, config: CheckConfig) -> None:
        self.config = flow_grpo_config(config)
        self.pipeline = TinySD3Pipeline(config)
        self.model = self.pipeline.transformer
        self.neg_prompt_embed, self.neg_pooled_prompt_embed = negative_prompt_embeddings(config)

    def compute_log_prob(self, sample, j, embeds, pooled_embeds):
        return compute_log_prob(self.model, self.pipeline, sample, j, embeds, pooled_embeds, self.config)

    def batches(self, samples, micro_batch_size):
        total_batch_size = samples["timesteps"].shape[0]
        for start in range(0, total_batch_size, micro_batch_size):
            rows = slice(start, start + micro_batch_size)
            yield rows, {k: v[rows] for k, v in samples.items()}

    def __call__(self, samples, *, micro_batch_size: int) -> torch.Tensor:
        out = torch.empty_like(samples["log_probs"])
        for rows, sample in self.batches(samples, micro_batch_size):
            n = len(sample["prompt_embeds"])
            if self.config.train.cfg:
                embeds = torch.cat([self.neg_prompt_embed.expand(n, -1, -1), sample["prompt_embeds"]])
                pooled_embeds = torch.cat([self.neg_pooled_prompt_embed.expand(n, -1), sample["pooled_prompt_embeds"]])
            else:
                embeds, pooled_embeds = sample["prompt_embeds"], sample["pooled_prompt_embeds"]
            for j in range(sample["timesteps"].shape[1]):
                out[rows, j] = self.compute_log_prob(sample, j, embeds, pooled_embeds)
        return out


# ====================================================================================================
# verl-omni (Qwen-Image): SDE inside each request's window, ODE outside; an actor that re-scores by micro-batch.
def apply_true_cfg(noise_pred, negative_noise_pred, true_cfg_scale):
    comb_pred = negative_noise_pred + true_cfg_scale * (noise_pred - negative_noise_pred)
    cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
    noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
    return comb_pred * (cond_norm / noise_norm)


def build_img_shapes(height, width, batch_size, vae_scale_factor=8):
    return [[(1, height // vae_scale_factor // 2, width // vae_scale_factor // 2)]] * batch_size


def verl_model_config(config: CheckConfig) -> SimpleNamespace:
    """verl-omni's ``DiffusionModelConfig``, the fields the adapters read."""
    return SimpleNamespace(
        pipeline=SimpleNamespace(
            height=config.height,
            width=config.width,
            num_inference_steps=config.num_inference_steps,
            true_cfg_scale=config.true_cfg_scale,
        ),
        algo=SimpleNamespace(noise_level=config.noise_level, sde_type=config.sde_type),
    )


class QwenImageRolloutAdapter:
    """The rollout side (a vLLM-omni engine's pipeline, here in-process): the request batch, step by step."""

    def __init__(self, config: CheckConfig) -> None:
        self.model_config = verl_model_config(config)
        self.transformer = load_qwen_image(seed=0)
        self.model = self.transformer
        self.scheduler = plan_scheduler("qwen-image", config, self.transformer).build()

    def forward(self, latents, t, prompt_embeds, prompt_embeds_mask):
        pipeline = self.model_config.pipeline
        if prompt_embeds_mask is not None and bool(prompt_embeds_mask.all()):
            prompt_embeds_mask = None  # no padding: QwenImagePipeline passes no mask
        return self.transformer(
            hidden_states=latents,
            timestep=t.expand(latents.shape[0]) / 1000,
            encoder_hidden_states=prompt_embeds,
            encoder_hidden_states_mask=prompt_embeds_mask,
            img_shapes=build_img_shapes(pipeline.height, pipeline.width, latents.shape[0]),
            return_dict=False,
        )[0]

    def predict_noise(self, latents, t, cond):
        noise_pred = self.forward(latents, t, cond["prompt_embeds"], cond.get("prompt_embeds_mask"))
        true_cfg_scale = self.model_config.pipeline.true_cfg_scale
        if true_cfg_scale > 1.0:
            neg = self.forward(latents, t, cond["negative_prompt_embeds"], cond.get("negative_prompt_embeds_mask"))
            noise_pred = apply_true_cfg(noise_pred, neg, true_cfg_scale)
        return noise_pred

    @torch.no_grad()
    def __call__(self, request: RolloutRequest) -> PluginRollout:
        algo, cond = self.model_config.algo, request.conditioning
        generator = generators_for(request.seeds)
        latents = request.family.initial_latents(self.transformer, generator, request.options)
        window_size = request.windows[0].size
        all_latents = torch.empty((len(generator), window_size + 1, *latents.shape[1:]))
        all_log_probs = torch.empty((len(generator), window_size))
        all_timesteps = torch.empty((len(generator), window_size))
        for i, t in enumerate(self.scheduler.timesteps[: max(w.stop for w in request.windows)]):
            noise_pred = self.predict_noise(latents, t, cond).float()
            sde_rows = [b for b, w in enumerate(request.windows) if i in w]
            ode_rows = [b for b, w in enumerate(request.windows) if i not in w]
            new_latents = torch.empty_like(latents)
            for rows, noise_level in ((sde_rows, algo.noise_level), (ode_rows, 0.0)):
                if not rows:
                    continue
                out = self.scheduler.sample_previous_step(
                    noise_pred[rows],
                    t,
                    latents[rows],
                    noise_level=noise_level,
                    sde_type=algo.sde_type,
                    generator=[generator[b] for b in rows] if noise_level else None,
                )
                new_latents[rows] = out.prev_sample
                if noise_level:
                    for k, b in enumerate(rows):
                        j = i - request.windows[b].start
                        all_latents[b, j], all_latents[b, j + 1] = latents[b], out.prev_sample[k]
                        all_log_probs[b, j], all_timesteps[b, j] = out.log_prob[k], t
            latents = new_latents
        batch = {"all_latents": all_latents, "all_timesteps": all_timesteps, **cond}
        return PluginRollout(
            log_probs=all_log_probs,
            timesteps=all_timesteps,
            seeds=request.seeds,
            window_starts=tuple(w.start for w in request.windows),
            prompt_groups=request.prompt_groups,
            batch=batch,
        )


class DiffusionActor:
    """The training side: verl-omni's diffusers engine, ``compute_log_prob`` over micro-batches and SDE steps."""

    def __init__(self, config: CheckConfig) -> None:
        self.model_config = verl_model_config(config)
        self.module = load_qwen_image(seed=0)
        self.model = self.module
        self.scheduler = plan_scheduler("qwen-image", config, self.module).build()

    def prepare_model_inputs(self, micro_batch, step):
        pipeline = self.model_config.pipeline
        latents, timesteps = micro_batch["all_latents"], micro_batch["all_timesteps"]
        prompt_embeds_mask = micro_batch.get("prompt_embeds_mask")
        if prompt_embeds_mask is not None and bool(prompt_embeds_mask.all()):
            prompt_embeds_mask = None
        negative_mask = micro_batch.get("negative_prompt_embeds_mask")
        if negative_mask is not None and bool(negative_mask.all()):
            negative_mask = None
        common = {
            "hidden_states": latents[:, step],
            "timestep": timesteps[:, step] / 1000.0,
            "img_shapes": build_img_shapes(pipeline.height, pipeline.width, latents.shape[0]),
            "return_dict": False,
        }
        model_inputs = {
            **common,
            "encoder_hidden_states": micro_batch["prompt_embeds"],
            "encoder_hidden_states_mask": prompt_embeds_mask,
        }
        negative_model_inputs = {
            **common,
            "encoder_hidden_states": micro_batch.get("negative_prompt_embeds"),
            "encoder_hidden_states_mask": negative_mask,
        }
        return model_inputs, negative_model_inputs

    def forward(self, model_inputs):
        return self.module(**model_inputs)[0]

    def predict_noise(self, model_inputs, negative_model_inputs):
        noise_pred = self.forward(model_inputs)
        true_cfg_scale = self.model_config.pipeline.true_cfg_scale
        if true_cfg_scale > 1.0:
            noise_pred = apply_true_cfg(noise_pred, self.forward(negative_model_inputs), true_cfg_scale)
        return noise_pred

    def forward_and_sample_previous_step(self, model_inputs, negative_model_inputs, scheduler_inputs, step):
        latents, timesteps = scheduler_inputs["all_latents"], scheduler_inputs["all_timesteps"]
        noise_pred = self.predict_noise(model_inputs, negative_model_inputs)
        out = self.scheduler.sample_previous_step(
            noise_pred.float(),
            timesteps[:, step],
            latents[:, step].float(),
            noise_level=self.model_config.algo.noise_level,
            sde_type=self.model_config.algo.sde_type,
            prev_sample=latents[:, step + 1].float(),
        )
        return out.log_prob

    def micro_batches(self, data, micro_batch_size):
        n = data["all_timesteps"].shape[0]
        return [{k: v[i : i + micro_batch_size] for k, v in data.items()} for i in range(0, n, micro_batch_size)]

    def compute_log_prob(self, data, micro_batch_size):
        log_probs = []
        for micro_batch in self.micro_batches(data, micro_batch_size):
            columns = []
            for step in range(micro_batch["all_timesteps"].shape[1]):
                model_inputs, negative_model_inputs = self.prepare_model_inputs(micro_batch, step)
                columns.append(
                    self.forward_and_sample_previous_step(model_inputs, negative_model_inputs, micro_batch, step)
                )
            log_probs.append(torch.stack(columns, dim=1))
        return torch.cat(log_probs)

    def __call__(self, data, *, micro_batch_size: int) -> torch.Tensor:
        return self.compute_log_prob(data, micro_batch_size)


# ====================================================================================================
# DanceGRPO (FLUX): one sample per forward, integer timesteps, DanceGRPO's flux_step.
def flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver, generator=None):
    """DanceGRPO's FLUX step: ``(prev_sample, pred_original_sample, log_prob)`` with ``grpo``."""
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    prev_sample_mean = latents + dsigma * model_output
    pred_original_sample = latents - sigma * model_output
    std_dev_t = eta * math.sqrt(float(sigma - sigmas[index + 1]))
    if sde_solver:
        score_estimate = -(latents - pred_original_sample * (1 - sigma)) / sigma**2
        prev_sample_mean = prev_sample_mean + (-0.5 * eta**2 * score_estimate) * dsigma
    if grpo and prev_sample is None:
        prev_sample = prev_sample_mean + randn_rows(prev_sample_mean.shape, generator) * std_dev_t
    if not grpo:
        return prev_sample_mean, pred_original_sample
    log_prob = (
        -((prev_sample.detach().to(torch.float32) - prev_sample_mean.to(torch.float32)) ** 2) / (2 * std_dev_t**2)
        - math.log(std_dev_t)
        - math.log(math.sqrt(2 * math.pi))
    )
    return prev_sample, pred_original_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def prepare_latent_image_ids(height, width):
    latent_image_ids = torch.zeros(height, width, 3)
    latent_image_ids[..., 1] = latent_image_ids[..., 1] + torch.arange(height)[:, None]
    latent_image_ids[..., 2] = latent_image_ids[..., 2] + torch.arange(width)[None, :]
    return latent_image_ids.reshape(height * width, 3)


def dance_args(config: CheckConfig) -> SimpleNamespace:
    """DanceGRPO's argparse namespace, the fields the loop reads."""
    return SimpleNamespace(
        eta=config.noise_level,
        sampling_steps=config.num_inference_steps,
        h=config.height,
        w=config.width,
        guidance=config.guidance_scale,
    )


class DanceGRPOFlux:
    """What both sides share: the transformer, the plan's sigma schedule and the forward."""

    def __init__(self, config: CheckConfig) -> None:
        self.args = dance_args(config)
        self.transformer = load_flux(seed=0)
        self.model = self.transformer
        self.sigma_schedule = plan_scheduler("flux", config, self.transformer).build().sigmas.float()

    def transformer_forward(self, z, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, guidance):
        return self.transformer(
            hidden_states=z,
            encoder_hidden_states=encoder_hidden_states,
            timestep=timesteps / 1000,
            guidance=torch.tensor([guidance], dtype=torch.float32).expand(z.shape[0]),
            txt_ids=torch.zeros(encoder_hidden_states.shape[1], 3),
            pooled_projections=pooled_prompt_embeds,
            img_ids=image_ids,
            joint_attention_kwargs=None,
            return_dict=False,
        )[0]


class DanceGRPOSampler(DanceGRPOFlux):
    """``sample_reference_model``: one sample at a time (``batch_size = 1``), every step with the SDE."""

    def run_sample_step(self, z, encoder_hidden_states, pooled_prompt_embeds, image_ids, generator):
        all_latents, all_log_probs = [z], []
        for i in range(self.args.sampling_steps):
            timestep_value = int(self.sigma_schedule[i] * 1000)
            timesteps = torch.full([encoder_hidden_states.shape[0]], timestep_value, dtype=torch.long)
            pred = self.transformer_forward(
                z, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, self.args.guidance
            )
            z, _, log_prob = flux_step(
                pred, z.to(torch.float32), self.args.eta, self.sigma_schedule, i, None, True, True, generator
            )
            all_latents.append(z)
            all_log_probs.append(log_prob)
        return torch.stack(all_latents, dim=1), torch.stack(all_log_probs, dim=1)

    @torch.no_grad()
    def __call__(self, request: RolloutRequest) -> PluginRollout:
        latent_h, latent_w = self.args.h // 8, self.args.w // 8
        image_ids = prepare_latent_image_ids(latent_h // 2, latent_w // 2)
        cond = request.conditioning
        all_latents, all_log_probs = [], []
        for index, seed in enumerate(request.seeds):
            generator = generators_for([seed])
            input_latents = randn_rows((1, 16, latent_h, latent_w), generator)
            batch_latents, batch_log_probs = self.run_sample_step(
                pack_latents(input_latents),
                cond["prompt_embeds"][index : index + 1],
                cond["pooled_prompt_embeds"][index : index + 1],
                image_ids,
                generator,
            )
            all_latents.append(batch_latents)
            all_log_probs.append(batch_log_probs)
        all_latents, all_log_probs = torch.cat(all_latents), torch.cat(all_log_probs)
        timestep_value = [int(sigma * 1000) for sigma in self.sigma_schedule][: self.args.sampling_steps]
        timesteps = torch.tensor([timestep_value] * len(request.seeds), dtype=torch.long)
        window = request.windows[0].size  # DanceGRPO trains on every step but the last
        samples = {
            "timesteps": timesteps[:, :window],
            "latents": all_latents[:, :-1][:, :window],
            "next_latents": all_latents[:, 1:][:, :window],
            "log_probs": all_log_probs[:, :window],
            "image_ids": image_ids,
            "encoder_hidden_states": cond["prompt_embeds"],
            "pooled_prompt_embeds": cond["pooled_prompt_embeds"],
        }
        return PluginRollout(
            log_probs=samples["log_probs"],
            timesteps=samples["timesteps"].float(),
            seeds=request.seeds,
            window_starts=tuple(w.start for w in request.windows),
            prompt_groups=request.prompt_groups,
            batch=samples,
        )


class DanceGRPOTrainer(DanceGRPOFlux):
    """``train_one_step``'s re-scoring: per sample, its timesteps in a permuted order, ``grpo_one_step`` each."""

    def __init__(self, config: CheckConfig) -> None:
        super().__init__(config)
        self.perm_generator = torch.Generator().manual_seed(config.seed)

    def transition(self, latents, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, i):
        """``flux_step``'s ``(prev_sample_mean, std_dev_t)`` of step `i` (for a trainer writing its own log-density)."""
        pred = self.transformer_forward(
            latents, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, self.args.guidance
        )
        prev_sample_mean, _ = flux_step(pred, latents.float(), self.args.eta, self.sigma_schedule, i, None, False, True)
        return prev_sample_mean, self.args.eta * math.sqrt(float(self.sigma_schedule[i] - self.sigma_schedule[i + 1]))

    def grpo_one_step(self, latents, pre_latents, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, i):
        pred = self.transformer_forward(
            latents, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, self.args.guidance
        )
        _, _, log_prob = flux_step(
            pred, latents.to(torch.float32), self.args.eta, self.sigma_schedule, i, pre_latents.float(), True, True
        )
        return log_prob

    def __call__(self, samples, *, micro_batch_size: int) -> torch.Tensor:
        batch_size, num_timesteps = samples["timesteps"].shape
        perms = torch.stack([torch.randperm(num_timesteps, generator=self.perm_generator) for _ in range(batch_size)])
        new_log_probs = torch.empty((batch_size, num_timesteps))
        for i in range(batch_size):
            for _ in range(num_timesteps):
                step = int(perms[i][_])
                new_log_probs[i, step] = self.grpo_one_step(
                    samples["latents"][i : i + 1, step],
                    samples["next_latents"][i : i + 1, step],
                    samples["encoder_hidden_states"][i : i + 1],
                    samples["pooled_prompt_embeds"][i : i + 1],
                    samples["image_ids"],
                    samples["timesteps"][i : i + 1, step],
                    step,
                )[0]
        return new_log_probs


# ====================================================================================================
# A LoRA policy, as the three trainers train one: peft's LoRA on the attention projections.
LORA_TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def add_policy_lora(transformer, *, lora_alpha: int = 64, lora_dropout: float = 0.0, seed: int = 1):
    """``transformer.add_adapter(LoraConfig(...), adapter_name="default")`` (verl-omni's diffusers engine; flow_grpo's
    targets), rank 8, its weights those of a policy some updates in: drawn from a generator seeded with `seed`, so
    both sides hold the same adapter. Returns the transformer (the same object, the adapter injected)."""
    from peft import LoraConfig

    config = LoraConfig(
        r=8,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        init_lora_weights="gaussian",
        target_modules=LORA_TARGET_MODULES,
    )
    transformer.add_adapter(config, adapter_name="default")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in transformer.named_parameters():
            if ".lora_" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    return transformer


# ====================================================================================================
#: The checker settings each loop runs under in the corpus (tiny models, 4 samples in 2 prompt groups).
SETTINGS: dict[str, dict[str, Any]] = {
    # flow_grpo runs the SDE on every step and trains on all of them: the window is the whole schedule.
    "flow_grpo": dict(
        model_family="sd3", guidance_scale=4.5, height=64, width=64, num_inference_steps=4, sde_window_size=4
    ),
    "verl_omni": dict(model_family="qwen-image", height=32, width=32, num_inference_steps=4, sde_window_size=2),
    # DanceGRPO trains on every step but the last.
    "dance_grpo": dict(
        model_family="flux",
        guidance_scale=3.5,
        noise_level=0.3,
        height=64,
        width=64,
        num_inference_steps=4,
        sde_window_size=3,
        sde_window_range=(0, 3),
    ),
}
COMMON = dict(num_prompts=2, num_images_per_prompt=2, rollout_batch_size=4, progress=False)


def settings(loop: str, **changes: Any) -> dict[str, Any]:
    return {**COMMON, **SETTINGS[loop], **changes}
