# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`rollout-consistency gate DUMP`: gate a log-prob dump (`rollout_consistency.gate.tables.dump`) from the command line.

Exit codes: 0 PASS, 1 FAIL, 2 usage error (bad flag, unreadable or invalid dump, an output path that is the
dump itself). Imports nothing heavy until it runs.
"""

from __future__ import annotations

import argparse
import os

from rollout_consistency.gate.config import ConfigError, parse_thresholds
from rollout_consistency.gate.tables.dump import DumpFormatError, read_dump
from rollout_consistency.gate.tables.settings import GateInputError, TableSettings
from rollout_consistency.safeguards.memory_budget import MemoryBudgetError
from rollout_consistency.safeguards.paths import InputPathError

from .command import ParserText
from .report_outputs import add_report_outputs, report_outputs, show_and_write
from .usage import UsageError, check_outputs
from .verdict_flags import add_profile_flags, add_threshold_flag

__all__ = ["PARSER_TEXT", "add_arguments", "run"]


PARSER_TEXT = ParserText(
    description=(
        "Read a log-prob dump (safetensors, format rollout-consistency/logprob-dump: rollout_log_probs and "
        "trainer_log_probs (N, T) float32, optional timesteps, sample_ids, prompt_groups, window_starts, "
        "advantages; write it with rollout_consistency.gate.write_dump or the in-loop recorder) and gate it "
        "against a tolerance profile. Guards the dump cannot support are reported as not checked."
    ),
    epilog=(
        "Examples:\n"
        "  rollout-consistency gate step1_logprobs.safetensors\n"
        "  rollout-consistency gate step1_logprobs.safetensors --profile kernel --json r.json --junit r.xml\n"
        "Docs: docs/ci.md"
    ),
    raw=True,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump", metavar="DUMP", help="the .safetensors log-prob dump")
    add_profile_flags(parser)
    parser.add_argument("--clip-ratio", type=float, default=1e-4, help="PPO clip range epsilon (default: 1e-4)")
    parser.add_argument("--clip-ratio-low", type=float, default=None, help="lower clip range (default: --clip-ratio)")
    parser.add_argument("--clip-ratio-high", type=float, default=None, help="upper clip range (default: --clip-ratio)")
    parser.add_argument(
        "--micro-batch-size", type=int, default=None, help="your trainer's micro-batch (default: one micro-batch)"
    )
    add_threshold_flag(parser)
    add_report_outputs(parser, "outputs (never the dump itself)")


def run(args: argparse.Namespace) -> int:
    targets = check_outputs(report_outputs(args), {"DUMP": args.dump})
    if os.path.isdir(args.dump):
        raise UsageError(f"DUMP {args.dump} is a directory; name the .safetensors dump inside it.")
    try:
        settings = TableSettings(
            profile=args.profile,
            compute_dtype=args.compute_dtype,
            clip_ratio=args.clip_ratio,
            clip_ratio_low=args.clip_ratio_low,
            clip_ratio_high=args.clip_ratio_high,
            micro_batch_size=args.micro_batch_size,
            thresholds=parse_thresholds(args.threshold) if args.threshold else None,
            source=str(args.dump),
        )
        report = read_dump(args.dump).gate(settings)
    except (
        FileNotFoundError,
        DumpFormatError,
        GateInputError,
        ConfigError,
        InputPathError,
        MemoryBudgetError,
    ) as error:
        raise UsageError(str(error)) from error
    return show_and_write(report, args, targets)
