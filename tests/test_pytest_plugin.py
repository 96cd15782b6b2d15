"""rollout_consistency.pytest_plugin (loaded through its pytest11 entry point): fixture, marker, report files."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET

import pytest

from rollout_consistency import run_step1_check

SMALL = "num_prompts=1, num_images_per_prompt=2, rollout_batch_size=2"


@pytest.fixture(scope="module", autouse=True)
def _import_the_checker_in_this_process():
    """In-process pytester runs drop the modules an inner session imported; re-importing torch then crashes.
    Running one check here first keeps torch, diffusers and the adapters imported for good."""
    run_step1_check(num_prompts=1, num_images_per_prompt=2, rollout_batch_size=2, progress=False)


GRPO_REPO_TESTS = f"""
import pytest

def test_rollout_matches_trainer(step1_check):
    report = step1_check({SMALL})
    assert report.passed

def test_a_broken_rollout_fails(step1_check):
    step1_check({SMALL}, inject="mask-sum-rope")

@pytest.mark.step1_check({SMALL}, sde_type="cps")
def test_marked(step1_report):
    assert step1_report.metrics.overall.max_abs_dlogp == 0
    assert step1_report.config["sde_type"] == "cps"

def test_report_fixture_without_marker(step1_report):
    pass
"""


def test_fixture_and_marker_gate_a_grpo_repo(pytester, tmp_path):
    pytester.makepyfile(test_grpo=GRPO_REPO_TESTS)
    reports = tmp_path / "reports"
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--step1-report-dir", str(reports))
    result.assert_outcomes(passed=2, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*needs @pytest.mark.step1_check*", "*rollout-consistency step-1 check FAILED*", "*FAIL because:*"]
    )
    written = sorted(p.name for p in reports.iterdir())
    assert len(written) == 6  # JSON + JUnit for each of the three checks that ran
    failing = next(p for p in reports.glob("*broken*.json"))
    assert json.loads(failing.read_text())["status"] == "FAIL"
    ET.parse(next(reports.glob("*broken*.xml")))


def test_base_settings_come_from_a_config_file(pytester):
    pytester.makefile(".toml", step1="num_prompts = 1\nnum_images_per_prompt = 2\nrollout_batch_size = 2\nseed = 9\n")
    pytester.makepyfile(
        test_cfg="""
def test_cfg(step1_check):
    report = step1_check()
    assert report.config["seed"] == 9 and report.metrics.num_samples == 2
"""
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--step1-config", "step1.toml")
    result.assert_outcomes(passed=1)


def test_plugin_import_is_light():
    import subprocess

    code = "import rollout_consistency.pytest_plugin, sys; print('torch' in sys.modules, 'diffusers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
