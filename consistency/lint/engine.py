# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Run the rules over files and directories: walk, parse, check, drop suppressed hits, sort.

Problems with the *invocation* raise `LintUsageError` (the command line exits 2): a path that does not
exist or cannot be read, an unknown rule id in `select`/`ignore`. A file that does not parse is a
*finding* (`syntax-error`, at the error's position): the run goes on with the other files and fails.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from .model import Finding, Hit
from .rules import RULES, SYNTAX_ERROR
from .source import SourceFile, SyntaxProblem, parse_source

__all__ = ["LintUsageError", "lint_paths", "lint_source", "resolve_rules"]

#: directory names never entered when walking a directory (a path named explicitly is still linted)
SKIPPED_DIRECTORIES = ("__pycache__", "node_modules", "site-packages", "venv", "*.egg-info", ".*")


class LintUsageError(ValueError):
    """Bad input to the lint itself (missing/unreadable path, unknown rule id); the message says which."""


def resolve_rules(select: Iterable[str] | None = None, ignore: Iterable[str] | None = None) -> tuple[str, ...]:
    """The rule ids to run, in `RULES` order: `select` (default: all) minus `ignore`."""
    chosen = _check_ids(select, "select") if select is not None else list(RULES)
    dropped = set(_check_ids(ignore, "ignore")) if ignore is not None else set()
    return tuple(rule for rule in RULES if rule in chosen and rule not in dropped)


def _check_ids(ids: Iterable[str], option: str) -> list[str]:
    ids = [ids] if isinstance(ids, str) else list(ids)
    for rule in ids:
        if rule not in RULES:
            close = difflib.get_close_matches(rule, list(RULES), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise LintUsageError(f"{option}: unknown rule {rule!r}{hint}; rules: {', '.join(RULES)}")
    return ids


def lint_paths(
    paths: Sequence[str | os.PathLike],
    *,
    select: Iterable[str] | None = None,
    ignore: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
) -> list[Finding]:
    """Lint Python files and directories (searched recursively for `*.py`); findings sorted by place.

    Args:
        paths: files (linted whatever their suffix) and directories.
        select: rule ids to run (default: all of `RULES`).
        ignore: rule ids not to run.
        exclude: glob patterns; a file or directory is skipped when its path as reported, or any one
            component of it, matches (`tests/*`, `lint_fixtures`, `*_pb2.py`).

    Raises:
        LintUsageError: no paths, a path that does not exist or cannot be read, an unknown rule id.
    """
    rules = resolve_rules(select, ignore)
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise LintUsageError("no paths given")
    excludes = tuple(exclude)
    parsed: list[SourceFile] = []
    problems: list[SyntaxProblem] = []
    seen: set[Path] = set()
    for display, parts in _collect(paths, excludes):
        key = Path(display).resolve()
        if key in seen:
            continue
        seen.add(key)
        try:
            data = Path(display).read_bytes()
        except OSError as error:
            raise LintUsageError(f"cannot read {display}: {error.strerror or error}") from error
        result = parse_source(data, display, parts)
        (problems if isinstance(result, SyntaxProblem) else parsed).append(result)
    return _run(parsed, problems, rules)


def lint_source(
    source: str, path: str = "<string>", *, select: Iterable[str] | None = None, ignore: Iterable[str] | None = None
) -> list[Finding]:
    """Lint one piece of source text as if it were the file `path` (the only file of the run)."""
    result = parse_source(source.encode("utf-8"), path)
    rules = resolve_rules(select, ignore)
    if isinstance(result, SyntaxProblem):
        return _run([], [result], rules)
    return _run([result], [], rules)


def _run(files: list[SourceFile], problems: list[SyntaxProblem], rules: Sequence[str]) -> list[Finding]:
    findings = [
        Finding(p.path, p.line, p.col, SYNTAX_ERROR.id, f"{p.message}; {SYNTAX_ERROR.fix}", p.line, p.col + 1)
        for p in problems
    ]
    seen: set[tuple] = set()
    for rule in rules:
        for hit in RULES[rule].check(files):
            if hit.file.is_suppressed(hit.node, rule):
                continue
            finding = _finding(hit, rule)
            key = (finding.path, finding.line, finding.col, finding.rule)
            if key not in seen:
                seen.add(key)
                findings.append(finding)
    return sorted(findings)


def _finding(hit: Hit, rule: str) -> Finding:
    node, file = hit.node, hit.file
    line = node.lineno
    end_line = getattr(node, "end_lineno", None) or line
    col = file.char_col(line, node.col_offset) + 1
    end_offset = getattr(node, "end_col_offset", None)
    end_col = file.char_col(end_line, end_offset) + 1 if end_offset is not None else col + 1
    return Finding(file.path, line, col, rule, hit.message, end_line, end_col)


def _excluded(display: str, excludes: tuple[str, ...]) -> bool:
    if not excludes:
        return False
    parts = [p for p in display.replace("\\", "/").split("/") if p not in ("", ".")]
    candidates = ["/".join(parts), display, *parts]
    return any(fnmatch.fnmatch(c, pattern) for pattern in excludes for c in candidates)


def _collect(paths: Iterable[str | os.PathLike], excludes: tuple[str, ...]) -> Iterable[tuple[str, tuple[str, ...]]]:
    """(path to report, path components for the side of a file) for every file to lint."""
    for raw in paths:
        root = os.fspath(raw)
        if not os.path.exists(root):
            raise LintUsageError(f"{root}: no such file or directory")
        if _excluded(root, excludes):
            continue
        # The components of the path as given (none of `.`, `..` or an absolute path's prefix) count for
        # the side of a file: `lint trainer/` makes `trainer` a directory of every file below it.
        given = () if os.path.isabs(root) else tuple(p for p in Path(root).parts if p not in (".", ".."))
        if not os.path.isdir(root):
            yield root, given or (os.path.basename(root),)
            continue
        for directory, subdirs, files in os.walk(root, onerror=_raise_walk_error):
            subdirs[:] = sorted(
                d
                for d in subdirs
                if not any(fnmatch.fnmatch(d, skip) for skip in SKIPPED_DIRECTORIES)
                and not _excluded(_display(root, directory, d), excludes)
            )
            for name in sorted(files):
                display = _display(root, directory, name)
                if name.endswith(".py") and not _excluded(display, excludes):
                    relative = os.path.relpath(os.path.join(directory, name), root)
                    yield display, (*given, *Path(relative).parts)


def _display(root: str, directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    if root in (".", "./"):
        path = os.path.relpath(path, ".")
    return path.replace(os.sep, "/")


def _raise_walk_error(error: OSError) -> None:
    raise LintUsageError(f"cannot read {error.filename}: {error.strerror or error}") from error
