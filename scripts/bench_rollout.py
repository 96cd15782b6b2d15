#!/usr/bin/env python
"""Adapter overhead over the bare transformer forward, and stored bytes per trajectory step.

Prints, from one run on the tiny Qwen-Image model (CPU):

1. time per denoising step of the request-level rollout, the step-wise rollout and the trainer recompute,
   each against the bare transformer forward(s) of one step on the same inputs (target: <= 5% overhead);
   the configurations are timed interleaved, repeat by repeat, and the median per-step time is reported;
2. bytes a trajectory stores per window step against the minimum, one float32 latent per sample and step.

    .venv/bin/python scripts/bench_rollout.py [--batch 4] [--steps 10] [--window 4] [--size 128] [--repeats 15]

With `--batch-invariant` it instead compares, per family (tiny Qwen-Image, SD3, FLUX), the request-level
rollout's time per denoising step in batch-invariant mode (every sample's forward at batch 1) against the
default mode (one batched forward), timed interleaved (target on CPU: <= 1.5x). `--device cuda` (or `auto`)
runs the same code on a GPU, synchronising around each timed rollout.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from rollout_consistency.adapters import (
    BatchRequests,
    SamplingSettings,
    Trajectory,
    make_generators,
    qwen_image,
    recompute_log_probs,
    rollout,
)
from rollout_consistency.adapters.stepwise import EngineSettings, StepwiseRequest, run_stepwise
from rollout_consistency.adapters.tiny import TinyPromptEncoder, load_qwen_image
from rollout_consistency.schedulers import SDEWindow

PROMPTS = [
    "a red cat sitting on a small blue house",
    "a dog in the garden at night",
    "sky",
    "photo of an old boat on the quiet lake in winter",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--size", type=int, default=128, help="image height = width in pixels")
    parser.add_argument("--guidance", type=float, default=1.0, help="> 1 runs true CFG (two forwards per step)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--batch-invariant", action="store_true", help="batch-invariant vs default, three families")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (--batch-invariant only)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch_invariant:
        bench_batch_invariant(args)
        return

    model = load_qwen_image()
    encoder = TinyPromptEncoder()
    prompts = (PROMPTS * args.batch)[: args.batch]
    cond = encoder.conditioning(prompts, [" "] * args.batch if args.guidance > 1 else None)
    width = cond["prompt_embeds"].shape[1]
    window = SDEWindow(start=1, size=args.window, num_steps=args.steps)
    requests = BatchRequests(seeds=tuple(range(args.batch)), windows=window)
    sampling = SamplingSettings(noise_level=0.7, guidance_scale=args.guidance)
    rollout_kwargs = dict(
        height=args.size,
        width=args.size,
        num_inference_steps=args.steps,
        requests=requests,
        sampling=sampling,
    )
    trajectory = qwen_image.rollout(model, cond, **rollout_kwargs)
    windows_only = {**rollout_kwargs, "requests": replace(requests, denoise_to_end=False)}
    passes = 2 if args.guidance > 1 else 1

    # The bare forward: the transformer call(s) of one step, inputs prepared once outside the timer.
    h = args.size // 8
    x = trajectory.latents[:, 0].clone()
    t = torch.full((args.batch,), float(trajectory.timesteps[0, 0]) / 1000)
    bare_inputs = []
    for prefix in ("", "negative_")[:passes]:
        mask = cond[prefix + "prompt_embeds_mask"]
        bare_inputs.append(
            dict(
                hidden_states=x,
                encoder_hidden_states=cond[prefix + "prompt_embeds"],
                encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                timestep=t,
                img_shapes=[[(1, h // 2, h // 2)]] * args.batch,
                return_dict=False,
            )
        )

    # Every timer spans a whole rollout's worth of work (`steps` forwards) and reports per step, so that all
    # configurations are equally exposed to other load on a shared machine.
    def bare() -> float:
        start = time.perf_counter()
        for _ in range(args.steps):
            for inputs in bare_inputs:
                model(**inputs)
        return (time.perf_counter() - start) / args.steps

    # The generic entry point with the scheduler setup built once and reused, as a training loop (and the
    # checker) does; `qwen_image.rollout` builds a new setup per call (one scheduler build, ~0.25 ms).
    generic_kwargs = dict(
        scheduler_setup=trajectory.scheduler,
        requests=requests,
        sampling=sampling,
        options=trajectory.family_options,
    )

    def request_level() -> float:
        start = time.perf_counter()
        rollout(qwen_image.FAMILY, model, cond, **generic_kwargs)
        return (time.perf_counter() - start) / args.steps

    stepwise_requests = [
        StepwiseRequest(f"r{i}", seed=i, conditioning={k: v[i : i + 1] for k, v in cond.items()}, window=window)
        for i in range(args.batch)
    ]

    def stepwise() -> float:
        start = time.perf_counter()
        run_stepwise(
            qwen_image.FAMILY,
            model,
            stepwise_requests,
            scheduler_setup=trajectory.scheduler,
            sampling=sampling,
            options=trajectory.family_options,
            engine=EngineSettings(max_num_seqs=args.batch, text_width=width),
        )
        return (time.perf_counter() - start) / args.steps

    def recompute() -> float:
        start = time.perf_counter()
        for _ in range(-(-args.steps // args.window)):
            recompute_log_probs(model, trajectory)
        return (time.perf_counter() - start) / (-(-args.steps // args.window) * args.window)

    scheduler = trajectory.scheduler.scheduler()
    generators = make_generators(requests.seeds)
    velocity = torch.randn_like(x)

    def scheduler_sde() -> float:
        start = time.perf_counter()
        for _ in range(args.steps):
            scheduler.sample_previous_step(
                velocity, trajectory.timesteps[0, 0], x, noise_level=0.7, generator=generators
            )
        return (time.perf_counter() - start) / args.steps

    def scheduler_ode() -> float:
        start = time.perf_counter()
        for _ in range(args.steps):
            scheduler.sample_previous_step(velocity, trajectory.timesteps[0, 0], x, noise_level=0.0)
        return (time.perf_counter() - start) / args.steps

    # The adapter's own work per step, measured directly: the request-level loop with the forward replaced by
    # an (almost) free velocity, so cache effects of interleaving it with real forwards do not count.
    no_forward = replace(qwen_image.FAMILY, velocity=lambda transformer, latents, *a, **k: latents * 0.5)

    def adapter_alone() -> float:
        start = time.perf_counter()
        rollout(no_forward, model, cond, **generic_kwargs)
        return (time.perf_counter() - start) / args.steps

    timers = {
        "bare forward": bare,
        "request-level rollout": request_level,
        "step-wise rollout": stepwise,
        "trainer recompute": recompute,
        "scheduler SDE step": scheduler_sde,
        "scheduler ODE step": scheduler_ode,
        "loop w/o forward": adapter_alone,
    }
    samples = {name: [] for name in timers}
    with torch.no_grad():
        for fn in timers.values():  # warm-up (caches, allocator)
            fn()
        for _ in range(args.repeats):
            for name, fn in timers.items():
                samples[name].append(fn())
    print(
        f"tiny Qwen-Image, batch {args.batch}, {args.size}x{args.size} px "
        f"({trajectory.latent_shape[0]} tokens x {trajectory.latent_shape[1]} ch), {args.steps} steps, "
        f"window {args.window}, CFG passes {passes}, torch threads {torch.get_num_threads()}, "
        f"{args.repeats} interleaved repeats"
    )
    # min: the contention-free cost (the machine may be shared); median: the typical one.
    print(f"{'per denoising step':<26}{'min ms':>9}{'vs bare':>9}{'median ms':>11}{'vs bare':>9}")
    base_min, base_med = min(samples["bare forward"]), statistics.median(samples["bare forward"])
    for name in timers:
        low, mid = min(samples[name]), statistics.median(samples[name])
        if name.startswith(("scheduler", "loop")):  # a part of a step, shown as a share of the bare forward
            print(
                f"{name:<26}{low * 1e3:>9.3f}{low / base_min * 100:>8.1f}%{mid * 1e3:>11.3f}{mid / base_med * 100:>8.1f}%"
            )
            continue
        print(
            f"{name:<26}{low * 1e3:>9.3f}{(low / base_min - 1) * 100:>+8.1f}%"
            f"{mid * 1e3:>11.3f}{(mid / base_med - 1) * 100:>+8.1f}%"
        )
    sde, ode = min(samples["scheduler SDE step"]), min(samples["scheduler ODE step"])
    mean_step = (args.window * sde + (args.steps - args.window) * ode) / args.steps
    rest = min(samples["request-level rollout"]) - base_min - mean_step
    print(
        f"request-level overhead without the scheduler's own step (min): {rest * 1e3:.3f} ms "
        f"= {rest / base_min * 100:+.1f}% of the bare forward"
    )

    # ---------------------------------------------------------------- bytes per stored step
    for final in (False, True):
        stored = trajectory if final else qwen_image.rollout(model, cond, **windows_only)
        with tempfile.TemporaryDirectory() as tmp:
            file_bytes = Path(stored.save(Path(tmp) / "t.safetensors")).stat().st_size
            assert torch.equal(Trajectory.load(Path(tmp) / "t.safetensors").latents, stored.latents)
        minimum = args.batch * args.window * stored.latents[0, 0].numel() * 4
        parts = {
            "latents (W+1 per sample)": stored.latents.numel() * 4,
            "log_probs + timesteps": (stored.log_probs.numel() + stored.timesteps.numel()) * 4,
            "conditioning": sum(v.numel() * v.element_size() for v in stored.conditioning.values()),
            "final_latents": 0 if stored.final_latents is None else stored.final_latents.numel() * 4,
        }
        print(
            f"\nstored bytes per window step ({'with' if final else 'without'} final latents; "
            f"minimum = one fp32 latent per sample and step = {minimum // args.window:,} B)"
        )
        for name, value in parts.items():
            print(f"  {name:<26}{value / args.window:>12,.0f} B  x{value / minimum:.3f}")
        print(
            f"  {'tensor data':<26}{stored.stored_bytes() / args.window:>12,.0f} B  "
            f"x{stored.stored_bytes() / minimum:.3f}"
        )
        print(f"  {'file on disk':<26}{file_bytes / args.window:>12,.0f} B  x{file_bytes / minimum:.3f}")


def bench_batch_invariant(args: argparse.Namespace) -> None:
    """Batch-invariant vs default request-level rollout, per denoising step, for each tiny family."""
    from rollout_consistency.adapters.batch_invariance import batch_invariant
    from rollout_consistency.gate.config import CheckConfig
    from rollout_consistency.gate.sides.backends import build_backend, resolve_device
    from rollout_consistency.gate.sides.shared import encode_prompts

    device = resolve_device(args.device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    print(
        f"batch {args.batch}, {args.size}x{args.size} px, {args.steps} steps, window {args.window}, guidance "
        f"{args.guidance}, device {device}, torch threads {torch.get_num_threads()}, {args.repeats} interleaved repeats"
    )
    print(f"{'family':<12}{'default ms':>12}{'invariant ms':>14}{'ratio (min)':>13}{'ratio (median)':>16}")
    for name in ("qwen-image", "sd3", "flux"):
        config = CheckConfig(
            model_family=name,
            height=args.size,
            width=args.size,
            num_inference_steps=args.steps,
            sde_window_size=args.window,
            true_cfg_scale=args.guidance,
            guidance_scale=max(args.guidance, 1.0),
            device=device,
            progress=False,
        )
        backend = build_backend(config)  # the checker's own set-up: model, encoder, scheduler, options
        family, model = backend.family, backend.trainer_model
        cond = encode_prompts(backend, (PROMPTS * args.batch)[: args.batch])
        common = dict(
            scheduler_setup=backend.scheduler_setup,
            requests=BatchRequests(
                seeds=tuple(range(args.batch)), windows=SDEWindow(start=1, size=args.window, num_steps=args.steps)
            ),
            sampling=SamplingSettings(noise_level=0.7, guidance_scale=backend.guidance),
            options=backend.options,
        )
        models = {"default": model, "invariant": batch_invariant(model, family)}

        def timed(which: str, models=models, family=family, cond=cond, common=common) -> float:
            sync()
            start = time.perf_counter()
            rollout(family, models[which], cond, **common)
            sync()
            return (time.perf_counter() - start) / args.steps

        samples = {which: [] for which in models}
        with torch.no_grad():
            for which in models:  # warm-up
                timed(which)
            for _ in range(args.repeats):
                for which in models:
                    samples[which].append(timed(which))
        low = {k: min(v) for k, v in samples.items()}
        mid = {k: statistics.median(v) for k, v in samples.items()}
        print(
            f"{name:<12}{low['default'] * 1e3:>12.3f}{low['invariant'] * 1e3:>14.3f}"
            f"{low['invariant'] / low['default']:>12.2f}x{mid['invariant'] / mid['default']:>15.2f}x"
        )


if __name__ == "__main__":
    main()
