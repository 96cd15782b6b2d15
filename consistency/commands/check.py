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
    DEVICES,
    DTYPES,
    INJECTIONS,
    MODEL_FAMILIES,
    SDE_TYPES,
    STEP_IMPLEMENTATIONS,
    WINDOW_KINDS,
    CheckConfig,
    load_config,
    parse_thresholds,
)
from rollout_consistency.gate.judging.tolerances import PROFILES
from rollout_consistency.object_spec import spec_source

from .report_outputs import add_report_outputs, report_outputs, show_and_write
from .usage import UsageError, check_outputs

__all__ = ["FIELD_HELP", "add_parser", "config_from_args", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
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
    return parser


def run(args: argparse.Namespace) -> int:
    from rollout_consistency.gate.check import USAGE_ERRORS

    try:
        return _run_check_command(args)
    except (*USAGE_ERRORS, ValueError, TypeError) as error:  # bad settings; a consistency problem is a FAIL
        raise UsageError(str(error)) from error


def _backends_help(side: str) -> str:
    """The registered `side` backends with their summaries (`rollout_consistency.gate.backend_registry`)."""
    listed = ", ".join(f"{name} ({get_backend(side, name).summary})" for name in backend_names(side))
    return f"{side} engine: {listed}, or your plug-in 'package.module:factory'"


#: One line of help per setting (the config file uses the same names, with underscores); the backends' lines
#: list the registered backends when the parser is built (`_backends_help`).
FIELD_HELP: dict[str, str] = {
    "model_family": "model family",
    "model_path": "diffusers model directory (default: the built-in tiny model, offline)",
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
    "num_frames": "video frames (Wan; num_frames - 1 a multiple of 4)",
    "width": "image width in pixels",
    "num_inference_steps": "denoising steps",
    "max_sequence_length": "text length (tokens)",
    "pad_prompts_to_max_length": "pad every prompt to max_sequence_length instead of the batch's longest",
    "mask_text_padding": "pass the text mask to attention (Qwen-Image)",
    "noise_level": "SDE noise level",
    "sde_type": "SDE step",
    "sde_window_size": "stochastic (log-prob carrying) steps per rollout, or 'all': every step (Flow-GRPO samples "
    "with the SDE on every step)",
    "sde_window_range": "half-open step range [LOW, HIGH) the window lies in",
    "sde_window_kind": "how the window is drawn per prompt group",
    "guidance_scale": "guidance (FLUX embedded guidance / SD3 and Wan CFG)",
    "true_cfg_scale": "Qwen-Image true CFG scale (1 = off)",
    "guidance_scale_2": "Wan 2.2: CFG scale of the low-noise expert (default: --guidance-scale)",
    "boundary_ratio": "Wan 2.2: the expert switch (transformer for timesteps >= ratio * 1000, transformer_2 below); "
    "default: the model directory's, one expert for the tiny model",
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
    "user_code_timeout_s": "seconds each call into your code (plug-in import, factory, rollout, recompute_log_probs, "
    "weight sync) may take before the check stops with exit 2",
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
        "--config", metavar="FILE", help="YAML, TOML or JSON file of settings (keys as below, with underscores)"
    )
    add_report_outputs(parser, "outputs")
    settings = parser.add_argument_group("settings (defaults: the built-in tiny Qwen-Image check on the CPU)")
    defaults = CheckConfig()
    for field in dataclasses.fields(CheckConfig):
        name = field.name
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        side = name.removesuffix("_backend")
        help_text = _backends_help(side) if side in ("rollout", "trainer") else FIELD_HELP.get(name, "")
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
    if name == "sde_window_size":
        return _window_size
    if name in ("micro_batch_size",) or (isinstance(default, int) and not isinstance(default, bool)):
        return int
    if name in ("clip_ratio_low", "clip_ratio_high", "guidance_scale_2", "boundary_ratio") or isinstance(
        default, float
    ):
        return float
    return str


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
        from rollout_consistency.gate.config import read_config_file

        return read_config_file(args.config).get("model_family")
    return None
