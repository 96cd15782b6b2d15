# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The `check` command: every `CheckConfig` setting as a flag, plus a config file and the report outputs.

`consistency/cli.py` registers it (``_add_check_parser`` / ``_run_check``); this module keeps the flag
table next to the config it mirrors. Importing it is cheap (no torch): ``--help`` stays fast.

Precedence: defaults < ``--config FILE`` (YAML/TOML) < flags. Exit codes: 0 PASS, 1 FAIL, 2 usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from .config import (
    DTYPES,
    INJECTIONS,
    MODEL_FAMILIES,
    ROLLOUT_BACKENDS,
    SDE_TYPES,
    TRAINER_BACKENDS,
    WINDOW_KINDS,
    CheckConfig,
    ConfigError,
    load_config,
)
from .tolerances import METRIC_NAMES, PROFILES

EXIT_PASS, EXIT_FAIL = 0, 1

#: One line of help per setting (the config file uses the same names, with underscores).
FIELD_HELP: dict[str, str] = {
    "model_family": "model family",
    "model_path": "diffusers model directory (default: the built-in tiny model, offline)",
    "rollout_backend": "rollout engine ('vllm-omni' needs the vllm extra and CUDA)",
    "trainer_backend": "trainer engine",
    "step_execution": "step-wise (continuous batching) rollout instead of request-level",
    "max_num_seqs": "requests the step-wise engine runs together",
    "stagger_arrivals": "step-wise: admit requests two per engine step (forwards mix requests at different steps)",
    "rollout_attention": "diffusers attention backend of the rollout (native = PyTorch SDPA, _native_math = math kernel)",
    "trainer_attention": "diffusers attention backend of the trainer",
    "calibration_attention": "the trainer's other kernel for --profile calibrated (default: the other of native/_native_math)",
    "rollout_dtype": "transformer dtype of the rollout (latents stay float32)",
    "trainer_dtype": "transformer dtype of the trainer",
    "device": "cpu, cuda or auto",
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
    "inject": "reproduce a stock pitfall to see what a failing run looks like",
    "trajectory": "check this saved trajectory file against the trainer instead of sampling",
    "workers": "Ray workers (more than 1 starts a local Ray cluster unless --ray-address is given)",
    "ray_address": "join this Ray cluster ('auto', 'ray://host:10001')",
    "progress": "progress bar on stderr",
}

_CHOICES: dict[str, tuple[str, ...]] = {
    "model_family": MODEL_FAMILIES,
    "rollout_backend": ROLLOUT_BACKENDS,
    "trainer_backend": TRAINER_BACKENDS,
    "rollout_dtype": DTYPES,
    "trainer_dtype": DTYPES,
    "device": ("cpu", "cuda", "auto"),
    "sde_type": SDE_TYPES,
    "sde_window_kind": WINDOW_KINDS,
    "profile": PROFILES,
    "inject": INJECTIONS,
}


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting as a flag (default: not given), plus --config and the output flags."""
    parser.add_argument("--config", metavar="FILE", help="YAML or TOML file of settings (keys as below, with underscores)")
    outputs = parser.add_argument_group("outputs")
    outputs.add_argument("--json", metavar="PATH", help="write the report as JSON")
    outputs.add_argument("--junit", metavar="PATH", help="write JUnit XML (one testcase per check) for CI")
    outputs.add_argument("--plot", metavar="PATH", help="write a PNG of per-timestep |dlogp| and ratio with the tolerance band")
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
    if name in ("micro_batch_size",) or isinstance(default, int) and not isinstance(default, bool):
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
        overrides["thresholds"] = _parse_thresholds(overrides["thresholds"])
    return load_config(getattr(args, "config", None), **overrides)


def _parse_thresholds(pairs: list[str]) -> dict[str, float | None]:
    from .tolerances import closest_name

    out: dict[str, float | None] = {}
    for pair in pairs:
        metric, sep, text = pair.partition("=")
        if not sep:
            raise ConfigError(f"--threshold expects METRIC=VALUE, got {pair!r} (e.g. --threshold ppo_kl=5e-5).")
        if metric not in METRIC_NAMES:
            raise ConfigError(
                f"--threshold: unknown metric {metric!r}; expected one of {', '.join(METRIC_NAMES)}."
                f"{closest_name(metric, METRIC_NAMES)}"
            )
        if text.strip().lower() in ("off", "none"):
            out[metric] = None
            continue
        try:
            out[metric] = float(text)
        except ValueError as error:
            raise ConfigError(f"--threshold {pair!r}: {text!r} is not a number (or 'off').") from error
    return out


def run_check_command(args: argparse.Namespace) -> int:
    """Run the check for a parsed command line: print the table, write outputs, return the exit code.

    Raises:
        ConfigError (and the other `consistency.check.USAGE_ERRORS`): bad settings — the caller maps them to
        exit code 2.
    """
    config = config_from_args(args)
    from .check import run_step1_check

    report = run_step1_check(config)
    print(report.format_table(per_sample=args.per_sample))
    for path, write in ((args.json, report.write_json), (args.junit, report.write_junit), (args.plot, report.write_plot)):
        if path:
            try:
                write(path)
            except OSError as error:
                raise ConfigError(f"cannot write {path}: {error}") from error
            print(f"wrote {path}", file=sys.stderr)
    return EXIT_PASS if report.passed else EXIT_FAIL
