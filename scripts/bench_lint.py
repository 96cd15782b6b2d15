#!/usr/bin/env python
# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Benchmark the static lint on trees: files per second and peak memory (targets: >= 500 files per CPU-second
and <= 100 MB on 2 cores, on a large library such as diffusers' `src` and on a large RL tree — several
diffusion-RL repositories side by side, where most files hold the words the rules look for, so most are
parsed).

Each run is a fresh Python process (so the memory figure is the lint's, not this script's), which lints the
tree in process with every rule and reports back: the files it holds (`*.py` under the tree, the directories
the lint skips left out), the lint's own wall time (interpreter and import start-up excluded; the command line
adds them once), the CPU time it used (its own and its workers'), its findings, and its peak resident memory —
its own and, with `--jobs`, the largest worker's. Runs of the job counts given are interleaved (1, 2, 1, 2,
...; with several trees, each run of each tree in turn), so that a loaded, shared machine slows them alike; the median and the spread of each are printed. On a
machine other jobs share, the wall time measures the load as much as the lint: files per CPU-second is what
one free core would give.

Usage::

    python scripts/bench_lint.py /path/to/diffusers/src                 # 5 runs, one process
    python scripts/bench_lint.py /path/to/diffusers/src /path/to/rl-trees --runs 7   # a library and RL trees
    python scripts/bench_lint.py /path/to/diffusers/src --jobs 1 2 --runs 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence

_CHILD = """
import fnmatch, json, os, resource, sys, time
from rollout_consistency.lint import lint_paths
from rollout_consistency.lint.engine import SKIPPED_DIRECTORIES
tree, jobs = sys.argv[1], int(sys.argv[2])
files = 0
for directory, subdirs, names in os.walk(tree):
    subdirs[:] = [d for d in subdirs if not any(fnmatch.fnmatch(d, s) for s in SKIPPED_DIRECTORIES)]
    files += sum(name.endswith(".py") for name in names)
start, cpu_start = time.perf_counter(), time.process_time()
findings = lint_paths([tree], jobs=jobs)
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
children = resource.getrusage(resource.RUSAGE_CHILDREN)
own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({
    "files": files, "seconds": seconds, "cpu": cpu + children.ru_utime + children.ru_stime,
    "findings": len(findings), "own_mb": own, "worker_mb": children.ru_maxrss / 1024,
}))
"""


def run_once(tree: str, jobs: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, tree, str(jobs)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", help="directories to lint (e.g. diffusers' src, a directory of RL trees)")
    parser.add_argument("--runs", type=int, default=5, help="runs per tree and job count (default 5)")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1], help="job counts to compare (default: 1)")
    args = parser.parse_args(argv)
    results: dict[tuple[str, int], list[dict]] = {(tree, jobs): [] for tree in args.trees for jobs in args.jobs}
    for _ in range(args.runs):
        for tree in args.trees:
            for jobs in args.jobs:
                results[tree, jobs].append(run_once(tree, jobs))
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"{os.cpu_count()} CPUs; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(
        f"{'tree':<28} {'jobs':>4} {'files':>6} {'findings':>8}  {'wall s (median, min-max)':<26} {'files/s':>8}  "
        f"{'CPU s (median)':>14} {'files/CPU-s':>11}  peak RSS MB (own, largest worker, total bound)"
    )
    status = 0
    for (tree, jobs), runs in results.items():
        seconds = [r["seconds"] for r in runs]
        cpu = statistics.median(r["cpu"] for r in runs)
        own = max(r["own_mb"] for r in runs)
        worker = max(r["worker_mb"] for r in runs) if jobs > 1 else 0.0
        bound = own + jobs * worker
        median, files = statistics.median(seconds), runs[0]["files"]
        print(
            f"{tree[-28:]:<28} {jobs:>4} {files:>6} {runs[0]['findings']:>8}  "
            f"{f'{median:.2f} ({min(seconds):.2f}-{max(seconds):.2f})':<26} {files / median:>8.0f}  "
            f"{cpu:>14.2f} {files / cpu:>11.0f}  {own:.0f}, {worker:.0f}, {bound:.0f}"
        )
        if len({r["findings"] for (t, _), rs in results.items() if t == tree for r in rs}) != 1:
            print(f"error: the runs on {tree} disagree on the findings", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
