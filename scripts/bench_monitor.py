# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Benchmark the run monitor: its cost per training step, on big tables against `gate()`, and its memory over many
steps (docs/performance.md, "Run monitor").

    python scripts/bench_monitor.py [--pairs 15] [--quick]

1. **Tiny-loop step.** One step of the tiny flow_grpo-style loop (scripts/examples/flow_grpo_monitored.py: rollout,
   the trainer's micro-batches with an update after each, the weight sync) with the `RunMonitor` hooks
   (``begin_step`` / ``record`` / the optimizer's hook ending the step), against the same step whose hooks go to an
   object that does nothing. Ratio monitored / bare of the process's CPU time (``time.process_time``: the load of
   other processes on a shared machine drops out), as interleaved pairs (scripts/paired_timing.py). Target: the
   monitor adds <= 1 % to a tiny-loop step.
2. **100,000 x 16 tables.** ``RunMonitor.observe`` (the figures and the judge; a PASS, so no doctor) against
   ``gate()`` on the same tables (profile ``kernel``, with timesteps), interleaved pairs. Target: <= 1.2x.
3. **Memory.** ``tracemalloc``: what the monitor holds after 1,000 and after 10,000 observed steps of 64 x 16
   tables, clean and failing every step (the alarms' doctor and records are bounded by ``max_alarms_kept``).
   Target: the same after 10,000 steps as after 1,000.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import torch
from paired_timing import interleaved_pairs

from rollout_consistency.gate import TableSettings, gate
from rollout_consistency.gate.monitor import MonitorSettings, MonitorWarning, RunMonitor

_LOOP = Path(__file__).resolve().parent / "examples" / "flow_grpo_monitored.py"


class _NoMonitor:
    """The loop's hooks going nowhere: the bare step's baseline."""

    def begin_step(self, step: int) -> None:
        pass

    def record(self, *args: object, **kwargs: object) -> None:
        pass


def _load_loop():
    spec = importlib.util.spec_from_file_location("flow_grpo_monitored", _LOOP)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("flow_grpo_monitored", module)
    spec.loader.exec_module(module)
    return module


def loop_step_timers(loop):
    """Two timers of one loop step each (bare, monitored), on separate but identical runs."""
    settings = MonitorSettings(gate=TableSettings(profile="implementation"))

    def make(monitored: bool):
        trainer, engine = loop.VelocityModel(0), loop.VelocityModel(0)
        optimizer = torch.optim.Adam(trainer.parameters(), lr=3e-3)
        monitor = RunMonitor(settings, optimizer=optimizer) if monitored else _NoMonitor()
        sched = loop.scheduler()
        generator = torch.Generator().manual_seed(0)
        prompts = torch.randn(loop.GROUPS, loop.D, generator=generator).repeat_interleave(loop.GROUP_SIZE, 0)
        state = {"step": 0}

        def one() -> float:
            start = time.process_time()  # this process's CPU time: other processes' load on a shared VM drops out
            samples = loop.rollout(engine, sched, prompts, generator, loop.NOISE_LEVEL)
            monitor.begin_step(state["step"])
            loop.train(trainer, sched, optimizer, samples, generator, monitor)
            engine.load_state_dict(trainer.state_dict())
            state["step"] += 1
            return time.process_time() - start

        return one

    return make(False), make(True)


def big_table_timers(rows: int, columns: int):
    rng = np.random.default_rng(0)
    rollout = rng.normal(-1.0, 0.1, (rows, columns)).astype(np.float32)
    trainer = (rollout + rng.normal(0.0, 1e-6, rollout.shape)).astype(np.float32)
    timesteps = np.tile(np.linspace(1000.0, 100.0, columns, dtype=np.float32), (rows, 1))
    settings = MonitorSettings(gate=TableSettings(profile="kernel"))
    monitor = RunMonitor(settings)
    state = {"step": 0}

    def with_gate() -> float:
        start = time.perf_counter()
        gate(rollout, trainer, settings.gate, timesteps=timesteps)
        return time.perf_counter() - start

    def with_monitor() -> float:
        start = time.perf_counter()
        verdict = monitor.observe(state["step"], rollout, trainer, timesteps=timesteps)
        state["step"] += 1
        assert verdict.passed
        return time.perf_counter() - start

    return with_gate, with_monitor


def held_after(steps: int, failing: bool) -> int:
    """Bytes the monitor holds (traced, still allocated) after `steps` observed steps."""
    rng = np.random.default_rng(1)
    rollout = rng.normal(-1.0, 0.1, (64, 16)).astype(np.float32)
    trainer = rollout + np.float32(1e-3) if failing else rollout.copy()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    monitor = RunMonitor(MonitorSettings(gate=TableSettings(profile="kernel")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MonitorWarning)
        for step in range(steps):
            monitor.observe(step, rollout, trainer)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del monitor
    return held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 pairs, 10,000-row tables, 300 steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the tiny loop: one thread, as the tests run it
    loop = _load_loop()
    rows = 10_000 if args.quick else 100_000
    pairs = 3 if args.quick else args.pairs

    bare, monitored = loop_step_timers(loop)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MonitorWarning)
        step = interleaved_pairs([("loop", bare, monitored)], pairs=pairs * 4, warmup=3)["loop"]
    print(f"tiny-loop step, monitored / bare: {step.describe()}")
    print(
        f"  bare step {1e3 * statistics.median(step.times_a):.2f} ms, monitored "
        f"{1e3 * statistics.median(step.times_b):.2f} ms: the monitor adds {100 * (step.median - 1):.2f} %"
    )
    with_gate, with_monitor = big_table_timers(rows, 16)
    big = interleaved_pairs([("big", with_gate, with_monitor)], pairs=pairs, warmup=1)["big"]
    print(f"{rows} x 16 tables, RunMonitor.observe / gate(): {big.describe()}")
    print(
        f"  gate {1e3 * statistics.median(big.times_a):.0f} ms, observe {1e3 * statistics.median(big.times_b):.0f} ms"
    )
    short, long = (300, 3000) if args.quick else (1000, 10000)
    for failing in (False, True):
        a, b = held_after(short, failing), held_after(long, failing)
        kind = "failing every step" if failing else "clean"
        print(f"memory held, {kind}: {a / 1024:.0f} KiB after {short} steps, {b / 1024:.0f} KiB after {long} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
