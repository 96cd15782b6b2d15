# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Command line: `rollout-consistency <command>` (also `python -m rollout_consistency <command>`).

Exit codes for every command: 0 pass, 1 fail, 2 could not run (bad arguments, unloadable spec or file, resource
limit, unreachable cluster), 130 interrupted; never a traceback (`--debug` shows it; see `cli_guard`).

Each command is one `_add_<name>_parser(subparsers)` + `_run_<name>(args) -> int` pair registered in
`_COMMANDS`. Heavy imports (torch, the checks) happen inside `_run_<name>`, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Cheap to import (no torch): `--help` stays fast.
from rollout_consistency import __version__
from rollout_consistency.gate.config import (
    DEVICES,
    DTYPES,
    INJECTIONS,
    MODEL_FAMILIES,
    SDE_TYPES,
    STEP_IMPLEMENTATIONS,
    WINDOW_KINDS,
    CheckConfig,
    ConfigError,
    load_config,
    parse_thresholds,
)
from rollout_consistency.gate.tolerances import PROFILES

__all__ = ["UsageError", "main"]

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad input to a command: reported on stderr, exit code 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 pass, 1 fail, 2 could not run, 130 interrupted)."""
    from rollout_consistency.cli_guard import guarded

    return guarded(_main, argv, "rollout-consistency")


def _main(argv: Sequence[str]) -> int:
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
        one_line = " ".join(line.strip() for line in str(error).splitlines() if line.strip())  # parser messages wrap
        print(f"rollout-consistency {args.command}: error: {one_line}", file=sys.stderr)
        return EXIT_USAGE


class _Parser(argparse.ArgumentParser):
    """argparse, plus the closest known flag for a misspelt one (as config keys get)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            known = sorted(_option_strings(self))
            for word in message.split(":", 1)[1].split():
                flag = word.split("=", 1)[0]
                if flag.startswith("--"):
                    close = difflib.get_close_matches(flag, known, n=1)
                    if close:
                        message += f" (did you mean {close[0]}?)"
        super().error(message)


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    options = set()
    for action in parser._actions:
        options.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                options |= _option_strings(subparser)
    return options


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rollout-consistency",
        description="Consistency checks for diffusion RL training (rollout vs trainer, and within a training run).",
        epilog="Exit codes: 0 pass, 1 fail, 2 could not run, 130 interrupted. Docs: docs/training-consistency.md",
    )
    parser.add_argument("--version", action="version", version=f"rollout-consistency {__version__}")
    # Stripped from the command line before parsing (`cli_guard.split_debug`), so any command takes it.
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (any command)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_parser in _COMMANDS:
        add_parser(subparsers)
    return parser


# ----------------------------------------------------------------------------------------------
# shared helpers


def _load_spec(spec: str) -> Any:
    from rollout_consistency.object_spec import SpecError, load_object

    try:
        return load_object(spec)
    except SpecError as error:
        raise UsageError(str(error)) from error


def _call_factory(factory: Any, spec: str, optional: dict[str, Any], required: dict[str, Any]) -> Any:
    from rollout_consistency.object_spec import SpecError, call_with_supported_kwargs

    if not callable(factory):
        return factory  # the spec named the object itself
    try:
        return call_with_supported_kwargs(factory, optional=optional, required=required)
    except SpecError as error:
        raise UsageError(f"{spec}: {error}") from error
    except (TypeError, ValueError) as error:  # the factory refused its arguments (e.g. --arg dropout=abc)
        given = ", ".join(f"{k}={v!r}" for k, v in required.items()) or "no --arg"
        raise UsageError(
            f"{spec} raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} "
            f"(called with {given}); check the --arg values."
        ) from error


def _parse_factory_args(pairs: Sequence[str]) -> dict[str, Any]:
    """`name=value` pairs; values are Python literals (numbers, strings, lists), else plain strings."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.isidentifier():
            raise UsageError(f"--arg expects name=value, got {pair!r}")
        try:
            kwargs[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            kwargs[name] = text
    return kwargs


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    from rollout_consistency.atomic_write import write_all

    if path is None:
        return
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    try:
        write_all([(path, lambda temporary: Path(temporary).write_text(text))])
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error}") from error


def _read_json(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read JSON from {path}: {error}") from error


# ----------------------------------------------------------------------------------------------
# checkpointing (the gradient-checkpointing check; `recompute` is its old name)


_CHECKPOINT_CHOICES = {
    "consistency": "rollout_consistency.training.checkpointing.checkpoint (torch non-reentrant, RNG preserved) [default]",
    "torch": "torch.utils.checkpoint.checkpoint(use_reentrant=False)",
    "torch-reentrant": "torch.utils.checkpoint.checkpoint(use_reentrant=True)",
}


def _add_checkpointing_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "checkpointing",
        # The old name keeps users' CI scripts working; it prints a deprecation note.
        aliases=["recompute"],
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
        epilog="Example: rollout-consistency checkpointing rollout_consistency.training.toy_denoiser:toy_case --arg dropout=0.3",
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
    parser.set_defaults(run=_run_checkpointing)


def _resolve_checkpoint(name: str) -> Callable[..., Any]:
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
    function = _load_spec(name)
    if not callable(function):
        raise UsageError(f"--checkpoint {name} is not callable")
    return function


def _checkpointing_case(spec: str, seed: int, factory_args: dict[str, Any]) -> dict[str, Any]:
    from torch import nn

    case = _call_factory(_load_spec(spec), spec, optional={"seed": seed}, required=factory_args)
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


def _check_outputs(outputs: dict[str, str | None], inputs: dict[str, str | None]) -> None:
    from rollout_consistency.atomic_write import OutputPathError, check_output_paths

    try:
        check_output_paths(outputs, inputs)
    except OutputPathError as error:
        raise UsageError(str(error)) from error


def _spec_file(spec: str | None) -> str | None:
    """The file a 'path/to/file.py:factory' spec names (None for a module spec)."""
    module_part = (spec or "").rpartition(":")[0]
    return module_part if module_part.endswith(".py") else None


def _run_checkpointing(args: argparse.Namespace) -> int:
    from rollout_consistency.training.checkpoint_check import check_checkpointing

    if args.command == "recompute":
        print(
            "rollout-consistency recompute: deprecated name, use 'rollout-consistency checkpointing'", file=sys.stderr
        )
    _check_outputs({"--json": args.json}, {"SPEC": _spec_file(args.spec)})
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed {args.seed} must lie in [0, 2**63-1].")
    if not 0 <= args.top <= 100000:
        raise UsageError(f"--top {args.top} must lie in [0, 100000].")
    case = _checkpointing_case(args.spec, args.seed, _parse_factory_args(args.arg))
    checkpoint_fn = _resolve_checkpoint(args.checkpoint)
    segments = args.segments if args.segments is not None else case.get("segments")
    set_checkpointing = None if args.segments is not None else case.get("set_checkpointing")
    try:
        report = check_checkpointing(
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
    from rollout_consistency.training.precision import PrecisionReport, audit_precision, diff_precision_reports

    diff_a, diff_b = args.diff or (None, None)
    _check_outputs({"--json": args.json}, {"--diff A": diff_a, "--diff B": diff_b, "--spec": _spec_file(args.spec)})
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
# check (the step-1 consistency check): every `CheckConfig` setting as a flag, plus a config file and the
# report outputs. Precedence: defaults < --config FILE (YAML/TOML) < flags.


def _add_check_parser(subparsers: Any) -> None:
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
    _add_check_arguments(parser)
    parser.set_defaults(run=_run_check)


def _run_check(args: argparse.Namespace) -> int:
    from rollout_consistency.gate.check import USAGE_ERRORS

    try:
        return _run_check_command(args)
    except (*USAGE_ERRORS, ValueError, TypeError) as error:  # bad settings; a consistency problem is a FAIL
        raise UsageError(str(error)) from error


#: One line of help per setting (the config file uses the same names, with underscores).
FIELD_HELP: dict[str, str] = {
    "model_family": "model family",
    "model_path": "diffusers model directory (default: the built-in tiny model, offline)",
    "rollout_backend": "rollout engine: torch, vllm-omni (needs the vllm extra and CUDA) or your plug-in 'package.module:factory'",
    "trainer_backend": "trainer engine: torch or your plug-in 'package.module:factory'",
    "step_execution": "step-wise (continuous batching) rollout instead of request-level",
    "max_num_seqs": "requests the step-wise engine runs together",
    "stagger_arrivals": "step-wise: admit requests two per engine step (forwards mix requests at different steps)",
    "rollout_attention": "diffusers attention backend of the rollout (native = PyTorch SDPA, _native_math = math kernel)",
    "trainer_attention": "diffusers attention backend of the trainer",
    "calibration_attention": "the trainer's other kernel for --profile calibrated (default: the other of native/_native_math)",
    "rollout_dtype": "transformer dtype of the rollout (latents stay float32)",
    "trainer_dtype": "transformer dtype of the trainer",
    "device": "cpu, cuda or auto",
    "batch_invariant": "run every forward at a shape that depends on nothing but the sample, on both sides (padded to "
    "rollout_batch_size rows where this machine's kernels allow, else one sample per forward): bit-identical per "
    "sample whatever its batch-mates or micro-batch (exact across batch compositions)",
    "prompts": "prompt text (repeatable; default: built-in prompts)",
    "num_prompts": "prompt groups to sample",
    "num_images_per_prompt": "rollouts per prompt group (GRPO's n)",
    "height": "image height in pixels",
    "width": "image width in pixels",
    "num_inference_steps": "denoising steps",
    "max_sequence_length": "text length (tokens)",
    "pad_prompts_to_max_length": "pad every prompt to max_sequence_length instead of the batch's longest",
    "mask_text_padding": "pass the text mask to attention (Qwen-Image)",
    "noise_level": "SDE noise level",
    "sde_type": "SDE step",
    "sde_window_size": "stochastic (log-prob carrying) steps per rollout",
    "sde_window_range": "half-open step range [LOW, HIGH) the window lies in",
    "sde_window_kind": "how the window is drawn per prompt group",
    "guidance_scale": "guidance (FLUX embedded guidance / SD3 CFG)",
    "true_cfg_scale": "Qwen-Image true CFG scale (1 = off)",
    "seed": "launcher seed (every draw derives from it)",
    "global_step": "training step whose rollout is checked",
    "rollout_batch_size": "requests per rollout batch (the unit of work of a worker)",
    "micro_batch_size": "trainer micro-batch (must divide --rollout-batch-size; default: the rollout batch)",
    "clip_ratio": "PPO clip range epsilon",
    "clip_ratio_low": "lower clip range (default: --clip-ratio)",
    "clip_ratio_high": "upper clip range (default: --clip-ratio)",
    "profile": "tolerance profile (default: exact for the torch rollout, kernel for vllm-omni)",
    "thresholds": "override one metric's limit (repeatable; VALUE 'off' reports without gating)",
    "calibration_multiple": "calibrated gate, in multiples of the measured floor",
    "trainer_step_implementation": "the trainer's SDE-step code (flow-grpo: same maths, other operation order)",
    "inject": "reproduce a stock pitfall to see what a failing run looks like",
    "trajectory": "check this saved trajectory file against the trainer instead of sampling",
    "workers": "Ray workers (more than 1 starts a local Ray cluster unless --ray-address is given)",
    "ray_address": "join this Ray cluster ('auto', 'ray://host:10001')",
    "ray_timeout_s": "seconds to reach --ray-address before giving up (exit 2)",
    "progress": "progress bar on stderr",
    "weight_sync": "also check step 2: one optimizer update, this sync to the rollout (load_state_dict, peft or 'package.module:function'), check again",
    "weight_sync_lr": "Adam learning rate of the step-2 update",
}

_CHOICES: dict[str, tuple[str, ...]] = {
    "model_family": MODEL_FAMILIES,
    "rollout_dtype": DTYPES,
    "trainer_dtype": DTYPES,
    "device": DEVICES,
    "sde_type": SDE_TYPES,
    "sde_window_kind": WINDOW_KINDS,
    "profile": PROFILES,
    "inject": INJECTIONS,
    "trainer_step_implementation": STEP_IMPLEMENTATIONS,
}


def _add_check_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting as a flag (default: not given), plus --config and the output flags."""
    parser.add_argument(
        "--config", metavar="FILE", help="YAML or TOML file of settings (keys as below, with underscores)"
    )
    outputs = parser.add_argument_group("outputs")
    outputs.add_argument("--json", metavar="PATH", help="write the report as JSON")
    outputs.add_argument("--junit", metavar="PATH", help="write JUnit XML (one testcase per check) for CI")
    outputs.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of per-timestep signed dlogp (mean, spread, clip band, limits) and ratio",
    )
    outputs.add_argument("--per-sample", action="store_true", help="also print the per-sample table")
    settings = parser.add_argument_group("settings (defaults: the built-in tiny Qwen-Image check on the CPU)")
    defaults = CheckConfig()
    for field in dataclasses.fields(CheckConfig):
        name = field.name
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        help_text = FIELD_HELP.get(name, "")
        if default is not None and name not in ("prompts", "thresholds"):
            help_text += f" (default: {_show(default)})"
        common = dict(dest=name, default=argparse.SUPPRESS, help=help_text)
        if name == "prompts":
            parser_args = dict(action="append", metavar="TEXT")
            settings.add_argument("--prompt", **parser_args, **common)
        elif name == "thresholds":
            settings.add_argument("--threshold", action="append", metavar="METRIC=VALUE", **common)
        elif name == "sde_window_range":
            settings.add_argument(flag, nargs=2, type=int, metavar=("LOW", "HIGH"), **common)
        elif isinstance(default, bool):
            settings.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        elif name in _CHOICES:
            settings.add_argument(flag, choices=_CHOICES[name], **common)
        else:
            settings.add_argument(flag, type=_flag_type(name, default), metavar=name.upper(), **common)


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _flag_type(name: str, default: Any):
    if name in ("micro_batch_size",) or (isinstance(default, int) and not isinstance(default, bool)):
        return int
    if name in ("clip_ratio_low", "clip_ratio_high") or isinstance(default, float):
        return float
    return str


def config_from_args(args: argparse.Namespace) -> CheckConfig:
    """The `CheckConfig` of a parsed `check` command line (raises ConfigError for bad settings)."""
    overrides: dict[str, Any] = {}
    for field in dataclasses.fields(CheckConfig):
        if hasattr(args, field.name):
            overrides[field.name] = getattr(args, field.name)
    if "thresholds" in overrides:
        overrides["thresholds"] = parse_thresholds(overrides["thresholds"])
    return load_config(getattr(args, "config", None), **overrides)


def _run_check_command(args: argparse.Namespace) -> int:
    """Run the check for a parsed command line: print the table, write outputs, return the exit code.

    Raises:
        ConfigError (and the other `rollout_consistency.gate.check.USAGE_ERRORS`): bad settings — the caller maps them to
        exit code 2.
    """
    from rollout_consistency.atomic_write import OutputPathError, check_output_paths, write_all

    config = config_from_args(args)
    outputs = {"--json": args.json, "--junit": args.junit, "--plot": args.plot}
    try:  # before any work: a report must never replace an input or another report
        check_output_paths(outputs, {"--config": args.config, "--trajectory": config.trajectory})
    except OutputPathError as error:
        raise ConfigError(str(error)) from error
    if config.trajectory is not None:
        from rollout_consistency.gate.trajectory_checks import check_explicit_family

        check_explicit_family(config.trajectory, _explicit_family(args))
    from rollout_consistency.gate.check import run_step1_check

    report = run_step1_check(config)
    print(report.format_table(per_sample=args.per_sample))
    writers = {"--json": report.write_json, "--junit": report.write_junit, "--plot": report.write_plot}
    requested = [(path, writers[flag]) for flag, path in outputs.items() if path]
    try:  # all or nothing: no report may be left that disagrees with the exit code
        written = write_all(requested)
    except OSError as error:
        raise ConfigError(f"cannot write the reports ({error.strerror or error}); none was written.") from error
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return EXIT_PASS if report.passed else EXIT_FAIL


def _explicit_family(args: argparse.Namespace) -> str | None:
    """The model family the user named (flag, else config file), or None when it is the default."""
    if getattr(args, "model_family", None) is not None:
        return args.model_family
    if getattr(args, "config", None):
        from rollout_consistency.gate.config import read_config_file

        return read_config_file(args.config).get("model_family")
    return None


# lint: static, pure AST (imports neither torch nor the linted code); the command lives in lint/cli.py.


def _add_lint_parser(subparsers: Any) -> None:
    from rollout_consistency.lint.cli import add_parser

    add_parser(subparsers).set_defaults(run=_run_lint)


def _run_lint(args: argparse.Namespace) -> int:
    from rollout_consistency.lint import LintUsageError
    from rollout_consistency.lint.cli import run

    try:
        return run(args)
    except LintUsageError as error:
        raise UsageError(str(error)) from error


# doctor: ranked likely causes of a report written earlier; the command lives in doctor.py.


def _add_doctor_parser(subparsers: Any) -> None:
    from rollout_consistency.gate.doctor import add_parser

    add_parser(subparsers).set_defaults(run=_run_doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    from rollout_consistency.gate.doctor import DoctorInputError, run

    try:
        return run(args)
    except DoctorInputError as error:
        raise UsageError(str(error)) from error


# Registration order is the order in `--help`; the step-1 `check` command goes first.
_COMMANDS: list[Callable[[Any], None]] = [
    _add_check_parser,
    _add_checkpointing_parser,
    _add_precision_parser,
    _add_lint_parser,
    _add_doctor_parser,
]

# `gate DUMP` (a user's own log-prob tables) lives in its own module; registered right after `check`.
from rollout_consistency.gate.cli import add_gate_parser  # noqa: E402

_COMMANDS.insert(1, add_gate_parser)
