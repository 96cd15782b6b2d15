#!/usr/bin/env python
# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Step-1 consistency check, script form: run it from a launcher before the first optimizer update.

The same command as `rollout-consistency check` — same flags, config file and exit codes (0 PASS, 1 FAIL,
2 usage error)::

    python scripts/step1_check.py                                   # tiny Qwen-Image, CPU, offline
    python scripts/step1_check.py --config step1.toml --json out/step1.json --junit out/step1.xml
    python scripts/step1_check.py --trajectory dumps/step1.safetensors --profile kernel

Inside a Python launcher, call the same API directly::

    from rollout_consistency import CheckConfig, run_step1_check

    report = run_step1_check(CheckConfig(model_path=ckpt, noise_level=0.7, sde_window_size=2, seed=launcher_seed))
    if not report.passed:
        raise SystemExit(report.format_table())
"""

import sys

from rollout_consistency.cli import PROG, main
from rollout_consistency.safeguards.supervisor import exit_now, run_supervised

if __name__ == "__main__":
    # Supervised like the console script: user code (plug-ins) cannot end the run with exit 0 and no verdict.
    exit_now(run_supervised(main, ["check", *sys.argv[1:]], PROG))
