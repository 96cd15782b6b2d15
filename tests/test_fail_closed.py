"""Fail closed (issue 12): a corpus of bad inputs and faults, each asserting the exit code, the one-line message
and the files left on disk.

Every case runs the CLI in-process through `main(argv)` (cheap: they fail before any model is built) except the
ones that need a real pipe or signal. The shared check: stderr is exactly one line (no traceback), it names the
problem, and the directory holds exactly what it held before (nothing overwritten, no temporary file left).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollout_consistency.cli import main
from rollout_consistency.gate import BackendEntry, register_backend
from rollout_consistency.gate.backend_registry import unregister_backend
from rollout_consistency.gate.config import BOUNDS
from rollout_consistency.safeguards.atomic_write import TEMP_PREFIX, write_all
from rollout_consistency.training.capture_file import CaptureFormatError
from rollout_consistency.training.nan_capture import NanCapture, NonFiniteGradientError, load_capture, replay

REPO = Path(__file__).resolve().parents[1]
CHECK = ["check", "--no-progress"]


def _snapshot(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `root` (symlinks by their target text)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _no_temp_files(root: Path) -> None:
    assert not [p for p in root.rglob("*") if p.name.startswith(TEMP_PREFIX)]


# ------------------------------------------------------------------------------------------------
# shared inputs (built once: a tiny trajectory, a dump, a YAML config)


@pytest.fixture(scope="module")
def trajectory_file(tmp_path_factory) -> Path:
    from rollout_consistency.adapters import BatchRequests, SamplingSettings, qwen_image
    from rollout_consistency.adapters.tiny import TinyPromptEncoder, load_qwen_image
    from rollout_consistency.schedulers import SDEWindow

    model = load_qwen_image()
    cond = TinyPromptEncoder().conditioning(["a red cat", "a dog"], [" ", " "])
    trajectory = qwen_image.rollout(
        model,
        cond,
        height=32,
        width=32,
        num_inference_steps=6,
        requests=BatchRequests(
            seeds=[11, 12], windows=SDEWindow(start=1, size=2, num_steps=6), prompt_groups=[0, 1], global_step=0
        ),
        sampling=SamplingSettings(noise_level=0.7, guidance_scale=1.0),
    )
    return trajectory.save(tmp_path_factory.mktemp("traj") / "t.safetensors")


def _rewrite_trajectory(source: Path, target: Path, *, extra_tensor: bool = False, options: dict | None = None) -> None:
    """A copy of `source` with an extra tensor or other family_options (the tensors' checksum stays valid)."""
    from safetensors import safe_open

    from rollout_consistency.adapters.trajectory import read_header_metadata

    metadata = read_header_metadata(source)
    with safe_open(str(source), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    if extra_tensor:
        tensors["rewards"] = torch.zeros(2)
    if options is not None:
        metadata = {**metadata, "family_options": json.dumps(options)}
    save_file(tensors, str(target), metadata=metadata)


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    """A directory with a config, a trajectory-like file and a JSON report; cwd moves there."""
    (tmp_path / "c.yaml").write_text("noise_level: 0.7\n")
    (tmp_path / "old.json").write_text('{"status": "PASS"}\n')
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ------------------------------------------------------------------------------------------------
# the corpus: (id, setup(dir) -> argv, exit code, message substring)


@dataclass(frozen=True)
class Case:
    id: str
    setup: Callable[[Path], list[str]]
    code: int
    message: str


def _file(name: str, content: bytes | str) -> Callable[[Path], Path]:
    def make(root: Path) -> Path:
        path = root / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    return make


def _config_case(id_: str, name: str, content: bytes | str, message: str) -> Case:
    return Case(id_, lambda d: [*CHECK, "--config", str(_file(name, content)(d))], 2, message)


def _traj_case(id_: str, content: bytes, message: str) -> Case:
    return Case(id_, lambda d: [*CHECK, "--trajectory", str(_file("t.safetensors", content)(d))], 2, message)


def _symlink_loop(root: Path) -> list[str]:
    (root / "loop").symlink_to(root / "loop")
    return [*CHECK, "--trajectory", str(root / "loop")]


def _link_to_config(root: Path) -> list[str]:
    (root / "link.json").symlink_to(root / "c.yaml")
    return [*CHECK, "--config", "c.yaml", "--json", "link.json"]


def _spec(body: str) -> Callable[[Path], list[str]]:
    def setup(root: Path) -> list[str]:
        (root / "case.py").write_text(body)
        return ["checkpointing", f"{root / 'case.py'}:make"]

    return setup


ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(9)
)

CORPUS = [
    # -- exit codes and no tracebacks: numeric settings out of bounds, checked before anything is built
    Case("global-step-65-bits", lambda d: [*CHECK, "--global-step", str(2**64)], 2, "'global_step' is"),
    Case("seed-65-bits", lambda d: [*CHECK, "--seed", str(2**64)], 2, "'seed' is"),
    Case("negative-global-step", lambda d: [*CHECK, "--global-step", "-1"], 2, "global_step"),
    Case("huge-height", lambda d: [*CHECK, "--height", "1000000"], 2, "'height' is 1000000"),
    Case("huge-steps", lambda d: [*CHECK, "--num-inference-steps", str(10**9)], 2, "'num_inference_steps' is"),
    Case("huge-prompts", lambda d: [*CHECK, "--num-prompts", str(10**7)], 2, "'num_prompts' is"),
    Case(
        "too-many-samples", lambda d: [*CHECK, "--num-prompts", "65536", "--num-images-per-prompt", "2"], 2, "rollouts"
    ),
    Case("huge-workers", lambda d: [*CHECK, "--workers", "100000"], 2, "'workers' is"),
    Case("huge-noise", lambda d: [*CHECK, "--noise-level", "1e300"], 2, "'noise_level' is"),
    Case("huge-seq-len", lambda d: [*CHECK, "--max-sequence-length", str(10**8)], 2, "'max_sequence_length' is"),
    Case("huge-guidance", lambda d: [*CHECK, "--guidance-scale", "1e12"], 2, "'guidance_scale' is"),
    Case("ray-timeout-zero", lambda d: [*CHECK, "--ray-timeout-s", "0"], 2, "'ray_timeout_s' is"),
    Case("checkpointing-seed-65-bits", lambda d: ["checkpointing", "x:y", "--seed", str(2**64)], 2, "--seed"),
    Case(
        "recompute-arg-not-a-number",
        lambda d: ["checkpointing", "rollout_consistency.training.toy_denoiser:toy_case", "--arg", "dropout=abc"],
        2,
        "check the --arg values",
    ),
    Case(
        "factory-raises-runtime-error",
        _spec("def make(seed=0):\n    raise RuntimeError('kaput')\n"),
        2,
        "could not run (RuntimeError: kaput); run again with --debug",
    ),
    Case("factory-out-of-memory", _spec("def make(seed=0):\n    raise MemoryError\n"), 2, "out of memory"),
    Case("factory-interrupted", _spec("def make(seed=0):\n    raise KeyboardInterrupt\n"), 130, "interrupted"),
    Case(
        "factory-disk-full",
        _spec("import errno\ndef make(seed=0):\n    raise OSError(errno.ENOSPC, 'No space left on device', 'x.bin')\n"),
        2,
        "free disk space",
    ),
    # -- unreachable or malformed Ray address: fails within --ray-timeout-s
    Case(
        "ray-address-refused",
        lambda d: [
            *CHECK,
            "--ray-address",
            "127.0.0.1:1",
            "--ray-timeout-s",
            "1",
            "--num-prompts",
            "1",
            "--num-images-per-prompt",
            "1",
            "--rollout-batch-size",
            "1",
        ],
        2,
        "cannot be reached within 1 s",
    ),
    Case(
        "ray-address-bad-scheme",
        lambda d: [
            *CHECK,
            "--ray-address",
            "http://x:1",
            "--num-prompts",
            "1",
            "--num-images-per-prompt",
            "1",
            "--rollout-batch-size",
            "1",
        ],
        2,
        "use 'auto', 'host:port'",
    ),
    # -- outputs never overwrite an input or each other (usage error before any work)
    Case(
        "json-is-config",
        lambda d: [*CHECK, "--config", "c.yaml", "--json", "c.yaml"],
        2,
        "is the file given to --config",
    ),
    Case("junit-is-config", lambda d: [*CHECK, "--config", "c.yaml", "--junit", "c.yaml"], 2, "--config"),
    Case("plot-is-trajectory", lambda d: [*CHECK, "--trajectory", "old.json", "--plot", "old.json"], 2, "--trajectory"),
    Case("json-equals-junit", lambda d: [*CHECK, "--json", "r.out", "--junit", "r.out"], 2, "both write r.out"),
    Case("json-symlink-to-config", _link_to_config, 2, "is the file given to --config"),
    Case("json-is-directory", lambda d: [*CHECK, "--json", str(d)], 2, "is a directory"),
    Case("gate-json-is-dump", lambda d: ["gate", "old.json", "--json", "old.json"], 2, "is the file given to DUMP"),
    Case("gate-plot-equals-json", lambda d: ["gate", "d.safetensors", "--json", "r", "--plot", "r"], 2, "both write"),
    Case("gate-dump-is-directory", lambda d: ["gate", str(d)], 2, "is a directory"),
    Case(
        "precision-json-is-diff-input",
        lambda d: ["precision", "--diff", "old.json", "c.yaml", "--json", "old.json"],
        2,
        "--diff A",
    ),
    Case(
        "checkpointing-json-is-spec-file", lambda d: ["checkpointing", "case.py:make", "--json", "case.py"], 2, "SPEC"
    ),
    Case("lint-output-is-linted-file", lambda d: ["lint", "old.json", "--output", "old.json"], 2, "PATH old.json"),
    Case("lint-output-is-directory", lambda d: ["lint", "c.yaml", "--output", str(d)], 2, "is a directory"),
    Case("doctor-json-is-report", lambda d: ["doctor", "old.json", "--json", "old.json"], 2, "REPORT.json"),
    Case("doctor-report-is-directory", lambda d: ["doctor", str(d)], 2, "is a directory"),
    # -- config files: safe YAML, duplicate keys, size limit, a directory
    _config_case("yaml-alias-bomb", "bomb.yaml", ALIAS_BOMB, "aliases"),
    _config_case("yaml-simple-alias", "a.yaml", "seed: &s 3\nglobal_step: *s\n", "aliases (*s)"),
    _config_case(
        "yaml-duplicate-key", "dup.yaml", "noise_level: 0.7\nnoise_level: 0.3\n", "'noise_level' is given twice"
    ),
    _config_case("yaml-duplicate-nested-key", "dupn.yaml", "thresholds:\n  ppo_kl: 1\n  ppo_kl: 2\n", "given twice"),
    _config_case("toml-duplicate-key", "dup.toml", "seed = 1\nseed = 2\n", "could not be parsed"),
    _config_case("yaml-too-large", "big.yaml", "# " + "x" * (2 << 20) + "\n", "larger than"),
    _config_case("yaml-not-utf8", "bin.yaml", b"seed: \xff\xfe\n", "could not be parsed"),
    _config_case("yaml-deep-nesting", "deep.yaml", "a: " + "[" * 20000 + "]" * 20000 + "\n", "config file"),
    _config_case("yaml-list-document", "list.yaml", "- 1\n- 2\n", "must hold a mapping"),
    _config_case("yaml-seed-65-bits", "s.yaml", f"seed: {2**70}\n", "'seed' is"),
    Case("config-is-directory", lambda d: [*CHECK, "--config", str(d)], 2, "is a directory"),
    # -- trajectory files: validated header first, never read larger than the header says
    # -- model directories
    Case("model-path-missing", lambda d: [*CHECK, "--model-path", "no-such-model"], 2, "No model directory"),
    Case("model-path-empty", lambda d: [*CHECK, "--model-path", str(d)], 2, "is not a diffusers model directory"),
    Case("trajectory-is-directory", lambda d: [*CHECK, "--trajectory", str(d)], 2, "is a directory"),
    Case("trajectory-symlink-loop", _symlink_loop, 2, "cannot be read"),
    _traj_case("trajectory-empty", b"", "too short"),
    _traj_case("trajectory-endless-header", (2**60).to_bytes(8, "little") + b"{", "header claims"),
    _traj_case("trajectory-random-bytes", os.urandom(64), "trajectory"),
    _traj_case("trajectory-not-json-header", (4).to_bytes(8, "little") + b"\xff\xff\xff\xff", "not valid JSON"),
    _traj_case(
        "trajectory-other-format",
        (2).to_bytes(8, "little") + b"{}",
        "not a rollout-consistency trajectory",
    ),
    # -- `gate DUMP`: the user's own tables, the same rules
    Case("gate-clip-ratio-nan", lambda d: _gate_args(d, "--clip-ratio", "nan"), 2, "must be a finite number >= 0"),
    Case("gate-clip-ratio-negative", lambda d: _gate_args(d, "--clip-ratio-high", "-1"), 2, "clip_ratio_high"),
    Case("gate-threshold-negative", lambda d: _gate_args(d, "--threshold", "ppo_kl=-1"), 2, "'ppo_kl' must be"),
    Case("gate-micro-batch-zero", lambda d: _gate_args(d, "--micro-batch-size", "0"), 2, "positive int"),
    Case("gate-json-is-the-dump", lambda d: _gate_args(d, "--json", "d.safetensors"), 2, "would destroy it"),
    Case("gate-two-reports-one-path", lambda d: _gate_args(d, "--json", "r", "--plot", "r"), 2, "both write r"),
    Case(
        "gate-dump-random-bytes", lambda d: ["gate", str(_file("x.safetensors", os.urandom(64))(d))], 2, "safetensors"
    ),
]


def _gate_args(root: Path, *flags: str) -> list[str]:
    return ["gate", str(_gate_dump(root)), *flags]


# -- user code fenced (issue 24): a SystemExit of any code raised by user code is a usage error naming the call,
#    never exit 0 (PASS) or 1 (FAIL); a call that never returns stops at user_code_timeout_s. In-process here; the
#    supervised command line (os._exit, kills) is tested with subprocesses below.
TINY = ["--num-prompts", "1", "--num-images-per-prompt", "1", "--rollout-batch-size", "1", "--num-inference-steps", "2"]
TINY += ["--sde-window-size", "1"]
ROLLOUT_OBJECT = "class R:\n    def rollout(self, request):\n        {body}\ndef make(config):\n    return R()\n"


def _user_file(name: str, source: str) -> Callable[[Path], str]:
    def write(root: Path) -> str:
        (root / name).write_text(source)
        return str(root / name)

    return write


def _plugin_case(id_: str, side: str, source: str, message: str, *extra: str) -> Case:
    def setup(root: Path) -> list[str]:
        path = _user_file("user_loop.py", source)(root)
        return [*CHECK, *TINY, f"--{side}-backend", f"{path}:make", *extra]

    return Case(id_, setup, 2, message)


def _sync_case(id_: str, source: str, message: str) -> Case:
    def setup(root: Path) -> list[str]:
        group = ["--num-images-per-prompt", "2", "--rollout-batch-size", "2"]  # a group of one has no advantage
        return [*CHECK, *TINY, *group, "--weight-sync", _user_file("user_sync.py", source)(root) + ":sync"]

    return Case(id_, setup, 2, message)


def _command_case(id_: str, command: list[str], flag_or_spec: str, source: str, message: str) -> Case:
    """`command` with `flag_or_spec` naming `user_spec.py:make` (a flag such as --spec, or '' for a positional)."""

    def setup(root: Path) -> list[str]:
        spec = _user_file("user_spec.py", source)(root) + ":make"
        return [*command, *([flag_or_spec] if flag_or_spec else []), spec]

    return Case(id_, setup, 2, message)


TOY = "from rollout_consistency.training.toy_denoiser import toy_case\n"
USER_CODE_CORPUS = [
    _plugin_case(
        "plugin-import-sys-exit-0",
        "trainer",
        "import sys\nsys.exit(0)\ndef make(config):\n    pass\n",
        "import of ",  # + "... raised SystemExit(0) ... move it under `if __name__ == '__main__':`"
    ),
    _plugin_case(
        "plugin-factory-sys-exit-0",
        "trainer",
        "import sys\ndef make(config):\n    sys.exit(0)\n",
        "the factory raised SystemExit(0)",
    ),
    _plugin_case(
        "plugin-factory-sys-exit-message",  # exited 1 (the FAIL code) before the fence
        "trainer",
        "import sys\ndef make(config):\n    sys.exit('stop')\n",
        "the factory raised SystemExit('stop')",
    ),
    _plugin_case(
        "plugin-factory-exit-builtin", "rollout", "def make(config):\n    raise SystemExit\n", "raised SystemExit(None)"
    ),
    _plugin_case(
        "plugin-rollout-call-sys-exit-0",
        "rollout",
        ROLLOUT_OBJECT.format(body="import sys; sys.exit(0)"),
        "R.rollout(request) on rollout batch 0 raised SystemExit(0)",
    ),
    _plugin_case(
        "plugin-trainer-experts-sys-exit-0",  # experts(batch): a Wan-style trainer's record of its experts
        "trainer",
        "import sys\nclass T:\n    def recompute_log_probs(self, batch, *, micro_batch_size):\n"
        "        return batch.log_probs.clone()\n    def experts(self, batch):\n        sys.exit(0)\n"
        "def make(config):\n    return T()\n",
        "experts(batch) raised SystemExit(0)",
    ),
    _plugin_case(
        "plugin-factory-never-returns",
        "trainer",
        "import threading\ndef make(config):\n    threading.Event().wait()\n",
        "the factory did not return within 0.5 s (user_code_timeout_s)",
        "--user-code-timeout-s",
        "0.5",
    ),
    _plugin_case(
        "plugin-rollout-call-never-returns",
        "rollout",
        ROLLOUT_OBJECT.format(body="while True: pass"),
        "R.rollout(request) on rollout batch 0 did not return within 0.5 s (user_code_timeout_s)",
        "--user-code-timeout-s",
        "0.5",
    ),
    _plugin_case(
        "plugin-rollout-never-returns-and-swallows-exceptions",  # `except Exception` cannot swallow the timeout
        "rollout",
        "import time\nclass R:\n    def rollout(self, request):\n        while True:\n            try:\n"
        "                time.sleep(0.05)\n            except Exception:\n                pass\n"
        "def make(config):\n    return R()\n",
        "R.rollout(request) on rollout batch 0 did not return within 0.5 s (user_code_timeout_s)",
        "--user-code-timeout-s",
        "0.5",
    ),
    _sync_case(
        "weight-sync-sys-exit-0",
        "import sys\ndef sync(trainer, rollout):\n    sys.exit(0)\n",
        "sync(trainer, rollout) raised SystemExit(0)",
    ),
    _command_case(
        "checkpointing-spec-import-sys-exit-0",
        ["checkpointing"],
        "",
        "import sys\nsys.exit(0)\n",
        "checkpointing SPEC",
    ),
    _command_case(
        "checkpointing-factory-sys-exit-0",
        ["checkpointing"],
        "",
        "import sys\ndef make(seed=0):\n    sys.exit(0)\n",
        "the factory raised SystemExit(0)",
    ),
    _command_case(
        "checkpoint-function-sys-exit-0",
        ["checkpointing", "rollout_consistency.training.toy_denoiser:toy_case"],
        "--checkpoint",
        "import sys\ndef make(function, *args, **kwargs):\n    sys.exit(0)\n",
        "the forward/backward runs raised SystemExit(0)",
    ),
    _command_case(
        "precision-spec-sys-exit-0",
        ["precision"],
        "--spec",
        "import sys\ndef make():\n    sys.exit(0)\n",
        "precision --spec",
    ),
    Case("user-code-timeout-out-of-bounds", lambda d: ["precision", "--user-code-timeout-s", "0"], 2, "must lie in"),
]
CORPUS += USER_CODE_CORPUS

# -- special files refused up front (a FIFO blocks its reader, /dev/zero never ends), one line on every command
FIFO = "fifo.safetensors"


def _fifo(root: Path) -> str:
    os.mkfifo(root / FIFO)
    return FIFO


SPECIAL_FILE_CORPUS = [
    Case("doctor-fifo", lambda d: ["doctor", _fifo(d)], 2, "is a FIFO (named pipe), not a regular file"),
    Case("doctor-dev-zero", lambda d: ["doctor", "/dev/zero"], 2, "/dev/zero is a character device"),
    Case("lint-fifo", lambda d: ["lint", _fifo(d)], 2, "is a FIFO (named pipe)"),
    Case("check-trajectory-fifo", lambda d: [*CHECK, "--trajectory", _fifo(d)], 2, "is a FIFO (named pipe)"),
    Case("check-config-fifo", lambda d: [*CHECK, "--config", _fifo(d)], 2, "config file fifo.safetensors is a FIFO"),
    Case("check-config-dev-zero", lambda d: [*CHECK, "--config", "/dev/zero"], 2, "is a character device"),
    Case("gate-fifo", lambda d: ["gate", _fifo(d)], 2, "dump fifo.safetensors is a FIFO"),
    Case("gate-dev-zero", lambda d: ["gate", "/dev/zero"], 2, "dump /dev/zero is a character device"),
    Case("precision-diff-fifo", lambda d: ["precision", "--diff", _fifo(d), "old.json"], 2, "is a FIFO"),
    Case(
        "plugin-spec-is-a-device",
        lambda d: [*CHECK, "--trainer-backend", "/dev/zero:make"],
        2,
        "is a character device, not a Python file",
    ),
    # -- an empty output path would silently write nothing
    Case("check-json-empty", lambda d: [*CHECK, "--json", ""], 2, "--json was given an empty path"),
    Case("gate-json-empty", lambda d: _gate_args(d, "--json", ""), 2, "--json was given an empty path"),
    Case("gate-junit-empty", lambda d: _gate_args(d, "--junit", ""), 2, "--junit was given an empty path"),
    Case("doctor-json-empty", lambda d: ["doctor", "old.json", "--json", ""], 2, "--json was given an empty path"),
    Case("precision-json-empty", lambda d: ["precision", "--json", ""], 2, "--json was given an empty path"),
    # -- dumps: negative window starts, extents that disagree with the file
    Case(
        "gate-dump-negative-window-start",
        lambda d: ["gate", _raw_dump(d, window_starts=[-1, 0])],
        2,
        "'window_starts' holds -1",
    ),
    Case("gate-dump-truncated", lambda d: ["gate", _raw_dump(d, cut=4)], 2, "truncated or has trailing bytes"),
    Case("gate-dump-trailing-bytes", lambda d: ["gate", _raw_dump(d, cut=-4)], 2, "truncated or has trailing bytes"),
    # -- nothing compared (issue 30): two precision reports with no setting in common
    Case(
        "precision-diff-of-reports-with-no-settings",
        lambda d: ["precision", "--diff", *(str(_file(n, '{"label": "x", "settings": {}}')(d)) for n in "ab")],
        2,
        "share no setting",
    ),
]
CORPUS += SPECIAL_FILE_CORPUS


# -- issue 30, item 5: never write over what is not the command's (output_paths, resolved when a command starts)
PLUG = "def make(config):\n    raise AssertionError('never built: the output check comes first')\n"


def _tree(root: Path, *files: str) -> None:
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x = 1\n")


def _with_files(*files: str) -> Callable[[list[str]], Callable[[Path], list[str]]]:
    def bind(argv: list[str]) -> Callable[[Path], list[str]]:
        def setup(root: Path) -> list[str]:
            _tree(root, *files)
            return argv

        return setup

    return bind


OUTPUTS_CORPUS = [
    Case("gate-json-dev-full", lambda d: _gate_args(d, "--json", "/dev/full"), 2, "/dev/full is a character device"),
    Case("gate-junit-dev-zero", lambda d: _gate_args(d, "--junit", "/dev/zero"), 2, "a report is written only to"),
    Case("gate-json-under-a-file", lambda d: _gate_args(d, "--json", "old.json/r.json"), 2, "a folder on its path"),
    Case(
        "gate-json-fifo-nobody-reads",
        lambda d: _gate_args(d, "--json", _fifo(d)),
        2,
        "no process reads this pipe; start its reader first",
    ),
    Case(
        "check-json-is-the-trainer-plugin",
        _with_files("plug.py")([*CHECK, "--trainer-backend", "plug.py:make", "--json", "plug.py"]),
        2,
        "is the file given to --trainer-backend",
    ),
    Case(
        "check-junit-is-a-module-plugin",
        _with_files("myplug.py")([*CHECK, "--rollout-backend", "myplug:make", "--junit", "myplug.py"]),
        2,
        "is the file given to --rollout-backend",
    ),
    Case(
        "check-plot-is-the-weight-sync-file",
        _with_files("sync.py")([*CHECK, "--weight-sync", "sync.py:push", "--plot", "./sync.py"]),
        2,
        "is the file given to --weight-sync",
    ),
    Case(
        "check-json-is-a-model-file",
        _with_files("m/config.json")([*CHECK, "--model-path", "m", "--json", "m/config.json"]),
        2,
        "is a file --model-path reads",
    ),
    Case(
        "checkpointing-json-is-the-checkpoint-file",
        _with_files("case.py", "ck.py")(
            ["checkpointing", "case.py:make", "--checkpoint", "ck.py:f", "--json", "ck.py"]
        ),
        2,
        "is the file given to --checkpoint",
    ),
    Case(
        "checkpointing-json-is-a-module-spec",
        _with_files("usermod.py")(["checkpointing", "usermod:make", "--json", "usermod.py"]),
        2,
        "is the file given to SPEC",
    ),
    Case(
        "precision-json-is-the-spec",
        _with_files("prec.py")(["precision", "--spec", "prec.py:make", "--json", "prec.py"]),
        2,
        "is the file given to --spec",
    ),
    Case(
        "lint-output-is-a-linted-file",
        _with_files("src/a.py")(["lint", "src", "--output", "src/a.py"]),
        2,
        "is a file PATH src reads",
    ),
    # -- issue 30, item 6: a Ray address is used or refused, never ignored
    Case("check-ray-address-scheme", lambda d: [*CHECK, "--ray-address", "http://head:6379"], 2, "use 'auto'"),
    Case("check-ray-address-port", lambda d: [*CHECK, "--ray-address", "head:99999"], 2, "'ray://host:port'"),
]
CORPUS += OUTPUTS_CORPUS


def _watch_run(root: Path, names: tuple[str, ...] = ("rollout_corr/logprob_abs_diff_max",)) -> str:
    """A TensorBoard run of three steps logging `names`, written by torch's SummaryWriter."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(root / "run"))
    for step in range(3):
        for name in names:
            writer.add_scalar(name, 1e-5, global_step=step)
    writer.close()
    return str(root / "run")


def _fifo_events(root: Path) -> str:
    (root / "run").mkdir()
    os.mkfifo(root / "run" / "events.out.tfevents.1.host")
    return str(root / "run")


# -- watch: a run that cannot be read or holds nothing to judge is exit 2, never a PASS
WATCH_CORPUS = [
    Case("watch-no-run", lambda d: ["watch", "absent"], 2, "no such file or folder: absent"),
    Case("watch-empty-folder", lambda d: ["watch", "."], 2, "holds no TensorBoard event files, a wandb offline run"),
    Case(
        "watch-bypass-only",
        lambda d: ["watch", _watch_run(d, ("actor/rollout_corr/logprob_abs_diff_max",))],
        2,
        "holds no rollout/trainer consistency series (only bypass mode's",
    ),
    Case("watch-fifo-event-file", lambda d: ["watch", _fifo_events(d)], 2, "is a FIFO (named pipe), not a run's file"),
    Case("watch-dev-zero", lambda d: ["watch", "/dev/zero"], 2, "/dev/zero is a character device"),
    Case(
        "watch-json-is-a-file-of-the-run",
        lambda d: ["watch", _watch_run(d), "--json", str(next((d / "run").glob("events.*")))],
        2,
        "is inside the run's folder",
    ),
    Case(
        "watch-plot-in-the-run",
        lambda d: ["watch", _watch_run(d), "--plot", str(d / "run" / "w.png")],
        2,
        "is inside the run's folder",
    ),
    Case("watch-poll-zero", lambda d: ["watch", _watch_run(d), "--follow", "--poll", "0"], 2, "must be positive"),
]
CORPUS += WATCH_CORPUS


def _raw_dump(root: Path, *, window_starts: list[int] | None = None, cut: int = 0) -> str:
    """A dump written with safetensors directly (what write_dump refuses to write), optionally cut or extended."""
    import numpy as np
    from safetensors.numpy import save_file

    tensors = {
        "rollout_log_probs": np.full((2, 3), -1.0, np.float32),
        "trainer_log_probs": np.full((2, 3), -1.0, np.float32),
    }
    if window_starts is not None:
        tensors["window_starts"] = np.asarray(window_starts, np.int64)
        tensors["prompt_groups"] = np.zeros(2, np.int64)
    path = root / "raw.safetensors"
    save_file(tensors, str(path), metadata={"format": "rollout-consistency/logprob-dump", "format_version": "1"})
    data = path.read_bytes()
    path.write_bytes(data[:-cut] if cut > 0 else data + b"\0" * -cut)
    return str(path)


@pytest.mark.parametrize("case", CORPUS, ids=[c.id for c in CORPUS])
def test_corpus(case, work, capsys, monkeypatch):
    argv = case.setup(work)
    before = _snapshot(work)
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == case.code, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert case.message in lines[0], lines[0]
    assert _snapshot(work) == before  # nothing written, nothing overwritten
    _no_temp_files(work)


def test_a_bound_itself_is_accepted():
    from rollout_consistency.gate.config import load_config

    assert load_config(height=8192, width=8192, seed=2**63 - 1, global_step=2**63 - 1).height == 8192


def test_debug_shows_the_traceback(work, capsys):
    argv = _spec("def make(seed=0):\n    raise RuntimeError('kaput')\n")(work)
    assert main([*argv, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RuntimeError: kaput" in err
    assert err.rstrip().splitlines()[-1].startswith("rollout-consistency: error: could not run")


def test_unreachable_ray_address_fails_within_its_timeout(work, capsys):
    start = time.monotonic()
    argv = [*CHECK, "--ray-address", "127.0.0.1:1", "--ray-timeout-s", "2", "--num-prompts", "1"]
    assert main([*argv, "--num-images-per-prompt", "1", "--rollout-batch-size", "1"]) == 2
    assert time.monotonic() - start < 30  # the default bound; Ray alone retried for minutes
    assert "cannot be reached within 2 s" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# soft false PASS: the trajectory's family, unknown tensors and family_options keys


def test_explicit_family_that_disagrees_with_the_trajectory_is_a_usage_error(trajectory_file, work, capsys):
    before = _snapshot(work)
    assert main([*CHECK, "--trajectory", str(trajectory_file), "--model-family", "sd3", "--json", "r.json"]) == 2
    assert "written by a 'qwen-image' rollout; drop --model-family" in capsys.readouterr().err
    (work / "f.yaml").write_text("model_family: flux\n")
    assert main([*CHECK, "--trajectory", str(trajectory_file), "--config", "f.yaml"]) == 2
    assert "--model-family flux" in capsys.readouterr().err
    assert _snapshot(work) == {**before, "f.yaml": _snapshot(work)["f.yaml"]}


def test_unknown_tensor_in_a_trajectory_is_refused(trajectory_file, work, capsys):
    _rewrite_trajectory(trajectory_file, work / "x.safetensors", extra_tensor=True)
    assert main([*CHECK, "--trajectory", "x.safetensors"]) == 2
    err = capsys.readouterr().err
    assert "unknown tensor 'rewards'" in err and len(err.strip().splitlines()) == 1


def test_unknown_family_option_in_a_trajectory_is_refused(trajectory_file, work, capsys):
    options = {"height": 32, "width": 32, "mask_txt_padding": False}
    _rewrite_trajectory(trajectory_file, work / "o.safetensors", options=options)
    assert main([*CHECK, "--trajectory", "o.safetensors"]) == 2
    assert "family_options key 'mask_txt_padding' is not read by the 'qwen-image' family" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["truncated", "trailing-bytes"])
def test_damaged_trajectory_is_refused_before_its_data_is_read(trajectory_file, work, capsys, damage):
    data = trajectory_file.read_bytes()
    (work / "d.safetensors").write_bytes(data[:-100] if damage == "truncated" else data + b"\0" * 100)
    assert main([*CHECK, "--trajectory", "d.safetensors"]) == 2
    assert "truncated or has trailing bytes" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# all-or-nothing reports


def _gate_dump(root: Path) -> Path:
    from rollout_consistency.gate.tables.dump import write_dump

    table = torch.full((4, 2), -1.5).numpy()
    return write_dump(root / "d.safetensors", table, table.copy())


def test_gate_writes_every_report_or_none(work, capsys):
    dump = _gate_dump(work)
    assert main(["gate", str(dump), "--json", "r.json", "--junit", "r.xml"]) == 0
    assert json.loads((work / "r.json").read_text())["status"] == "PASS"
    (work / "blocker").write_text("a file where a directory should be\n")
    before = _snapshot(work)
    # The JUnit target cannot be created: refused when the command starts, and r.json stays whole.
    assert main(["gate", str(dump), "--json", "r.json", "--junit", "blocker/r.xml"]) == 2
    err = capsys.readouterr().err
    assert "a folder on its path is a file" in err.strip().splitlines()[-1]
    assert _snapshot(work) == before
    _no_temp_files(work)


def test_a_write_that_fails_midway_leaves_no_report(work):
    # A real file-size limit (ulimit -f): the JSON and the JUnit fit, the PNG does not; nothing may be left.
    import resource

    dump = _gate_dump(work)
    (work / "r.json").write_text("previous\n")
    before = _snapshot(work)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (24_000, 24_000))

    argv = ["gate", str(dump), "--json", "r.json", "--junit", "r.xml", "--plot", "r.png"]
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_consistency", *argv],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limited,
    )
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "(File too large); none was written" in line, line
    assert _snapshot(work) == before
    _no_temp_files(work)


@pytest.mark.parametrize("fault", [errno.ENOSPC, errno.EFBIG, "interrupt"])
def test_write_all_leaves_nothing_on_a_fault(tmp_path, fault):
    (tmp_path / "a.json").write_text("previous report\n")
    before = _snapshot(tmp_path)

    def failing(temporary: str) -> None:
        Path(temporary).write_text("half a rep")
        if fault == "interrupt":
            raise KeyboardInterrupt
        raise OSError(fault, os.strerror(fault))

    expected = KeyboardInterrupt if fault == "interrupt" else OSError
    with pytest.raises(expected):
        write_all([(tmp_path / "a.json", lambda t: Path(t).write_text("new\n")), (tmp_path / "b.xml", failing)])
    assert _snapshot(tmp_path) == before
    _no_temp_files(tmp_path)


def test_concurrent_writers_never_tear_a_report(tmp_path):
    target = tmp_path / "r.json"
    contents = ["A" * 300_000, "B" * 300_000]
    stop = threading.Event()

    def writer(text: str) -> None:
        while not stop.is_set():
            write_all([(target, lambda t, text=text: Path(t).write_text(text))])

    threads = [threading.Thread(target=writer, args=(c,)) for c in contents]
    for thread in threads:
        thread.start()
    try:
        seen = set()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if target.exists():
                seen.add(target.read_text())
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert seen and seen <= set(contents)  # every read saw one complete report
    _no_temp_files(tmp_path)


# ------------------------------------------------------------------------------------------------
# NaN-capture files: checksum and format version; replay says what it compared


@pytest.fixture
def capture(tmp_path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    nan_capture = NanCapture(model, optimizer, directory=tmp_path / "caps")
    nan_capture.begin_step(7)
    model(torch.tensor([[float("nan"), 1.0, 2.0]])).sum().backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(NonFiniteGradientError) as info:
        nan_capture.check({"x": torch.tensor([[float("nan"), 1.0, 2.0]])}, grad_norm=grad_norm)
    return info.value.path


@pytest.mark.parametrize(
    "damage, message",
    [
        ("zero-bytes", "is empty"),
        ("truncated", "truncated"),
        ("trailing", "trailing bytes"),
        ("bit-flip", "checksum mismatch"),
        ("version", "format version 99"),
        ("unversioned", "not a NaN-capture file"),
    ],
)
def test_damaged_capture_is_refused(capture, damage, message):
    data = capture.read_bytes()
    header, _, payload = data.partition(b"\n")
    if damage == "zero-bytes":
        data = b""
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "trailing":
        data += b"\0"
    elif damage == "bit-flip":
        flipped = bytearray(payload)
        flipped[len(flipped) // 2] ^= 0x01
        data = header + b"\n" + bytes(flipped)
    elif damage == "version":
        data = header.replace(b'"version": 2', b'"version": 99') + b"\n" + payload
    else:  # what format version 1 wrote: a bare torch.save with no checksum
        data = payload
    capture.write_bytes(data)
    with pytest.raises(CaptureFormatError, match=message):
        load_capture(capture)


def test_replay_says_what_it_compared_and_why_a_difference_can_be_expected(capture):
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 2)

    def step_fn(batch):
        loss = model(batch["x"]).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss

    result = replay(capture, step_fn, model=model)
    assert result.step == 7
    assert "gradients of 2 parameter(s)" in result.compared and "bit for bit" in result.compared
    assert any("clip_grad_norm_" in reason for reason in result.expected_differences)
    assert result.describe().startswith("step 7: ")


# ------------------------------------------------------------------------------------------------
# pipes and signals (subprocesses)


def _as_started_from_a_terminal() -> None:
    # A job a non-interactive shell starts in the background inherits SIGINT ignored, and Python then never
    # raises KeyboardInterrupt; these tests model Ctrl-C in a terminal, where SIGINT has its default action.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rollout_consistency", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_as_started_from_a_terminal,
        **kwargs,
    )


def test_help_into_a_closed_pipe_is_not_an_error():
    proc = _cli("check", "--help")
    proc.stdout.close()  # the reader went away (`| head -0`)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_interrupt_leaves_no_report_and_no_temp_files(tmp_path):
    (tmp_path / "r.json").write_text("previous\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    # a run of a minute or more here, so that 3 s in is inside the imports or the run on any machine
    slow = ["--num-prompts", "16", "--num-images-per-prompt", "8", "--num-inference-steps", "40"]
    slow += ["--sde-window-size", "40", "--height", "512", "--width", "512"]
    proc = _cli("check", "--no-progress", *slow, "--json", "r.json", "--junit", "r.xml", cwd=tmp_path, env=env)
    time.sleep(3)  # inside the import of torch or the run: either way it must exit 130 and leave nothing
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()
    assert (
        err.decode()
        .strip()
        .splitlines()[-1]
        .endswith("no report was written (reports are written all at once at the end).")
    )
    ours = [p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")]  # torch's cache
    assert ours == ["r.json"]
    assert (tmp_path / "r.json").read_text() == "previous\n"


# ------------------------------------------------------------------------------------------------
# documentation


def test_interrupt_during_ray_start_up_leaves_no_temp_dir_and_no_ray_process(tmp_path, request):
    """Ctrl-C while the local Ray cluster starts (its temp dir exists, the workers are not up yet)."""
    short = Path(tempfile.mkdtemp(prefix="rc-t", dir="/tmp"))  # Ray's sockets need a short TMPDIR
    request.addfinalizer(lambda: shutil.rmtree(short, ignore_errors=True))
    env = {**os.environ, "TMPDIR": str(short)}
    proc = _cli("check", "--no-progress", "--workers", "2", "--json", "r.json", cwd=tmp_path, env=env)
    deadline = time.monotonic() + 120
    while not list(short.glob("rc-ray-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(short.glob("rc-ray-*")), "the check never started Ray"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()
    left = [p.name for d in (tmp_path, short) for p in d.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == [], left  # no report, no Ray temp dir (torch's own cache dir aside)
    ray = subprocess.run(["pgrep", "-f", str(short)], capture_output=True, text=True)
    assert ray.stdout.strip() == "", f"Ray processes left running: {ray.stdout}"


def test_a_long_tmpdir_does_not_stop_ray(tmp_path):
    # pytest's tmp_path is far longer than Ray's AF_UNIX socket paths allow; the start falls back to /tmp
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    env = {**os.environ, "TMPDIR": str(deep)}
    proc = _cli("check", "--no-progress", "--workers", "2", "--num-prompts", "2", cwd=tmp_path, env=env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    assert b"PASS" in out


def test_docs_list_exit_codes_and_every_bound():
    text = (REPO / "docs" / "checker.md").read_text()
    for line in ("| 0 |", "| 1 |", "| 2 |", "| 130 |"):
        assert line in text
    for name in BOUNDS:
        assert f"`{name}`" in text, name


def test_interrupt_inside_an_exec_still_exits_130(tmp_path):
    # CPython marks a KeyboardInterrupt that leaves an exec() of a string (dataclasses build their methods that
    # way) as unhandled even when it is caught, and under `python -m` then kills itself with SIGINT at exit
    (tmp_path / "interrupted_in_exec.py").write_text(
        "from rollout_consistency.safeguards.cli_guard import guarded\n"
        "def run(argv):\n"
        "    exec('raise KeyboardInterrupt')\n"
        "raise SystemExit(guarded(run, [], 'prog'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "interrupted_in_exec"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 130, proc.stderr  # -2 (killed by SIGINT) before the fix
    assert proc.stderr.strip().endswith(
        "interrupted; no report was written (reports are written all at once at the end)."
    )


# ------------------------------------------------------------------------------------------------
# user code fenced: what the corpus cannot hold (several lines, subprocesses, Ray)


def test_a_plugin_of_the_wrong_shape_shows_the_accepted_shapes_with_an_example(work, capsys):
    source = (
        "class MyRollout:\n    def sample(self, request):\n        pass\ndef make(config):\n    return MyRollout()\n"
    )
    path = _user_file("user_loop.py", source)(work)
    assert main([*CHECK, *TINY, "--rollout-backend", f"{path}:make"]) == 2
    lines = capsys.readouterr().err.rstrip().splitlines()
    assert "the factory returned a MyRollout, which is not a rollout" in lines[0]
    assert "a function rollout(request), or an object with a rollout(request) method (or __call__)" in lines[0]
    example = lines[1:]
    assert len(example) == 5 and "def rollout(self, request):" in "\n".join(example)


def test_a_training_script_that_parses_its_arguments_at_import_is_a_usage_error(work, capsys):
    # argparse at module level, as many training scripts do: under the checker it sees the checker's argv and exits
    source = "import argparse\nparser = argparse.ArgumentParser()\nparser.add_argument('--config', required=True)\n"
    source += "args = parser.parse_args()\ndef make(config):\n    pass\n"
    path = _user_file("train_script.py", source)(work)
    assert main([*CHECK, *TINY, "--trainer-backend", f"{path}:make"]) == 2
    last = capsys.readouterr().err.rstrip().splitlines()[-1]  # argparse printed its own usage lines first
    assert "import of " in last and "raised SystemExit(2)" in last and "if __name__ == '__main__':" in last


def test_a_backend_registered_from_user_code_is_fenced_like_a_plugin(work, capsys):
    path = _user_file("my_engine.py", "import sys\ndef start(config):\n    sys.exit(0)\n")(work)
    register_backend(BackendEntry(name="my-engine", side="rollout", factory=f"{path}:start", summary="exits"))
    try:
        assert main([*CHECK, *TINY, "--rollout-backend", "my-engine"]) == 2
    finally:
        unregister_backend("rollout", "my-engine")
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "rollout_backend 'my-engine': the factory raised SystemExit(0)" in line


def test_user_code_that_ends_a_ray_worker_is_a_usage_error(work, capsys, ray_session):
    path = _user_file("user_loop.py", "import sys\ndef make(config):\n    sys.exit(0)\n")(work)
    # One rollout batch of two samples: one actor (workers are capped at the batches), which must not start.
    argv = [*CHECK, *TINY, "--workers", "2"]
    assert main([*argv, "--trainer-backend", f"{path}:make"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # The user-code error itself, as in process: not "a Ray worker could not start" with it buried in a traceback.
    assert len(err) == 1 and err[0].startswith(f"rollout-consistency: error: trainer_backend '{path}:make'"), err
    assert "the factory raised SystemExit(0)" in err[0], err


_SUPERVISOR_CASES = r"""
import io, json, os, signal, sys
from rollout_consistency.safeguards.fence import fenced
from rollout_consistency.safeguards.supervisor import run_supervised

def in_user_code(end):
    def command(argv):
        with fenced("trainer_backend 'x.py:make'", "the factory"):
            end()
        return 0
    return command

def late_death(argv):  # the verdict was handed over; what happens at exit cannot change it
    import atexit
    atexit.register(lambda: os._exit(3))
    return 0

def escaping_exit(argv):
    raise SystemExit(0)  # outside any fence: the command never handed a code over

cases = {
    "pass": lambda argv: 0,
    "fail": lambda argv: 1,
    "os._exit(0) in user code": in_user_code(lambda: os._exit(0)),
    "SIGKILL in user code": in_user_code(lambda: os.kill(os.getpid(), signal.SIGKILL)),
    "SystemExit(0) outside the fences": escaping_exit,
    "death after the handover": late_death,
    "killed by SIGTERM": lambda argv: os.kill(os.getpid(), signal.SIGTERM),
}
signal.signal(signal.SIGTERM, signal.SIG_DFL)
results = {}
for name, command in cases.items():
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        code = run_supervised(command, [], "prog")
    except SystemExit as child:  # the child ends here; only the parent goes on
        os._exit(int(child.code or 0))
    finally:
        said, sys.stderr = sys.stderr.getvalue(), stderr
    results[name] = [code, said]
print(json.dumps(results))
"""


def test_supervisor_exit_codes_come_only_from_a_handed_over_verdict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _SUPERVISOR_CASES], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results["pass"] == [0, ""] and results["fail"] == [1, ""]
    code, said = results["os._exit(0) in user code"]
    assert code == 2 and "exited with status 0 while running trainer_backend 'x.py:make': the factory" in said
    code, said = results["SIGKILL in user code"]
    assert code == 2 and "killed by signal 9 (SIGKILL" in said and "the factory" in said
    code, said = results["SystemExit(0) outside the fences"]
    assert code == 2 and "ended before it produced a verdict" in said and "not a PASS" in said
    assert results["death after the handover"] == [0, ""]
    code, said = results["killed by SIGTERM"]
    assert code == 130 and "interrupted" in said


def test_os_exit_0_in_a_factory_is_not_a_pass(work):
    # The measured case: exit 0 and no report before the supervisor. A factory named by a spec, through the
    # console command: `precision --spec` (torch only, ~3x faster than `check`, which imports diffusers before it
    # calls a plug-in's factory through the same fence).
    path = _user_file("user_loop.py", "import os\ndef make():\n    os._exit(0)\n")(work)
    proc = _cli("precision", "--spec", f"{path}:make", "--json", "r.json", cwd=work)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err.decode()
    last = err.decode().strip().splitlines()[-1]
    assert "exited with status 0 while running precision --spec" in last and "the factory" in last
    assert not (work / "r.json").exists()


def test_a_closed_output_pipe_does_not_change_a_finished_verdict(work):
    # `gate DUMP --json r.json 2>&1 | head -0`: stdout and stderr are one pipe whose reader is gone
    dump = _gate_dump(work)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_consistency", "gate", str(dump), "--json", "r.json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=work,
    )
    proc.stdout.close()
    assert proc.wait(timeout=120) == 0  # exit 2 before the fix, while the report said PASS
    assert json.loads((work / "r.json").read_text())["status"] == "PASS"


def test_a_dump_too_large_for_the_memory_limit_is_refused_before_loading(work):
    # The case: a valid 4 GiB dump under a 6 GiB address-space limit ended in a Rust panic, exit 1. A sparse
    # file: the header is real, the data reads as zeros, and nothing is written to disk.
    rows, steps = 1 << 20, 512
    header = {
        name: {
            "dtype": "F32",
            "shape": [rows, steps],
            "data_offsets": [i * rows * steps * 4, (i + 1) * rows * steps * 4],
        }
        for i, name in enumerate(("rollout_log_probs", "trainer_log_probs"))
    }
    header["__metadata__"] = {"format": "rollout-consistency/logprob-dump", "format_version": "1"}
    text = json.dumps(header).encode()
    path = work / "big.safetensors"
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        handle.truncate(8 + len(text) + 2 * rows * steps * 4)

    def limited() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    proc = subprocess.run(
        [sys.executable, "-m", "rollout_consistency", "gate", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limited,
    )
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert f"({rows} samples x {steps} steps) needs about" in line and "gate fewer samples" in line, line
    assert len(line.splitlines()) == 1 and "image size" not in line


def _unprivileged(argv: list[str]) -> list[str]:
    """`argv` run without the right to read other users' files (root reads a mode-000 file otherwise)."""
    if os.geteuid() != 0:
        return argv
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a mode-000 file stays readable")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *argv]


def test_out_of_memory_names_a_fix_that_fits_the_command(capsys):
    # The issue: `gate` and `doctor` ran out of memory with the check's fix ("lower the image size").
    from rollout_consistency.safeguards.cli_guard import guarded

    def out_of_memory(argv: list[str]) -> int:
        raise MemoryError

    for command, fix in (
        ("check", "lower the image size"),
        ("gate", "gate fewer samples"),
        ("doctor", "the report is too large"),
        ("lint", "lint fewer or smaller files"),
    ):
        assert guarded(out_of_memory, [command, "x"], "prog") == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("prog: error: out of memory;") and fix in line, line
        assert command == "check" or "image size" not in line, line


@pytest.mark.parametrize("command", [["gate", "d.safetensors"], [*CHECK, "--config", "c.yaml"]], ids=["gate", "config"])
def test_an_unreadable_input_says_permission(work, command):
    _gate_dump(work)
    for name in ("d.safetensors", "c.yaml"):
        (work / name).chmod(0)
    proc = subprocess.run(
        _unprivileged([sys.executable, "-m", "rollout_consistency", *command]),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=work,
    )
    assert proc.returncode == 2, proc.stderr
    assert "permission denied" in proc.stderr and "No such file" not in proc.stderr, proc.stderr


def test_load_capture_refuses_a_fifo_without_blocking(tmp_path):
    from rollout_consistency.safeguards.paths import InputPathError

    os.mkfifo(tmp_path / "capture.pt")
    with pytest.raises(InputPathError, match="is a FIFO"):
        load_capture(tmp_path / "capture.pt")


# ------------------------------------------------------------------------------------------------
# issue 30, item 5: outputs never written over what is not theirs; item 6: --ray-address without Ray


@pytest.fixture
def null_device(tmp_path) -> Path:
    """A null device to write reports to. As root: a node of our own in tmp_path (same device numbers as
    /dev/null), so that even a regression can replace nothing but it; otherwise /dev/null itself (a user other
    than root cannot rename over it)."""
    if os.geteuid() != 0:
        return Path(os.devnull)
    node = tmp_path / "null"
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.stat(os.devnull).st_rdev)
    except OSError as error:
        pytest.skip(f"root without the right to make a device node ({error.strerror}); /dev/null is never risked")
    return node


def _is_null_device(path: Path) -> bool:
    info = os.lstat(path)
    return stat.S_ISCHR(info.st_mode) and info.st_rdev == os.stat(os.devnull).st_rdev


def test_reports_to_the_null_device_leave_it_a_device(null_device, work, capsys):
    dump = _gate_dump(work)
    before = _snapshot(work)
    assert main(["gate", str(dump), "--json", str(null_device), "--junit", str(null_device)]) == 0, capsys.readouterr()
    assert _is_null_device(null_device)  # written to, never renamed over
    assert _snapshot(work) == before
    _no_temp_files(work)
    _no_temp_files(null_device.parent)
    (target,) = write_all([(null_device, lambda t: Path(t).write_text("discarded\n"))])  # the Python API too
    assert target.kind == "null" and _is_null_device(null_device)


def test_a_path_that_becomes_a_device_is_not_renamed_over(null_device, tmp_path):
    # Resolved as a new file, then a device appears there before the rename: the report is not written over it.
    if null_device == Path(os.devnull):
        pytest.skip("needs a device node of our own (root)")
    target = tmp_path / "r.json"

    def write(temporary: str) -> None:
        Path(temporary).write_text("{}\n")
        os.mknod(target, 0o666 | stat.S_IFCHR, os.stat(os.devnull).st_rdev)

    with pytest.raises(OSError, match="no longer a regular file"):
        write_all([(target, write)])
    assert _is_null_device(target)
    _no_temp_files(tmp_path)
    # And the other way: resolved as the null device, a regular file by the time the report is written.
    from rollout_consistency.safeguards.output_paths import resolve_output

    resolved = resolve_output(null_device)
    os.unlink(null_device)
    null_device.write_text("the user's file\n")
    with pytest.raises(OSError, match="no longer the null"):
        write_all([(resolved, lambda t: Path(t).write_text("report\n"))])
    assert null_device.read_text() == "the user's file\n"


def test_a_report_on_stdout_follows_the_table(work):
    dump = _gate_dump(work)
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_consistency", "gate", str(dump), "--json", "/dev/stdout"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    table, brace, rest = proc.stdout.partition("\n{")
    assert "step-1 gate" in table and json.loads(brace.strip() + rest)["status"] == "PASS"
    # stdout redirected to a file: the report is appended through the open descriptor; the file is not replaced.
    out = work / "out.txt"
    with out.open("w") as handle:
        inode = os.fstat(handle.fileno()).st_ino
        proc = subprocess.run(
            [sys.executable, "-m", "rollout_consistency", "gate", str(dump), "--junit", "/dev/stdout"],
            stdout=handle,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert os.stat(out).st_ino == inode
    assert text.index("step-1 gate") < text.index("<?xml") and text.rstrip().endswith("</testsuites>")
    _no_temp_files(work)


def test_a_relative_output_is_fixed_when_the_command_starts(work, capsys):
    # User code that changes the working directory cannot move the report (exit 0 said it was written here).
    (work / "elsewhere").mkdir()
    (work / "moving.py").write_text(
        "import os\n" + TOY + "def make(seed=0):\n    os.chdir('elsewhere')\n    return toy_case(seed=seed)\n"
    )
    assert main(["checkpointing", "moving.py:make", "--json", "r.json"]) == 0, capsys.readouterr().err
    os.chdir(work)
    assert json.loads((work / "r.json").read_text())["passed"] is True
    assert not (work / "elsewhere" / "r.json").exists()


def test_a_check_plugin_that_changes_directory_does_not_move_the_reports(work, capsys):
    (work / "elsewhere").mkdir()
    (work / "plug.py").write_text(
        "import os\nfrom rollout_consistency.plugin_template import make_rollout as _make_rollout, make_trainer\n"
        "def make_rollout(config):\n    os.chdir('elsewhere')\n    return _make_rollout(config)\n"
    )
    plug = work / "plug.py"  # absolute: the trainer's spec is loaded after the rollout's chdir
    argv = [*CHECK, *TINY, "--rollout-backend", f"{plug}:make_rollout", "--trainer-backend", f"{plug}:make_trainer"]
    code = main([*argv, "--sde-window-size", "all", "--json", "r.json", "--junit", "r.xml"])
    os.chdir(work)
    assert code == 0, capsys.readouterr().err
    assert (work / "r.json").is_file() and (work / "r.xml").is_file()
    assert sorted(p.name for p in (work / "elsewhere").iterdir()) == []


def test_a_symlinked_output_writes_its_target_and_keeps_the_link(work, capsys):
    dump = _gate_dump(work)
    (work / "reports").mkdir()
    (work / "r.json").symlink_to(work / "reports" / "r.json")
    assert main(["gate", str(dump), "--json", "r.json"]) == 0, capsys.readouterr().err
    assert (work / "r.json").is_symlink()
    assert json.loads((work / "reports" / "r.json").read_text())["status"] == "PASS"


def _pair(tmp_path: Path, tag: str) -> list[tuple[Path, Callable[[str], None]]]:
    return [(tmp_path / name, lambda t, tag=tag: Path(t).write_text(tag * 50_000)) for name in ("r.json", "r.xml")]


def test_renames_wait_for_the_reports_lock(tmp_path):
    from rollout_consistency.safeguards.atomic_write import reports_lock

    done = threading.Event()
    writer = threading.Thread(target=lambda: (write_all(_pair(tmp_path, "A")), done.set()))
    with reports_lock([tmp_path / "r.json"]):
        writer.start()
        assert not done.wait(0.5)  # the temporaries are written; the renames wait for the lock
        assert not (tmp_path / "r.json").exists() and not (tmp_path / "r.xml").exists()
    writer.join(timeout=30)
    assert done.is_set() and (tmp_path / "r.json").read_text() == (tmp_path / "r.xml").read_text()
    _no_temp_files(tmp_path)


def test_concurrent_runs_leave_their_reports_as_a_pair(tmp_path):
    # Two writers of the same JSON and JUnit: whoever holds the lock sees both files from the same writer.
    from rollout_consistency.safeguards.atomic_write import reports_lock

    stop = threading.Event()

    def writer(tag: str) -> None:
        while not stop.is_set():
            write_all(_pair(tmp_path, tag))

    threads = [threading.Thread(target=writer, args=(tag,)) for tag in "AB"]
    for thread in threads:
        thread.start()
    pairs = []
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            with reports_lock([tmp_path / "r.json"]):
                if (tmp_path / "r.xml").exists():
                    pairs.append(((tmp_path / "r.json").read_text()[0], (tmp_path / "r.xml").read_text()[0]))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert len(pairs) > 10 and all(json_tag == xml_tag for json_tag, xml_tag in pairs), pairs
    _no_temp_files(tmp_path)


def test_a_lock_held_too_long_is_an_error_not_a_hang(tmp_path, monkeypatch):
    from rollout_consistency.safeguards import atomic_write

    monkeypatch.setattr(atomic_write, "LOCK_WAIT_S", 0.2)
    with atomic_write.reports_lock([tmp_path / "r.json"]), pytest.raises(OSError, match="held the reports' lock"):
        write_all(_pair(tmp_path, "A"))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


FULL_DISK_SCRIPT = """
import sys
import numpy as np
from rollout_consistency.safeguards.cli_guard import guarded
from rollout_consistency.gate.tables.dump import read_dump, write_dump

small, big = np.full((4, 2), -1.0, np.float32), np.full((64, 512), -1.0, np.float32)
write_dump(sys.argv[1], small, small.copy())  # fits: the previous dump

def run(argv):
    write_dump(sys.argv[1], big, big.copy())
    return 0

code = guarded(run, [], "rollout-consistency")
assert read_dump(sys.argv[1]).rollout_log_probs.shape == (4, 2)  # the previous dump is whole
sys.exit(code)
"""


def _dump_on_a_full_disk(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)


def test_write_dump_on_a_full_disk_is_one_line(tmp_path):
    # A real 64 KiB file system, mounted in a private mount namespace (nothing outside the test sees it).
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a private tmpfs needs root and unshare")
    folder = tmp_path / "small"
    folder.mkdir()
    script = tmp_path / "full.py"
    script.write_text(FULL_DISK_SCRIPT)
    shell = (
        f"mount -t tmpfs -o size=64k tmpfs {folder} || exit 77; "
        f"{sys.executable} {script} {folder}/d.safetensors; code=$?; ls -A {folder}; exit $code"
    )
    proc = _dump_on_a_full_disk(["unshare", "-m", "--propagation", "private", "sh", "-c", shell])
    if proc.returncode == 77:
        pytest.skip(f"no private tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "No space left on device; the dump was not written" in line, line
    assert proc.stdout.split() == ["d.safetensors"]  # no temporary file left


def test_write_dump_over_a_file_size_limit_is_one_line(tmp_path):
    import resource

    script = tmp_path / "full.py"
    script.write_text(FULL_DISK_SCRIPT)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64_000, 64_000))

    proc = _dump_on_a_full_disk([sys.executable, str(script), str(tmp_path / "d.safetensors")], preexec_fn=limited)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "File too large; the dump was not written" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors", "full.py"]


SUPERVISOR_PIPE_SCRIPT = """
import os, sys
from rollout_consistency.safeguards.output_paths import OutputPathError, resolve_output
from rollout_consistency.safeguards.supervisor import exit_now, run_supervised

def command(argv):
    refused = []
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            resolve_output(f"/dev/fd/{fd}")
        except OutputPathError as error:
            refused += ["supervisor" in str(error)]
    return 0 if refused.count(True) == 1 else 1

exit_now(run_supervised(command, [], "rollout-consistency"))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_the_supervisors_pipe_is_never_a_report(tmp_path):
    script = tmp_path / "pipe.py"
    script.write_text(SUPERVISOR_PIPE_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_ray_address_without_ray_is_refused_not_ignored(work, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed (importlib finds no spec)
    code = main([*CHECK, *TINY, "--ray-address", "127.0.0.1:1", "--json", "r.json"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Ray is required for --ray-address" in err and len(err.strip().splitlines()) == 1
    assert not (work / "r.json").exists()
    assert main([*CHECK, *TINY, "--ray-address", "http://head:6379"]) == 2  # malformed: named as such
    assert "use 'auto', 'host:port' or 'ray://host:port'" in capsys.readouterr().err


# A PASS is earned (issue 30): nothing compared — one buffer on both sides, a trainer that returns or writes the
# rollout's own tensors, a side that is not the plan's window, a step 2 that cannot test the sync — is a FAIL
# (exit 1) naming the guard and the fix, never a PASS. The user's side is the plug-in template with one change,
# written the way such a change is written in a training loop.
def _template_variant(*edits: tuple[str, str]) -> str:
    from rollout_consistency import plugin_template

    source = Path(plugin_template.__file__).read_text(encoding="utf-8")
    for old, new in edits:
        assert source.count(old) == 1, old  # the template changed: re-anchor this variant
        source = source.replace(old, new)
    return source


RECOMPUTED = ("        return out\n", "        {line}\n")


def _returning(line: str) -> tuple[str, str]:
    return RECOMPUTED[0], RECOMPUTED[1].format(line=line)


@dataclass(frozen=True)
class Vacuous:
    id: str
    source: str
    flags: tuple[str, ...]
    guard: str
    message: str
    also: str = ""  # another check that must fail too


TEMPLATE_TINY = ("--num-prompts", "1", "--num-images-per-prompt", "1", "--rollout-batch-size", "1")
EVERY_STEP = (*TEMPLATE_TINY, "--num-inference-steps", "3", "--sde-window-size", "all")
VACUOUS_CORPUS = [
    Vacuous(  # verl's bypass mode: old_log_probs := rollout_log_probs
        "trainer-returns-the-rollouts-table",
        _template_variant(_returning('return samples["log_probs"]')),
        EVERY_STEP,
        "distinct",
        "the trainer returned the memory of batch['log_probs']",
    ),
    Vacuous(  # a trainer off by a bf16 noise level, whose table then overwrote the rollout's: it used to PASS
        "trainer-writes-into-the-rollouts-log-probs",
        _template_variant(
            (
                "noise_level=self.config.noise_level,\n            prev_sample=",
                "noise_level=float(torch.tensor(self.config.noise_level, dtype=torch.bfloat16)),\n"
                "            prev_sample=",
            ),
            _returning('samples["log_probs"].copy_(out)  # keep it with the batch\n        return out'),
        ),
        EVERY_STEP,
        "distinct",
        "the trainer changed what the rollout stored (rollout.log_probs, rollout.batch['log_probs'])",
        "max_abs_dlogp",  # the rollout's table as it made it, copied before the trainer ran, is what is compared
    ),
    Vacuous(  # after its own recompute, so its table still agrees: only the seal sees it
        "trainer-rounds-a-rollout-tensor-it-kept",
        _template_variant(
            _returning('samples["latents"].copy_(samples["latents"].bfloat16().float())\n        return out')
        ),
        EVERY_STEP,
        "distinct",
        "rollout.batch['latents']",
    ),
    Vacuous(  # samples with the SDE on every step, reports the plan's window starts
        "rollout-samples-every-step-under-a-2-step-plan",
        _template_variant(("if any(w.start != 0 or w.size != num_steps for w in request.windows):", "if False:")),
        (*TEMPLATE_TINY, "--num-inference-steps", "4", "--sde-window-size", "2", "--sde-window-range", "0", "2"),
        "windows",
        "rollout side: not the plan's window: its tables are 4 steps wide, the plan's SDE window 2",
    ),
    Vacuous(  # both sides on one other schedule: they agree with each other, not with the plan
        "both-sides-on-another-schedule",
        _template_variant(
            (
                "family.scheduler_setup(family.scheduler_config,",
                'family.scheduler_setup({**family.scheduler_config, "use_dynamic_shifting": False, "shift": 3.0},',
            )
        ),
        EVERY_STEP,
        "windows",
        "rollout side: not the plan's window: its timesteps differ from the plan's schedule",
    ),
    Vacuous(  # the template's sides share one transformer (module state): the update reaches the rollout unsynced
        "step-2-with-one-module-on-both-sides",
        _template_variant(
            (
                "def make_rollout(",
                "def _train_step(self, batches, **settings):\n    for p in self.model.parameters():\n"
                "        p.data.add_(1e-3)\n\n\nTrainer.train_step = _train_step\n\n\ndef make_rollout(",
            )
        ),
        (*EVERY_STEP, "--weight-sync", "load_state_dict"),
        "weight_sync",
        "step 2 cannot test the weight sync 'load_state_dict': the rollout and the trainer hold one module",
    ),
]


@pytest.mark.parametrize("case", VACUOUS_CORPUS, ids=[c.id for c in VACUOUS_CORPUS])
def test_nothing_compared_is_a_fail_naming_the_guard(case, work, capsys):
    path = _user_file("my_sides.py", case.source)(work)
    argv = [*CHECK, "--rollout-backend", f"{path}:make_rollout", "--trainer-backend", f"{path}:make_trainer"]
    code = main([*argv, *case.flags, "--json", "r.json"])
    captured = capsys.readouterr()
    assert code == 1 and "Traceback" not in captured.err, captured.err
    report = json.loads((work / "r.json").read_text())
    failed = {c["name"]: c["message"] for c in report["verdict"]["checks"] if not c["passed"]}
    assert case.guard in failed and case.message in failed[case.guard], failed
    fix = "bypass_mode" if case.guard == "distinct" else "request" if case.guard == "windows" else "own copy"
    assert fix in failed[case.guard], failed[case.guard]
    assert not case.also or case.also in failed, failed


def test_a_registered_trainer_returning_the_trajectorys_table_fails_distinct(work, capsys):
    """A trainer backend registered from user code (not a plug-in): its returned array is tested too."""
    source = "def start(config):\n    return lambda backend, trajectory, kernel: trajectory.log_probs.numpy()\n"
    path = _user_file("my_trainer.py", source)(work)
    register_backend(BackendEntry(name="my-trainer", side="trainer", factory=f"{path}:start", summary="reads back"))
    try:
        assert main([*CHECK, *TINY, "--trainer-backend", "my-trainer", "--json", "r.json"]) == 1
    finally:
        unregister_backend("trainer", "my-trainer")
    checks = {c["name"]: c for c in json.loads((work / "r.json").read_text())["verdict"]["checks"]}
    assert not checks["distinct"]["passed"]
    assert "the trainer returned the memory of trajectory.log_probs" in checks["distinct"]["message"]


def test_the_template_itself_passes_every_guard_it_claims(work, capsys):
    """The negative control of the corpus above: the unchanged pair, each guard checked and ok."""
    path = _user_file("my_sides.py", _template_variant())(work)
    argv = [*CHECK, "--rollout-backend", f"{path}:make_rollout", "--trainer-backend", f"{path}:make_trainer"]
    assert main([*argv, *EVERY_STEP, "--json", "r.json"]) == 0, capsys.readouterr().err
    checks = {c["name"]: c["passed"] for c in json.loads((work / "r.json").read_text())["verdict"]["checks"]}
    assert checks["distinct"] and checks["windows"]


def _log_probs(shape=(4, 3)):
    import numpy as np

    return np.random.default_rng(0).normal(-1.0, 0.1, shape).astype(np.float32)


@pytest.mark.parametrize(
    "pair",
    [
        lambda t: (t, t),
        lambda t: (torch.from_numpy(t), t),  # a tensor and the NumPy array over its buffer
        lambda t: (torch.from_numpy(t), torch.from_numpy(t).detach()[:, :]),  # a view
        lambda t: (t[:, :2], t.T.T[:, 1:]),  # overlapping slices of one buffer
    ],
    ids=["same-array", "tensor-and-its-numpy", "detached-view", "overlapping-slices"],
)
def test_gate_of_one_buffer_fails_distinct(pair):
    from rollout_consistency.gate import gate

    rollout, trainer = pair(_log_probs())
    if rollout.shape != trainer.shape:  # overlapping slices: same width, one column apart
        rollout, trainer = rollout, trainer[:, : rollout.shape[1]]
    report = gate(rollout, trainer)
    assert not report.passed
    (reason,) = [r for r in report.reasons if r.startswith("distinct:")]
    assert "nothing was compared" in reason and "bypass_mode" in reason
    assert report.diagnosis[0]["cause"] == "aliased-tables"


def test_equal_values_in_two_buffers_are_not_aliasing():
    """Bit-identical tables are what `exact` promises: a copy, and two disjoint halves of one buffer, pass."""
    import numpy as np

    from rollout_consistency.gate import gate

    table = _log_probs()
    assert gate(table, table.copy()).passed
    both = torch.from_numpy(np.concatenate([table, table], axis=1))
    report = gate(both[:, :3], both[:, 3:])
    assert report.passed and "distinct ok" in report.format_table()


def test_recorder_and_write_dump_refuse_one_buffer(tmp_path):
    from rollout_consistency.gate import Step1Recorder, write_dump
    from rollout_consistency.gate.tables.dump import DumpFormatError
    from rollout_consistency.gate.tables.recorder import RecorderError

    log_prob = torch.from_numpy(_log_probs((4,)))
    recorder = Step1Recorder()
    with pytest.raises(RecorderError, match=r"one tensor .* nothing would be compared.*bypass_mode"):
        recorder.record(torch.arange(4), 0, log_prob, log_prob)  # old_log_probs := rollout_log_probs
    recorder.record(torch.arange(4), 0, log_prob, log_prob.clone())  # a recomputation that agrees: fine
    table = _log_probs()
    with pytest.raises(DumpFormatError, match=r"one array .* nothing would be compared"):
        write_dump(tmp_path / "d.safetensors", table, table[:, :])
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_nan_capture_check_without_gradients_is_refused(tmp_path):
    model = torch.nn.Linear(3, 2)
    capture = NanCapture(model, directory=tmp_path)
    capture.begin_step(0)
    with pytest.raises(RuntimeError, match="no gradient on any of the model's 2 trainable parameters"):
        capture.check({"x": torch.zeros(1, 3)})  # check() before backward: nothing to call finite
    capture.begin_step(1)
    model(torch.ones(1, 3)).sum().backward()
    assert capture.check({"x": torch.ones(1, 3)})


# issue 30: the supervisor enforces from outside what the child cannot (bounds, the end after the handover,
# temporary files of a killed child), and a threaded process is never forked

_SUPERVISED_CASE = r"""
import atexit, io, json, os, signal, sys, threading, time
from rollout_consistency.safeguards.atomic_write import write_all
from rollout_consistency.safeguards.fence import fenced
from rollout_consistency.safeguards.supervisor import run_supervised

def in_user_code(body, timeout_s=1.0):
    def command(argv):
        with fenced("trainer_backend 'x.py:make'", "the factory", timeout_s=timeout_s):
            body()
        return 0
    return command

def sigalrm_blocked():  # a call blocked in C code never runs the fence's SIGALRM handler either
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    time.sleep(600)

def sigalrm_replaced():
    signal.signal(signal.SIGALRM, lambda *_: None)
    threading.Event().wait()

def alarm_cancelled():
    signal.setitimer(signal.ITIMER_REAL, 0)
    threading.Event().wait()

def grandchild_then_blocked():  # a process it started holds our stdout: killed with it, or the reader waits
    import subprocess
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    sigalrm_blocked()

def handed_over(hold):
    def command(argv):
        hold()
        return 1
    return command

class SlowToTearDown:  # as torch and diffusers are on a loaded machine: seconds after the last atexit handler
    def __del__(self):
        time.sleep(6)

def killed_while_writing(signum):
    def command(argv):
        write_all([("report.json", lambda temporary: os.kill(os.getpid(), signum))])
        return 0
    return command

cases = {
    "sigalrm blocked": in_user_code(sigalrm_blocked),
    "sigalrm replaced": in_user_code(sigalrm_replaced),
    "alarm cancelled": in_user_code(alarm_cancelled),
    "nested calls": in_user_code(lambda: in_user_code(sigalrm_blocked, timeout_s=30)([])),
    "a grandchild holds the output": in_user_code(grandchild_then_blocked),
    "atexit holds": handed_over(lambda: atexit.register(threading.Event().wait)),
    "non-daemon thread holds": handed_over(lambda: threading.Thread(target=threading.Event().wait).start()),
    "slow interpreter shutdown": handed_over(lambda: setattr(sys.modules["__main__"], "slow", SlowToTearDown())),
    "SIGKILL while writing": killed_while_writing(signal.SIGKILL),
    "SIGHUP while writing": killed_while_writing(signal.SIGHUP),
}
signal.signal(signal.SIGHUP, signal.SIG_DFL)
start = time.monotonic()
stderr, sys.stderr = sys.stderr, io.StringIO()
code = run_supervised(cases[sys.argv[1]], [], "prog")  # the child exits normally (SystemExit) in here
said, sys.stderr = sys.stderr.getvalue(), stderr
print(json.dumps([code, said, time.monotonic() - start, sorted(os.listdir("."))]))
"""


def test_supervisor_enforces_bounds_handover_and_temp_files_from_outside(tmp_path):
    from rollout_consistency.safeguards.supervisor import HANDOVER_GRACE_S, KILL_GRACE_S

    names = ["sigalrm blocked", "sigalrm replaced", "alarm cancelled", "nested calls", "a grandchild holds the output"]
    names += ["atexit holds"]
    names += ["non-daemon thread holds", "slow interpreter shutdown", "SIGKILL while writing", "SIGHUP while writing"]
    procs = {}
    results = {}
    try:
        for i, name in enumerate(names):  # side by side: most of them wait out a bound
            (tmp_path / str(i)).mkdir()
            procs[name] = subprocess.Popen(
                [sys.executable, "-c", _SUPERVISED_CASE, name],
                cwd=tmp_path / str(i),
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,  # its own group: a case that hangs is killed whole below
            )
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, (name, out)
            results[name] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    stopped = "trainer_backend 'x.py:make': the factory did not return within 1 s (user_code_timeout_s); the supervisor"
    for name in names[:5]:
        code, said, seconds, _ = results[name]
        assert code == 2 and stopped in said and len(said.strip().splitlines()) == 1, (name, said)
        assert seconds < 1 + KILL_GRACE_S + 15, (name, seconds)  # hung for ever before
    for name in ("atexit holds", "non-daemon thread holds"):
        code, said, seconds, _ = results[name]
        assert (
            code == 1
            and "did not exit after handing over its verdict" in said
            and "The exit code is the verdict's" in said
        ), (name, said)
        assert seconds < HANDOVER_GRACE_S + 15, (name, seconds)
    code, said, seconds, _ = results["slow interpreter shutdown"]
    assert code == 1 and said == "" and seconds > 6, (said, seconds)  # not mistaken for a hold
    code, said, _, left = results["SIGKILL while writing"]
    assert code == 2 and "killed by signal 9 (SIGKILL" in said and left == [], (said, left)
    code, said, _, left = results["SIGHUP while writing"]
    assert code == 130 and "interrupted" in said and left == [], (said, left)


_THREADED_CALLER = """
import sys, threading, shared
from rollout_consistency.cli import main

shared.LOCK.acquire()  # another thread of the caller holds a lock the user's factory needs, as a logger's would
threading.Thread(target=threading.Event().wait, daemon=True).start()
sys.argv = ["rollout-consistency", "precision", "--spec", "user_spec.py:make", "--user-code-timeout-s", "5"]
main()  # the process entry without argv: a forked child would wait on the held lock for ever
"""


def test_main_without_argv_in_a_threaded_process_runs_in_a_fresh_interpreter(tmp_path):
    (tmp_path / "shared.py").write_text("import threading\nLOCK = threading.Lock()\n")
    (tmp_path / "user_spec.py").write_text("import shared\ndef make():\n    with shared.LOCK:\n        return {}\n")
    (tmp_path / "caller.py").write_text(_THREADED_CALLER)
    proc = subprocess.run([sys.executable, "caller.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr  # deadlocked before; exit 2 at the bound with a forked child
    assert "precision" in proc.stdout.lower(), proc.stdout


def test_the_console_command_stops_a_factory_stuck_outside_python(work):
    # The class end to end: the fence's bound reaches the supervisor through the console command. A factory
    # with SIGALRM blocked, as a call stuck in C (a collective that never completes) is, hung the command for ever.
    source = "import signal, time\ndef make():\n    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])\n"
    path = _user_file("user_loop.py", source + "    time.sleep(600)\n")(work)
    proc = _cli("precision", "--spec", f"{path}:make", "--user-code-timeout-s", "1", "--json", "r.json", cwd=work)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 2, err.decode()
    (line,) = err.decode().strip().splitlines()
    assert "the factory did not return within 1 s (user_code_timeout_s); the supervisor stopped it" in line, line
    assert not (work / "r.json").exists()
    _no_temp_files(work)


def test_a_hangup_is_an_interrupt(tmp_path):
    # A closed terminal sends SIGHUP: clean up and exit 130 as for Ctrl-C or SIGTERM (before: killed on the spot)
    code = (
        "import os, signal\nfrom rollout_consistency.safeguards.cli_guard import guarded\n"
        "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
        "def run(argv):\n    os.kill(os.getpid(), signal.SIGHUP)\n    signal.pause()\n"
        "raise SystemExit(guarded(run, [], 'prog'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().endswith(
        "interrupted; no report was written (reports are written all at once at the end)."
    )


# issue 30: a figure beyond float64's squares is a FAIL with the doctor's diagnosis, never an error


@pytest.mark.parametrize("dlogp", [400.0, 700.0])
def test_a_trainer_hundreds_of_nats_off_fails_with_the_doctor_not_exit_2(work, capsys, dlogp):
    import numpy as np

    from rollout_consistency.gate.tables.dump import write_dump

    rollout = np.random.default_rng(0).normal(-1.0, 0.1, (8, 4)).astype(np.float32)
    trainer = rollout.copy()
    trainer[:4] += np.float32(dlogp)  # a pooled profile's bias allowance squares per-sample ratio means ~exp(dlogp)
    trainer[4:] -= np.float32(1.0)
    write_dump(work / "d.safetensors", rollout, trainer)
    assert main(["gate", "d.safetensors", "--profile", "kernel"]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "error" not in err, err
    assert "rollout-consistency step-1 gate: FAIL" in out and "doctor: likely causes" in out
    # A ratio of ~exp(dlogp) in the table's exponent form, not hundreds of fixed-point digits.
    assert re.search(r"^  ratio_mean +\d\.\d{3}e\+\d{3} ", out, re.MULTILINE), out


def test_an_input_one_byte_over_its_bound_is_refused_and_one_at_it_is_read(tmp_path):
    from rollout_consistency.safeguards.paths import InputPathError, check_input_file

    path = tmp_path / "d.safetensors"
    path.write_bytes(b"x" * 101)
    assert check_input_file(path, "DUMP", max_bytes=101) == 101
    with pytest.raises(InputPathError, match="is 101 bytes, more than the 100 this input may hold"):
        check_input_file(path, "DUMP", max_bytes=100)


def test_an_interrupt_swallowed_by_python_still_ends_the_command_and_writes_no_report(tmp_path):
    """CPython swallows an exception raised where it cannot propagate ("Exception ignored in": an at-fork hook while
    Ray starts its workers, a __del__): a Ctrl-C whose KeyboardInterrupt lands there must still end the command with
    130 and put no report in place (once seen on a loaded machine: the check ran on and wrote its report)."""
    from rollout_consistency.safeguards.atomic_write import write_all
    from rollout_consistency.safeguards.cli_guard import EXIT_INTERRUPTED, guarded

    report = tmp_path / "r.json"

    class InterruptedInFinaliser:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs here, inside __del__, and its exception is swallowed
                pass

    def run(_argv):
        InterruptedInFinaliser()  # dropped at once: __del__ runs now
        write_all([(str(report), lambda path: Path(path).write_text("{}"))])
        return 0

    assert guarded(run, [], "rollout-consistency") == EXIT_INTERRUPTED
    assert not report.exists()
    assert list(tmp_path.iterdir()) == []
    # The record ends with the command: a report written afterwards, outside any command, is put in place.
    write_all([(str(report), lambda path: Path(path).write_text("{}"))])
    assert report.read_text() == "{}"
