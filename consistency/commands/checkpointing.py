# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`rollout-consistency checkpointing SPEC` (old name `recompute`): does gradient checkpointing recompute the same
forward? The loss and every gradient of a user's module, without and with checkpointing, from one RNG state."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from rollout_consistency.safeguards.cli_guard import EXIT_FAIL, EXIT_PASS
from rollout_consistency.safeguards.fence import fenced
from rollout_consistency.safeguards.object_spec import spec_source

from .command import ParserText
from .factories import add_timeout_argument, call_factory, load_spec, parse_factory_args, timeout
from .usage import UsageError, check_outputs, write_json

__all__ = ["PARSER_TEXT", "add_arguments", "run"]


_CHECKPOINT_CHOICES = {
    "consistency": "rollout_consistency.training.checkpointing.checkpoint (torch non-reentrant, RNG preserved) [default]",
    "torch": "torch.utils.checkpoint.checkpoint(use_reentrant=False)",
    "torch-reentrant": "torch.utils.checkpoint.checkpoint(use_reentrant=True)",
}


PARSER_TEXT = ParserText(
    description=(
        "Run one forward+backward of a module without and with gradient checkpointing from the same RNG "
        "state and compare the loss and every gradient. SPEC names a factory 'package.module:factory' or "
        "'path/to/file.py:factory'. The factory is called (with seed=SEED if it takes a seed, plus any "
        "--arg) and returns a mapping with 'module' (nn.Module) and 'inputs' (tensor, tuple for "
        "module(*inputs), or dict for module(**inputs)), and optionally 'loss_fn' (output -> scalar), "
        "'segments' (submodule names/patterns to checkpoint) and 'set_checkpointing' (fn(module, "
        "checkpoint_fn or None)); a (module, inputs) or (module, inputs, loss_fn) tuple also works."
    ),
    epilog="Example: rollout-consistency checkpointing rollout_consistency.training.toy_denoiser:toy_case --arg dropout=0.3",
    raw=True,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
    add_timeout_argument(parser)


def _resolve_checkpoint(name: str, timeout_s: float | None) -> Callable[..., Any]:
    import functools

    import torch.utils.checkpoint

    from rollout_consistency.training.checkpointing import checkpoint

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
    function = load_spec(name, f"--checkpoint {name!r}", timeout_s)
    if not callable(function):
        raise UsageError(f"--checkpoint {name} is not callable")
    return function


def _checkpointing_case(spec: str, seed: int, factory_args: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    from torch import nn

    owner = f"checkpointing SPEC {spec!r}"
    factory = load_spec(spec, owner, timeout_s)
    case = call_factory(factory, spec, {"seed": seed}, factory_args, owner=owner, timeout_s=timeout_s)
    if isinstance(case, tuple) and len(case) in (2, 3):
        case = dict(zip(("module", "inputs", "loss_fn"), case, strict=False))
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


def run(args: argparse.Namespace) -> int:
    from rollout_consistency.training.checkpoint_check import CheckpointingSettings, check_checkpointing

    if args.command == "recompute":
        print(
            "rollout-consistency recompute: deprecated name, use 'rollout-consistency checkpointing'", file=sys.stderr
        )
    # Before any work: the report never replaces the SPEC's or the --checkpoint function's source.
    targets = check_outputs(
        {"--json": args.json}, {"SPEC": spec_source(args.spec), "--checkpoint": spec_source(args.checkpoint)}
    )
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed {args.seed} must lie in [0, 2**63-1].")
    if not 0 <= args.top <= 100000:
        raise UsageError(f"--top {args.top} must lie in [0, 100000].")
    timeout_s = timeout(args)
    case = _checkpointing_case(args.spec, args.seed, parse_factory_args(args.arg), timeout_s)
    checkpoint_fn = _resolve_checkpoint(args.checkpoint, timeout_s)
    segments = args.segments if args.segments is not None else case.get("segments")
    set_checkpointing = None if args.segments is not None else case.get("set_checkpointing")
    # The check runs the SPEC's module, loss and hooks and the --checkpoint function: user code throughout.
    owner = f"checkpointing SPEC {args.spec!r} with --checkpoint {args.checkpoint!r}"
    try:
        with fenced(owner, "the forward/backward runs", timeout_s=timeout_s):
            report = check_checkpointing(
                case["module"],
                case["inputs"],
                checkpoint_fn,
                segments=segments,
                set_checkpointing=set_checkpointing,
                loss_fn=case.get("loss_fn"),
                settings=CheckpointingSettings(
                    seed=args.seed, rtol=args.rtol, atol=args.atol, baseline=not args.no_baseline
                ),
            )
    except ValueError as error:
        raise UsageError(str(error)) from error
    print(report.format(top=args.top))
    write_json(targets.get("--json"), report.to_dict())
    return EXIT_PASS if report.passed else EXIT_FAIL
