#!/usr/bin/env python
# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Step-1 consistency check, script form: run it from a launcher before the first optimizer update.

Same flags, config file and exit codes as `rollout-consistency check` (0 PASS, 1 FAIL, 2 usage error)::

    python scripts/step1_check.py                                   # tiny Qwen-Image, CPU, offline
    python scripts/step1_check.py --config step1.toml --json out/step1.json --junit out/step1.xml
    python scripts/step1_check.py --trajectory dumps/step1.safetensors --profile kernel

Inside a Python launcher, call the same API directly::

    from consistency import CheckConfig, run_step1_check

    report = run_step1_check(CheckConfig(model_path=ckpt, noise_level=0.7, sde_window_size=2, seed=launcher_seed))
    if not report.passed:
        raise SystemExit(report.format_table())
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from consistency.check import USAGE_ERRORS
from consistency.check_cli import add_check_arguments, run_check_command

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="step1_check.py",
        description="Step-1 consistency check: rollout log-probs vs the trainer's recomputation (docs/checker.md).",
        epilog="Exit codes: 0 PASS, 1 FAIL, 2 usage error.",
    )
    add_check_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: 0 after --help, 2 on bad flags
        return int(exit_.code or 0)
    try:
        return run_check_command(args)
    except (*USAGE_ERRORS, ValueError, TypeError) as error:
        print(f"step1_check.py: error: {error}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
