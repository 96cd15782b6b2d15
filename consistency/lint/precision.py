# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The mixed-precision settings a set of linted files shows: whether the model (and so a sampler's input) runs in
bf16/fp16 or in float32.

A sampler step that returns `prev_sample.type(sample.dtype)` (the DDPO lineage) rounds only if `sample` is
bf16/fp16, which its pipeline decides from the trainer's mixed-precision setting (`inference_dtype = torch.float16
if accelerator.mixed_precision == "fp16"`). Where the setting is visible — in a config file, a config class, a
command-line default, the `Accelerator(...)` call — it is read from the text, as written:

* `config.mixed_precision = "fp16"`, `mixed_precision: str = "fp16"`, `Accelerator(mixed_precision="bf16")`;
* `mixed_precision: str = field(default="fp16", ...)`;
* `parser.add_argument("--mixed_precision", ..., default="bf16")`;
* `mixed_precision: bf16` in a YAML file is not read (only the `*.py` files are linted).

Values: `fp16`/`bf16` (and `float16`/`bfloat16`) are low precision; `no`/`fp32`/`float32` are not; anything else
(a variable) says nothing. The files are read again (most were never parsed), and only when a finding
depends on the setting.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Setting", "mixed_precision_settings", "nearest_settings"]

_LOW = frozenset({"fp16", "bf16", "float16", "bfloat16"})
_FLOAT32 = frozenset({"no", "fp32", "float32"})
_VALUE = r"[\"'](\w+)[\"']"
_PATTERNS = (
    # `x.mixed_precision = "fp16"`, `mixed_precision="bf16"`, `mixed_precision: str = "fp16"`
    re.compile(rb"\bmixed_precision\s*(?::\s*[\w.\[\], ]+)?=\s*" + _VALUE.encode()),
    # `mixed_precision: str = field(default="fp16", ...)`
    re.compile(rb"\bmixed_precision\s*(?::\s*[\w.\[\], ]+)?=\s*field\(\s*default\s*=\s*" + _VALUE.encode()),
    # `add_argument("--mixed_precision", type=str, default="bf16", ...)`
    re.compile(rb"[\"']--mixed[_-]precision[\"'][^)]*?\bdefault\s*=\s*" + _VALUE.encode(), re.DOTALL),
)
_WORD = b"mixed_precision"


@dataclass(frozen=True)
class Setting:
    """One mixed-precision setting found in a file."""

    value: str
    path: str
    line: int

    @property
    def low(self) -> bool:
        return self.value.lower() in _LOW

    @property
    def where(self) -> str:
        return f"`mixed_precision` at {self.path}:{self.line}"


def mixed_precision_settings(path: str, data: bytes) -> list[Setting]:
    """The low-precision and float32 settings of one file (its path and bytes), in order; a value neither (a
    variable, `"auto"`) is left out."""
    if _WORD not in data and b"mixed-precision" not in data:
        return []
    found: list[Setting] = []
    for pattern in _PATTERNS:
        for match in pattern.finditer(data):
            value = match.group(1).decode("ascii", "replace")
            if value.lower() in _LOW | _FLOAT32:
                found.append(Setting(value, path, data.count(b"\n", 0, match.start(1)) + 1))
    return sorted(found, key=lambda s: s.line)


def nearest_settings(settings: Sequence[Setting], path: str) -> list[Setting]:
    """The settings of the project `path` belongs to: those in the deepest directory they share with it (a
    repository linted beside another keeps its own config; `config/base.py` serves `ddpo/...` in one tree)."""
    directory = path.replace("\\", "/").split("/")[:-1]

    def shared(setting: Setting) -> int:
        other = setting.path.replace("\\", "/").split("/")[:-1]
        depth = 0
        while depth < min(len(directory), len(other)) and directory[depth] == other[depth]:
            depth += 1
        return depth

    if not settings:
        return []
    deepest = max(shared(s) for s in settings)
    return [s for s in settings if shared(s) == deepest]
