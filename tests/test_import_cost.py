"""What an import costs: the root package is lazy (importing `rollout_consistency.safeguards.fence` or the lint loads a few
modules of ours and no numpy), every public name of the root still imports, and an import inside a function of a
module of ours is there for a reason (it defers torch, diffusers, numpy or an optional extra, or it is listed
below with its own)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = "rollout_consistency"
MAPPED = {"consistency": TOP, "adapters": f"{TOP}.adapters", "schedulers": f"{TOP}.schedulers"}


def _loaded_by(module: str) -> dict:
    """In a fresh interpreter: the modules of ours that `import module` loads, and whether numpy / torch came."""
    code = (
        f"import sys, json, {module}\n"
        f"ours = sorted(m for m in sys.modules if m == {TOP!r} or m.startswith({TOP + '.'!r}))\n"
        "print(json.dumps({'ours': ours, 'numpy': 'numpy' in sys.modules, 'torch': 'torch' in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


# Measured when the root became lazy (before: the fence 55 modules of ours and numpy, the lint 72 and numpy;
# after: 2 and 18, no numpy), and when the gate's faces (gate, gate.tables, gate.monitor) became lazy (before: the
# gate 59 and numpy, the pytest plugin 62 and numpy; after: 3 and 8, no numpy). Since the root's and the safeguards'
# faces are `base.lazy_face`'s, each loads the gate's face, `base` and `lazy_face` too (the root 4, the fence 7). The bound
# leaves room for a helper module or two, not for the gate.
@pytest.mark.parametrize(
    ("module", "most"),
    [
        (f"{TOP}.safeguards.fence", 7),
        (f"{TOP}.lint", 24),
        (TOP, 4),
        (f"{TOP}.gate", 4),
        (f"{TOP}.pytest_plugin", 9),  # pytest loads it in every session where we are installed
    ],
)
def test_light_modules_load_little_of_ours_and_no_numpy(module: str, most: int) -> None:
    loaded = _loaded_by(module)
    assert len(loaded["ours"]) <= most, f"import {module} loaded {len(loaded['ours'])} modules: {loaded['ours']}"
    assert not loaded["numpy"] and not loaded["torch"], f"import {module} loaded numpy or torch"


_RUN_COMMAND = """
import contextlib, io, json, sys
from rollout_consistency.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    code = main(sys.argv[1:])
ours = sorted(m for m in sys.modules if m == "rollout_consistency" or m.startswith("rollout_consistency."))
print(json.dumps({"code": code, "ours": ours, "numpy": "numpy" in sys.modules, "torch": "torch" in sys.modules}))
"""

#: Modules of `rollout_consistency.commands` every command may load: the table's and the shared helpers.
_SHARED_COMMAND_MODULES = {"", "command", "usage", "report_outputs", "factories", "verdict_flags"}


# Measured when the command line became lazy (each command's module imported when it runs; before, every command
# and numpy came at start: 86 modules of ours for any `--help`): `--help` 15 and no numpy, `lint --help` 36,
# `plugin-template` 19 (and no torch: the template file is read, not imported), `precision --help` and
# `checkpointing --help` 18 (torch waits for `run`), `check --help` 37, `watch --help` 50, `gate --help` 53,
# `doctor --help` 45 (the settings and the tolerance profiles load numpy: the metrics' registry lives in a numpy
# module). The bound leaves room for a helper module or two, not for another command or the gate's sides.
_COMMAND_COSTS = [
    (["--help"], 17, False, set()),
    (["--version"], 17, False, set()),
    (["lint", "--help"], 38, False, {"lint"}),
    (["plugin-template", "--help"], 21, False, {"plugin_template"}),
    (["plugin-template", "--family", "wan"], 21, False, {"plugin_template"}),
    (["check", "--help"], 40, True, {"check"}),
    (["watch", "--help"], 53, True, {"watch"}),
    (["gate", "--help"], 55, True, {"gate"}),
    (["doctor", "--help"], 48, True, {"doctor"}),
    (["precision", "--help"], 20, False, {"precision"}),
    (["recompute", "--help"], 20, False, {"checkpointing"}),
]


@pytest.mark.parametrize(
    ("argv", "most", "numpy", "commands"), _COMMAND_COSTS, ids=[" ".join(c[0]) for c in _COMMAND_COSTS]
)
def test_a_command_loads_what_it_runs(argv: list[str], most: int, numpy: bool, commands: set[str]) -> None:
    """In a fresh interpreter, ``main(argv)``: the modules of ours it loaded (at most `most`), numpy only where
    promised, never torch, the gate's sides or the check, and no command module but the one it runs (and the
    helpers the commands share)."""
    out = subprocess.run([sys.executable, "-c", _RUN_COMMAND, *argv], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout)
    assert loaded["code"] == 0
    ours = loaded["ours"]
    assert len(ours) <= most, f"{argv} loaded {len(ours)} modules of ours: {ours}"
    assert not loaded["torch"], f"{argv} loaded torch"
    if not numpy:
        assert not loaded["numpy"], f"{argv} loaded numpy"
    assert not [m for m in ours if m.startswith((f"{TOP}.gate.sides", f"{TOP}.gate.check"))], ours
    prefix = f"{TOP}.commands"
    ran = {m[len(prefix) + 1 :] for m in ours if m == prefix or m.startswith(prefix + ".")}
    assert ran - _SHARED_COMMAND_MODULES == commands, f"{argv} loaded the commands {sorted(ran)}"


def test_a_command_parser_completed_on_first_use_parses_again() -> None:
    """A command's parser gets its arguments the first time the command line names it, once: the same parser
    parses that command again (and an alias of it), with every flag."""
    from rollout_consistency import cli

    parser = cli.build_parser()
    assert parser.parse_args(["gate", "a.safetensors"]).dump == "a.safetensors"
    again = parser.parse_args(["gate", "b.safetensors", "--profile", "kernel"])
    assert (again.dump, again.profile, again.run.__module__) == ("b.safetensors", "kernel", f"{TOP}.commands.gate")
    assert (
        parser.parse_args(["checkpointing", "m:f"]).seed == parser.parse_args(["recompute", "m:f", "--seed", "0"]).seed
    )


def test_lint_and_watch_run_without_torch(tmp_path: Path) -> None:
    """Running them, not only their help: `lint FILE` loads no numpy and no torch, `watch RUN` of a TensorBoard run no
    torch (it judges with numpy)."""
    from torch.utils.tensorboard import SummaryWriter

    source = tmp_path / "trainer.py"
    source.write_text("import torch\n\nlatents = torch.randn(2, 4)\n")
    writer = SummaryWriter(log_dir=str(tmp_path / "run"))
    for step in range(3):
        writer.add_scalar("rollout_corr/logprob_abs_diff_max", 1e-6, global_step=step)
    writer.close()
    for argv, numpy in ((["lint", str(source)], False), (["watch", str(tmp_path / "run")], True)):
        out = subprocess.run([sys.executable, "-c", _RUN_COMMAND, *argv], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        loaded = json.loads(out.stdout)
        assert loaded["code"] in (0, 1), argv  # judged, whatever the verdict
        assert not loaded["torch"], f"{argv} loaded torch"
        assert numpy or not loaded["numpy"], f"{argv} loaded numpy"


def test_every_public_name_of_the_root_still_imports() -> None:
    import rollout_consistency

    for name in rollout_consistency.__all__:
        assert getattr(rollout_consistency, name) is not None, name
    from rollout_consistency import CheckConfig, GateReport, NanCapture, run_step1_check  # a 0.1.0 name each

    assert CheckConfig().model_family and callable(run_step1_check) and GateReport and NanCapture
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        getattr(rollout_consistency, "nothing_here")  # noqa: B009 (a name the docs-resolve test must not read)


_FACE_CHECK = """
import importlib, sys
face = importlib.import_module(sys.argv[1])
module = getattr(face, sys.argv[2])  # its modules read as attributes, as when the face loaded them all
assert module is importlib.import_module(f"{face.__name__}.{sys.argv[2]}")
for name in face.__all__:
    exec(f"from {face.__name__} import {name}")
    assert getattr(face, name) is not None and name in dir(face), name
try:
    face.nothing_here
except AttributeError:
    pass
else:
    raise SystemExit("an unknown name was served")
"""


@pytest.mark.parametrize(
    ("package", "module"),
    [
        (f"{TOP}.gate", "sides"),
        (f"{TOP}.gate.tables", "dump"),
        (f"{TOP}.gate.monitor", "judge"),
        (f"{TOP}.safeguards", "fence"),
    ],
)
def test_every_public_name_of_a_lazy_face_imports(package: str, module: str) -> None:
    """In a fresh interpreter (nothing loaded before): `from package import X` for every X of its `__all__`."""
    result = subprocess.run([sys.executable, "-c", _FACE_CHECK, package, module], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


# ----------------------------------------------------------------------------------------------------
# Imports inside functions


def _modules() -> dict[str, tuple[Path, str]]:
    """Module of ours -> (file, the package its relative imports start from)."""
    found = {}
    for folder, package in MAPPED.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
                found[".".join(parts)] = (path, ".".join(parts))
            else:
                found[".".join(parts)] = (path, ".".join(parts[:-1]))
    return found


def _loads(node: ast.Import | ast.ImportFrom, package: str, modules: dict) -> list[str]:
    """The modules an import statement loads: each named module, its parent packages, and `from pkg import mod`'s
    submodules."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join([*parts[: len(parts) - (node.level - 1)], *([node.module] if node.module else [])])
        names = [base, *(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules)]
    return [".".join(name.split(".")[: i + 1]) for name in names for i in range(name.count(".") + 1)]


def _scan(modules: dict) -> tuple[dict[str, set[str]], list[tuple[str, int, list[str]]]]:
    """(module -> what its module-level imports load, [(module, line, what an import inside a function loads)])."""
    top: dict[str, set[str]] = {}
    inner: list[tuple[str, int, list[str]]] = []
    for module, (path, package) in modules.items():
        top[module] = {".".join(module.split(".")[: i + 1]) for i in range(module.count("."))}  # its packages

        def visit(node: ast.AST, in_function: bool, module=module, package=package) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    loads = _loads(child, package, modules)
                    if in_function:
                        inner.append((module, child.lineno, loads))
                    elif not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
                        top[module].update(loads)
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)), module)

        visit(ast.parse(path.read_text()), False)
    return top, inner


def _closure(names: set[str], top: dict[str, set[str]]) -> set[str]:
    """Every module that importing `names` loads, through our modules' module-level imports."""
    seen, stack = set(), list(names)
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(top.get(name, ()))
    return seen


def _third_party(names: set[str], top: dict[str, set[str]]) -> set[str]:
    """The third-party distributions (numpy, torch, ...) that importing `names` loads, through our modules."""
    roots = {name.split(".")[0] for name in _closure(names, top)}
    return {r for r in roots if r != TOP and r not in sys.stdlib_module_names and r != "__future__"}


def unexplained_inner_imports(modules: dict) -> list[str]:
    """Imports of our modules inside functions that defer no third-party module the importer does not load
    already, would close no import circle at the top, and that `INNER_IMPORTS` does not list:
    `module:line -> target` each."""
    top, inner = _scan(modules)
    found = []
    for module, line, loads in inner:
        ours = [name for name in loads if name.split(".")[0] == TOP and name != TOP]
        if not ours or _third_party(set(ours), top) - _third_party({module}, top):
            continue  # nothing of ours, or it defers numpy/torch/an extra: the reason an import waits
        if module in _closure(set(ours), top):
            continue  # at the top it would close a circle (through a package's __init__ too): it must wait
        target = ours[-1]
        if (module, target) not in INNER_IMPORTS:
            found.append(f"{module}:{line} -> {target}")
    return found


def test_imports_inside_functions_have_a_reason() -> None:
    found = unexplained_inner_imports(_modules())
    assert found == [], (
        "imports of light modules of ours inside functions: move them to the top of the module, or list them in "
        "INNER_IMPORTS with the reason they wait:\n" + "\n".join(found)
    )


def test_every_listed_inner_import_still_exists() -> None:
    """A stale entry would let a new import in unexplained."""
    _, inner = _scan(_modules())
    present = {(module, name) for module, _, loads in inner for name in loads}
    assert [entry for entry in INNER_IMPORTS if entry not in present] == []


def test_the_inner_import_rule_catches_a_light_import() -> None:
    """Planted: a module whose function imports a light module of ours is refused; one that defers numpy is not."""
    modules = _modules()
    light = f"{TOP}.safeguards.paths"
    heavy = f"{TOP}.gate.judging.metrics"  # imports numpy
    planted = {**modules}
    path = ROOT / "consistency" / "safeguards" / "fence.py"
    assert _third_party({heavy}, _scan(modules)[0]) >= {"numpy"}
    source = path.read_text() + f"\n\ndef _planted():\n    import {light}\n    import {heavy}\n"
    tmp = Path(__file__).parent / "__pycache__" / "planted_fence.py"
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_text(source)
    try:
        planted[f"{TOP}.safeguards.fence"] = (tmp, TOP)
        found = unexplained_inner_imports(planted)
    finally:
        tmp.unlink()
    assert [f for f in found if f.startswith(f"{TOP}.safeguards.fence:")] == [
        f"{TOP}.safeguards.fence:{source.count(chr(10)) - 1} -> {light}"
    ]


_PLUGIN = (
    "pytest loads the plugin in every session where we are installed: the checker waits for a fixture's first call"
)
_CHECK_RUNS = "the check's machinery (the sides, their torch-side modules) loads when `check` runs, not at the command line's start"
_REPLAY_RUNS = "the sides load when a replay runs: the command line's start loads the doctor (for `doctor REPORT`), never the sides"
#: (module, the module of ours it imports inside a function) -> why that import waits.
INNER_IMPORTS: dict[tuple[str, str], str] = {
    ("rollout_consistency.pytest_plugin", "rollout_consistency.gate.config"): _PLUGIN,
    ("rollout_consistency.pytest_plugin", "rollout_consistency.gate.check"): _PLUGIN,
    ("rollout_consistency.pytest_plugin", "rollout_consistency.safeguards.supervised_call"): _PLUGIN,
    ("rollout_consistency.pytest_plugin", "rollout_consistency.gate.backend_registry"): _PLUGIN,
    ("rollout_consistency.gate.tables.pytest_fixtures", "rollout_consistency.gate.tables.api"): _PLUGIN,
    ("rollout_consistency.gate.tables.pytest_fixtures", "rollout_consistency.gate.tables.dump"): _PLUGIN,
    ("rollout_consistency.gate.monitor.pytest_fixtures", "rollout_consistency.gate.monitor"): _PLUGIN,
    (
        "rollout_consistency.plugin_template",
        "rollout_consistency.gate.sides.backends",
    ): "the template's load_pipeline is the part a user replaces with their own: its imports travel with it",
    ("rollout_consistency.commands.check", "rollout_consistency.gate.check"): _CHECK_RUNS,
    (
        "rollout_consistency.gate.diagnosis.settings",
        "rollout_consistency.gate.sides.backends",
    ): "the doctor's settings are built where the command line starts; the sides load only when a replay builds them",
    ("rollout_consistency.commands.check", "rollout_consistency.gate.sides.trajectory_checks"): _CHECK_RUNS,
    ("rollout_consistency.gate.diagnosis.replay", "rollout_consistency.gate.sides.plugins"): _REPLAY_RUNS,
    ("rollout_consistency.gate.diagnosis.replay", "rollout_consistency.gate.sides.backends"): _REPLAY_RUNS,
    ("rollout_consistency.gate.diagnosis.replay", "rollout_consistency.gate.sides.trainer"): _REPLAY_RUNS,
    ("rollout_consistency.gate.diagnosis.localise", "rollout_consistency.gate.sides.shared"): _REPLAY_RUNS,
}
