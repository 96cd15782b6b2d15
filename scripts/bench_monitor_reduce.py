# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Benchmark the run monitor across ranks and after the fact (docs/performance.md, "Run monitor across ranks and
after the fact").

    python scripts/bench_monitor_reduce.py [--steps 50] [--watch-steps 1000]

1. **Reduction on 2 gloo ranks.** Per training step, each rank's `StepStats.from_tables` on its 64 x 16 shard
   (per-sample windows over a 40-step schedule) and `reduce_step_stats` (pack, one all_gather, unpack, merge) on
   2 CPU processes, and a bare ``all_gather`` of a tensor of the same size (the floor of any one-collective
   reduction); medians over the steps. Target: the reduction adds to the bare collective no more than computing
   the shard's figures costs.
2. **watch on a long run.** A 1000-step TensorBoard run of verl-omni's consistency series (mean, max, kl, k3_kl and
   4 per-timestep series) written with torch's SummaryWriter; the time `watch` takes to read and judge it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from rollout_consistency.gate.monitor import StepStats
from rollout_consistency.gate.monitor.distributed import reduce_step_stats

ROWS, COLUMNS, SCHEDULE = 64, 16, 40


def _shard(step: int, rank: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    rollout = rng.normal(-1.0, 0.2, (ROWS, COLUMNS)).astype(np.float32)
    trainer = (rollout + rng.normal(0.0, 1e-5, rollout.shape)).astype(np.float32)
    schedule = np.linspace(1000.0, 25.0, SCHEDULE, dtype=np.float32)
    starts = rng.integers(0, SCHEDULE - COLUMNS + 1, ROWS)
    return {"rollout": rollout, "trainer": trainer, "timesteps": np.stack([schedule[s : s + COLUMNS] for s in starts])}


def _rank(rank: int, world: int, port: int, steps: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    figures, reduce, bare = [], [], []
    try:
        payload = torch.zeros(5534, dtype=torch.int64)  # the packed size at the default 128 timestep slots
        for step in range(steps):  # the same loop with a bare collective of the same size in place of the reduction
            tables = _shard(step, rank)
            StepStats.from_tables(tables["rollout"], tables["trainer"], timesteps=tables["timesteps"])
            gathered = [torch.empty_like(payload) for _ in range(world)]
            started = time.perf_counter()
            dist.all_gather(gathered, payload)
            bare.append(time.perf_counter() - started)
        for step in range(steps):
            tables = _shard(step, rank)
            started = time.perf_counter()
            stats = StepStats.from_tables(tables["rollout"], tables["trainer"], timesteps=tables["timesteps"])
            middle = time.perf_counter()
            reduce_step_stats(stats, step=step, shape=(ROWS, COLUMNS))
            figures.append(middle - started)
            reduce.append(time.perf_counter() - middle)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump({"figures": figures, "reduce": reduce, "bare": bare}, handle)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_reduce(steps: int) -> None:
    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.spawn(_rank, args=(2, _free_port(), steps, out), nprocs=2, join=True)
        runs = []
        for rank in range(2):
            with open(os.path.join(out, f"rank{rank}.json")) as handle:
                runs.append(json.load(handle))
    for rank, run in enumerate(runs):
        figures = statistics.median(run["figures"][1:]) * 1e3
        reduce = statistics.median(run["reduce"][1:]) * 1e3
        bare = statistics.median(run["bare"][1:]) * 1e3
        print(
            f"rank {rank}: figures of a {ROWS}x{COLUMNS} shard {figures:.2f} ms, reduce_step_stats {reduce:.2f} ms, "
            f"a bare all_gather of the same size {bare:.2f} ms (reduce - bare = {reduce - bare:.2f} ms) — median of "
            f"{steps - 1} steps"
        )


def bench_watch(steps: int) -> None:
    from torch.utils.tensorboard import SummaryWriter

    from rollout_consistency.cli import main

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as directory:
        writer = SummaryWriter(log_dir=os.path.join(directory, "run"))
        for step in range(steps):
            values = {
                "rollout_corr/logprob_abs_diff_mean": float(rng.lognormal(np.log(1e-5), 0.1)),
                "rollout_corr/logprob_abs_diff_max": float(rng.lognormal(np.log(1e-4), 0.1)),
                "rollout_corr/kl": float(rng.normal(0.0, 1e-6)),
                "rollout_corr/k3_kl": float(rng.lognormal(np.log(1e-10), 0.1)),
            }
            values.update(
                {f"rollout_corr/logprob_abs_diff/ts_{t}": float(rng.lognormal(np.log(1e-5), 0.1)) for t in (1000, 750)}
            )
            for name, value in values.items():
                writer.add_scalar(name, value, global_step=step)
        writer.close()
        started = time.perf_counter()
        code = main(["watch", os.path.join(directory, "run"), "--profile", "kernel"])
        elapsed = time.perf_counter() - started
    print(f"watch on a {steps}-step TensorBoard run of 6 series: {elapsed:.2f} s (exit {code})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--watch-steps", type=int, default=1000)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    bench_reduce(args.steps)
    bench_watch(args.watch_steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
