# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`rollout-consistency check`: the step-1 consistency check. Every `CheckConfig` setting is a flag, plus a config
file and the report outputs; precedence: defaults < ``--config FILE`` (YAML/TOML/JSON) < flags."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

# Cheap to import (no torch): `--help` stays fast.
from rollout_consistency.gate.backend_registry import backend_names, get_backend
from rollout_consistency.gate.config import (
    SETTINGS,
    CheckConfig,
    Setting,
    load_config,
    parse_thresholds,
    read_config_file,
)
from rollout_consistency.safeguards.object_spec import spec_source

from .command import ParserText
from .report_outputs import add_report_outputs, report_outputs, show_and_write
from .usage import UsageError, check_outputs

__all__ = ["PARSER_TEXT", "add_arguments", "config_from_args", "run"]


PARSER_TEXT = ParserText(
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
    raw=True,
)


def run(args: argparse.Namespace) -> int:
    from rollout_consistency.gate.check import USAGE_ERRORS

    try:
        return _run_check_command(args)
    except (*USAGE_ERRORS, ValueError, TypeError) as error:  # bad settings; a consistency problem is a FAIL
        raise UsageError(str(error)) from error


def _flag_help(name: str, setting: Setting) -> str:
    """The command line's help for setting `name`, from its `Setting`: the help line (a registry's setting lists
    the registered names and summaries when the parser is built), then the default."""
    text = setting.help
    if setting.registry is not None:
        side = setting.registry
        text += ": " + ", ".join(f"{n} ({get_backend(side, n).summary})" for n in backend_names(side))
        if setting.spec:
            text += ", or your plug-in 'package.module:factory'"
    default = _DEFAULTS[name]
    if default is not None and setting.kind not in ("prompts", "thresholds"):
        text += f" (default: {_show(default)})"
    return text


_DEFAULTS: dict[str, Any] = {
    f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
    for f in dataclasses.fields(CheckConfig)
}
#: The command-line type of each `Setting.kind` that takes one value (a bool is a --flag/--no-flag pair).
_FLAG_TYPES: dict[str, Any] = {"int": int, "float": float, "str": str}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting as a flag (default: not given), generated from its `Setting`, plus --config and the outputs."""
    parser.add_argument(
        "--config", metavar="FILE", help="YAML, TOML or JSON file of settings (keys as below, with underscores)"
    )
    add_report_outputs(parser, "outputs")
    group = parser.add_argument_group("settings (defaults: the built-in tiny Qwen-Image check on the CPU)")
    for name, setting in SETTINGS.items():
        flag = setting.flag or "--" + name.replace("_", "-")
        common: dict[str, Any] = dict(dest=name, default=argparse.SUPPRESS, help=_flag_help(name, setting))
        if setting.kind in ("prompts", "thresholds"):
            group.add_argument(flag, action="append", metavar=setting.metavar, **common)
        elif setting.kind == "window_range":
            group.add_argument(flag, nargs=2, type=int, metavar=setting.metavar, **common)
        elif setting.kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        elif setting.choices and not setting.spec:
            group.add_argument(flag, choices=setting.choices, **common)
        else:
            kind = _window_size if setting.kind == "window_size" else _FLAG_TYPES[setting.kind]
            group.add_argument(flag, type=kind, metavar=setting.metavar or name.upper(), **common)


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _window_size(text: str) -> int | str:
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"invalid window size {text!r}: an integer or 'all'") from error


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
        ConfigError (and the other `rollout_consistency.gate.check.USAGE_ERRORS`): bad settings — `run` maps them to
        exit code 2. UsageError: an output path that is an input, or reports that cannot be written.
    """
    config = config_from_args(args)
    # Before any work: a report must never replace an input (a plug-in's source, a model directory's files
    # included) or another report, and a plug-in that changes the working directory cannot move it.
    inputs = {
        "--config": args.config,
        "--trajectory": config.trajectory,
        "--model-path": config.model_path,
        "--rollout-backend": spec_source(config.rollout_backend),
        "--trainer-backend": spec_source(config.trainer_backend),
        "--weight-sync": spec_source(config.weight_sync),
    }
    targets = check_outputs(report_outputs(args), inputs, directories_read={"--model-path": ()})
    if config.trajectory is not None:
        from rollout_consistency.gate.sides.trajectory_checks import check_explicit_family

        check_explicit_family(config.trajectory, _explicit_family(args))
    from rollout_consistency.gate.check import run_step1_check

    return show_and_write(run_step1_check(config), args, targets)


def _explicit_family(args: argparse.Namespace) -> str | None:
    """The model family the user named (flag, else config file), or None when it is the default."""
    if getattr(args, "model_family", None) is not None:
        return args.model_family
    if getattr(args, "config", None):
        return read_config_file(args.config).get("model_family")
    return None
