"""Every example in README.md and docs/*.md runs as written, one scratch directory per page.

The rules a page follows (a new page needs nothing more):

* A block whose first line is ``# NAME`` with ``NAME`` a relative file path (``# step1.toml``,
  ``# my_project/factories.py``) is written to that file first, so the page's commands can use it.
* Every ```` ```python ```` block then runs on its own, in a fresh namespace and a fresh scratch copy of the
  repository (readers copy single blocks; a block that needs a file makes it); the registries of metrics,
  statistics, profiles, backends, causes, built-in families and lint rules are restored after it, so a block's
  registrations do not outlive it.
* Every shell block then runs, command by command (``\\`` continues a line), with this environment's ``bin``
  first on ``PATH``, in a scratch copy of the repository (``scripts/...`` and ``tests/...`` resolve) holding
  what the page's python blocks wrote, as a reader following the page would have it: in a
  ```` ```bash ```` block each line is a command, expected to exit 0 unless its comment says ``(exit N)``; in a
  ```` ```console ```` block each ``$`` line is one, and a ``$ echo $?`` line with the number under it gives
  the code the command before it must exit with.
* A block right after a ``<!-- not run: REASON -->`` line is not run; the reason is required (a GPU, the
  set-up commands themselves, a benchmark whose measured figures the page reports). A command that installs
  packages or runs ``make`` must be in such a block: run here it would change the suite's own environment.
* Other fences (``text``, ``json``, unnamed ``toml``/``yaml``, ``python-gpu``) are shown, not run. A page
  whose examples another test runs is listed in `RUN_ELSEWHERE`.

No page, and no source file, refers to a file outside the repository.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout_consistency.base.builtin_families import BUILTIN_FAMILIES
from rollout_consistency.gate.backend_registry import scoped_backends
from rollout_consistency.gate.diagnosis import CAUSES
from rollout_consistency.gate.judging import METRICS, PROFILES, STATISTICS
from rollout_consistency.lint import RULES

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not run:(.*?)-->\s*$")
NAMED = re.compile(r"#\s*([\w./-]+\.(?:py|toml|yaml|yml|json))\b")
SHELL = {"bash", "sh", "console"}
#: Pages whose shell examples another test runs, comparing their output too.
RUN_ELSEWHERE = {"lint.md": "tests/test_lint.py runs every console block and compares its output and exit code"}
#: Left out of the scratch copy of the repository (large, generated, or this environment's own).
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    body: str
    not_run: str | None  # the reason given in a `<!-- not run: ... -->` line, if any

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = NOT_RUN.search(before)
        line = text.count("\n", 0, match.start()) + 1
        found.append(
            Block(page.name, line, match.group(1), match.group(2), marker.group(1).strip() if marker else None)
        )
    return found


def _named_file(block: Block) -> str | None:
    first = block.body.split("\n", 1)[0]
    named = NAMED.fullmatch(first.strip()) if first.startswith("#") else None
    return named.group(1) if named else None


def commands(block: Block) -> list[tuple[str, int]]:
    """(command, expected exit code) of a shell block, in order."""
    lines = block.body.splitlines()
    found: list[tuple[str, int]] = []
    if block.lang == "console":
        joined: list[str] = []
        for line in lines:
            if joined and joined[-1].endswith("\\"):
                joined[-1] = joined[-1][:-1].rstrip() + " " + line.strip()
            elif line.startswith("$ "):
                joined.append(line[2:])
            elif joined and joined[-1] == "echo $?" and line.strip().isdigit():
                joined[-1] = f"echo $? {line.strip()}"
        for command in joined:
            if command.startswith("echo $? "):
                found[-1] = (found[-1][0], int(command.split()[-1]))
            else:
                found.append(_with_exit_code(command))
        return found
    command = ""
    for line in lines:
        command += line.strip()
        if command.endswith("\\"):
            command = command[:-1].rstrip() + " "
            continue
        if command and not command.startswith("#"):
            found.append(_with_exit_code(command))
        command = ""
    return found


def _with_exit_code(command: str) -> tuple[str, int]:
    code, comment = command, ""
    if " #" in command:
        code, comment = command.split(" #", 1)
    expected = re.search(r"\(exit (\d+)\)", comment)
    return code.strip(), int(expected.group(1)) if expected else 0


def _environment() -> dict[str, str]:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "MPLBACKEND": "Agg"}


def _scratch_copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, symlinks=True, ignore=NOT_COPIED, dirs_exist_ok=True)
    return target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_examples_run(page, tmp_path, monkeypatch):
    page_blocks = blocks(page)
    refused = [f"{b.where}: `{c}`" for b in page_blocks if b.not_run is None for c, _ in _setup_commands(b)]
    assert refused == [], f"set-up commands would change this environment; mark their block not run: {refused}"
    base = _scratch_copy(ROOT, tmp_path / "repo")
    # Commands written as `.venv/bin/python ...` (as the README's set-up leaves it) find this environment.
    (base / ".venv").symlink_to(Path(sys.executable).parent.parent, target_is_directory=True)
    for block in page_blocks:
        if block.not_run is not None:
            assert block.not_run, f"{block.where}: a block that is not run must say why (<!-- not run: REASON -->)"
        elif (name := _named_file(block)) is not None:
            (base / name).parent.mkdir(parents=True, exist_ok=True)
            (base / name).write_text(block.body)
    # The shell examples run where a reader following the page stands: after its python examples.
    shell_dir = _scratch_copy(base, tmp_path / "shell")
    for block in page_blocks:
        if block.lang == "python" and block.not_run is None:
            # On its own: a fresh namespace in a fresh copy, so no block leans on one run before it.
            monkeypatch.chdir(_scratch_copy(base, tmp_path / f"python-{block.line}"))
            # What a block registers (a metric, a statistic, a profile, a backend, a cause, a built-in family, a lint
            # rule) is gone after it, as in a fresh process.
            with (
                METRICS.scoped(),
                STATISTICS.scoped(),
                PROFILES.scoped(),
                scoped_backends(),
                CAUSES.scoped(),
                BUILTIN_FAMILIES.scoped(),
                RULES.scoped(),
            ):
                exec(compile(block.body, block.where, "exec"), {"__name__": f"docs_{page.stem}_{block.line}"})
            _scratch_copy(Path.cwd(), shell_dir)
    if page.name in RUN_ELSEWHERE:
        return
    for block in page_blocks:
        if block.lang not in SHELL or block.not_run is not None:
            continue
        for command, expected in commands(block):
            done = subprocess.run(
                ["bash", "-c", command], cwd=shell_dir, env=_environment(), capture_output=True, text=True, timeout=600
            )
            assert done.returncode == expected, (
                f"{block.where}: `{command}` exited {done.returncode}, the page says {expected}\n"
                f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            )


#: Commands that install packages or build environments: run here, they would change the environment the
#: suite runs in, so their blocks carry a `not run` marker (`.ci/run` runs the README's own).
SETUP = re.compile(r"(^|[;&|(]\s*)(\S*/)?(pip3?|make|uv|conda|python3? -m (pip|venv))\b")


def _setup_commands(block: Block) -> list[tuple[str, int]]:
    return [c for c in commands(block) if SETUP.search(c[0])] if block.lang in SHELL else []


def test_the_block_rules_read_what_pages_write(tmp_path):
    page = "\n".join(
        [
            "<!-- not run: needs a GPU -->",
            "```bash",
            "rollout-consistency check --device cuda",
            "```",
            "```bash",
            "rollout-consistency check \\",
            "    --inject bf16-latents            # FAIL (exit 1)",
            "# a comment line",
            "rollout-consistency check",
            "```",
            "```console",
            "$ rollout-consistency lint a.py",
            "a.py:1:1 rule message",
            "$ echo $?",
            "1",
            "```",
            "```toml",
            "# step1.toml",
            "seed = 1",
            "```",
            "",
        ]
    )
    path = tmp_path / "page.md"
    path.write_text(page)
    gpu, bash, console, toml = blocks(path)
    assert gpu.not_run == "needs a GPU" and bash.not_run is None
    assert commands(bash) == [("rollout-consistency check --inject bf16-latents", 1), ("rollout-consistency check", 0)]
    assert commands(console) == [("rollout-consistency lint a.py", 1)]
    assert _named_file(toml) == "step1.toml" and _named_file(bash) is None
    assert _setup_commands(bash) == []
    setup = Block("page.md", 1, "bash", "pip install -e .\nmake test\ncd x && .venv/bin/python -m pip list\n", None)
    assert [c for c, _ in _setup_commands(setup)] == [
        "pip install -e .",
        "make test",
        "cd x && .venv/bin/python -m pip list",
    ]


def test_no_reference_to_a_file_outside_the_repository():
    """The design brief the project started from is not in the repository: docs/design.md is."""
    outside = re.compile(r"DESIGN\.md|§ ?\d")
    files = [*PAGES, ROOT / "pyproject.toml", ROOT / "Makefile"]
    files += [
        p
        for folder in ("consistency", "adapters", "schedulers", "scripts", "tests")
        for p in (ROOT / folder).rglob("*.py")
    ]
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if outside.search(line) and path != Path(__file__).resolve()
    ]
    assert found == [], f"references to a file outside the repository: {found}"
