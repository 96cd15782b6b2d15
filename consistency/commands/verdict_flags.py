# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The flags of a table's verdict that `gate` and `watch` share: ``--profile`` and ``--compute-dtype`` (the
tolerance profile) and ``--threshold METRIC=VALUE`` (one limit overridden)."""

from __future__ import annotations

import argparse

from rollout_consistency.gate.judging.tolerances import table_profiles

__all__ = ["add_profile_flags", "add_threshold_flag"]


def add_profile_flags(parser: argparse.ArgumentParser) -> None:
    """``--profile`` and ``--compute-dtype``: the tolerance profile of a table's verdict (`gate`, `watch`)."""
    parser.add_argument(
        "--profile",
        choices=table_profiles(),
        default="exact",
        help="tolerance profile (default: exact)",
    )
    parser.add_argument(
        "--compute-dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="narrowest dtype either side's forward runs in; the kernel limits are 8x tighter for float16/float32",
    )


def add_threshold_flag(parser: argparse.ArgumentParser) -> None:
    """``--threshold METRIC=VALUE`` (repeatable): one metric's limit overridden (`gate`, `watch`)."""
    parser.add_argument(
        "--threshold",
        action="append",
        default=[],
        metavar="METRIC=VALUE",
        help="override one metric's limit (repeatable; VALUE 'off' reports without gating)",
    )
