# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Command line: `rollout-consistency <command>` (also `python -m consistency <command>`).

Exit codes for every command: 0 pass, 1 fail, 2 usage error (bad arguments, unloadable spec or file).

Each command is one `_add_<name>_parser(subparsers)` + `_run_<name>(args) -> int` pair registered in
`_COMMANDS`. Heavy imports (torch, the checks) happen inside `_run_<name>`, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "UsageError"]

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad input to a command: reported on stderr, exit code 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 pass, 1 fail, 2 usage error)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: 0 after --help, 2 on bad arguments
        return int(exit_.code or 0)
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.run(args)
    except UsageError as error:
        print(f"rollout-consistency {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-consistency",
        description="Consistency checks for diffusion RL training (rollout vs trainer, and within a training run).",
        epilog="Exit codes: 0 pass, 1 fail, 2 usage error. Docs: docs/training-consistency.md",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_parser in _COMMANDS:
        add_parser(subparsers)
    return parser


# ----------------------------------------------------------------------------------------------
# shared helpers


def _load_spec(spec: str) -> Any:
    from consistency.object_spec import SpecError, load_object

    try:
        return load_object(spec)
    except SpecError as error:
        raise UsageError(str(error)) from error


def _call_factory(factory: Any, spec: str, optional: dict[str, Any], required: dict[str, Any]) -> Any:
    from consistency.object_spec import SpecError, call_with_supported_kwargs

    if not callable(factory):
        return factory  # the spec named the object itself
    try:
        return call_with_supported_kwargs(factory, optional=optional, required=required)
    except SpecError as error:
        raise UsageError(f"{spec}: {error}") from error


def _parse_factory_args(pairs: Sequence[str]) -> dict[str, Any]:
    """`name=value` pairs; values are Python literals (numbers, strings, lists), else plain strings."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.isidentifier():
            raise UsageError(f"--arg expects name=value, got {pair!r}")
        try:
            kwargs[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            kwargs[name] = text
    return kwargs


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if path is None:
        return
    try:
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error}") from error


def _read_json(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read JSON from {path}: {error}") from error


# ----------------------------------------------------------------------------------------------
# recompute


_CHECKPOINT_CHOICES = {
    "consistency": "consistency.checkpointing.checkpoint (torch non-reentrant, RNG preserved) [default]",
    "torch": "torch.utils.checkpoint.checkpoint(use_reentrant=False)",
    "torch-reentrant": "torch.utils.checkpoint.checkpoint(use_reentrant=True)",
}


def _add_recompute_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "recompute",
        help="check that gradient checkpointing recomputes the same forward (same loss and gradients)",
        description=(
            "Run one forward+backward of a module without and with gradient checkpointing from the same RNG "
            "state and compare the loss and every gradient. SPEC names a factory 'package.module:factory' or "
            "'path/to/file.py:factory'. The factory is called (with seed=SEED if it takes a seed, plus any "
            "--arg) and returns a mapping with 'module' (nn.Module) and 'inputs' (tensor, tuple for "
            "module(*inputs), or dict for module(**inputs)), and optionally 'loss_fn' (output -> scalar), "
            "'segments' (submodule names/patterns to checkpoint) and 'set_checkpointing' (fn(module, "
            "checkpoint_fn or None)); a (module, inputs) or (module, inputs, loss_fn) tuple also works."
        ),
        epilog="Example: rollout-consistency recompute consistency._checkpoint_pitfall:toy_case --arg dropout=0.3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("spec", metavar="SPEC", help="factory spec, 'package.module:factory' or 'file.py:factory'")
    parser.add_argument(
        "--checkpoint",
        default="consistency",
        metavar="NAME|SPEC",
        help="checkpoint function to check: "
        + "; ".join(f"{name}: {what}" for name, what in _CHECKPOINT_CHOICES.items())
        + "; or a 'module:function' spec called as fn(function, *args)",
    )
    parser.add_argument(
        "--segments", nargs="+", metavar="PATTERN", help="submodules to checkpoint (overrides the factory's)"
    )
    parser.add_argument(
        "--arg", action="append", default=[], metavar="NAME=VALUE", help="extra keyword for the factory (repeatable)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the runs and of the factory (default 0)")
    parser.add_argument(
        "--rtol", type=float, default=1e-6, help="relative tolerance per gradient (default 1e-6; 0 = bitwise)"
    )
    parser.add_argument("--atol", type=float, default=0.0, help="absolute tolerance per gradient (default 0)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the repeat of the reference run")
    parser.add_argument("--top", type=int, default=10, help="gradients shown in the table (default 10)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.set_defaults(run=_run_recompute)


def _resolve_checkpoint(name: str) -> Callable[..., Any]:
    import functools

    import torch.utils.checkpoint

    from consistency.checkpointing import checkpoint

    if name == "consistency":
        return checkpoint
    if name == "torch":
        return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    if name == "torch-reentrant":
        return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    if ":" not in name:
        raise UsageError(
            f"--checkpoint must be one of {', '.join(_CHECKPOINT_CHOICES)} or a 'module:function' spec, got {name!r}"
        )
    function = _load_spec(name)
    if not callable(function):
        raise UsageError(f"--checkpoint {name} is not callable")
    return function


def _recompute_case(spec: str, seed: int, factory_args: dict[str, Any]) -> dict[str, Any]:
    from torch import nn

    case = _call_factory(_load_spec(spec), spec, optional={"seed": seed}, required=factory_args)
    if isinstance(case, tuple) and len(case) in (2, 3):
        case = dict(zip(("module", "inputs", "loss_fn"), case))
    if not isinstance(case, dict) or "module" not in case or "inputs" not in case:
        raise UsageError(
            f"{spec} must return a mapping with 'module' and 'inputs' (or a (module, inputs[, loss_fn]) tuple), "
            f"got {type(case).__name__}"
        )
    unknown = set(case) - {"module", "inputs", "loss_fn", "segments", "set_checkpointing"}
    if unknown:
        raise UsageError(f"{spec} returned unknown keys {sorted(unknown)}")
    if not isinstance(case["module"], nn.Module):
        raise UsageError(f"{spec}: 'module' must be a torch.nn.Module, got {type(case['module']).__name__}")
    return case


def _run_recompute(args: argparse.Namespace) -> int:
    from consistency.recompute import check_recompute_consistency

    case = _recompute_case(args.spec, args.seed, _parse_factory_args(args.arg))
    checkpoint_fn = _resolve_checkpoint(args.checkpoint)
    segments = args.segments if args.segments is not None else case.get("segments")
    set_checkpointing = None if args.segments is not None else case.get("set_checkpointing")
    try:
        report = check_recompute_consistency(
            case["module"],
            case["inputs"],
            checkpoint_fn,
            segments=segments,
            set_checkpointing=set_checkpointing,
            loss_fn=case.get("loss_fn"),
            seed=args.seed,
            rtol=args.rtol,
            atol=args.atol,
            baseline=not args.no_baseline,
        )
    except ValueError as error:
        raise UsageError(str(error)) from error
    print(report.format(top=args.top))
    _write_json(args.json, report.to_dict())
    return EXIT_PASS if report.passed else EXIT_FAIL


# ----------------------------------------------------------------------------------------------
# precision


def _add_precision_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "precision",
        help="audit precision settings (TF32, autocast, GradScaler, determinism) or diff two audits",
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
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    parser.set_defaults(run=_run_precision)


def _run_precision(args: argparse.Namespace) -> int:
    from consistency.precision import PrecisionReport, audit_precision, diff_precision_reports

    if args.diff:
        if args.spec:
            raise UsageError("--diff compares two saved reports; it takes no --spec")
        try:
            a, b = (PrecisionReport.from_dict(_read_json(path)) for path in args.diff)
        except ValueError as error:
            raise UsageError(str(error)) from error
        diff = diff_precision_reports(a, b)
        print(diff.format())
        _write_json(args.json, diff.to_dict())
        return EXIT_PASS if diff.consistent else EXIT_FAIL

    objects: dict[str, Any] = {}
    if args.spec:
        objects = _call_factory(_load_spec(args.spec), args.spec, optional={}, required=_parse_factory_args(args.arg))
        allowed = {"model", "optimizer", "scaler", "autocast_dtype", "device"}
        if not isinstance(objects, dict) or not set(objects) <= allowed:
            raise UsageError(f"{args.spec} must return a mapping with keys among {sorted(allowed)}")
    elif args.arg:
        raise UsageError("--arg needs --spec")
    try:
        report = audit_precision(**objects, label=args.label)
    except (TypeError, ValueError) as error:
        raise UsageError(f"{args.spec}: {error}") from error
    print(report.format())
    _write_json(args.json, report.to_dict())
    failing = {"error": ("error",), "warning": ("error", "warning"), "never": ()}[args.fail_on]
    return EXIT_FAIL if any(f.severity in failing for f in report.findings) else EXIT_PASS


# ----------------------------------------------------------------------------------------------
# check (the step-1 consistency check; flags and outputs live in consistency/check_cli.py)


def _add_check_parser(subparsers: Any) -> None:
    from consistency.check_cli import add_check_arguments

    parser = subparsers.add_parser(
        "check",
        help="step-1 check: rollout log-probs vs the trainer's recomputation (ratio must be 1)",
        description=(
            "Sample rollouts with the rollout backend, recompute their log-probs with the trainer backend on "
            "identical weights, and gate ratio/ppo_kl/clipfrac/approx_kl/|dlogp| against a tolerance profile. "
            "With no arguments: the built-in tiny Qwen-Image model on the CPU, offline (passes)."
        ),
        epilog=(
            "Examples:\n"
            "  rollout-consistency check\n"
            "  rollout-consistency check --inject bf16-latents --plot step1.png\n"
            "  rollout-consistency check --config step1.toml --json step1.json --junit step1.xml\n"
            "  rollout-consistency check --trajectory step1.safetensors --profile kernel\n"
            "Docs: docs/checker.md"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_check_arguments(parser)
    parser.set_defaults(run=_run_check)


def _run_check(args: argparse.Namespace) -> int:
    from consistency.check import USAGE_ERRORS
    from consistency.check_cli import run_check_command

    try:
        return run_check_command(args)
    except (*USAGE_ERRORS, ValueError, TypeError) as error:  # bad settings; a consistency problem is a FAIL
        raise UsageError(str(error)) from error


# Registration order is the order in `--help`; the step-1 `check` command goes first.
_COMMANDS: list[Callable[[Any], None]] = [_add_check_parser, _add_recompute_parser, _add_precision_parser]
