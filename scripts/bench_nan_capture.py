"""Overhead of the NaN-capture hook: training steps/s with and without it, side by side in one run.

    .venv/bin/python scripts/bench_nan_capture.py              # about 40 s on one CPU thread
    .venv/bin/python scripts/bench_nan_capture.py --no-clip    # loop without gradient clipping
    .venv/bin/python scripts/bench_nan_capture.py --steps 400 --width 2048

One seeded training loop (MLP with dropout, AdamW; gradients clipped to norm 1.0 as diffusion-RL
trainers do, unless --no-clip) whose steps cycle through the variants in a balanced order, so that
load changes on a shared machine hit every variant alike:

- without the hook, twice (the second is an A/A control: its ratio to the first is the noise floor
  of this run);
- with `NanCapture.begin_step` + `check(batch)` (the hook's own fused finiteness check);
- with `check(batch, grad_norm=norm)` reusing the norm that `clip_grad_norm_` returned (clip only).

It prints the median steps/s of each variant, and the overhead: the time spent inside the hook's
calls, measured in the loop, over the hook-free step time (target <= 2 %) — robust where whole-step
ratios drown in the noise of a shared machine. Then it times the hook's parts alone in microseconds
per call: the RNG snapshot, and the finiteness check used (`_foreach_norm` 2-norms) against the
exact inf-norm and per-tensor `isfinite().all()` alternatives. Those microseconds are the overhead to
expect on any model with this many gradient elements: divide by your step time.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from rollout_consistency.training import nan_capture
from rollout_consistency.training.nan_capture import NanCapture, grads_are_finite
from rollout_consistency.training.rng_state import capture_rng_state, isolated_rng

TARGET = 0.02
PLAIN, CONTROL = "without hook", "without hook (A/A control)"
HOOK, HOOK_REUSING_NORM = "with hook", "with hook, reusing clip norm"


def build(width: int, depth: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    with isolated_rng(seed):
        layers: list[nn.Module] = [nn.Linear(64, width), nn.GELU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)]
        layers.append(nn.Linear(width, 64))
        model = nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def one_step(model, optimizer, batch, step: int, capture: NanCapture, variant: str, clip: bool) -> tuple[float, float]:
    """Seconds for one training step of the given variant, and seconds spent inside the hook's calls."""
    x, y = batch
    hooked = variant in (HOOK, HOOK_REUSING_NORM)
    start = time.perf_counter()
    if hooked:
        capture.begin_step(step)
    after_begin = time.perf_counter()
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0) if clip else None
    before_check = time.perf_counter()
    if variant == HOOK:
        capture.check(batch)
    elif variant == HOOK_REUSING_NORM:
        capture.check(batch, grad_norm=norm)
    after_check = time.perf_counter()
    optimizer.step()
    end = time.perf_counter()
    return end - start, (after_begin - start) + (after_check - before_check) if hooked else 0.0


def micro_us(fn, repeats: int = 30) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per variant")
    parser.add_argument("--no-clip", dest="clip", action="store_false", help="do not clip gradients in the loop")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps a shared machine quiet)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    generator = torch.Generator().manual_seed(args.seed)
    batches = [
        (torch.randn(args.batch, 64, generator=generator), torch.randn(args.batch, 64, generator=generator))
        for _ in range(16)
    ]
    model, optimizer = build(args.width, args.depth, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    variants = [PLAIN, CONTROL, HOOK, HOOK_REUSING_NORM] if args.clip else [PLAIN, CONTROL, HOOK]
    # Every ordering of the variants in turn: each variant follows each other equally often.
    schedule = [variant for order in itertools.permutations(variants) for variant in order]
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    hook_times: dict[str, list[float]] = {variant: [] for variant in variants}
    with tempfile.TemporaryDirectory() as directory:
        capture = NanCapture(model, optimizer, directory)
        with isolated_rng(args.seed):
            for step in range(20):  # warm-up (allocator, kernels)
                one_step(model, optimizer, batches[step % 16], step, capture, schedule[step % len(schedule)], args.clip)
            for step in range(len(variants) * args.steps):
                variant = schedule[step % len(schedule)]
                total, in_hook = one_step(model, optimizer, batches[step % 16], step, capture, variant, args.clip)
                times[variant].append(total)
                hook_times[variant].append(in_hook)
        assert not list(Path(directory).iterdir()), "a clean run must write nothing"

    grads = [p.grad for p in model.parameters()]
    parts = {
        "RNG snapshot (python, numpy, torch CPU"
        + (", CUDA)" if torch.cuda.is_initialized() else ")"): capture_rng_state,
        "finiteness check, _foreach_norm(2) + stack [used]": lambda: grads_are_finite(grads),
        "finiteness check, _foreach_norm(inf) + stack": lambda: nan_capture.grads_are_finite_inf_norm(grads),
        "finiteness check, per-tensor isfinite().all() stacked": lambda: nan_capture.grads_are_finite_stacked(grads),
    }
    part_us = {name: micro_us(fn) for name, fn in parts.items()}

    print(
        f"model: MLP {args.depth}x{args.width}, {n_params / 1e6:.2f} M parameters in {len(grads)} tensors, "
        f"batch {args.batch}, AdamW{', clip_grad_norm_(1.0)' if args.clip else ''}, "
        f"{args.threads} CPU thread(s), torch {torch.__version__}"
    )
    print(f"median over {args.steps} steps per variant, variants interleaved step by step")
    plain_s = statistics.median(times[PLAIN])
    for variant in variants:
        seconds = statistics.median(times[variant])
        line = f"  {variant:<30}: {1 / seconds:7.2f} steps/s ({seconds * 1e3:8.3f} ms/step)"
        if variant != PLAIN:
            line += f"   step-time ratio {(seconds / plain_s - 1.0) * 100:+6.2f} %"
        print(line)
    noise = abs(statistics.median(times[CONTROL]) / plain_s - 1.0)
    print(f"  (the A/A control is this run's noise floor: step-time ratios within ±{noise * 100:.1f} % are noise)")
    print("overhead = time inside the hook's calls per step (median, in the loop) / step time without hook:")
    for variant in (HOOK, HOOK_REUSING_NORM):
        if variant in variants:
            in_hook = statistics.median(hook_times[variant])
            overhead = in_hook / plain_s
            verdict = "met" if overhead <= TARGET else "NOT met"
            print(
                f"  {variant:<30}: {in_hook * 1e6:8.1f} µs/step = {overhead * 100:5.2f} %"
                f"   (target <= {TARGET * 100:.0f} %: {verdict})"
            )
    print("hook parts alone, median µs per call:")
    for name, us in part_us.items():
        print(f"  {name:<56}: {us:9.1f}")


if __name__ == "__main__":
    main()
