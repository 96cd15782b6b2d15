#!/usr/bin/env python
# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Every figure of a fixed set of step-1 checks, saved, then compared bit for bit: the check for a change that
must move no figure (a refactor, a move, a settings object).

The cases cover what the figures flow through: each built-in family, a bf16 rollout with a micro-batch under
``kernel``, a fixed SDE window, the five ``--inject`` pitfalls (the doctor's diagnosis too), two Ray workers,
step 2's weight sync, the step-wise engine and the plug-in template pair. Each runs as a reader would run it
(``rollout-consistency check --json``, a fresh process); the comparison is of the whole JSON report and the exit
code, with wall times left out (``run.timings_s``, every ``seconds`` entry, the doctor's "(0.2 s, one batch)")::

    python scripts/figures_snapshot.py save /tmp/figures-before      # on the tree before the change
    python scripts/figures_snapshot.py compare /tmp/figures-before   # after it: exit 1 when a figure moved

Compare on the machine that saved: kernels differ between CPUs, so figures do too.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: name -> the `check` flags of the case (the plug-in pair's file is written once, into the saved folder).
CASES: dict[str, tuple[str, ...]] = {
    "default": (),
    "sd3": ("--model-family", "sd3"),
    "flux": ("--model-family", "flux"),
    "wan": ("--model-family", "wan"),
    "bf16-micro-batch": ("--rollout-dtype", "bfloat16", "--micro-batch-size", "1", "--profile", "kernel"),
    "fixed-window": ("--sde-window-size", "2", "--sde-window-kind", "fixed"),
    "inject-bf16-latents": ("--inject", "bf16-latents"),
    "inject-stepwise-bf16": ("--inject", "stepwise-bf16"),
    "inject-mask-sum-rope": ("--inject", "mask-sum-rope"),
    "inject-per-request-window": ("--inject", "per-request-window"),
    "inject-expert-switch": ("--inject", "expert-switch"),
    "ray-workers": ("--workers", "2"),
    "weight-sync": ("--weight-sync", "load_state_dict"),
    "step-wise": ("--step-execution", "--max-num-seqs", "3"),
    "plugin-pair": (
        "--rollout-backend",
        "{plugin}:make_rollout",
        "--trainer-backend",
        "{plugin}:make_trainer",
        "--sde-window-size",
        "all",
    ),
}
_WALL_TIME = re.compile(r"\([0-9.e+-]+ s, ")


def run_cases(into: Path, plugin: Path) -> dict[str, int]:
    """Run every case, its report written to ``into/NAME.json``; the exit code of each."""
    codes = {}
    for name, flags in CASES.items():
        argv = [flag.format(plugin=plugin) for flag in flags]
        command = [sys.executable, "-m", "rollout_consistency", "check", "--no-progress", "--json"]
        done = subprocess.run([*command, str(into / f"{name}.json"), *argv], capture_output=True, text=True)
        codes[name] = done.returncode
        print(f"{name}: exit {done.returncode}", flush=True)
    return codes


def without_wall_times(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_wall_times(v) for k, v in value.items() if k not in ("seconds", "timings_s")}
    if isinstance(value, list):
        return [without_wall_times(v) for v in value]
    return _WALL_TIME.sub("(_ s, ", value) if isinstance(value, str) else value


def differences(before: Any, after: Any, path: str = "") -> list[str]:
    """Where two reports differ (JSON paths), every float compared by its value as written (repr: bit for bit)."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [
            d
            for key in sorted(set(before) | set(after))
            for d in differences(before.get(key), after.get(key), f"{path}.{key}")
        ]
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [
            d for i, (b, a) in enumerate(zip(before, after, strict=True)) for d in differences(b, a, f"{path}[{i}]")
        ]
    return (
        []
        if json.dumps(before) == json.dumps(after)
        else [f"{path}: {json.dumps(before)[:80]} -> {json.dumps(after)[:80]}"]
    )


def save(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    plugin = folder / "plugin_pair.py"
    if not plugin.exists():
        subprocess.run([sys.executable, "-m", "rollout_consistency", "plugin-template", str(plugin)], check=True)
    (folder / "exit_codes.json").write_text(json.dumps(run_cases(folder, plugin), indent=1))
    return 0


def compare(folder: Path) -> int:
    saved = json.loads((folder / "exit_codes.json").read_text())
    moved = 0
    with tempfile.TemporaryDirectory() as scratch:
        codes = run_cases(Path(scratch), folder / "plugin_pair.py")
        for name in CASES:
            if codes[name] != saved.get(name):
                print(f"MOVED {name}: exit {saved.get(name)} -> {codes[name]}")
                moved += 1
                continue
            reports = [path / f"{name}.json" for path in (folder, Path(scratch))]
            written = [report.exists() for report in reports]
            if written != [True, True]:
                # no report on either side (the case stops before writing one, exit 2): only its exit code compared
                gone = written != [False, False]
                moved += gone
                print(f"{'MOVED' if gone else 'same '} {name}: report written {written[0]} -> {written[1]}")
                continue
            before, after = (without_wall_times(json.loads(report.read_text())) for report in reports)
            found = differences(before, after)
            moved += bool(found)
            print(f"{'MOVED' if found else 'same '} {name}" + "".join(f"\n    {d}" for d in found[:10]))
    print(f"{len(CASES) - moved} of {len(CASES)} cases identical (wall times aside)")
    return 1 if moved else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("save", "compare"))
    parser.add_argument("folder", type=Path, help="where the reports are saved / were saved")
    args = parser.parse_args()
    return save(args.folder) if args.action == "save" else compare(args.folder)


if __name__ == "__main__":
    sys.exit(main())
