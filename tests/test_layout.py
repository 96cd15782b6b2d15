"""The layout's rules, checked: one top-level package in the wheel, every package listed and with a documented
face, and the import rules between our modules (no bare folder names, no private names across packages,
adapters never import the checker, schedulers import nothing of ours, no import circles, arrows only down the
layers, only the command line imports the commands). See docs/design.md for why each rule exists."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
TOP = "rollout_consistency"
# folder -> the package it installs as (pyproject's [tool.setuptools.package-dir]).
MAPPED = {"consistency": TOP, "adapters": f"{TOP}.adapters", "schedulers": f"{TOP}.schedulers"}
SCANNED = ("consistency", "adapters", "schedulers", "scripts", "tests")
BARE = {"adapters", "consistency", "schedulers"}
# The gate and the training tools; the adapters must work without them (and without their config).
CHECKER = (f"{TOP}.gate", f"{TOP}.training", f"{TOP}.cli", f"{TOP}.pytest_plugin")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_folders() -> dict[str, Path]:
    """Installed package name -> folder, for every folder under the mapped ones that holds an __init__.py."""
    found = {}
    for folder, package in MAPPED.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            parts = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" not in parts:
                found[".".join((package, *parts))] = init.parent
    return found


def _module_name(path: Path) -> tuple[str, str]:
    """(module name, package it belongs to) of a scanned file; scripts/tests are not packages of ours."""
    rel = path.relative_to(ROOT)
    folder = rel.parts[0]
    if folder not in MAPPED:
        return ".".join(rel.with_suffix("").parts), folder
    parts = [MAPPED[folder], *rel.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    package = ".".join(parts) if path.name == "__init__.py" else ".".join(parts[:-1])
    return ".".join(parts), package


def _scanned_files() -> Iterator[Path]:
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).parts
            # lint_fixtures are deliberately bad user code, the lint's test input, not ours to import from.
            if "__pycache__" in rel or rel[:2] == ("tests", "lint_fixtures"):
                continue
            yield path


def _imports(source: str, package: str) -> Iterator[tuple[int, str, str | None]]:
    """(line, absolute module, imported name or None) for every import statement of a module of `package`, and
    for every private attribute read from a module of ours bound by an import (`nan_capture._helper`)."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> module of ours it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    modules[alias.asname] = alias.name
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            for alias in node.names:
                if _is_module(f"{module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{module}.{alias.name}"
                yield node.lineno, module, alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and _private(node.attr)
        ):
            yield node.lineno, modules[node.value.id], node.attr


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _violations(rule) -> list[str]:
    found = []
    for path in _scanned_files():
        for line, module, name in _imports(path.read_text(), _module_name(path)[1]):
            why = rule(path, module, name)
            if why:
                found.append(f"{path.relative_to(ROOT)}:{line}: {why}")
    return found


# ----------------------------------------------------------------------------------------------------
# The wheel and the package list


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    assert listed == set(_package_folders()), (
        "[tool.setuptools] packages must list exactly the folders with __init__.py"
    )
    assert _pyproject()["tool"]["setuptools"]["package-dir"] == {
        TOP: "consistency",
        f"{TOP}.adapters": "adapters",
        f"{TOP}.schedulers": "schedulers",
    }


@pytest.mark.slow
def test_wheel_has_one_top_level_package_holding_every_package(tmp_path: Path) -> None:
    # Built from a copy, so the repository gets no build/ or egg-info of this test's making.
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in MAPPED:
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", "dist", "."]
    result = subprocess.run(command, cwd=source, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = (source / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()

    top = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert top == {TOP}
    packages = {name.rsplit("/", 1)[0].replace("/", ".") for name in names if name.endswith("/__init__.py")}
    assert packages == set(_package_folders())
    for package in (TOP, f"{TOP}.adapters", f"{TOP}.schedulers"):
        assert f"{package.replace('.', '/')}/py.typed" in names, package
    # The console script and the pytest plugin point into the one namespace.
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/entry_points.txt")))
    assert b"rollout-consistency = rollout_consistency.cli:main" in entry_points
    assert b"rollout_consistency = rollout_consistency.pytest_plugin" in entry_points


def test_every_package_has_a_documented_public_face() -> None:
    """Each package's __init__ has a docstring and an `__all__` whose every name it serves."""
    import importlib

    faceless = []
    for package, folder in sorted(_package_folders().items()):
        tree = ast.parse((folder / "__init__.py").read_text())
        if ast.get_docstring(tree) is None or "__all__" not in {
            t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
        }:
            faceless.append(f"{package}: no docstring or no __all__")
            continue
        module = importlib.import_module(package)
        faceless += [f"{package}.{name} is not served" for name in module.__all__ if not hasattr(module, name)]
    assert faceless == []


# ----------------------------------------------------------------------------------------------------
# Imports


def test_no_bare_folder_imports() -> None:
    """`python -m pytest` puts the repository root on sys.path: a bare `import adapters` would load a second copy."""

    def rule(path: Path, module: str, name: str | None) -> str | None:
        return f"bare import of {module!r}" if module.split(".")[0] in BARE else None

    assert _violations(rule) == []


def _source(module: str) -> Path | None:
    """The file a `rollout_consistency...` module name maps to (a package's __init__.py), if it exists."""
    parts = module.split(".")
    for depth in range(len(parts), 0, -1):
        for folder, package in MAPPED.items():
            if ".".join(parts[:depth]) == package:
                base = ROOT / folder / Path(*parts[depth:])
                for candidate in (base / "__init__.py", base.with_suffix(".py")):
                    if candidate.is_file():
                        return candidate
                return None
    return None


def _is_package(module: str) -> bool:
    source = _source(module)
    return source is not None and source.name == "__init__.py"


def _is_module(module: str) -> bool:
    return _source(module) is not None


def _cross_package_private(path: Path, module: str, name: str | None) -> str | None:
    """A private name belongs to the package that holds it: `pkg._mod`, `pkg.mod._x` and `pkg._x` to `pkg`."""
    if module.split(".")[0] != TOP:
        return None
    _, package = _module_name(path)
    parts = module.split(".")
    for depth, part in enumerate(parts):
        if _private(part) and package != ".".join(parts[:depth]):
            return f"imports private module {module!r}"
    if name is not None and _private(name):
        owner = module if _is_package(module) else module.rsplit(".", 1)[0]
        if package != owner:
            return f"imports private name {name!r} from {module!r}"
    return None


def test_no_module_imports_another_packages_private_names() -> None:
    assert _violations(_cross_package_private) == []


def test_adapters_never_import_the_checker() -> None:
    def rule(path: Path, module: str, name: str | None) -> str | None:
        if path.relative_to(ROOT).parts[0] != "adapters":
            return None
        if module == TOP and name not in ("adapters", "schedulers"):
            return f"imports {name!r} from the root package (the checker's API)"
        if module.startswith(CHECKER) and (module in CHECKER or module.startswith(tuple(f"{c}." for c in CHECKER))):
            return f"imports the checker ({module})"
        return None

    assert _violations(rule) == []


def test_adapters_never_name_the_checkers_config() -> None:
    """The checker translates its config into adapters-level arguments, never the other way round."""
    named = []
    for path in sorted((ROOT / "adapters").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            identifier = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "name", None)
            if identifier in ("CheckConfig", "from_check_config"):
                named.append(f"{path.relative_to(ROOT)}:{node.lineno}: {identifier}")
    assert named == []


def test_production_adapters_never_import_the_tiny_models() -> None:
    """The tiny offline models are for tests and the checker's default; production code never needs them."""

    def rule(path: Path, module: str, name: str | None) -> str | None:
        rel = path.relative_to(ROOT).parts
        if rel[0] != "adapters" or rel[1] == "tiny" or rel[-1].startswith("tiny"):
            return None
        if module.split(".")[:2] != [TOP, "adapters"]:
            return None
        imported = f"{module}.{name}" if name and _is_module(f"{module}.{name}") else module
        tiny = any(part.startswith("tiny") for part in imported.split(".")[2:])
        return f"imports {imported}" if tiny else None

    assert _violations(rule) == []


def test_schedulers_import_nothing_of_ours() -> None:
    def rule(path: Path, module: str, name: str | None) -> str | None:
        if path.relative_to(ROOT).parts[0] != "schedulers":
            return None
        ours = module.split(".")[0] == TOP and not (module + ".").startswith(f"{TOP}.schedulers.")
        return f"imports {module}" if ours else None

    assert _violations(rule) == []


def test_the_rules_catch_what_they_are_for() -> None:
    """The scanner itself: relative imports resolve to the right package, private names are told apart."""
    backends = ROOT / "consistency" / "gate" / "sides" / "backends.py"
    assert _module_name(backends) == (f"{TOP}.gate.sides.backends", f"{TOP}.gate.sides")
    assert _module_name(ROOT / "consistency" / "gate" / "__init__.py") == (f"{TOP}.gate", f"{TOP}.gate")
    assert _cross_package_private(backends, f"{TOP}.gate.sides.plan", "_private_helper") is None  # same package
    script = ROOT / "scripts" / "bench_step1.py"
    assert _cross_package_private(script, f"{TOP}.gate.config", "_private_helper")
    assert _cross_package_private(script, f"{TOP}.training._hidden", "x")
    assert _cross_package_private(script, f"{TOP}.gate.config", "__all__") is None
    source = "from rollout_consistency.training import nan_capture as nc\nfrom .config import x\nnc._helper()\n"
    assert sorted(_imports(source, f"{TOP}.gate"), key=str) == [
        (1, f"{TOP}.training", "nan_capture"),
        (2, f"{TOP}.gate.config", "x"),
        (3, f"{TOP}.training.nan_capture", "_helper"),
    ]


# ----------------------------------------------------------------------------------------------------
# The import graph: no circles, and arrows only down the layers

#: Our modules in layers, lowest first (dotted prefixes under `rollout_consistency`, the longest prefix wins; ""
#: is the root package). A module imports only from its own layer or a lower one; within a layer, only without
#: a circle. docs/design.md ("The packages") says what each layer holds.
LAYERS: tuple[tuple[str, ...], ...] = (
    # Import nothing of ours but each other: the scheduler math, the facts every layer reads (`base`: the registry,
    # the built-in families, the sampling rules), what protects the user's process and files (`safeguards`: the
    # fence around user code, its supervisor, input and output paths, memory left, ...); `base.lazy_face` serves
    # every package face.
    ("schedulers", "base", "safeguards"),
    ("adapters",),
    ("training", "lint"),
    ("gate.judging",),  # figures, limits, verdict, report: never the settings, the sides or the doctor
    # the settings: the check's `CheckConfig`, the sides' own (`SidesSettings`), and the rollout plug-in's request,
    # which carries the `CheckConfig` to user code past the sides
    (
        "gate.config",
        "gate.bounds",
        "gate.safe_yaml",
        "gate.backend_registry",
        "gate.sides.settings",
        "gate.plugin_request",
    ),
    ("gate.sides",),  # running the rollout and the trainer
    ("gate.diagnosis",),  # the doctor and the localisation
    ("gate.tables",),  # users' own tables: gate(), dumps, the recorder
    ("gate.monitor",),  # the run monitor: every training step's figures, verdict and alarms
    # run_step1_check, step 2 (weight_sync_check), what both judge by, the false-alarm sweep, the gate's face; the
    # plug-in template
    ("gate", "plugin_template"),
    ("commands",),  # one module per sub-command
    ("cli", "pytest_plugin", "safeguards.supervised_call", "__main__", ""),
)


def _import_graph() -> dict[str, set[str]]:
    """Module of ours -> the modules of ours it imports, from the AST of every package file. Every import
    counts, at module level or inside a function (a lazy import is an arrow too); `from pkg import mod` is an
    arrow to `pkg.mod`, `from pkg import name` to `pkg`."""
    graph: dict[str, set[str]] = {}
    for folder in MAPPED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            module, package = _module_name(path)
            arrows = graph.setdefault(module, set())
            for _, imported, name in _imports(path.read_text(), package):
                if imported.split(".")[0] != TOP:
                    continue
                target = f"{imported}.{name}" if name and _is_module(f"{imported}.{name}") else imported
                if target != module:
                    arrows.add(target)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as ``[a, b, ..., a]``, or None (depth-first, in sorted order)."""
    finished: set[str] = set()

    def visit(path: list[str]) -> list[str] | None:
        for target in sorted(graph.get(path[-1], ())):
            if target in path:
                return [*path[path.index(target) :], target]
            if target not in finished:
                found = visit([*path, target])
                if found:
                    return found
        finished.add(path[-1])
        return None

    for module in sorted(graph):
        found = None if module in finished else visit([module])
        if found:
            return found
    return None


def _layer(module: str) -> int | None:
    rel = module[len(TOP) + 1 :] if module != TOP else ""
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = rel == prefix or (prefix and rel.startswith(prefix + "."))
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def test_no_import_circles() -> None:
    cycle = _find_cycle(_import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_every_module_sits_in_a_layer() -> None:
    assert [m for m in sorted(_import_graph()) if _layer(m) is None] == [], "add the module to LAYERS"


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, targets in sorted(_import_graph().items())
        for target in sorted(targets)
        if _layer(module) is not None and _layer(target) is not None and _layer(target) > _layer(module)
    ]
    assert upward == [], "\n".join(upward)


def test_only_the_command_line_imports_the_commands() -> None:
    """The sub-commands are registered in one table (rollout_consistency.cli); no other module of ours reaches
    into them."""

    def rule(path: Path, module: str, name: str | None) -> str | None:
        rel = path.relative_to(ROOT).parts
        if rel[0] != "consistency" or rel[1] in ("cli.py", "commands"):
            return None
        target = f"{module}.{name}" if name else module
        return f"imports {target}" if (target + ".").startswith(f"{TOP}.commands.") else None

    assert _violations(rule) == []


def test_the_graph_rules_catch_what_they_are_for() -> None:
    """The circle finder and the layers on planted graphs: a circle through a lazy import, an upward arrow."""
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    lazy = "def f():\n    from .backends import run_batch\n"
    assert list(_imports(lazy, f"{TOP}.gate.sides")) == [(2, f"{TOP}.gate.sides.backends", "run_batch")]
    assert _layer(f"{TOP}.gate.judging.metrics") < _layer(f"{TOP}.gate.config") < _layer(f"{TOP}.gate.sides.plan")
    assert _layer(f"{TOP}.gate.check") == _layer(f"{TOP}.gate") > _layer(f"{TOP}.gate.tables.api")
    assert _layer(f"{TOP}.cli") == _layer(TOP) > _layer(f"{TOP}.commands.check")
    assert _layer(f"{TOP}.nothing_here") is None


def test_every_dotted_name_of_ours_in_code_and_docs_resolves() -> None:
    """Every dotted name of ours in code, comments and docs names a module or attribute that exists (no stale
    names after a module moves). The changelog is history and keeps the names of its time."""
    import importlib
    import re

    pattern = re.compile(rf"\b{TOP}(?:\.[A-Za-z_]\w*)+")
    texts = [*_scanned_files(), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    stale = set()
    for path in texts:
        for dotted in set(pattern.findall(path.read_text())):
            parts = dotted.split(".")
            if parts[1] == "step1":  # the JUnit suite's name (rollout_consistency.step1.<check>), not a module
                continue
            depth = next(d for d in range(len(parts), 0, -1) if _is_module(".".join(parts[:d])))
            try:
                target = importlib.import_module(".".join(parts[:depth]))
            except ImportError:  # an optional dependency (vllm-omni) is absent: the module file exists, enough
                continue
            for name in parts[depth:]:
                if not hasattr(target, name):
                    stale.add(f"{path.relative_to(ROOT)}: {dotted}")
                    break
                target = getattr(target, name)
    assert sorted(stale) == [], "\n".join(sorted(stale))


# ----------------------------------------------------------------------------------------------------
# Settings handed downward are typed: below the check, no layer takes "the config" as `Any`

#: The layers below the check that receive settings from it; each reads its own typed settings object
#: (judging: `JudgingSettings`, sides: `SidesSettings`, diagnosis: `DiagnosisSettings`), never an untyped one that
#: hides an upward arrow.
TYPED_SETTINGS_PACKAGES = ("gate/judging", "gate/sides", "gate/diagnosis", "gate/bounds.py")


def _untyped_settings(source: str) -> list[tuple[int, str]]:
    """(line, parameter) of every function parameter named like settings (``config``, ``settings``,
    ``*_config``, ``*_settings``; not ``**settings`` keywords) that is unannotated or annotated ``Any``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        arguments = node.args
        for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
            named = arg.arg in ("config", "settings") or arg.arg.endswith(("_config", "_settings"))
            annotation = arg.annotation
            untyped = annotation is None or (
                ast.unparse(annotation).strip("'\"") in ("Any", "typing.Any", "Any | None", "object")
            )
            if named and untyped:
                found.append((arg.lineno, f"{node.name}({arg.arg})"))
    return found


def test_settings_below_the_check_are_typed() -> None:
    found = []
    for target in TYPED_SETTINGS_PACKAGES:
        root = ROOT / "consistency" / target
        for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            found += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in _untyped_settings(path.read_text())]
    assert found == [], "type these with the layer's own settings object:\n" + "\n".join(found)


def test_the_typed_settings_rule_catches_an_any_config() -> None:
    planted = (
        "def exact_notice(config: Any) -> str: ...\n"
        "def floor(settings, kernel: str) -> None: ...\n"
        "def ok(settings: JudgingSettings, **options: Any) -> None: ...\n"
        "def also_ok(pipeline_settings: 'PipelineSettings') -> None: ...\n"
    )
    assert _untyped_settings(planted) == [(1, "exact_notice(config)"), (2, "floor(settings)")]


# ----------------------------------------------------------------------------------------------------
# The sides never see the check's `CheckConfig`: they read `SidesSettings`, and user code gets its `CheckConfig`
# through the binding the check made (`SidesSettings.user_code`)


def _check_config_in_code(source: str) -> list[tuple[int, str]]:
    """(line, what) of every place `source`'s code names ``CheckConfig`` (an import, a name, an attribute, an
    annotation, quoted or not) or takes a parameter called ``config`` (the name a `CheckConfig`, or an `Any`
    standing in for it, goes by); docstrings and other strings are prose, not code."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and any(a.name == "CheckConfig" for a in node.names):
            found.append((node.lineno, "imports CheckConfig"))
        elif isinstance(node, ast.Name) and node.id == "CheckConfig":
            found.append((node.lineno, "names CheckConfig"))
        elif isinstance(node, ast.Attribute) and node.attr == "CheckConfig":
            found.append((node.lineno, "reads .CheckConfig"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            annotations = [a.annotation for a in every] + [node.returns]
            if any(a is not None and "CheckConfig" in ast.unparse(a) for a in annotations):
                found.append((node.lineno, f"{node.name}: CheckConfig in an annotation"))
            found += [(a.lineno, f"{node.name}(config)") for a in every if a.arg == "config"]
        elif isinstance(node, ast.AnnAssign) and "CheckConfig" in ast.unparse(node.annotation):
            found.append((node.lineno, "CheckConfig in an annotation"))
    return found


def test_the_sides_never_see_the_check_config() -> None:
    root = ROOT / "consistency" / "gate" / "sides"
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in sorted(root.rglob("*.py"))
        for line, what in _check_config_in_code(path.read_text())
    ]
    assert found == [], "the sides read SidesSettings (CheckConfig.sides):\n" + "\n".join(found)


def test_the_sides_rule_catches_a_check_config() -> None:
    planted = (
        "from rollout_consistency.gate.config import CheckConfig\n"
        "def make_plan(settings: 'CheckConfig') -> None: ...\n"
        "def start(config) -> None: ...\n"
        "def ok(settings: SidesSettings) -> None:\n"
        '    """Receives what the CheckConfig resolves."""\n'
        "    config_free = settings.execution\n"
        "request_config: CheckConfig | None = None\n"
    )
    assert _check_config_in_code(planted) == [
        (1, "imports CheckConfig"),
        (2, "make_plan: CheckConfig in an annotation"),
        (3, "start(config)"),
        (7, "CheckConfig in an annotation"),
        (7, "names CheckConfig"),
    ]
