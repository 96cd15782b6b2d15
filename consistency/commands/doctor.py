# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`rollout-consistency doctor REPORT.json`: the command lives with the doctor
(`rollout_consistency.gate.diagnosis.doctor`); here its bad input becomes a `UsageError`."""

from __future__ import annotations

import argparse
from typing import Any

from rollout_consistency.gate.diagnosis import doctor

from .usage import UsageError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    return doctor.add_parser(subparsers)


def run(args: argparse.Namespace) -> int:
    try:
        return doctor.run(args)
    except doctor.DoctorInputError as error:
        raise UsageError(str(error)) from error
