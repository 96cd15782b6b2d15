"""The command line as a process (`--version`, a reader that closes the pipe early) and the built distributions.

`python -m build` makes a wheel and an sdist; each installs into a fresh venv (no dependencies downloaded:
the running environment's site-packages are appended to the fresh venv's path, after its own, so the
installed copy — not this checkout — is what runs) and passes a smoke check.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
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
        version = subprocess.run([script, "--version"], capture_output=True, text=True, check=True, env=_env())
        assert version.stdout.strip() == f"rollout-consistency {metadata.version('rollout-consistency')}"
        if kind == "wheel":  # the check itself once: the sdist installs the same files
            check = subprocess.run(
                [script, *SMALL_CHECK], capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=300
            )
            assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
            assert "PASS" in check.stdout


def test_torch_requirement_is_a_range_admitting_newer_releases():
    """A trainer's newer torch resolves against the declared range (the resolve itself: `pip install --dry-run`)."""
    from packaging.requirements import Requirement

    torch_req = next(Requirement(r) for r in metadata.requires("rollout-consistency") if r.startswith("torch"))
    assert all(torch_req.specifier.contains(v) for v in ("2.13.0", "2.14.1", "2.15.0"))
    assert not torch_req.specifier.contains("2.12.1")
