# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""One parsed Python file: its tree, parent links, import aliases and suppression comments.

Suppression: a comment `# rollout-consistency: ignore[rule-id]` (several ids: `ignore[a, b]`; anything
after the `]` is free text, the reason) silences those rules for the statement it stands on — any line of
a simple statement, or the header of a compound one. A suppression comment alone on its line applies to
the next line of code.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Mapping
from dataclasses import dataclass, field

from .astutil import children, own_nodes

__all__ = ["SUPPRESSION_PATTERN", "SourceFile", "SyntaxProblem", "parse_source"]

#: a suppression comment (the syntax is in the module docstring); group 1 holds the rule ids
SUPPRESSION_PATTERN = re.compile(r"#\s*rollout-consistency:\s*ignore\[([^\]]*)\]")

_NON_CODE_TOKENS = frozenset(
    {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
)


@dataclass(frozen=True, eq=False)
class SourceFile:
    """A parsed file.

    Attributes:
        path: the path as reported (relative to where the lint was pointed, as given).
        parts: the path components the one-sided-flag rule reads the side from: the linted path as given
            (when relative; none of `.`/`..`), the directories below it, then the file name.
        lines: the source text, one entry per line (no line ends).
        tree: the module.
        statements: every statement of `tree`, nested bodies included, in source order.
        functions: every function definition among `statements`.
        aliases: local name -> the dotted name it was imported as (`np` -> `numpy`, `randint` ->
            `random.randint`, `dist` -> `torch.distributed`).
        suppressions: line -> rule ids silenced on that line.

    `nodes` (every node but contexts and operators) and `parents` are built on first use, once for all the
    rules: most files a rule parses need neither.
    """

    path: str
    parts: tuple[str, ...]
    lines: tuple[str, ...]
    tree: ast.Module
    statements: tuple[ast.stmt, ...] = field(repr=False)
    functions: tuple[ast.FunctionDef | ast.AsyncFunctionDef, ...] = field(repr=False)
    aliases: Mapping[str, str] = field(repr=False)
    suppressions: Mapping[int, frozenset[str]] = field(repr=False)
    _own_nodes: dict[int, tuple[ast.AST, ...]] = field(default_factory=dict, repr=False)
    _index: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def nodes(self) -> tuple[ast.AST, ...]:
        """Every node of `tree` but contexts and operators, depth first."""
        if "nodes" not in self._index:
            self._index["nodes"], self._index["parents"] = _index(self.tree)
        return self._index["nodes"]  # type: ignore[return-value]

    @property
    def parents(self) -> Mapping[ast.AST, ast.AST]:
        """Child node -> parent node, for every node of `nodes`."""
        if "parents" not in self._index:
            self._index["nodes"], self._index["parents"] = _index(self.tree)
        return self._index["parents"]  # type: ignore[return-value]

    def text_of(self, node: ast.AST) -> str:
        """The source lines `node` spans, joined (for cheap word tests before walking a scope)."""
        return "\n".join(self.lines[node.lineno - 1 : (getattr(node, "end_lineno", None) or node.lineno)])

    def own_nodes(self, stmt: ast.stmt) -> tuple[ast.AST, ...]:
        """`astutil.own_nodes(stmt)`, computed once per statement for all the rules."""
        nodes = self._own_nodes.get(id(stmt))
        if nodes is None:
            nodes = self._own_nodes[id(stmt)] = tuple(own_nodes(stmt))
        return nodes

    def char_col(self, line: int, byte_offset: int) -> int:
        """The 0-based character column of an AST (UTF-8 byte) offset on 1-based `line`."""
        if not 1 <= line <= len(self.lines):
            return byte_offset
        return len(self.lines[line - 1].encode("utf-8")[:byte_offset].decode("utf-8", errors="replace"))

    def statement_of(self, node: ast.AST) -> ast.stmt | None:
        """The innermost statement containing `node` (itself if it is one)."""
        while node is not None and not isinstance(node, ast.stmt):
            node = self.parents.get(node)
        return node

    def suppression_lines(self, node: ast.AST) -> range:
        """Lines whose suppression comments cover `node`: its statement (a compound statement's header)."""
        first = getattr(node, "lineno", 1)
        last = getattr(node, "end_lineno", None) or first
        stmt = self.statement_of(node)
        if stmt is not None:
            body = getattr(stmt, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):  # compound: its header
                stmt_last = max(stmt.lineno, body[0].lineno - 1)
            else:
                stmt_last = stmt.end_lineno or stmt.lineno
            first, last = min(first, stmt.lineno), max(last, stmt_last)
        return range(first, last + 1)

    def is_suppressed(self, node: ast.AST, rule: str) -> bool:
        return any(rule in self.suppressions.get(line, ()) for line in self.suppression_lines(node))


@dataclass(frozen=True)
class SyntaxProblem:
    """A file that does not parse (reported as a `syntax-error` finding)."""

    path: str
    line: int
    col: int
    message: str


def parse_source(data: bytes, path: str, parts: tuple[str, ...] = ()) -> SourceFile | SyntaxProblem:
    """Parse Python source bytes (PEP 263 encoding cookies honoured)."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        text = data.decode(encoding)
        tree = ast.parse(text, filename=path)
    except SyntaxError as error:
        return SyntaxProblem(path, error.lineno or 1, error.offset or 1, f"cannot parse: {error.msg}")
    except (UnicodeDecodeError, LookupError, ValueError) as error:  # bad encoding, NUL bytes
        return SyntaxProblem(path, 1, 1, f"cannot parse: {error}")
    except (RecursionError, MemoryError):  # CPython's parser gives up on very deep nesting this way
        return SyntaxProblem(path, 1, 1, "cannot parse: nested too deeply for Python's parser")
    statements = _all_statements(tree)
    return SourceFile(
        path=path,
        parts=parts or (path.replace("\\", "/").rsplit("/", 1)[-1],),
        lines=tuple(text.splitlines()),
        tree=tree,
        statements=tuple(statements),
        functions=tuple(s for s in statements if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))),
        aliases=_import_aliases(statements),
        suppressions=_suppressions(text),
    )


def _all_statements(tree: ast.Module) -> list[ast.stmt]:
    """Every statement of the module, nested bodies (functions, classes, loops, handlers) included."""
    found: list[ast.stmt] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.stmt):
            found.append(node)
        inner = [
            item for name in ("body", "orelse", "finalbody", "handlers", "cases") for item in getattr(node, name, ())
        ]
        stack.extend(reversed(inner))
    return found


def _index(tree: ast.Module) -> tuple[tuple[ast.AST, ...], dict[ast.AST, ast.AST]]:
    """Every node (depth first, contexts and operators left out) and each one's parent, in one pass."""
    nodes: list[ast.AST] = []
    parents: dict[ast.AST, ast.AST] = {}
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        nodes.append(node)
        for child in children(node):
            parents[child] = node
            stack.append(child)
    return tuple(nodes), parents


def _import_aliases(statements: list[ast.stmt]) -> dict[str, str]:
    aliases: dict[str, str] = {}
    for node in statements:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _suppressions(text: str) -> dict[int, frozenset[str]]:
    """line -> rule ids; a comment alone on its line is moved to the next line of code."""
    found: dict[int, set[str]] = {}
    if SUPPRESSION_PATTERN.search(text) is None:  # most files: no tokenizing
        return {}
    pending: list[set[str]] = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT:
                match = SUPPRESSION_PATTERN.search(token.string)
                if match is None:
                    continue
                ids = {part.strip() for part in match.group(1).split(",") if part.strip()}
                if token.line[: token.start[1]].strip():  # trailing comment: this line
                    found.setdefault(token.start[0], set()).update(ids)
                else:  # alone on its line: the next line of code
                    pending.append(ids)
            elif token.type not in _NON_CODE_TOKENS and pending:
                for ids in pending:
                    found.setdefault(token.start[0], set()).update(ids)
                pending.clear()
    except (tokenize.TokenError, SyntaxError):  # the file parsed, so this is not expected; lint without them
        pass
    return {line: frozenset(ids) for line, ids in found.items()}
