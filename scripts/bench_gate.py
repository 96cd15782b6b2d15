"""Benchmark `gate()` on a user's two log-prob tables against a previous revision of this repository, side by side.

    python scripts/bench_gate.py [--pairs 5] [--sizes 100000x16 1000x16] [--reference db9a427] [--cases pass fail]

Every measurement is a fresh child process: import the package, one warm-up `gate()` on a 10-row table, then
`gate()` on the full tables twice — once timed (``time.perf_counter``), once under ``tracemalloc`` (the peak of
every allocation NumPy and Python make during the call) — plus the resident-set peak of the timed call above the
resident size right before it (``VmHWM``, reset through ``/proc/self/clear_refs``; Linux only). The tables are
built in the child from a fixed seed, so both revisions gate the same numbers.

The previous implementation is the package at ``--reference`` (a git revision, extracted with ``git archive`` into
a temporary directory). Children run as interleaved pairs — reference, current, current, reference, ... — and each
size and case reports the median time of each side, the median over pairs of the ratio reference/current with its
spread (min-max), and the memory peaks as multiples of the tables' bytes (rollout, trainer and timesteps, float32).

Cases:
    pass     trainer = rollout + N(0, 1e-6) (float32 rounding-sized), ``profile="kernel"``: PASS, the doctor idle
    fail     the same tables under ``profile="exact"``: FAIL, the doctor reads every figure
    windows  ``pass`` with each prompt group of 8 samples on its own SDE window (the timestep view groups exact
             timestep values across window positions) and micro-batches of 4

Targets (issue 26): ``gate()`` on 100,000 x 16 in <= 0.3 s and <= 3x the tables' memory; 1,000 x 16 ~0.03 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("pass", "fail", "windows")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def tables(rows: int, width: int, case: str):
    """The seeded tables of one case: rollout, trainer, timesteps (float32) and gate()'s settings."""
    import numpy as np

    rng = np.random.default_rng(0)
    rollout = rng.normal(-1.0, 0.1, (rows, width)).astype(np.float32)
    trainer = (rollout + rng.normal(0.0, 1e-6, (rows, width))).astype(np.float32)
    schedule = np.linspace(1000.0, 0.0, width + 8, dtype=np.float32)
    if case == "windows":
        starts = rng.integers(0, 9, size=(rows + 7) // 8).repeat(8)[:rows]  # one window per group of 8
        settings = {"profile": "kernel", "micro_batch_size": 4}
    else:
        starts = np.zeros(rows, dtype=np.int64)
        settings = {"profile": "kernel" if case == "pass" else "exact"}
    timesteps = schedule[starts[:, None] + np.arange(width)[None, :]]
    return rollout, trainer, timesteps, settings


def child(rows: int, width: int, case: str) -> dict:
    """One measurement, in this (fresh) process."""
    import tracemalloc

    from rollout_consistency.gate import gate

    rollout, trainer, timesteps, settings = tables(rows, width, case)
    gate(rollout[:10], trainer[:10], timesteps=timesteps[:10], **settings)
    rss_before = _status_kib("VmRSS")
    if os.path.exists("/proc/self/clear_refs"):
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # reset VmHWM to the current resident size
    start = time.perf_counter()
    report = gate(rollout, trainer, timesteps=timesteps, **settings)
    seconds = time.perf_counter() - start
    rss_peak = (_status_kib("VmHWM") - rss_before) * 1024
    del report
    tracemalloc.start()
    report = gate(rollout, trainer, timesteps=timesteps, **settings)
    traced_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    table_bytes = rollout.nbytes + trainer.nbytes + timesteps.nbytes
    return {
        "seconds": seconds,
        "traced_peak": traced_peak,
        "rss_peak": rss_peak,
        "table_bytes": table_bytes,
        "status": report.status,
    }


def extract_reference(revision: str, into: Path) -> Path:
    """The package at `revision` as an importable ``rollout_consistency`` under `into` (returns the path entry)."""
    source = into / "source"
    source.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "consistency", "adapters", "schedulers"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    package = into / "path" / "rollout_consistency"
    shutil.copytree(source / "consistency", package)
    shutil.copytree(source / "adapters", package / "adapters")
    shutil.copytree(source / "schedulers", package / "schedulers")
    return into / "path"


def run_child(rows: int, width: int, case: str, path_entry: Path | None) -> dict:
    env = dict(os.environ)
    if path_entry is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path_entry), env.get("PYTHONPATH", "")])
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]) if sys.argv[1] else None; "
        "sys.path.insert(0, sys.argv[2]); import bench_gate; "
        "print(json.dumps(bench_gate.child(int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])))"
    )
    argv = [str(path_entry or ""), str(ROOT / "scripts"), str(rows), str(width), case]
    done = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_reference_imports(path_entry: Path) -> None:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import rollout_consistency; print(rollout_consistency.__file__)"
    )
    where = subprocess.run([sys.executable, "-c", code, str(path_entry)], capture_output=True, text=True, check=True)
    if not where.stdout.strip().startswith(str(path_entry)):
        raise SystemExit(f"the reference package did not shadow the installed one: {where.stdout.strip()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5, help="interleaved pairs per size and case (default 5)")
    parser.add_argument("--sizes", nargs="+", default=["100000x16", "1000x16"], help="ROWSxSTEPS (default both)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--reference", default="db9a427", help="git revision to compare with ('' for none)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-gate-") as scratch:
        reference = extract_reference(args.reference, Path(scratch)) if args.reference else None
        if reference is not None:
            check_reference_imports(reference)
        print(f"gate() benchmark: {args.pairs} interleaved pairs per row; reference {args.reference or '-'}")
        print(
            f"  {'size':>10} {'case':>8} {'status':>6} {'current s':>10} {'ref s':>9} {'ref/cur':>17}"
            f" {'traced peak':>12} {'rss peak':>9} {'ref traced':>11}"
        )
        for size in args.sizes:
            rows, width = (int(x) for x in size.lower().split("x"))
            for case in args.cases:
                current, previous = [], []
                for pair in range(args.pairs):
                    order = (True, False) if pair % 2 == 0 else (False, True)  # A B, then B A
                    for is_current in order:
                        if is_current:
                            current.append(run_child(rows, width, case, None))
                        elif reference is not None:
                            previous.append(run_child(rows, width, case, reference))
                table = current[0]["table_bytes"]
                line = (
                    f"  {size:>10} {case:>8} {current[0]['status']:>6} "
                    f"{statistics.median(r['seconds'] for r in current):>10.4f}"
                )
                if previous:
                    ratios = [p["seconds"] / c["seconds"] for p, c in zip(previous, current, strict=True)]
                    line += (
                        f" {statistics.median(r['seconds'] for r in previous):>9.4f}"
                        f" {statistics.median(ratios):>6.1f}x ({min(ratios):.1f}-{max(ratios):.1f})"
                    )
                else:
                    line += f" {'-':>9} {'-':>17}"
                line += (
                    f" {max(r['traced_peak'] for r in current) / table:>11.2f}x"
                    f" {max(r['rss_peak'] for r in current) / table:>8.2f}x"
                )
                if previous:
                    line += f" {max(r['traced_peak'] for r in previous) / table:>10.2f}x"
                print(line, flush=True)
        print(f"  tables: rollout + trainer + timesteps, float32 ({table / 2**20:.1f} MiB at the last size)")


if __name__ == "__main__":
    main()
