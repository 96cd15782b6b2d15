"""The lint's tree walks (`rollout_consistency.lint.astutil`) against the standard library's definitions.

`children`, `own_nodes` and `nodes_in_order` are hand-rolled for speed (the lint walks every node of every file
it parses); each must give what `ast.iter_child_nodes` gives, contexts and operators left out, in the same order,
on every statement of real code (the repository's own source, a few thousand statements of every kind).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rollout_consistency.lint.astutil import children, nodes_in_order, own_nodes

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for folder in ("consistency", "adapters", "schedulers") for p in (ROOT / folder).rglob("*.py"))
TOKENS = (ast.expr_context, ast.boolop, ast.operator, ast.unaryop, ast.cmpop)
NESTED = (ast.stmt, ast.ExceptHandler, ast.match_case)
# What the hand-rolled walks must also cover: every kind of field (a list, a single node, None, a constant),
# operators of each token family, nested scopes a statement's own nodes stop at.
EXTRA = """
x = -a + b * c if not d and e or f < g <= h else [i for i in j if i is not k]
del x[1:2], y.z
lambda q: q ** 2
match m:
    case [1, *rest] if rest: pass
    case {"k": v, **kw}: pass
try:
    pass
except (A, B) as err:
    raise C from err
finally:
    pass
async def f(a, /, b=1, *c, d: int = 2, **e) -> None:
    async with g() as h, i():
        await j
    async for k in l:
        yield k
@deco(1)
class K(Base, metaclass=M):
    t: "T" = f"{u!r:>{w}}"
global_name: int
"""


def _reference_children(node: ast.AST) -> list[ast.AST]:
    return [child for child in ast.iter_child_nodes(node) if not isinstance(child, TOKENS)]


def _reference_in_order(node: ast.AST) -> list[ast.AST]:
    found = [node]
    for child in _reference_children(node):
        if not isinstance(child, ast.Lambda):
            found.extend(_reference_in_order(child))
    return found


def _reference_own(stmt: ast.stmt) -> list[ast.AST]:
    # each child's own walk: a lambda that is a direct child is named, not entered, as `nodes_in_order` does
    found = [stmt]
    for child in _reference_children(stmt):
        if not isinstance(child, NESTED):
            found.extend(_reference_in_order(child))
    return found


def _trees() -> list[tuple[str, ast.AST]]:
    return [("extra", ast.parse(EXTRA))] + [(str(p.relative_to(ROOT)), ast.parse(p.read_text())) for p in SOURCES]


@pytest.fixture(scope="module")
def trees() -> list[tuple[str, ast.AST]]:
    return _trees()


def test_children_is_iter_child_nodes_without_tokens(trees):
    compared = 0
    for name, tree in trees:
        for node in ast.walk(tree):
            assert children(node) == _reference_children(node), (name, ast.dump(node)[:200])
            compared += 1
    assert compared > 50_000  # the walk looked at the whole source, not an empty list


def test_nodes_in_order_and_own_nodes_are_the_recursive_definitions(trees):
    statements = 0
    for name, tree in trees:
        assert list(nodes_in_order(tree)) == _reference_in_order(tree), name
        for node in ast.walk(tree):
            if isinstance(node, ast.stmt):
                assert list(own_nodes(node)) == _reference_own(node), (name, node.lineno)
                statements += 1
    assert statements > 5_000
