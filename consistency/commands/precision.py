# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`rollout-consistency precision`: audit this process's precision settings (and a user's model, optimizer and
GradScaler), or `--diff` two saved audits."""

from __future__ import annotations

import argparse
from typing import Any

from rollout_consistency.safeguards.cli_guard import EXIT_FAIL, EXIT_PASS
from rollout_consistency.safeguards.fence import fenced
from rollout_consistency.safeguards.object_spec import spec_source

from .command import ParserText
from .factories import add_timeout_argument, call_factory, load_spec, parse_factory_args, timeout
from .usage import UsageError, check_outputs, read_json, write_json

__all__ = ["PARSER_TEXT", "add_arguments", "run"]


PARSER_TEXT = ParserText(
    description=(
        "Without --diff: audit this process's precision settings (and, with --spec, a model, optimizer and "
        "GradScaler), print the findings with their fixes, optionally write the report as JSON. The spec's "
        "factory returns a mapping with any of 'model', 'optimizer', 'scaler', 'autocast_dtype', 'device'. "
        "With --diff A B: compare two JSON reports (e.g. written with --json on the rollout and the trainer "
        "side, or with PrecisionReport.to_dict()) and fail when they differ in a setting that changes numbers."
    ),
    epilog=(
        "Examples:\n"
        "  rollout-consistency precision --json trainer.json --label trainer\n"
        "  rollout-consistency precision --diff rollout.json trainer.json"
    ),
    raw=True,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec", help="factory returning {'model': ..., 'optimizer': ..., 'scaler': ..., 'autocast_dtype': ...}"
    )
    parser.add_argument(
        "--arg", action="append", default=[], metavar="NAME=VALUE", help="extra keyword for the factory (repeatable)"
    )
    parser.add_argument("--label", default="", help="name of this side in the report (e.g. rollout, trainer)")
    parser.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two JSON reports instead of auditing")
    parser.add_argument(
        "--fail-on",
        choices=("error", "warning", "never"),
        default="error",
        help="audit: exit 1 when a finding of this severity or worse exists (default error)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the report (or the diff) as JSON")
    add_timeout_argument(parser)


def run(args: argparse.Namespace) -> int:
    from rollout_consistency.training.precision import PrecisionReport, audit_precision, diff_precision_reports

    diff_a, diff_b = args.diff or (None, None)
    inputs = {"--diff A": diff_a, "--diff B": diff_b, "--spec": spec_source(args.spec)}
    json_target = check_outputs({"--json": args.json}, inputs).get("--json")
    if args.diff:
        if args.spec:
            raise UsageError("--diff compares two saved reports; it takes no --spec")
        try:
            a, b = (PrecisionReport.from_dict(read_json(path, "--diff input")) for path in args.diff)
            diff = diff_precision_reports(a, b)
        except ValueError as error:
            raise UsageError(f"precision --diff {diff_a} {diff_b}: {error}") from error
        print(diff.format())
        write_json(json_target, diff.to_dict())
        return EXIT_PASS if diff.consistent else EXIT_FAIL

    objects: dict[str, Any] = {}
    owner, timeout_s = f"precision --spec {args.spec!r}", timeout(args)
    if args.spec:
        factory = load_spec(args.spec, owner, timeout_s)
        objects = call_factory(factory, args.spec, {}, parse_factory_args(args.arg), owner=owner, timeout_s=timeout_s)
        allowed = {"model", "optimizer", "scaler", "autocast_dtype", "device"}
        if not isinstance(objects, dict) or not set(objects) <= allowed:
            raise UsageError(f"{args.spec} must return a mapping with keys among {sorted(allowed)}")
    elif args.arg:
        raise UsageError("--arg needs --spec")
    try:
        with fenced(owner, "the audit of its objects", timeout_s=timeout_s):  # reads the user's objects
            report = audit_precision(**objects, label=args.label)
    except (TypeError, ValueError) as error:
        raise UsageError(f"{args.spec}: {error}") from error
    print(report.format())
    write_json(json_target, report.to_dict())
    failing = {"error": ("error",), "warning": ("error", "warning"), "never": ()}[args.fail_on]
    return EXIT_FAIL if any(f.severity in failing for f in report.findings) else EXIT_PASS
