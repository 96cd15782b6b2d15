"""Shared fixtures. One Ray session per test session (starting Ray costs ~5 s and ~650 MB)."""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run and machine: a red CI is reproducible, never luck.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")

# `pytester` runs inner pytest sessions (tests of the pytest plugin, tests/test_pytest_plugin.py).
pytest_plugins = ("pytester",)

# The lint's fixtures are user code to be linted, never run: some are a project's own tests (test_*.py), which the
# lint must see as test modules, not program roots.
collect_ignore = ["lint_fixtures"]


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray cluster (2 CPUs, no dashboard), started on first use and shut down at the end.

    Code under test that calls `rollout_consistency.gate.sides.distributed.run_sharded` reuses it (it never starts a second
    one while `ray.is_initialized()`). Ray's files live in a short temp dir: its socket paths must stay under
    the 107-character limit, which pytest's own tmp paths can exceed.
    """
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'rollout-consistency[ray]')")
    temp_dir = tempfile.mkdtemp(prefix="rc-ray-")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=temp_dir,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


# vLLM-omni's runtime modules bind their platform at import: the CPU platform shims must be in place before any
# test imports them (tests/test_vllm_omni_cpu.py). Only where vLLM and vLLM-omni are installed and there is no
# GPU: on a CUDA machine vLLM-omni's own CUDA platform serves the GPU tests.
if all(importlib.util.find_spec(name) is not None for name in ("vllm", "vllm_omni")) and not torch.cuda.is_available():
    import vllm_cpu_shims  # noqa: F401  (installs the CPU platform on import)
