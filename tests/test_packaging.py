"""The command line as a process (`--version`, a reader that closes the pipe early) and the built distributions.

`python -m build` makes a wheel and an sdist; each installs into a fresh venv (no dependencies downloaded:
the running environment's site-packages are appended to the fresh venv's path, after its own, so the
installed copy — not this checkout — is what runs) and passes a smoke check.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
#: The packages a user imports from, the gate's subpackages and the commands among them.
PACKAGES = (
    "rollout_consistency.gate",
    "rollout_consistency.gate.judging",
    "rollout_consistency.gate.sides",
    "rollout_consistency.gate.diagnosis",
    "rollout_consistency.gate.tables",
    "rollout_consistency.commands",
    "rollout_consistency.adapters.vllm_omni",
    "rollout_consistency.training",
    "rollout_consistency.lint",
)
SMALL_CHECK = ["check", "--num-inference-steps", "3", "--sde-window-size", "1", "--rollout-batch-size", "2"]


def _env(buffered: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    if buffered:
        env.pop("PYTHONUNBUFFERED", None)  # a block-buffered stdout is what a shell pipe gives
    return env


def test_version_flag():
    out = subprocess.run(
        [BIN / "rollout-consistency", "--version"], capture_output=True, text=True, check=True, env=_env()
    )
    assert out.stdout.strip() == f"rollout-consistency {metadata.version('rollout-consistency')}"


@pytest.mark.parametrize("args", [["--help"], ["check", "--help"], ["--version"]], ids=" ".join)
@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_reader_closing_the_pipe_gives_no_traceback(args, buffered):
    """`rollout-consistency check --help | head`: the reader is gone before the first write."""
    process = subprocess.Popen(
        [BIN / "rollout-consistency", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(buffered)
    )
    process.stdout.close()
    stderr = process.stderr.read().decode()
    process.stderr.close()
    assert process.wait() in (0, 141)
    assert "BrokenPipeError" not in stderr and "Traceback" not in stderr, stderr


def _fresh_venv(path: Path) -> Path:
    """A venv without pip whose path ends with this environment's site-packages (no download, no editable
    finder: a plain path entry does not run the .pth files it holds)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "_parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.mark.slow
def test_wheel_and_sdist_install_into_a_fresh_venv_and_run(tmp_path):
    pytest.importorskip("build")
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    )
    if tracked.returncode != 0:
        pytest.skip("not a git checkout: the build copies the files git tracks or would")
    source = tmp_path / "src"
    for name in tracked.stdout.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, source],
        check=True,
        capture_output=True,
    )
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(dist.iterdir())

    for kind, artifact in (("wheel", wheels[0]), ("sdist", sdists[0])):
        python = _fresh_venv(tmp_path / f"venv-{kind}")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                python,
                "install",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                artifact,
            ],
            check=True,
            capture_output=True,
        )
        script = python.parent / "rollout-consistency"
        where = subprocess.run(
            [python, "-c", "import rollout_consistency.schedulers as s; print(s.__file__)"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert str(tmp_path / f"venv-{kind}") in where, where  # the installed copy, not this checkout
        # Every subpackage is in the distribution (a package missing from pyproject's list is absent here).
        installed = subprocess.run(
            [
                python,
                "-c",
                "import importlib, sys; print(*(importlib.import_module(n).__file__ for n in sys.argv[1:]))",
                *PACKAGES,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert len(installed) == len(PACKAGES), installed
        assert all(str(tmp_path / f"venv-{kind}") in path for path in installed), installed
        version = subprocess.run([script, "--version"], capture_output=True, text=True, check=True, env=_env())
        assert version.stdout.strip() == f"rollout-consistency {metadata.version('rollout-consistency')}"
        if kind == "wheel":  # the check itself once: the sdist installs the same files
            check = subprocess.run(
                [script, *SMALL_CHECK], capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=300
            )
            assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
            assert "PASS" in check.stdout


def _requirement(name: str, extra: str | None = None) -> Requirement:
    for text in metadata.requires("rollout-consistency"):
        requirement = Requirement(text)
        in_extra = requirement.marker is not None and requirement.marker.evaluate({"extra": extra or ""})
        if requirement.name == name and (in_extra if extra else requirement.marker is None):
            return requirement
    raise AssertionError(f"{name} is not declared{f' in the {extra} extra' if extra else ''}")


@pytest.mark.parametrize(
    "name,extra,admitted,refused",
    [
        # torch: a trainer's newer torch resolves (`pip install --dry-run`, docs/ci.md); a next major does not.
        ("torch", None, ["2.13.0", "2.14.1", "2.15.0"], ["2.12.1", "3.0.0"]),
        # diffusers: 0.38 and older fail the adapters' tests (run in a second venv, docs/ci.md); 0.43 is unreleased.
        ("diffusers", None, ["0.39.0", "0.40.0", "0.42.1"], ["0.38.0", "0.43.0"]),
        ("ray", "ray", ["2.55.0", "2.60.0"], ["2.54.1", "2.61.0"]),
    ],
)
def test_dependency_bounds_are_the_tested_ones(name, extra, admitted, refused):
    specifier = _requirement(name, extra).specifier
    assert [v for v in admitted if not specifier.contains(v)] == []
    assert [v for v in refused if specifier.contains(v)] == []


def test_installed_environment_satisfies_every_declared_range():
    """What `make` installed (the environment every test here ran in) is inside the declared ranges."""
    outside = []
    for text in metadata.requires("rollout-consistency"):
        requirement = Requirement(text)
        extra = next(
            (e for e in ("ray", "dev") if requirement.marker and requirement.marker.evaluate({"extra": e})), None
        )
        if requirement.marker is not None and extra is None:
            continue  # an extra `make` does not install
        installed = metadata.version(requirement.name)
        if not requirement.specifier.contains(installed, prereleases=True):
            outside.append(f"{requirement} (installed {installed})")
    assert outside == []


def test_every_module_level_import_of_the_package_is_a_declared_requirement():
    """A third-party module imported when a module of the package loads is a core requirement; optional ones
    (ray, vllm, peft, transformers, lightning) are imported inside the functions that need them. pytest loads
    the plug-in modules itself."""
    declared = {Requirement(r).name.lower() for r in metadata.requires("rollout-consistency") if "extra ==" not in r}
    providers = metadata.packages_distributions()
    imported = set()
    for folder in ("consistency", "adapters", "schedulers"):
        for path in (ROOT / folder).rglob("*.py"):
            if path in (
                ROOT / "adapters" / "vllm_omni" / "pipeline.py",
                ROOT / "adapters" / "vllm_omni" / "wan_pipeline.py",
            ):
                continue  # the engine worker's classes: only vLLM-omni imports them (the vllm extra)
            for node in ast.parse(path.read_text()).body:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                imported |= {name.split(".")[0] for name in names}
    third_party = imported - set(sys.stdlib_module_names) - {"rollout_consistency", "__future__", "pytest"}
    assert [m for m in third_party if m not in providers] == [], "imported at module level, but installed by nobody"
    required = {providers[module][0].lower() for module in third_party}
    assert required <= declared, sorted(required - declared)
