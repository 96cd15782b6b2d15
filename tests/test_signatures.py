"""No function of ours takes more than eight parameters: settings travel as one frozen object (`CheckConfig`,
`TableSettings`, `SamplingSettings`, `BatchRequests`, `EngineSettings`, `CheckpointingSettings`), not as long
parameter lists. Checked on the AST of every module of the package and the scripts.

What counts: every named parameter, positional-only, positional or keyword-only. Not counted: a method's
``self`` / ``cls`` (the object it is called on is not something the caller lists), and ``*args`` /
``**kwargs``: a variadic forwards to one settings object or one function whose own fields or parameters are
documented and checked (``gate(..., **overrides)`` are `TableSettings` fields, a family's ``rollout(...,
**settings)`` are `family_rollout`'s, ``VllmOmniRollout(..., **engine_args)`` are `engine_kwargs`'), and that
function is held to this rule too.

The allow-list holds the signatures diffusers dictates: a scheduler's registered config and its ``step``,
which pipelines call by diffusers' names and positions."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("consistency", "adapters", "schedulers", "scripts")
LIMIT = 8

#: "path::Qualified.name" -> why its signature is not ours to shorten.
ALLOWED: dict[str, str] = {
    # diffusers builds schedulers from a saved config by keyword (`from_config`, `@register_to_config`): the
    # parameters are FlowMatchEulerDiscreteScheduler's config keys plus our two SDE defaults.
    "schedulers/flow_match_sde.py::FlowMatchSDEDiscreteScheduler.__init__": "diffusers' scheduler config",
    # A stock pipeline calls `scheduler.step(noise_pred, t, latents, ...)` with FlowMatchEulerDiscreteScheduler's
    # positional signature; the SDE settings are keyword-only additions after it.
    "schedulers/flow_match_sde.py::FlowMatchSDEDiscreteScheduler.step": "diffusers' step signature",
    # The one body behind `step` and `sample_previous_step`, taking `step`'s arguments as `step` receives them.
    "schedulers/flow_match_sde.py::FlowMatchSDEDiscreteScheduler._sde_step": "the body of diffusers' step",
}


def counted_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef, *, is_method: bool) -> list[str]:
    """The parameter names the rule counts (see the module docstring)."""
    arguments = function.args
    names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
    decorators = {getattr(d, "id", getattr(d, "attr", None)) for d in function.decorator_list}
    if is_method and names and "staticmethod" not in decorators and names[0] in ("self", "cls"):
        names = names[1:]
    return names


def long_signatures(source: str, path: str) -> Iterator[tuple[str, int, int]]:
    """("path::Qualified.name", line, counted parameters) of every function of `source` above the limit."""

    def visit(node: ast.AST, scope: list[str], in_class: bool) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from visit(child, [*scope, child.name], True)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count = len(counted_parameters(child, is_method=in_class))
                if count > LIMIT:
                    yield f"{path}::{'.'.join([*scope, child.name])}", child.lineno, count
                yield from visit(child, [*scope, child.name], False)
            else:
                yield from visit(child, scope, in_class)

    yield from visit(ast.parse(source), [], False)


def _ours() -> Iterator[tuple[str, str]]:
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_no_function_takes_more_than_eight_parameters() -> None:
    found = [(name, line, count) for path, source in _ours() for name, line, count in long_signatures(source, path)]
    too_long = [f"{name} (line {line}): {count} parameters" for name, line, count in found if name not in ALLOWED]
    assert too_long == [], "pass one frozen settings object instead:\n" + "\n".join(too_long)
    # Every exception still names a function that needs it: a stale entry would hide a new long signature.
    stale = sorted(set(ALLOWED) - {name for name, _, _ in found})
    assert stale == [], f"remove these entries, their functions are short now or gone: {stale}"


def test_the_rule_catches_what_it_is_for() -> None:
    """A planted nine-parameter function fails; eight, self and variadics do not count against the limit."""
    planted = (
        "def nine(a, b, c, d, e, f, g, h, i):\n    pass\n"
        "def eight(a, b, c, d, e, f, g, h, *args, **kwargs):\n    pass\n"
        "class C:\n"
        "    def method(self, a, b, c, d, e, f, g, h):\n        pass\n"
        "    def keywords(self, a, *, b, c, d, e, f, g, h, i):\n        pass\n"
        "    @staticmethod\n"
        "    def static(self, a, b, c, d, e, f, g, h):\n        pass\n"
        "def outer():\n"
        "    def inner(a, b, c, d, e, f, g, h, i, /):\n        pass\n"
    )
    assert sorted(long_signatures(planted, "x.py")) == [
        ("x.py::C.keywords", 8, 9),
        ("x.py::C.static", 11, 9),
        ("x.py::nine", 1, 9),
        ("x.py::outer.inner", 14, 9),
    ]
