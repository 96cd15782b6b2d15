"""Benchmark the patched scheduler step against diffusers' Euler step (and verl-omni's SDE step), side by side.

    python scripts/bench_scheduler.py [--batch 8] [--pairs 40] [--calls 5] [--device cpu|cuda]
                                      [--verl-omni PATH] [--threads N] [--json]

(a) recompute path (score a given prev_sample)  vs  diffusers' FlowMatchEulerDiscreteScheduler.step
(b) sampling path (draw + score)                vs  diffusers' step + drawing the same amount of noise
(c) recompute path                              vs  verl-omni's FlowMatchSDEDiscreteScheduler scoring the same
    sample (its `sample_previous_step(..., prev_sample=...)`), and (d) sampling vs its sampling: only with
    `--verl-omni PATH`, the root of a verl-omni source tree (e.g. `git archive HEAD | tar -x -C PATH`), whose
    scheduler file is loaded from there at run time (it imports only torch and diffusers); skipped otherwise.
Every ratio is timed as interleaved pairs (A B, B A, ...; scripts/paired_timing.py): each timing covers
`--calls` calls, and the figure is the median pair ratio with the spread of the pairs.
Also the peak extra memory of one step, as a multiple of one latent tensor (CUDA: allocator peak; CPU:
the resident-set peak of a child process), the latent-sized passes each path makes (bytes its ATen ops read
and write, from a dispatch trace) and, on CPU, the time of one pass on this machine (from a copy).
`--fused-reference` adds (e): the recompute's maths as one torch.compile'd kernel, the floor a fused kernel
reaches (not what the scheduler runs).
Targets: (a) <= 1.5x, (b) <= 1.3x, (c) <= 0.25x, memory <= 3 latents.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from paired_timing import interleaved_pairs, time_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rollout_consistency.schedulers import FlowMatchSDEDiscreteScheduler

LATENT = (16, 128, 128)
STEP_INDEX = 3
NOISE_LEVEL = 0.7
VERL_OMNI_SCHEDULER = Path("verl_omni/pipelines/schedulers/flow_match_sde.py")


def load_verl_omni_scheduler(root: str | None) -> tuple[type | None, str]:
    """verl-omni's scheduler class from the source tree at `root`, or None and the reason it is skipped."""
    if root is None:
        return None, "skipped: no --verl-omni PATH (a verl-omni source tree) given"
    path = Path(root) / VERL_OMNI_SCHEDULER
    if not path.is_file():
        return None, f"skipped: {path} does not exist (pass the root of a verl-omni source tree)"
    spec = importlib.util.spec_from_file_location("verl_omni_flow_match_sde", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FlowMatchSDEDiscreteScheduler, f"verl-omni scheduler from {path}"


def setup(batch: int, device: str, verl_cls: type | None = None):
    ours, stock = FlowMatchSDEDiscreteScheduler(shift=3.0), FlowMatchEulerDiscreteScheduler(shift=3.0)
    verl = verl_cls(shift=3.0) if verl_cls is not None else None
    for scheduler in (ours, stock, verl):
        if scheduler is not None:
            scheduler.set_timesteps(10, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (batch, *LATENT)
    x, v, prev = (torch.randn(shape, generator=g, device=device) for _ in range(3))
    return ours, stock, verl, x, v, prev, ours.timesteps[STEP_INDEX]


def paths(batch: int, device: str, sde_type: str = "sde", verl_cls: type | None = None):
    ours, stock, verl, x, v, prev, t = setup(batch, device, verl_cls)
    generator = torch.Generator(device=device).manual_seed(1)

    def stock_step():
        stock._step_index = STEP_INDEX  # diffusers' hidden counter; keep it on the same step
        return stock.step(v, t, x).prev_sample

    def stock_step_and_noise():
        stock_step()
        return torch.randn(x.shape, generator=generator, device=device)

    def recompute():
        return ours.sample_previous_step(v, t, x, noise_level=NOISE_LEVEL, sde_type=sde_type, prev_sample=prev).log_prob

    def sample():
        return ours.sample_previous_step(
            v, t, x, noise_level=NOISE_LEVEL, sde_type=sde_type, generator=generator
        ).log_prob

    fns = {
        "stock_step": stock_step,
        "stock_step_and_noise": stock_step_and_noise,
        "recompute": recompute,
        "sample": sample,
    }
    if verl is not None:

        def verl_recompute():
            verl._step_index = STEP_INDEX  # its timestep=None path reads diffusers' counter
            return verl.sample_previous_step(x, v, noise_level=NOISE_LEVEL, prev_sample=prev, sde_type=sde_type)[1]

        def verl_sample():
            verl._step_index = STEP_INDEX
            return verl.sample_previous_step(x, v, noise_level=NOISE_LEVEL, generator=generator, sde_type=sde_type)[1]

        fns.update(verl_recompute=verl_recompute, verl_sample=verl_sample)
    return fns, x


def fused_reference(batch: int, device: str):
    """The recompute's maths as one torch.compile'd kernel (mean written, residual reduced in float64 without
    being stored): what a fused kernel reaches. A reference for the floor only — the scheduler does not use it,
    because its bits differ from the eager ops' and a process without a compiler would fall back to those."""
    _, _, _, x, v, prev, _ = setup(batch, device)
    a = torch.full((batch, 1, 1, 1), 0.97, device=device)
    b = torch.full((batch, 1, 1, 1), -0.08, device=device)

    def recompute(x, v, prev, a, b):
        mean = x * a + v * b
        residual = (prev - mean).view(x.shape[0], -1)
        return mean, (residual.double() ** 2).sum(dim=1)

    compiled = torch.compile(recompute, dynamic=False)
    compiled(x, v, prev, a, b)  # compiles here: raises where no compiler is present
    return lambda: compiled(x, v, prev, a, b)


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


class _Traffic(TorchDispatchMode):
    """Bytes every ATen op of a call reads and writes (op level: a re-read from cache counts too)."""

    def __init__(self) -> None:
        super().__init__()
        self.read = self.written = self.allocated = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:  # a slice or view moves no data
            return out
        written = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if func._schema.name in ("aten::empty", "aten::empty_like", "aten::empty_strided"):
            self.allocated += sum(t.numel() * t.element_size() for t in written)  # written later, through out=
            return out
        # An `out=` argument is written, not read; an in-place op's `self` is both (returned, so written).
        inputs = tree_flatten((args, {k: v for k, v in kwargs.items() if k != "out"}))[0]
        self.read += sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))
        self.written += sum(t.numel() * t.element_size() for t in written)
        if not func._schema.is_mutable:  # a fresh output: its memory is read for ownership before the write
            self.allocated += sum(t.numel() * t.element_size() for t in written)
        return out


def memory_passes(fns: dict, names: list[str], batch: int) -> dict[str, dict[str, float]]:
    """Latent-sized passes of each path: reads, writes and fresh outputs, in units of one latent."""
    latent = batch * torch.Size(LATENT).numel() * 4
    passes = {}
    for name in names:
        with torch.no_grad(), _Traffic() as traffic:
            fns[name]()
        passes[name] = {
            "read": round(traffic.read / latent, 2),
            "written": round(traffic.written / latent, 2),
            "fresh": round(traffic.allocated / latent, 2),
        }
    return passes


def stream_time(batch: int, pairs: int, calls: int) -> dict[str, float]:
    """This machine's cost of moving one latent: a copy into an owned buffer reads one latent and writes one;
    its time over 2 is the cost of one pass (the roofline every latent-sized op sits on)."""
    x = torch.randn(batch, *LATENT)
    out = torch.empty_like(x)
    copy = statistics.median(time_call(lambda: out.copy_(x), calls) for _ in range(pairs))
    size = x.numel() * x.element_size()
    return {
        "latent_MiB": round(size / 2**20, 2),
        "pass_ms": round(1e3 * copy / 2, 4),
        "GBps": round(2 * size / copy / 1e9, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=40, help="interleaved pairs per ratio")
    parser.add_argument("--calls", type=int, default=5, help="calls per timing")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--verl-omni", metavar="PATH", help="root of a verl-omni source tree, for (c) and (d)")
    parser.add_argument("--sde-type", default="sde", choices=("sde", "cps", "dance_sde"))
    parser.add_argument("--fused-reference", action="store_true", help="also time the maths as one compiled kernel")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--measure-memory", metavar="PATH", help=argparse.SUPPRESS)  # the child of peak_extra_latents
    args = parser.parse_args()
    if args.device == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # Time with a caching allocator, as on CUDA: glibc otherwise hands latent-sized buffers back to the OS
        # on free, and every call then pays page faults that swamp the arithmetic being compared.
        cached = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**31)}
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], {**os.environ, **cached})
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure_memory:
        print(measure_peak_extra(args.measure_memory, args.batch))
        return

    verl_cls, verl_note = load_verl_omni_scheduler(args.verl_omni)
    fns, _ = paths(args.batch, args.device, args.sde_type, verl_cls)
    sync = torch.cuda.synchronize if args.device == "cuda" else None

    def timer(name):
        return lambda: time_call(fns[name], args.calls, sync)

    comparisons = [
        ("(a) recompute / diffusers step", timer("stock_step"), timer("recompute")),
        ("(b) sample / (diffusers step + noise)", timer("stock_step_and_noise"), timer("sample")),
    ]
    fused_note = "not requested (--fused-reference)"
    if args.fused_reference:
        try:
            fused = fused_reference(args.batch, args.device)
            comparisons.append(
                (
                    "(e) fused reference / diffusers step",
                    timer("stock_step"),
                    lambda: time_call(fused, args.calls, sync),
                )
            )
            fused_note = "torch.compile'd"
        except Exception as error:  # no compiler, no inductor backend for this device, ...
            fused_note = f"skipped: torch.compile failed ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    if verl_cls is not None:
        comparisons += [
            ("(c) recompute / verl-omni recompute", timer("verl_recompute"), timer("recompute")),
            ("(d) sample / verl-omni sample", timer("verl_sample"), timer("sample")),
        ]
    ratios = interleaved_pairs(comparisons, args.pairs)
    result = {
        "device": args.device,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "shape": [args.batch, *LATENT],
        "sde_type": args.sde_type,
        "verl_omni": verl_note,
        "fused_reference": fused_note,
        "ratios": {name: ratio.as_dict() for name, ratio in ratios.items()},
        "peak_extra_latents": {
            name: round(peak_extra_latents(name, args.batch, args.device), 2) for name in ("recompute", "sample")
        },
    }
    traced = ["stock_step", "recompute", "stock_step_and_noise", "sample"]
    traced += ["verl_recompute", "verl_sample"] if verl_cls is not None else []
    result["passes"] = memory_passes(fns, traced, args.batch)
    if args.device == "cpu":
        result["memory"] = stream_time(args.batch, args.pairs, args.calls)
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"device {args.device} ({result['cpu_capability']}, {result['threads']} threads), latents "
        f"{tuple(result['shape'])} fp32, {args.sde_type}, {args.pairs} interleaved pairs of {args.calls} calls each"
    )
    targets = {"(a)": "<= 1.5x", "(b)": "<= 1.3x", "(c)": "<= 0.25x", "(d)": "(no target)", "(e)": "(the floor)"}
    for name, ratio in ratios.items():
        print(f"{name:<40} {ratio.describe()}   target {targets[name[:3]]}")
        print(f"{'':<40} {1e3 * min(ratio.times_b):.3f} / {1e3 * min(ratio.times_a):.3f} ms (fastest of each)")
    if verl_cls is None:
        print(f"(c), (d) verl-omni: {verl_note}")
    if not fused_note.startswith("torch"):
        print(f"(e) fused reference: {fused_note}")
    for name, value in result["peak_extra_latents"].items():
        print(f"peak extra memory, {name:<10}            {value:.2f} latents (target <= 3)")
    print("latent-sized passes per call (op level, from a dispatch trace): read + written (of which fresh outputs)")
    for name, p in result["passes"].items():
        print(f"  {name:<24} {p['read']:5.2f} + {p['written']:5.2f} ({p['fresh']:.2f})")
    if "memory" in result:
        m = result["memory"]
        print(f"one latent pass ({m['latent_MiB']} MiB) {m['pass_ms']:.3f} ms ({m['GBps']} GB/s, from a copy)")


if __name__ == "__main__":
    main()
