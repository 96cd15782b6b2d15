#!/usr/bin/env python
"""Adapter overhead over the bare transformer forward, and stored bytes per trajectory step.

Prints, from one run on the tiny Qwen-Image model (CPU):

1. time per denoising step of the request-level rollout, the step-wise rollout and the trainer recompute,
   each against the bare transformer forward(s) of one step on the same inputs (target: <= 5% overhead);
2. bytes a trajectory stores per window step against the minimum, one float32 latent per sample and step.

    .venv/bin/python scripts/bench_rollout.py [--batch 4] [--steps 10] [--window 4] [--size 128] [--repeats 15]
    .venv/bin/python scripts/bench_rollout.py --batch-invariant [--size 256] [--avx2-kernels] [--device cuda]

Every figure is a ratio timed as interleaved pairs (A B, B A, ...; scripts/paired_timing.py): the median pair
ratio, with the middle half and the whole spread of the pairs.

With `--batch-invariant` it instead compares, per family (tiny Qwen-Image, SD3, FLUX), the request-level
rollout's time per denoising step in batch-invariant mode against the default mode (one batched forward):
the per-row route (every sample's forward at batch 1) and the fixed-shape route (`rows_per_forward=--batch`:
forwards of a fixed number of rows, where the proxy's probes find this machine's kernels position-invariant;
it prints the route it took). Targets on CPU: <= 2x at 128 px, <= 1.5x at 256 px. `--avx2-kernels` reruns
it with MKL, oneDNN and ATen on their AVX2 code paths. `--device cuda` (or `auto`) runs the same code on a
GPU, synchronising around each timed rollout.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from paired_timing import interleaved_pairs

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
    parser.add_argument("--repeats", type=int, default=15, help="interleaved pairs per ratio")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--batch-invariant", action="store_true", help="batch-invariant vs default, three families")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (--batch-invariant only)")
    parser.add_argument("--avx2-kernels", action="store_true", help="rerun with MKL/oneDNN/ATen on their AVX2 paths")
    args = parser.parse_args()
    if args.avx2_kernels:
        reexec_with_avx2_kernels()
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

    # Each configuration against the bare forward, as interleaved pairs (scripts/paired_timing.py).
    timers = {
        "request-level rollout": request_level,
        "step-wise rollout": stepwise,
        "trainer recompute": recompute,
        "scheduler SDE step": scheduler_sde,
        "scheduler ODE step": scheduler_ode,
        "loop w/o forward": adapter_alone,
    }
    with torch.no_grad():
        ratios = interleaved_pairs([(name, bare, fn) for name, fn in timers.items()], args.repeats)
    print(
        f"tiny Qwen-Image, batch {args.batch}, {args.size}x{args.size} px "
        f"({trajectory.latent_shape[0]} tokens x {trajectory.latent_shape[1]} ch), {args.steps} steps, "
        f"window {args.window}, CFG passes {passes}, torch threads {torch.get_num_threads()}, "
        f"{args.repeats} interleaved pairs per row"
    )
    bare_ms = 1e3 * min(min(r.times_a) for r in ratios.values())
    print(f"bare forward per step: {bare_ms:.3f} ms (fastest)")
    print("per denoising step, against the bare forward (median pair ratio, middle half, all pairs):")
    for name, ratio in ratios.items():
        q1, q3 = ratio.quartiles
        if name.startswith(("scheduler", "loop")):  # a part of a step, shown as a share of the bare forward
            print(
                f"  {name:<24}{ratio.median * 100:>7.1f}% of it  ({q1 * 100:.1f}-{q3 * 100:.1f}%, "
                f"{min(ratio.ratios) * 100:.1f}-{max(ratio.ratios) * 100:.1f}%)"
            )
        else:
            print(
                f"  {name:<24}{(ratio.median - 1) * 100:>+7.1f}% over it ({(q1 - 1) * 100:+.1f} to {(q3 - 1) * 100:+.1f}%, "
                f"{(min(ratio.ratios) - 1) * 100:+.1f} to {(max(ratio.ratios) - 1) * 100:+.1f}%)"
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
    """Batch-invariant vs default request-level rollout, per denoising step, for each tiny family: the per-row
    route (one forward per sample) and the fixed-shape route (forwards of `--batch` rows, where the proxy's
    probes find this machine's kernels position-invariant), each timed in interleaved pairs with the default."""
    from rollout_consistency.adapters.batch_invariance import batch_invariant
    from rollout_consistency.gate.config import CheckConfig
    from rollout_consistency.gate.sides.backends import build_backend, resolve_device
    from rollout_consistency.gate.sides.shared import encode_prompts

    device = resolve_device(args.device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    print(
        f"batch {args.batch}, {args.size}x{args.size} px, {args.steps} steps, window {args.window}, guidance "
        f"{args.guidance}, device {device}, kernels {torch.backends.cpu.get_cpu_capability()}"
        f"{' (AVX2 paths forced)' if os.environ.get('MKL_ENABLE_INSTRUCTIONS') == 'AVX2' else ''}, torch threads "
        f"{torch.get_num_threads()}, {args.repeats} interleaved pairs per ratio (median, middle half, all pairs)"
    )
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
        backend = build_backend(config.sides)  # the checker's own set-up: model, encoder, scheduler, options
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
        try:  # the adapter validates the size against the model when it runs
            family.check_conditioning(model, cond, args.batch, backend.guidance, backend.options)
        except ValueError as error:  # e.g. SD3's pos_embed_max_size at 512 px
            print(f"{name:<12}skipped: {error}")
            continue
        fixed = batch_invariant(model, family, rows_per_forward=args.batch)
        models = {"default": model, "per-row": batch_invariant(model, family), "fixed-shape": fixed}

        def timed(which: str, models=models, family=family, cond=cond, common=common) -> float:
            sync()
            start = time.perf_counter()
            rollout(family, models[which], cond, **common)
            sync()
            return (time.perf_counter() - start) / args.steps

        with torch.no_grad():
            ratios = interleaved_pairs(
                [
                    (route, lambda: timed("default"), lambda route=route: timed(route))
                    for route in ("per-row", "fixed-shape")
                ],
                args.repeats,
            )
        default_ms = 1e3 * min(min(r.times_a) for r in ratios.values())
        routes = sorted(set(fixed.routes.values()))
        print(f"{name:<12}default {default_ms:.3f} ms per step (fastest); fixed-shape proxy took route(s) {routes}")
        for route, ratio in ratios.items():
            print(f"{'':<12}{route + ' / default':<26}{ratio.describe()}")


def reexec_with_avx2_kernels() -> None:
    """Run this script again with MKL, oneDNN and ATen told to use their AVX2 code paths (on an AVX-512 CPU)."""
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    argv = [a for a in sys.argv[1:] if a != "--avx2-kernels"]
    os.execve(sys.executable, [sys.executable, __file__, *argv], env)


if __name__ == "__main__":
    main()
