"""Benchmark the patched scheduler step against diffusers' Euler step, side by side in one run.

    python scripts/bench_scheduler.py [--batch 8] [--repeats 30] [--device cpu|cuda]

(a) recompute path (score a given prev_sample)  vs  diffusers' FlowMatchEulerDiscreteScheduler.step
(b) sampling path (draw + score)                vs  diffusers' step + drawing the same amount of noise
Also the peak extra memory of one step, as a multiple of one latent tensor (CUDA: allocator peak; CPU:
the resident-set peak of a child process).
Targets: (a) <= 1.5x, (b) <= 1.3x, memory <= 3 latents.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from rollout_consistency.schedulers import FlowMatchSDEDiscreteScheduler

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

    return {
        "stock_step": stock_step,
        "stock_step_and_noise": stock_step_and_noise,
        "recompute": recompute,
        "sample": sample,
    }, x


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


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_peak_extra(name: str, batch: int) -> float:
    """In this process: peak resident memory above the inputs during one call, in latents (CPU, Linux).

    Run it in a child whose malloc returns every latent-sized buffer to the OS when freed
    (MALLOC_MMAP_THRESHOLD_ fixed), so the resident set follows live tensors exactly; the kernel's peak
    (VmHWM) is reset to the current size right before the call.
    """
    fns, x = paths(batch, "cpu")
    fns[name]()  # warm-up: kernels, thread pool
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset VmHWM to the current resident size
    base = _status_kib("VmRSS")
    result = fns[name]()
    peak = _status_kib("VmHWM")
    del result
    return (peak - base) * 1024 / (x.numel() * x.element_size())


def peak_extra_latents(name: str, batch: int, device: str) -> float:
    """Peak memory above the inputs during one call of path `name`, in units of one latent tensor.

    CUDA: the caching allocator's peak. CPU: the resident-set peak, measured in a child process.
    """
    if device == "cuda":
        fns, x = paths(batch, device)
        fns[name]()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fns[name]()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / (x.numel() * x.element_size())
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    child = subprocess.run(
        [sys.executable, __file__, "--measure-memory", name, "--batch", str(batch)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return float(child.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--measure-memory", metavar="PATH", help=argparse.SUPPRESS)  # the child of peak_extra_latents
    args = parser.parse_args()
    if args.device == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # Time with a caching allocator, as on CUDA: glibc otherwise hands latent-sized buffers back to the OS
        # on free, and every call then pays page faults that swamp the arithmetic being compared.
        cached = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**31)}
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], {**os.environ, **cached})
    if args.measure_memory:
        print(measure_peak_extra(args.measure_memory, args.batch))
        return

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
