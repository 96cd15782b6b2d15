#!/usr/bin/env python
# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What starting the command line costs: each command's ``--help`` as it runs now (a command's module imported
when the command line names it) against the eager start it replaced (every command's module imported first),
side by side as interleaved pairs of fresh processes.

For each command line (``--help``, ``lint --help``, ``check --help``, ...): the modules of ours it loads, whether
numpy and torch come, and the median wall time of a fresh ``python -c`` running ``main(argv)`` — as it is (lazy)
and with every command module imported first (eager: the start before issue 34) — plus a bare interpreter's start
(``python -c pass``) for scale. Timings on a shared machine are noisy; the ratio of interleaved pairs less so::

    python scripts/bench_cli_start.py --pairs 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from rollout_consistency.cli import COMMANDS

_MAIN = """
import contextlib, io, json, sys
{eager}from rollout_consistency.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    code = main(sys.argv[1:])
ours = [m for m in sys.modules if m == "rollout_consistency" or m.startswith("rollout_consistency.")]
print(json.dumps({{"code": code, "ours": len(ours), "numpy": "numpy" in sys.modules, "torch": "torch" in sys.modules}}))
"""
_EAGER = "".join(f"import rollout_consistency.commands.{c.module}\n" for c in COMMANDS)
COMMAND_LINES = (
    ["--help"],
    ["lint", "--help"],
    ["plugin-template", "--help"],
    ["watch", "--help"],
    ["check", "--help"],
)


def _run(code: str, argv: list[str]) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    return seconds, json.loads(done.stdout) if done.stdout.strip() else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=10, help="interleaved lazy/eager pairs per command line")
    args = parser.parse_args()
    lazy_code, eager_code = _MAIN.format(eager=""), _MAIN.format(eager=_EAGER)
    bare = statistics.median(_run("pass", [])[0] for _ in range(args.pairs))
    print(f"python -c pass: median {bare * 1e3:.0f} ms over {args.pairs} runs")
    for argv in COMMAND_LINES:
        lazy_s, eager_s, ratios = [], [], []
        for _ in range(args.pairs):
            lazy, lazy_loaded = _run(lazy_code, argv)
            eager, eager_loaded = _run(eager_code, argv)
            lazy_s.append(lazy)
            eager_s.append(eager)
            ratios.append(lazy / eager)
        assert lazy_loaded["code"] == eager_loaded["code"] == 0, argv
        print(
            f"{' '.join(argv):22} lazy {statistics.median(lazy_s) * 1e3:4.0f} ms ({lazy_loaded['ours']} of ours, "
            f"numpy {'yes' if lazy_loaded['numpy'] else 'no'}, torch {'yes' if lazy_loaded['torch'] else 'no'}) | "
            f"eager {statistics.median(eager_s) * 1e3:4.0f} ms ({eager_loaded['ours']} of ours, numpy "
            f"{'yes' if eager_loaded['numpy'] else 'no'}) | lazy/eager median {statistics.median(ratios):.2f} "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
