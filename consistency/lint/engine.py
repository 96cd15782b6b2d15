# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Run the rules over files and directories: walk, read, parse, check, drop suppressed hits, sort.

Files are linted one at a time and their trees dropped after: memory stays at one file's tree plus the
findings (and the few facts a rule that compares files keeps). A file in which no selected rule could fire
(`Rule.needs`, a test of its text) is not parsed at all: in a large tree most are not.

Problems with the *invocation* raise `LintUsageError` (the command line exits 2): a path that does not
exist or cannot be read, a directory without Python files, a run that `--exclude` leaves empty, a FIFO,
device or socket (refused, never opened for reading), an unknown rule id in `select`/`ignore`. A file that
does not parse, or is nested too deeply to check, is a *finding* (`syntax-error`): the run goes on with
the other files and fails.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import difflib
import fnmatch
import gc
import itertools
import multiprocessing
import multiprocessing.context
import os
import stat
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from .loads import SKIPPED_DIRECTORIES
from .model import Finding, Hit, Rule, span
from .rules import RULES, SYNTAX_ERROR
from .source import SyntaxProblem, parse_source

__all__ = ["LintUsageError", "lint_paths", "lint_source", "resolve_rules"]


_FILE_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


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
    jobs: int = 1,
) -> list[Finding]:
    """Lint Python files and directories (searched recursively for `*.py`); findings sorted by place.

    Args:
        paths: files (linted whatever their suffix) and directories.
        select: rule ids to run (default: all of `RULES`).
        ignore: rule ids not to run.
        exclude: glob patterns; a file or directory is skipped when its path as reported, or any one
            component of it, matches (`tests/*`, `lint_fixtures`, `*_pb2.py`).
        jobs: worker processes for a large tree (at most one per `FILES_PER_JOB` files; 1: none). The
            findings do not depend on it.

    Raises:
        LintUsageError: no paths; a path that does not exist, cannot be read or is not a regular file or a
            directory; a directory with no Python files; nothing left to lint after `exclude`; an unknown
            rule id.
    """
    rule_ids = resolve_rules(select, ignore)
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise LintUsageError("no paths given")
    targets = _distinct(_collect(paths, tuple(exclude)))
    workers = max(1, min(int(jobs), len(targets) // FILES_PER_JOB))
    if workers == 1:
        findings, facts = _lint_files([target[:2] for target in targets], rule_ids)
    else:
        findings, facts = [], {}
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=_process_context()) as pool:
            chunks = _balanced([target[:2] for target in targets], workers * 4, [target[2] for target in targets])
            for chunk_findings, chunk_facts in pool.map(_lint_files, chunks, itertools.repeat(rule_ids)):
                findings.extend(chunk_findings)
                for rule, items in chunk_facts.items():
                    facts.setdefault(rule, []).extend(items)
    linted = [(display, parts) for display, parts, _ in targets]
    for rule_id in rule_ids:
        rule = RULES[rule_id]
        if rule.compare is not None:
            findings.extend(rule.compare(facts.get(rule_id, []), linted))
    return _unique_sorted(findings)


#: a worker process only pays for itself past this many files
FILES_PER_JOB = 128


def _lint_files(
    targets: Sequence[tuple[str, tuple[str, ...]]], rule_ids: Sequence[str]
) -> tuple[list[Finding], dict[str, list[object]]]:
    """Lint files one at a time: (findings, the facts of the rules that compare files). Run in the calling
    process, or in a worker on its share of the files."""
    rules = [RULES[rule] for rule in rule_ids]
    findings: list[Finding] = []
    facts: dict[str, list[object]] = {rule.id: [] for rule in rules if rule.compare is not None}
    with _no_cyclic_gc():
        for display, parts in targets:
            findings.extend(_lint_file(_read(display), display, parts, rules, facts))
    return findings, facts


def _distinct(targets: list[tuple[str, tuple[str, ...]]]) -> list[tuple[str, tuple[str, ...], int]]:
    """The targets with each file once (two paths to one file, a symlink), with their sizes."""
    seen: set[tuple[int, int]] = set()
    distinct = []
    for display, parts in targets:
        try:
            info = os.stat(display)
        except OSError as error:
            raise LintUsageError(f"cannot read {display}: {error.strerror or error}") from error
        if (info.st_dev, info.st_ino) not in seen:
            seen.add((info.st_dev, info.st_ino))
            distinct.append((display, parts, info.st_size))
    return distinct


def _balanced(items: list, count: int, sizes: list[int]) -> list[list]:
    """`items` dealt into `count` lists of about equal total size (largest first), each in the original order."""
    order = sorted(range(len(items)), key=lambda i: -sizes[i])
    loads = [0] * count
    shares: list[list[int]] = [[] for _ in range(count)]
    for index in order:
        lightest = loads.index(min(loads))
        shares[lightest].append(index)
        loads[lightest] += sizes[index]
    return [[items[i] for i in sorted(share)] for share in shares if share]


def _process_context() -> multiprocessing.context.BaseContext:
    """Workers are forked (no start-up cost) from a process that runs one thread, as the command line does;
    from a threaded process (a library caller), they are started by a fork server instead."""
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Python's cyclic collector off while files are parsed (restored after): building a tree allocates
    hundreds of thousands of nodes, and the collections they trigger cost twice the parse itself. A file's tree
    has no reference cycles, so it is freed as soon as the file is done."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def lint_source(
    source: str, path: str = "<string>", *, select: Iterable[str] | None = None, ignore: Iterable[str] | None = None
) -> list[Finding]:
    """Lint one piece of source text as if it were the file `path` (the only file of the run)."""
    rules = [RULES[rule] for rule in resolve_rules(select, ignore)]
    facts: dict[str, list[object]] = {rule.id: [] for rule in rules if rule.compare is not None}
    parts = (path.replace("\\", "/").rsplit("/", 1)[-1],)
    findings = _lint_file(source.encode("utf-8"), path, parts, rules, facts, always_parse=True)
    for rule in rules:
        if rule.compare is not None:
            findings.extend(rule.compare(facts[rule.id], [(path, parts)]))
    return _unique_sorted(findings)


def _lint_file(
    data: bytes,
    display: str,
    parts: tuple[str, ...],
    rules: Sequence[Rule],
    facts: dict[str, list[object]],
    *,
    always_parse: bool = False,
) -> list[Finding]:
    text, where = data.lower(), display.lower()
    wanted = [rule for rule in rules if rule.needs(text, where)]
    if not wanted and not always_parse:
        return []
    parsed = parse_source(data, display, parts)
    if isinstance(parsed, SyntaxProblem):
        return [_syntax_error(display, parsed.line, parsed.col, parsed.message)]
    findings: list[Finding] = []
    try:
        for rule in wanted:
            for hit in rule.check(parsed):
                if not hit.is_suppressed(rule.id):
                    findings.append(_finding(hit, rule.id))
            if rule.summarise is not None:
                facts[rule.id].append(rule.summarise(parsed))
    except RecursionError:  # a tree deeper than the rules can walk: not checked, so not clean
        findings.append(_syntax_error(display, 1, 1, "cannot check: nested too deeply for the lint"))
    return findings


def _syntax_error(path: str, line: int, col: int, message: str) -> Finding:
    return Finding(path, line, col, SYNTAX_ERROR.id, f"{message}; {SYNTAX_ERROR.fix}", line, col + 1)


def _finding(hit: Hit, rule: str) -> Finding:
    line, col, end_line, end_col = span(hit.file, hit.node)
    return Finding(hit.file.path, line, col, rule, hit.message, end_line, end_col)


def _unique_sorted(findings: Iterable[Finding]) -> list[Finding]:
    unique: dict[tuple, Finding] = {}
    for finding in findings:
        unique.setdefault((finding.path, finding.line, finding.col, finding.rule), finding)
    return sorted(unique.values())


def _read(display: str) -> bytes:
    """The bytes of a regular file. Opened without blocking and checked before reading, so a FIFO swapped in
    after the walk is refused rather than waited on."""
    try:
        descriptor = os.open(display, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise LintUsageError(f"cannot read {display}: {error.strerror or error}") from error
    with open(descriptor, "rb", closefd=True) as handle:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise LintUsageError(_not_regular(display, info.st_mode))
        try:
            return handle.read()
        except OSError as error:
            raise LintUsageError(f"cannot read {display}: {error.strerror or error}") from error


def _not_regular(path: str, mode: int) -> str:
    kind = _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return f"{path}: refused, {kind} is not a Python file (give regular files and directories)"


def _excluded(display: str, excludes: tuple[str, ...]) -> bool:
    if not excludes:
        return False
    parts = [p for p in display.replace("\\", "/").split("/") if p not in ("", ".")]
    candidates = ["/".join(parts), display, *parts]
    return any(fnmatch.fnmatch(c, pattern) for pattern in excludes for c in candidates)


def _collect(paths: Iterable[str | os.PathLike], excludes: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
    """(path to report, path components for the side of a file) for every file to lint."""
    targets: list[tuple[str, tuple[str, ...]]] = []
    skipped = 0  # Python files left out by `excludes`
    for raw in paths:
        root = os.fspath(raw)
        try:
            mode = os.stat(root).st_mode
        except FileNotFoundError:
            raise LintUsageError(f"{root}: no such file or directory") from None
        except OSError as error:
            raise LintUsageError(f"cannot read {root}: {error.strerror or error}") from error
        # The components of the path as given (none of `.`, `..` or an absolute path's prefix) count for
        # the side of a file: `lint trainer/` makes `trainer` a directory of every file below it.
        given = () if os.path.isabs(root) else tuple(p for p in Path(root).parts if p not in (".", ".."))
        if stat.S_ISDIR(mode):
            found, left_out = _walk(root, given, excludes)
            if not found and not left_out:
                raise LintUsageError(f"{root}: no Python files (*.py) in this directory; check the path")
            targets.extend(found)
            skipped += left_out
        elif not stat.S_ISREG(mode):
            raise LintUsageError(_not_regular(root, mode))
        elif _excluded(root, excludes):
            skipped += 1
        else:
            targets.append((root, given or (os.path.basename(root),)))
    if not targets:
        raise LintUsageError(
            f"nothing to lint: --exclude leaves none of the {skipped} Python file{'s' * (skipped != 1)} under the "
            "given paths; check the patterns"
        )
    return targets


def _walk(
    root: str, given: tuple[str, ...], excludes: tuple[str, ...]
) -> tuple[list[tuple[str, tuple[str, ...]]], int]:
    """The `*.py` files under a directory (sorted; skipped directories not entered), and how many Python
    files `excludes` left out."""
    found: list[tuple[str, tuple[str, ...]]] = []
    left_out = 0
    for path, is_file in _entries(root, excludes):
        display = _display(root, path)
        if _excluded(display, excludes):
            left_out += 1
            continue
        if not is_file:
            try:
                mode = os.stat(path).st_mode
            except OSError as error:  # a dangling symlink
                raise LintUsageError(f"cannot read {display}: {error.strerror or error}") from error
            raise LintUsageError(_not_regular(display, mode))
        relative = os.path.relpath(path, root)
        found.append((display, (*given, *Path(relative).parts)))
    return found, left_out


def _entries(root: str, excludes: tuple[str, ...]) -> Iterator[tuple[str, bool]]:
    """(path, is a regular file) of each `*.py` entry below `root`, depth first in name order. Directory
    symlinks are not followed (no cycles); file symlinks are (their target is what is read)."""
    stack = [root]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as iterator:
                entries = sorted(iterator, key=lambda entry: entry.name)
        except OSError as error:
            raise LintUsageError(f"cannot read {directory}: {error.strerror or error}") from error
        subdirectories = []
        for entry in entries:
            if entry.is_symlink() and entry.is_dir():
                continue  # a symlinked directory: not followed
            if entry.is_dir(follow_symlinks=False):
                if not any(fnmatch.fnmatch(entry.name, skip) for skip in SKIPPED_DIRECTORIES) and not _excluded(
                    _display(root, entry.path), excludes
                ):
                    subdirectories.append(entry.path)
            elif entry.name.endswith(".py"):
                try:
                    yield entry.path, entry.is_file()
                except OSError as error:
                    raise LintUsageError(f"cannot read {entry.path}: {error.strerror or error}") from error
        stack.extend(reversed(subdirectories))


def _display(root: str, path: str) -> str:
    if root in (".", "./"):
        path = os.path.relpath(path, ".")
    return path.replace(os.sep, "/")
