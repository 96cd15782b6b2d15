#!/usr/bin/env python
# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Benchmark the step-1 check: its overhead over the bare forward passes, and Ray against in-process.

1. **Overhead.** A check must run, per rollout batch, the rollout's transformer forwards (every step up to
   the end of the last SDE window) and the trainer's (one per stored window step and micro-batch). This
   script times the whole check (plan, rollout with the scheduler and the trajectory, recompute, metrics,
   verdict, report; model loading excluded: it is timed separately as *setup*) against (a) exactly those
   forwards called directly on the same model with inputs of the same shapes, and (b) the same rollout and
   recompute through the adapters without the checker (forwards + scheduler steps + trajectories), in the
   same process, after a warm-up, interleaved, fastest of `--repeats`. Target: overhead <= 10%.
2. **Ray.** The same check on 2 Ray workers against in-process: the work part (target <= 1.2x the
   in-process time) and Ray's start-up (cluster start + worker setup), reported separately.

Usage::

    python scripts/bench_step1.py                 # both parts, default sizes
    python scripts/bench_step1.py --repeats 5 --sizes 32 128 --skip-ray
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence

import torch

from rollout_consistency import CheckConfig, adapters, run_step1_check
from rollout_consistency.gate.sides.backends import build_backend
from rollout_consistency.gate.sides.plan import make_plan


def bare_forwards(config: CheckConfig) -> float:
    """Seconds for the transformer forwards the check makes, called directly (same shapes, same model)."""
    backend = build_backend(config.sides)
    family, model = backend.family, backend.trainer_model
    plan = make_plan(config.sides)
    latent_shape = family.latent_shape(model, backend.options)
    guidance = backend.kit.guidance(config)
    schedule = backend.scheduler_setup.timesteps().to(torch.float32)
    micro = config.resolved_micro_batch_size
    generator = torch.Generator().manual_seed(0)
    calls = []  # (batch size, timestep, conditioning) of every forward, prepared outside the timed loop
    for batch in plan:
        n = len(batch.samples)
        conditioning = backend.kit.conditioning(backend.encoder, [s.prompt for s in batch.samples], config)
        last = max(s.window_start + s.window_size for s in batch.samples)
        calls += [(n, schedule[step].expand(n), conditioning) for step in range(last)]
        for start in range(0, n, micro):
            rows = slice(start, min(start + micro, n))
            sub = {k: v[rows] for k, v in conditioning.items()}
            m = rows.stop - rows.start
            calls += [
                (m, schedule[batch.samples[0].window_start + k].expand(m), sub)
                for k in range(config.resolved_window_size)
            ]
    inputs = [(torch.randn((n, *latent_shape), generator=generator), t.contiguous(), c) for n, t, c in calls]
    with torch.no_grad():
        start = time.perf_counter()
        for latents, timesteps, conditioning in inputs:
            family.velocity(model, latents, timesteps, conditioning, guidance, options=backend.options)
        return time.perf_counter() - start


def adapter_calls(config: CheckConfig) -> float:
    """Seconds for the same rollout + recompute through the adapters directly (forwards, scheduler steps,
    trajectories), without the checker around them: what a trainer would run anyway."""
    backend = build_backend(config.sides)
    plan = make_plan(config.sides)
    micro = config.resolved_micro_batch_size
    from rollout_consistency.schedulers import SDEWindow

    start = time.perf_counter()
    with torch.no_grad():
        for batch in plan:
            conditioning = backend.kit.conditioning(backend.encoder, [s.prompt for s in batch.samples], config)
            windows = [SDEWindow(s.window_start, s.window_size, config.num_inference_steps) for s in batch.samples]
            trajectory = adapters.rollout(
                backend.family,
                backend.rollout_model,
                conditioning,
                scheduler_setup=backend.scheduler_setup,
                requests=adapters.BatchRequests(
                    seeds=[s.seed for s in batch.samples],
                    windows=windows,
                    prompt_groups=[s.prompt_group for s in batch.samples],
                    global_step=config.global_step,
                    denoise_to_end=False,
                ),
                sampling=adapters.SamplingSettings(
                    noise_level=config.noise_level,
                    sde_type=config.sde_type,
                    guidance_scale=backend.kit.guidance(config),
                ),
                options=backend.options,
            )
            for first in range(0, trajectory.batch_size, micro):
                part = trajectory.select(range(first, min(first + micro, trajectory.batch_size)))
                adapters.recompute_log_probs(backend.trainer_model, part, family=backend.family)
    return time.perf_counter() - start


def check_work(config: CheckConfig) -> tuple[float, float]:
    """(work seconds, setup seconds) of one check: total minus model loading, and the loading."""
    report = run_step1_check(config)
    if not report.passed:
        raise SystemExit("benchmark config does not pass:\n" + report.format_table())
    timings = report.run["timings_s"]
    setup = timings["setup"] + timings["startup"]
    return timings["total"] - setup, setup


def best_of(fn, repeats: int) -> float:
    """The fastest of `repeats` runs: on a shared machine the minimum is the least disturbed measurement."""
    return min(fn() for _ in range(repeats))


def bench_overhead(sizes: Sequence[int], repeats: int) -> None:
    print(
        "== the check against its bare transformer forwards, and against the same adapter calls (in-process, warm) =="
    )
    print(
        f"{'image':>7} {'samples':>7} {'forwards':>8} {'bare s':>8} {'adapters s':>10} {'check s':>8} "
        f"{'vs bare':>8} {'vs adapters':>11} {'setup s':>8}"
    )
    for size in sizes:
        config = CheckConfig(height=size, width=size, progress=False)
        check_work(config)  # warm-up (first forwards, lazy imports)
        bare_forwards(config)
        adapter_calls(config)
        forwards = run_step1_check(config).run["forwards"]
        # Interleaved, so that a burst of load on a shared machine hits every side alike; fastest of each.
        bare_runs, adapter_runs, check_runs = [], [], []
        for _ in range(repeats):
            bare_runs.append(bare_forwards(config))
            adapter_runs.append(adapter_calls(config))
            check_runs.append(check_work(config))
        bare, direct = min(bare_runs), min(adapter_runs)
        work = min(w for w, _ in check_runs)
        setup = min(s for _, s in check_runs)
        total_forwards = sum(forwards.values())
        print(
            f"{size:>5}px {config.num_samples:>7} {total_forwards:>8} {bare:>8.4f} {direct:>10.4f} {work:>8.4f} "
            f"{100 * (work / bare - 1):>7.1f}% {100 * (work / direct - 1):>10.1f}% {setup:>8.4f}"
        )


def bench_ray(size: int, repeats: int, workers: int) -> None:
    import ray

    print(f"\n== Ray ({workers} workers, local cluster) against in-process, same check ==")
    config = CheckConfig(height=size, width=size, progress=False, num_prompts=8, rollout_batch_size=4)
    check_work(config)
    local = best_of(lambda: check_work(config)[0], repeats)
    temp_dir = tempfile.mkdtemp(prefix="rc-ray-")
    start = time.perf_counter()
    ray.init(
        num_cpus=workers,
        include_dashboard=False,
        _temp_dir=temp_dir,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    ray_init = time.perf_counter() - start
    try:
        results = [run_step1_check(config.replace(workers=workers)) for _ in range(repeats)]
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    work = min(r.run["timings_s"]["work"] for r in results)
    startup = min(r.run["timings_s"]["startup"] for r in results)
    local_report = run_step1_check(config)
    same = all(r.results_dict() == local_report.results_dict() for r in results)
    print(f"in-process work      {local:8.3f} s   ({config.num_samples} samples, {size}px)")
    print(f"Ray work             {work:8.3f} s   ratio {work / local:.2f}x (target <= 1.2x)")
    print(f"Ray start-up         {ray_init:8.3f} s cluster + {startup:.3f} s worker setup (separate)")
    print(f"identical results    {same}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[32, 128], help="image sizes (px) for the overhead part"
    )
    parser.add_argument("--repeats", type=int, default=15, help="runs per measurement; the fastest is reported")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in this process (default: torch's)")
    args = parser.parse_args(argv)
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, diffusers via adapters {adapters.__name__}")
    bench_overhead(args.sizes, args.repeats)
    if not args.skip_ray:
        bench_ray(args.sizes[0], min(args.repeats, 3), args.workers)  # each Ray run starts its workers (seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
