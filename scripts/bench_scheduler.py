"""Benchmark the patched scheduler step against diffusers' Euler step, side by side in one run.

    python scripts/bench_scheduler.py [--batch 8] [--repeats 30] [--device cpu|cuda]

(a) recompute path (score a given prev_sample)  vs  diffusers' FlowMatchEulerDiscreteScheduler.step
(b) sampling path (draw + score)                vs  diffusers' step + drawing the same amount of noise
Also the peak extra memory of one step, as a multiple of one latent tensor (CUDA: allocator peak; CPU:
resident memory sampled while the step runs).
Targets: (a) <= 1.5x, (b) <= 1.3x, memory <= 3 latents.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import threading
import time

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from schedulers import FlowMatchSDEDiscreteScheduler

LATENT = (16, 128, 128)
STEP_INDEX = 3


def setup(batch: int, device: str):
    ours, stock = FlowMatchSDEDiscreteScheduler(shift=3.0), FlowMatchEulerDiscreteScheduler(shift=3.0)
    ours.set_timesteps(10, device=device)
    stock.set_timesteps(10, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (batch, *LATENT)
    x, v, prev = (torch.randn(shape, generator=g, device=device) for _ in range(3))
    return ours, stock, x, v, prev, ours.timesteps[STEP_INDEX]


def paths(batch: int, device: str, sde_type: str = "sde"):
    ours, stock, x, v, prev, t = setup(batch, device)
    generator = torch.Generator(device=device).manual_seed(1)

    def stock_step():
        stock._step_index = STEP_INDEX  # diffusers' hidden counter; keep it on the same step
        return stock.step(v, t, x).prev_sample

    def stock_step_and_noise():
        stock_step()
        return torch.randn(x.shape, generator=generator, device=device)

    def recompute():
        return ours.sample_previous_step(v, t, x, noise_level=0.7, sde_type=sde_type, prev_sample=prev).log_prob

    def sample():
        return ours.sample_previous_step(v, t, x, noise_level=0.7, sde_type=sde_type, generator=generator).log_prob

    return {"stock_step": stock_step, "stock_step_and_noise": stock_step_and_noise, "recompute": recompute,
            "sample": sample}, x


def median_ms(fn, repeats: int, device: str) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_extra_latents(name: str, batch: int, device: str, calls: int = 5) -> float:
    """Peak memory above the inputs during one call of path `name`, in units of one latent tensor.

    CUDA: the caching allocator's peak. CPU: resident memory sampled by a thread while the call runs
    (torch releases the GIL inside kernels; latent-sized buffers are mmap-backed, so they enter and
    leave the resident set as they are allocated and freed). The maximum over a few calls.
    """
    fns, x = paths(batch, device)
    fn = fns[name]
    latent_bytes = x.numel() * x.element_size()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / latent_bytes
    peak_extra = 0
    for _ in range(calls):
        gc.collect()
        base = _resident_bytes()
        peak, done = [base], threading.Event()

        def sample_resident():
            while not done.is_set():
                peak[0] = max(peak[0], _resident_bytes())

        sampler = threading.Thread(target=sample_resident)
        sampler.start()
        result = fn()
        done.set()
        sampler.join()
        del result
        peak_extra = max(peak_extra, peak[0] - base)
    return peak_extra / latent_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()

    fns, _ = paths(args.batch, args.device)
    # Interleave the paths round by round so that machine load affects all of them alike.
    rounds = {name: [] for name in fns}
    for _ in range(5):
        for name, fn in fns.items():
            rounds[name].append(median_ms(fn, max(1, args.repeats // 5), args.device))
    ms = {name: statistics.median(values) for name, values in rounds.items()}
    result = {
        "device": args.device,
        "shape": [args.batch, *LATENT],
        "ms": {k: round(v, 3) for k, v in ms.items()},
        "recompute_vs_stock_step": round(ms["recompute"] / ms["stock_step"], 3),
        "sample_vs_stock_step_and_noise": round(ms["sample"] / ms["stock_step_and_noise"], 3),
        "peak_extra_latents": {
            name: round(peak_extra_latents(name, args.batch, args.device), 2) for name in ("recompute", "sample")
        },
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"device {args.device}, latents {tuple(result['shape'])} fp32, median of {args.repeats} calls")
    for name, value in result["ms"].items():
        print(f"  {name:<24} {value:8.3f} ms")
    print(f"(a) recompute / diffusers step          {result['recompute_vs_stock_step']:.2f}x   (target <= 1.5x)")
    print(f"(b) sample / (diffusers step + noise)   {result['sample_vs_stock_step_and_noise']:.2f}x   (target <= 1.3x)")
    for name, value in result["peak_extra_latents"].items():
        print(f"peak extra memory, {name:<10}          {value:.2f} latents (target <= 3)")


if __name__ == "__main__":
    main()
