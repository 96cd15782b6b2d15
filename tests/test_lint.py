"""The static lint (rollout_consistency.lint, `rollout-consistency lint`): fixtures, suppression, formats, CLI.

Fixtures live in tests/lint_fixtures/{positive,negative}/. Each top-level file or directory there is one lint
run (a directory is linted as a whole, so the cross-file rule sees both sides). A line that must be reported
ends with `# expect: <rule-id>[, <rule-id>]`; every other line must stay silent — the negative fixtures
(near misses) have no marker at all.
"""

from __future__ import annotations

import ast
import gc
import json
import os
import re
import shutil
import socket
import textwrap
from pathlib import Path

import pytest
import yaml

from rollout_consistency.cli import main
from rollout_consistency.lint import FORMATS, RULES, Finding, LintUsageError, lint_paths, lint_source, render
from rollout_consistency.lint.engine import FILES_PER_JOB
from rollout_consistency.lint.source import SUPPRESSION_PATTERN, parse_source

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "lint_fixtures"
# The whole repository but the fixtures, which hold the anti-patterns on purpose (`--exclude lint_fixtures`).
PROJECT_TREE = ["consistency", "adapters", "schedulers", "scripts", "tests"]
EXPECT = re.compile(r"# expect: ([a-z0-9-]+(?:, [a-z0-9-]+)*)$")


def _cases(kind: str) -> list[Path]:
    return sorted(p for p in (FIXTURES / kind).iterdir() if p.suffix == ".py" or p.is_dir())


def _expected(case: Path) -> set[tuple[Path, int, str]]:
    files = [case] if case.is_file() else sorted(case.rglob("*.py"))
    expected = set()
    for file in files:
        for number, line in enumerate(file.read_text().splitlines(), start=1):
            match = EXPECT.search(line)
            if match:
                expected.update((file, number, rule.strip()) for rule in match.group(1).split(","))
    return expected


def _found(findings: list[Finding]) -> set[tuple[Path, int, str]]:
    return {(Path(f.path), f.line, f.rule) for f in findings}


# ----------------------------------------------------------------------------------------------
# fixtures


@pytest.mark.parametrize("case", _cases("positive"), ids=lambda p: p.name)
def test_positive_fixture_reports_exactly_the_marked_lines(case):
    expected = _expected(case)
    assert expected, f"{case} has no `# expect:` marker"
    assert _found(lint_paths([case])) == expected


@pytest.mark.parametrize("case", _cases("negative"), ids=lambda p: p.name)
def test_negative_fixture_is_clean(case):
    assert not _expected(case)
    assert lint_paths([case]) == []


def test_all_negative_fixtures_together_are_clean():
    assert lint_paths([FIXTURES / "negative"]) == []


def test_every_rule_has_positives_and_near_misses():
    marked = {rule for case in _cases("positive") for _, _, rule in _expected(case)}
    assert marked == set(RULES)
    negative_names = {p.stem for p in _cases("negative")}
    for rule in RULES:
        stem = {"grad-scaler-with-bf16": "grad_scaler_with_bf16"}.get(rule, rule.replace("-", "_"))
        assert stem in negative_names, f"no near-miss fixture for {rule}"


def test_real_looking_snippets_hit_several_rules():
    for name in ("flow_grpo_like", "dance_grpo_like", "verl_omni_like"):
        rules = {f.rule for f in lint_paths([FIXTURES / "positive" / name])}
        assert len(rules) >= 2, (name, rules)


DEAD_COPY = FIXTURES / "negative" / "low_precision_latents" / "pref_grpo_unused_sd"


def test_a_sampler_no_running_program_reaches_is_no_finding_only_where_a_program_is_seen(tmp_path):
    """The dead DDPO copy beside Pref-GRPO's trainers is cleared because a script of its tree runs (and
    computes log-probs) and none reaches it; linted alone, its directory shows no program, and a sampler whose
    caller is not in sight is reported."""
    assert lint_paths([DEAD_COPY]) == []
    alone = lint_paths([DEAD_COPY / "fastvideo" / "models"])
    assert [(Path(f.path).name, f.line, f.rule) for f in alone] == [
        ("ddim_with_logprob.py", 37, "low-precision-latents")
    ]


@pytest.mark.parametrize(
    "reach",
    [
        "from fastvideo.models.stable_diffusion.pipeline_with_logprob import pipeline_with_logprob\n",
        "import importlib\nPIPELINE = importlib.import_module('fastvideo.models.stable_diffusion.pipeline_with_logprob')\n",
        "from fastvideo.models.stable_diffusion import pipeline_with_logprob\n",
    ],
    ids=["import", "import-by-string", "submodule-from-package"],
)
def test_a_sampler_a_running_script_reaches_is_reported(tmp_path, reach):
    """The same tree once the trainer reaches the copy — an import, a module path spelled in a string, a
    submodule taken from its package — reports it."""
    tree = tmp_path / "pref_grpo"
    for source in DEAD_COPY.rglob("*.py"):
        (tree / source.relative_to(DEAD_COPY)).parent.mkdir(parents=True, exist_ok=True)
        (tree / source.relative_to(DEAD_COPY)).write_bytes(source.read_bytes())
    trainer = tree / "fastvideo" / "train_flux.py"
    trainer.write_text(reach + trainer.read_text())
    found = lint_paths([tree])
    assert [(Path(f.path).name, f.line) for f in found] == [("ddim_with_logprob.py", 37)]


def test_a_tree_with_a_running_program_does_not_answer_for_a_tree_beside_it(tmp_path):
    """Linted side by side (one directory holding both), the whole Pref-GRPO-like tree says nothing about a part
    of another project beside it: its program's imports resolve from its own directory, so the DDPO package
    linted without its scripts keeps its findings."""
    shutil.copytree(DEAD_COPY, tmp_path / "pref_grpo")
    shutil.copytree(FIXTURES / "positive" / "ddpo_like" / "ddpo", tmp_path / "ddpo_lib" / "ddpo")
    found = lint_paths([tmp_path])
    assert sorted((Path(f.path).parent.name, f.line) for f in found) == [
        ("diffusers_patch", 45),
        ("diffusers_patch", 56),
    ]


def test_trees_side_by_side_under_names_no_import_can_spell_are_answered_each_on_its_own(tmp_path):
    """Trees fetched side by side as `owner+repo` directories (no import can name such a directory, so only a
    tree's own scripts can reach its files): each tree's dead copy is cleared, each live sampler reported."""
    shutil.copytree(FIXTURES / "positive" / "dance_grpo_sd_copies", tmp_path / "yaoliliu+DanceGRPO-kontext")
    shutil.copytree(DEAD_COPY, tmp_path / "CodeGoat24+Pref-GRPO")
    found = lint_paths([tmp_path])
    assert [Path(f.path).relative_to(tmp_path).parts[:2] for f in found] == [
        ("yaoliliu+DanceGRPO-kontext", "fastvideo")
    ]


REGISTRY = FIXTURES / "positive" / "verl_registry_rollout"
HYDRA = FIXTURES / "positive" / "hydra_target_sampler"
PLUGIN = FIXTURES / "positive" / "dynamic_plugin_sampler"
LEGACY = FIXTURES / "negative" / "low_precision_latents" / "registry_prefix_elsewhere"


def _copy_with(tmp_path, tree, relative, text):
    """A copy of the fixture `tree` with the file `relative` (below it) replaced by `text`."""
    copy = tmp_path / tree.name
    shutil.copytree(tree, copy)
    (copy / relative).parent.mkdir(parents=True, exist_ok=True)
    (copy / relative).write_text(textwrap.dedent(text))
    return copy


def _sampler_findings(tree):
    return [(Path(f.path).name, f.line) for f in lint_paths([tree], select=["low-precision-latents"])]


_LOAD = "import importlib\n\n\ndef get_rollout_class(name):\n    {body}\n    return module.Rollout\n"


@pytest.mark.parametrize(
    "body",
    [
        'module = importlib.import_module(f"myproj.rollout.{name}_rollout")',
        'module = importlib.import_module("myproj.rollout." + name + "_rollout")',
        'module = importlib.import_module("myproj.rollout.%s_rollout" % name)',
        'module = importlib.import_module("myproj.rollout.{}_rollout".format(name))',
        'module = __import__(f"myproj.rollout.{name}_rollout", fromlist=["Rollout"])',
        'module = importlib.import_module("." + name + "_rollout", package=__package__)',
        'module = importlib.import_module(f".{name}_rollout", "myproj.rollout")',
        'module = importlib.import_module("..rollout." + name + "_rollout", __package__)',
        'for package in ("myproj.rollout", "myproj.plugins"):\n        module = importlib.import_module(f"{package}.{name}_rollout")',
        "from hydra.utils import get_class\n\n    "
        'rollouts = {"naive": "myproj.rollout.naive_rollout.Rollout", "sde": "myproj.rollout.sde_rollout.Rollout"}\n'
        "    module = get_class(rollouts[name])",
    ],
    ids=[
        "f-string",
        "concatenation",
        "percent",
        "format",
        "dunder-import",
        "relative",
        "relative-constant",
        "relative-two-levels",
        "loop-over-constants",
        "registry-dict",
    ],
)
def test_a_sampler_a_registry_loads_by_a_built_name_is_reported(tmp_path, body):
    """verl's pattern: the rollout module is `myproj.rollout.<config name>_rollout`, loaded by a name built at
    run time; no file imports it. Each way of building a name with a constant head reaches every module under
    the head, so the sampler there keeps its finding (the lint at the round's start took it for a dead copy).
    A registry of class paths spelled in strings (loaded by a library: `hydra.utils.get_class`) reaches their
    modules."""
    tree = _copy_with(tmp_path, REGISTRY, "myproj/rollout/registry.py", _LOAD.format(body=body))
    assert _sampler_findings(tree) == [("sde_rollout.py", 28)]


@pytest.mark.parametrize(
    "body",
    [
        'module = importlib.import_module(f"myproj.reward.{name}")',
        'module = importlib.import_module("myproj.workers." + name)',
        'module = importlib.import_module("myproj.reward.%s" % name)',
        'module = importlib.import_module("myproj.reward.{}".format(name))',
        'module = __import__(f"myproj.reward.{name}", fromlist=["Reward"])',
        'module = importlib.import_module("..reward." + name, package=__package__)',
        'module = importlib.import_module(f".{name}", "myproj.reward")',
        'for package in ("myproj.reward", "myproj.workers"):\n        module = importlib.import_module(f"{package}.{name}")',
    ],
    ids=[
        "f-string",
        "concatenation",
        "percent",
        "format",
        "dunder-import",
        "relative",
        "relative-constant",
        "loop-over-constants",
    ],
)
def test_a_built_name_whose_head_misses_the_sampler_leaves_it_a_dead_copy(tmp_path, body):
    """The same registry loading from another package: the sampler's module is under none of the heads, and
    nothing else loads it: a dead copy, no finding."""
    tree = _copy_with(tmp_path, REGISTRY, "myproj/rollout/registry.py", _LOAD.format(body=body))
    assert _sampler_findings(tree) == []


@pytest.mark.parametrize(
    ("config", "text"),
    [
        ("configs/sampler/sde.yaml", "_target_: flowrl.samplers.sde_sampler.SDESampler\nnoise_level: 0.7\n"),
        ("configs/model.yaml", "model:\n  target: flowrl.samplers.sde_sampler.SDESampler\n  params: {}\n"),
        ("configs/run.json", '{"sampler": {"class_path": "flowrl.samplers.sde_sampler.SDESampler"}}\n'),
        ("pyproject.toml", '[project.scripts]\nsample = "flowrl.samplers.sde_sampler:main"\n'),
        ("setup.cfg", "[options.entry_points]\nconsole_scripts =\n    sample = flowrl.samplers.sde_sampler:main\n"),
        ("configs/entry.toml", '[scripts]\nsample = "sde_sampler:main"\n'),
        ("configs/model.yaml", "sampler:\n  target: sde_sampler.SDESampler\n"),
    ],
    ids=[
        "hydra-target",
        "ldm-target",
        "json-class-path",
        "pyproject-entry-point",
        "setup-cfg-entry-point",
        "top-level-entry-point",
        "top-level-module-class",
    ],
)
def test_a_sampler_a_config_file_names_is_reported(tmp_path, config, text):
    """Hydra's `hydra.utils.instantiate(cfg.sampler)` loads the class `_target_` names, from a library the lint
    does not see; a config file naming a module (`_target_`, `target:`, `class_path:`, an entry point) reaches
    it. Without that config, nothing reaches the sampler: a dead copy — nor with one that holds its name as a
    lone word, or its package only."""
    tree = tmp_path / HYDRA.name
    shutil.copytree(HYDRA, tree, ignore=shutil.ignore_patterns("*.yaml"))
    assert _sampler_findings(tree) == []
    (tree / "configs" / "near.yaml").write_text("sampler: sde_sampler\nsearch_path: flowrl.samplers\n")
    assert _sampler_findings(tree) == []
    (tree / config).parent.mkdir(parents=True, exist_ok=True)
    (tree / config).write_text(text)
    assert _sampler_findings(tree) == [("sde_sampler.py", 19)]
    assert _sampler_findings(HYDRA) == [("sde_sampler.py", 19)]


def test_a_load_no_text_bounds_leaves_no_dead_copy_in_its_repository_only(tmp_path):
    """`importlib.import_module(args.sampler)` in the trainer may load any module: the DDPO plugin keeps its
    finding. Beside it (`owner+repo` trees side by side), Pref-GRPO's dead copy stays dead: the load answers for
    its own repository only. The same load in a module no program runs (`tools/plugins.py` in the legacy tree)
    loads nothing: that tree's dead copy stays dead too."""
    assert _sampler_findings(PLUGIN) == [("ddim_sampler.py", 36)]
    shutil.copytree(PLUGIN, tmp_path / "someone+ddpo-plugins")
    shutil.copytree(DEAD_COPY, tmp_path / "CodeGoat24+Pref-GRPO")
    shutil.copytree(LEGACY, tmp_path / "someone+legacy")
    found = lint_paths([tmp_path], select=["low-precision-latents"])
    assert [Path(f.path).relative_to(tmp_path).parts[0] for f in found] == ["someone+ddpo-plugins"]
    assert _sampler_findings(LEGACY) == []
    assert _sampler_findings(LEGACY / "myproj" / "legacy") == [("ddim_with_logprob.py", 37)]


def test_a_load_no_text_bounds_in_a_running_module_reaches_a_legacy_copy(tmp_path):
    """The legacy tree once its trainer calls the plugin loader (`tools/plugins.py` now runs): its load may name
    `myproj.legacy.ddim_with_logprob`, so the copy is no longer called dead."""
    tree = tmp_path / LEGACY.name
    shutil.copytree(LEGACY, tree)
    workers = tree / "myproj" / "workers" / "fsdp_workers.py"
    workers.write_text("from myproj.tools.plugins import load_plugin\n" + workers.read_text())
    assert _sampler_findings(tree) == [("ddim_with_logprob.py", 37)]


def test_one_sided_rule_needs_the_other_side_in_the_linted_code():
    """A rollout worker linted alone (no trainer code in sight) cannot be called one-sided."""
    alone = FIXTURES / "positive" / "one_sided_precision_flag" / "vllm_rollout.py"
    assert lint_paths([alone], select=["one-sided-precision-flag"]) == []


def test_one_sided_rule_compares_values_through_a_shared_launcher(tmp_path):
    (tmp_path / "launcher.py").write_text(
        "import rollout\nimport torch\nimport trainer\n\ntorch.backends.cudnn.benchmark = False\n"
    )
    (tmp_path / "trainer.py").write_text("def train(model):\n    return model\n")
    (tmp_path / "rollout.py").write_text("import torch\ntorch.backends.cudnn.benchmark = True\n")
    findings = lint_paths([tmp_path])
    assert [(Path(f.path).name, f.line, f.rule) for f in findings] == [("rollout.py", 2, "one-sided-precision-flag")]
    assert "launcher.py:5" in findings[0].message
    # The same files, no import between the launcher and the rollout: two programs, nothing to compare.
    (tmp_path / "launcher.py").write_text("import torch\nimport trainer\n\ntorch.backends.cudnn.benchmark = False\n")
    assert lint_paths([tmp_path]) == []


def _python_files() -> list[Path]:
    """Every fixture and every file of the project: what the text tests below are checked on."""
    return sorted({*FIXTURES.rglob("*.py"), *(p for name in PROJECT_TREE for p in (ROOT / name).rglob("*.py"))})


def test_a_rule_never_skips_a_file_it_would_report_in():
    """`Rule.needs` (the text test that spares parsing) says yes wherever the rule finds something."""
    checked = 0
    for path in _python_files():
        data = path.read_bytes()
        parsed = parse_source(data, str(path), path.parts[-4:])
        for rule in RULES.values():
            facts = rule.summarise(parsed) if rule.summarise is not None else None
            # what a comparing rule keeps of the file: flag settings, or candidate findings
            found = list(rule.check(parsed)) or getattr(facts, "settings", ()) or getattr(facts, "candidates", ())
            if found:
                checked += 1
                assert rule.needs(data.lower(), str(path).lower()), (rule.id, path)
    assert checked >= 40


def test_the_garbage_collector_is_left_as_it_was():
    gc.enable()
    lint_paths([FIXTURES / "positive" / "flow_grpo_like"])
    assert gc.isenabled()
    gc.disable()
    try:
        lint_paths([FIXTURES / "positive" / "flow_grpo_like"])
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_worker_processes_find_the_same(tmp_path):
    """Over `FILES_PER_JOB` files per job the files are shared among worker processes; the findings do not
    change, nor their order."""
    sources = [p for p in FIXTURES.rglob("*.py") if p.parent.name != "one_sided_precision_flag"]
    for index in range(2 * FILES_PER_JOB + 10):
        source = sources[index % len(sources)]
        (tmp_path / f"{index:03d}_{source.name}").write_bytes(source.read_bytes())
    alone = lint_paths([tmp_path])
    assert len(alone) > 100
    assert lint_paths([tmp_path], jobs=2) == alone


# ----------------------------------------------------------------------------------------------
# the project's own tree


def test_project_tree_lints_clean():
    assert lint_paths([ROOT / name for name in PROJECT_TREE], exclude=["lint_fixtures"]) == []


def test_project_suppressions_name_their_rule_give_a_reason_and_are_needed():
    suppressions = []
    for name in PROJECT_TREE:
        for path in sorted((ROOT / name).rglob("*.py")):
            if FIXTURES in path.parents or path == Path(__file__):  # this file: examples in strings
                continue
            text = path.read_text()
            lines = text.splitlines()
            for number, line in enumerate(lines, start=1):
                match = SUPPRESSION_PATTERN.search(line)
                if not (match and line.lstrip().startswith("#")):  # the project's own stand on their own line
                    continue
                rules = set(match.group(1).replace(" ", "").split(","))
                assert rules <= set(RULES), (path, number)
                assert len(line[match.end() :].strip()) >= 10, f"{path}:{number}: give a reason"
                # Not stale: without the comment, the rule fires on the statement below it.
                unsuppressed = "\n".join([*lines[: number - 1], "#", *lines[number:]]) + "\n"
                fired = {(f.line, f.rule) for f in lint_source(unsuppressed, str(path), select=sorted(rules))}
                assert {(number + 1, rule) for rule in rules} <= fired, f"{path}:{number}: stale suppression"
                suppressions.extend((path.name, rule) for rule in sorted(rules))
    # The deliberate pitfall reproductions the rules see; a new one needs a look. (The bf16-latents and
    # mask-sum-rope reproductions in adapters/ are helpers that compute no log-prob and run in no rollout
    # engine, so the rules, which follow the data, have nothing to say there.)
    assert sorted(suppressions) == [
        ("pitfalls.py", "non-launcher-seed"),  # the per-request window (--inject per-request-window)
        ("test_scheduler.py", "low-precision-latents"),  # diffusers' stock bf16 step, re-scored
        ("toy_denoiser.py", "rng-unsafe-recompute"),
    ]


def test_lint_package_imports_only_itself_and_the_standard_library():
    """Self-contained (no torch, nothing of the checker), so the lint runs in any environment; the one
    exceptions are the stdlib-only `atomic_write` and `output_paths`, which check and write `--output` as every
    other command checks and writes its reports, and `registry`, the one `Registry` that holds the rules."""
    for path in sorted((ROOT / "consistency" / "lint").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and node.module
                not in (
                    "rollout_consistency.safeguards.atomic_write",
                    "rollout_consistency.safeguards.output_paths",
                    "rollout_consistency.base.registry",
                )
            ):
                assert node.module.split(".")[0] not in (
                    "rollout_consistency",
                    "consistency",
                    "adapters",
                    "schedulers",
                ), path
            if isinstance(node, ast.Import):
                assert all(
                    a.name.split(".")[0]
                    not in ("rollout_consistency", "consistency", "adapters", "schedulers", "torch")
                    for a in node.names
                )


# ----------------------------------------------------------------------------------------------
# suppression

BF16_STORE = """
def denoise(scheduler, transformer, latents, timesteps, dtype):
    stored, log_probs = [], []
    for t in timesteps:
        latents, log_prob = scheduler.step_with_logprob(transformer(latents), t, latents)
        log_probs.append(log_prob)
        stored.append(latents.to(dtype)){comment}
    return stored, log_probs
"""


def _lint(source: str, **kwargs) -> list[tuple[int, str]]:
    return [(f.line, f.rule) for f in lint_source(textwrap.dedent(source), **kwargs)]


def test_unsuppressed_baseline():
    assert _lint(BF16_STORE.format(comment="")) == [(7, "low-precision-latents")]


@pytest.mark.parametrize(
    "comment",
    [
        "  # rollout-consistency: ignore[low-precision-latents]",
        "  # rollout-consistency: ignore[low-precision-latents] reason: a reproduction",
        "  # rollout-consistency:ignore[mask-sum-rope, low-precision-latents]",
        "  # noqa  # rollout-consistency: ignore[low-precision-latents]",
    ],
)
def test_trailing_suppression(comment):
    assert _lint(BF16_STORE.format(comment=comment)) == []


@pytest.mark.parametrize(
    "comment",
    [
        "  # rollout-consistency: ignore[mask-sum-rope]",  # another rule
        "  # rollout-consistency: ignore",  # no rule named: not a suppression
        "  # rollout-consistency ignore[low-precision-latents]",  # malformed
    ],
)
def test_suppression_must_name_the_rule(comment):
    assert _lint(BF16_STORE.format(comment=comment)) == [(7, "low-precision-latents")]


def test_suppression_on_its_own_line_covers_the_next_line_of_code():
    source = """
    import random

    def draw():
        # rollout-consistency: ignore[non-launcher-seed] the reason, on a line of its own

        sde_window_start = random.randint(0, 8)
        sde_window_end = random.randint(0, 8)
        return sde_window_start, sde_window_end
    """
    assert _lint(source) == [(8, "non-launcher-seed")]


def test_a_seed_finding_is_silenced_where_the_rank_is_read_or_where_the_window_is_drawn():
    source = """
    import os

    def window(num_steps):
        local_rank = int(os.environ["LOCAL_RANK"]){at_read}
        sde_window_start = local_rank % num_steps{at_window}
        return sde_window_start
    """
    comment = "  # rollout-consistency: ignore[non-launcher-seed] a one-GPU demo"
    assert _lint(source.format(at_read="", at_window="")) == [(5, "non-launcher-seed")]  # where LOCAL_RANK is read
    assert _lint(source.format(at_read=comment, at_window="")) == []
    assert _lint(source.format(at_read="", at_window=comment)) == []


def test_suppression_on_any_line_of_a_multiline_statement():
    source = """
    def forward(transformer, prompt_embeds, prompt_embeds_mask):
        return transformer(
            encoder_hidden_states=prompt_embeds,
            txt_seq_lens=prompt_embeds_mask.sum(dim=1).tolist(),
        )  # rollout-consistency: ignore[mask-sum-rope] padded embeddings never reach this model
    """
    adapter = "vllm_omni_rollout_adapter.py"  # rollout-engine code, where the rule looks
    assert _lint(source, path=adapter) == []
    unsuppressed = source.replace("# rollout-consistency: ignore[mask-sum-rope]", "#")
    assert _lint(unsuppressed, path=adapter) == [(5, "mask-sum-rope")]


def test_suppression_text_inside_a_string_is_not_a_comment():
    source = BF16_STORE.format(comment='; note = "# rollout-consistency: ignore[low-precision-latents]"')
    assert _lint(source) == [(7, "low-precision-latents")]


# ----------------------------------------------------------------------------------------------
# selection, paths, errors


def test_select_and_ignore():
    case = FIXTURES / "positive" / "dance_grpo_like"
    every = {f.rule for f in lint_paths([case])}
    assert {f.rule for f in lint_paths([case], select=["clip-before-unscale"])} == {"clip-before-unscale"}
    assert {f.rule for f in lint_paths([case], ignore=["clip-before-unscale"])} == every - {"clip-before-unscale"}
    assert lint_paths([case], select=["clip-before-unscale"], ignore=["clip-before-unscale"]) == []


def test_unknown_rule_is_a_usage_error_with_a_suggestion():
    with pytest.raises(LintUsageError, match="did you mean mask-sum-rope"):
        lint_paths([FIXTURES], select=["mask-sum-rop"])


def test_missing_path_is_a_usage_error(tmp_path):
    with pytest.raises(LintUsageError, match="no such file"):
        lint_paths([tmp_path / "nope.py"])
    with pytest.raises(LintUsageError, match="no paths"):
        lint_paths([])


WINDOW_FROM_GLOBAL_RANDOM = "import random\nsde_window = random.randint(0, 9)\n"


def test_syntax_error_is_a_finding_and_the_run_goes_on(tmp_path):
    (tmp_path / "broken.py").write_text("log_prob = latents.to(dtype)\ndef f(:\n    pass\n")
    (tmp_path / "seeded.py").write_text(WINDOW_FROM_GLOBAL_RANDOM)
    findings = lint_paths([tmp_path], select=["low-precision-latents"])  # syntax-error is always on
    assert [(Path(f.path).name, f.rule, f.line) for f in findings] == [("broken.py", "syntax-error", 2)]
    assert {Path(f.path).name for f in lint_paths([tmp_path])} == {"broken.py", "seeded.py"}
    # A file in which no selected rule could fire is not parsed: the lint is not a syntax checker.
    (tmp_path / "broken.py").write_text("def f(:\n    pass\n")
    assert lint_paths([tmp_path], select=["low-precision-latents"]) == []


@pytest.mark.parametrize(
    "nested",
    [
        "x = " + "-" * 5_000 + "1",  # RecursionError in CPython's parser
        "x = " + "-" * 50_000 + "1",  # MemoryError ("parser stack overflow")
        "x = " + " + ".join(["rank"] * 3_000),  # a generated sum deeper than the parser goes
        "x = " + "(" * 300 + "1" + ")" * 300,  # SyntaxError: too many nested parentheses
    ],
    ids=["unary-5k", "unary-50k", "sum-3k", "parens-300"],
)
def test_a_file_nested_too_deeply_is_a_syntax_error_finding_and_the_run_goes_on(tmp_path, nested):
    (tmp_path / "generated.py").write_text(f"sde_window = 0\nlog_prob = latents.to(dtype)\n{nested}\n")
    (tmp_path / "seeded.py").write_text(WINDOW_FROM_GLOBAL_RANDOM)
    findings = lint_paths([tmp_path])
    assert [(Path(f.path).name, f.rule) for f in findings] == [
        ("generated.py", "syntax-error"),
        ("seeded.py", "non-launcher-seed"),
    ]


def test_a_file_too_deep_for_the_rules_is_a_syntax_error_finding_and_the_run_goes_on(tmp_path):
    """A 990-factor product parses, but unwrapping it to find a mask's sum would exhaust the recursion limit:
    the file is reported as not checked (never a crash, never clean), the other files are linted."""
    product = " * ".join(["1"] * 990)
    (tmp_path / "vllm_rollout.py").write_text(f"txt_seq_lens = mask.sum(dim=1) * {product}\n")
    (tmp_path / "seeded.py").write_text(WINDOW_FROM_GLOBAL_RANDOM)
    findings = lint_paths([tmp_path])
    assert [(Path(f.path).name, f.rule) for f in findings] == [
        ("seeded.py", "non-launcher-seed"),
        ("vllm_rollout.py", "syntax-error"),
    ]
    assert findings[1].message.startswith("cannot check: nested too deeply for the lint")


def test_a_deep_but_parseable_expression_is_checked(tmp_path):
    """Parsed fine, walked without recursion: no rule gives up on a 900-term sum (the parser stops near 1000)."""
    source = "import random\nsde_window = " + " + ".join(["1"] * 900) + " + random.randint(0, 9)\n"
    (tmp_path / "generated.py").write_text(source)
    assert [f.rule for f in lint_paths([tmp_path])] == ["non-launcher-seed"]


def test_directories_walk_python_files_only_and_skip_caches_and_excludes(tmp_path):
    for relative in ("a.py", "notes.txt", "__pycache__/c.py", ".venv/d.py", "gen/e_pb2.py", "sub/f.py", "g.py"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(WINDOW_FROM_GLOBAL_RANDOM if relative != "g.py" else "x = 1\n")
    names = {Path(f.path).relative_to(tmp_path).as_posix() for f in lint_paths([tmp_path], exclude=["*_pb2.py"])}
    assert names == {"a.py", "sub/f.py"}
    assert lint_paths([tmp_path], exclude=["sub", "a.py", "gen"]) == []  # g.py is left, and clean
    # A file named explicitly is linted whatever its suffix.
    assert len(lint_paths([tmp_path / "notes.txt"])) == 1


# ----------------------------------------------------------------------------------------------
# fail closed: a wrong path never reads as clean, a special file is never opened


def test_a_directory_without_python_files_is_a_usage_error(tmp_path):
    with pytest.raises(LintUsageError, match=r"no Python files \(\*\.py\) in this directory; check the path"):
        lint_paths([tmp_path])
    (tmp_path / "README.md").write_text("# not Python\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.rst").write_text("title\n")
    with pytest.raises(LintUsageError, match="no Python files"):
        lint_paths([tmp_path])


def test_excluding_everything_is_a_usage_error(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    with pytest.raises(LintUsageError, match="--exclude leaves none of the 2 Python files"):
        lint_paths([tmp_path], exclude=["*.py"])
    with pytest.raises(LintUsageError, match="--exclude leaves none of the 1 Python file "):
        lint_paths([tmp_path / "a.py"], exclude=["a.py"])


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _socket(path: Path) -> Path:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.close()  # the socket file stays
    return path


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("make,kind", [(_fifo, "a FIFO"), (_socket, "a socket")], ids=["fifo", "socket"])
def test_special_files_are_refused_not_read(tmp_path, make, kind):
    special = make(tmp_path / "pipe.py")  # opening a FIFO for reading would block forever
    with pytest.raises(LintUsageError, match=f"pipe.py: refused, {kind} is not a Python file"):
        lint_paths([special])
    (tmp_path / "ok.py").write_text("x = 1\n")
    with pytest.raises(LintUsageError, match=f"pipe.py: refused, {kind}"):
        lint_paths([tmp_path])  # found by walking the directory


@pytest.mark.skipif(not Path("/dev/null").exists(), reason="no /dev/null")
def test_a_device_file_is_refused():
    with pytest.raises(LintUsageError, match="/dev/null: refused, a character device is not a Python file"):
        lint_paths(["/dev/null"])


def test_a_dangling_symlink_is_a_usage_error(tmp_path):
    (tmp_path / "gone.py").symlink_to(tmp_path / "missing.py")
    with pytest.raises(LintUsageError, match=r"cannot read .*gone\.py"):
        lint_paths([tmp_path])


def test_columns_count_characters_not_bytes():
    source = 'import random\nlabel = "é"; sde_window = random.randint(0, 9)\n'
    (finding,) = lint_source(source)
    assert (finding.line, finding.col) == (2, 27)
    assert finding.end_col == 47  # exclusive, as SARIF's endColumn


# ----------------------------------------------------------------------------------------------
# output formats


@pytest.fixture(scope="module")
def verl_findings():
    return lint_paths([FIXTURES / "positive" / "verl_omni_like"])


def test_text_format(verl_findings):
    lines = render(verl_findings, "text").splitlines()
    assert len(lines) == len(verl_findings) == 6
    for line, finding in zip(lines, verl_findings, strict=True):
        assert line == f"{finding.path}:{finding.line}:{finding.col} {finding.rule} {finding.message}"
        assert re.match(r"^\S+:\d+:\d+ [a-z0-9-]+ \S", line)
    assert render([], "text") == ""


def test_github_annotations(verl_findings):
    lines = render(verl_findings, "github").splitlines()
    assert len(lines) == 6
    finding = verl_findings[0]
    head, message = lines[0].split("::", 2)[1:]
    assert head.startswith(f"error file={finding.path},line={finding.line},col={finding.col},")
    assert f"title=rollout-consistency {finding.rule}" in head
    assert message == f"{finding.rule}: {finding.message}".replace("%", "%25")


def test_github_escapes_properties_and_data():
    finding = Finding("a,b:c.py", 1, 2, "mask-sum-rope", "100% wrong\nsecond line", 1, 3)
    line = render([finding], "github")
    assert line.startswith("::error file=a%2Cb%3Ac.py,line=1,col=2,endLine=1,endColumn=3,")
    assert line.endswith("::mask-sum-rope: 100%25 wrong%0Asecond line\n")


def test_sarif_is_structurally_valid(verl_findings):
    log = json.loads(render(verl_findings, "sarif"))
    assert log["version"] == "2.1.0"
    assert log["$schema"].endswith("sarif-2.1.0.json")
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "rollout-consistency lint"
    ids = [rule["id"] for rule in driver["rules"]]
    assert ids == [*RULES, "syntax-error"]
    for rule in driver["rules"]:
        assert set(rule) >= {"id", "shortDescription", "fullDescription", "help", "defaultConfiguration"}
        assert rule["shortDescription"]["text"] and rule["help"]["text"].startswith("Fix: ")
        assert rule["defaultConfiguration"]["level"] in ("none", "note", "warning", "error")
    assert len(run["results"]) == len(verl_findings)
    for result, finding in zip(run["results"], verl_findings, strict=True):
        assert result["ruleId"] == finding.rule
        assert ids[result["ruleIndex"]] == finding.rule
        assert result["level"] in ("none", "note", "warning", "error")
        assert result["message"]["text"] == finding.message
        (location,) = result["locations"]
        physical = location["physicalLocation"]
        artifact = physical["artifactLocation"]
        assert artifact["uri"] == Path(finding.path).as_uri()  # absolute paths become file:// URIs
        region = physical["region"]
        assert all(isinstance(region[k], int) and region[k] >= 1 for k in region)
        assert (region["startLine"], region["startColumn"]) == (finding.line, finding.col)
        assert (region["endLine"], region["endColumn"]) >= (region["startLine"], region["startColumn"])


def test_sarif_relative_paths_use_the_source_root():
    log = json.loads(render([Finding("./src/a.py", 3, 1, "mask-sum-rope", "m", 3, 9)], "sarif"))
    artifact = log["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]
    assert artifact == {"uri": "src/a.py", "uriBaseId": "%SRCROOT%"}
    assert json.loads(render([], "sarif"))["runs"][0]["results"] == []


def test_unknown_format():
    with pytest.raises(ValueError, match="unknown format"):
        render([], "xml")
    assert FORMATS == ("text", "github", "sarif")


# ----------------------------------------------------------------------------------------------
# command line


def test_cli_exit_codes(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    clean = "tests/lint_fixtures/negative"
    dirty = "tests/lint_fixtures/positive/clip_before_unscale.py"
    assert main(["lint", clean]) == 0
    assert main(["lint", dirty]) == 1
    out = capsys.readouterr()
    assert out.out.startswith(f"{dirty}:14:5 clip-before-unscale ")
    assert "2 findings in 1 file" in out.err
    assert main(["lint", dirty, "--ignore", "clip-before-unscale"]) == 0
    assert main(["lint", dirty, "--select", "mask-sum-rope,clip-before-unscale"]) == 1
    assert main(["lint", str(tmp_path / "missing.py")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert main(["lint", dirty, "--select", "nonsense"]) == 2
    assert "unknown rule 'nonsense'" in capsys.readouterr().err
    assert main(["lint", dirty, "--format", "xml"]) == 2
    assert main(["lint", dirty, "--no-such-flag"]) == 2
    assert main(["lint"]) == 2
    (tmp_path / "a-file").write_text("")
    assert main(["lint", dirty, "--output", str(tmp_path / "a-file" / "out.txt")]) == 2  # cannot be written
    assert main(["lint", dirty, "--output", dirty]) == 2  # would overwrite the linted file
    assert main(["lint", dirty, "--output", str(tmp_path / "new-dir" / "out.txt")]) == 1  # written, dir made
    assert "clip-before-unscale" in (tmp_path / "new-dir" / "out.txt").read_text()


def test_cli_formats_output_file_and_exclude(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    target = "tests/lint_fixtures/positive/verl_omni_like"
    assert main(["lint", target, "--format", "sarif", "--output", str(tmp_path / "lint.sarif")]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    log = json.loads((tmp_path / "lint.sarif").read_text())
    uris = {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in log["runs"][0]["results"]}
    assert uris == {f"{target}/dp_actor.py", f"{target}/vllm_rollout.py"}
    assert main(["lint", target, "--format", "github"]) == 1
    assert all(line.startswith("::error file=") for line in capsys.readouterr().out.splitlines())
    assert main(["lint", target, "--exclude", "dp_actor.py", "--exclude", "vllm_rollout.py"]) == 0


def test_cli_list_rules(capsys):
    assert main(["lint", "--list-rules"]) == 0
    out = capsys.readouterr().out
    assert all(rule in out for rule in RULES)


def test_pre_commit_hook_entry():
    (hook,) = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert hook["id"] == "rollout-consistency-lint"
    assert hook["entry"] == "rollout-consistency lint"
    assert hook["language"] == "python"
    assert hook["types"] == ["python"]


# ----------------------------------------------------------------------------------------------
# docs/lint.md shows real output

CONSOLE = re.compile(r"^```console\n(.*?)^```", re.S | re.M)


def _console_examples() -> list[tuple[str, str]]:
    examples = []
    for block in CONSOLE.findall((ROOT / "docs" / "lint.md").read_text()):
        command, _, output = block.partition("\n")
        if command.startswith("$ rollout-consistency lint "):
            examples.append((command, output))
    return examples


def test_docs_have_examples():
    assert len(_console_examples()) >= 5


@pytest.mark.parametrize("command,output", _console_examples(), ids=lambda v: v[:40] if isinstance(v, str) else "")
def test_docs_output_is_real(command, output, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = command.removeprefix("$ rollout-consistency ").split()
    code = main(argv)
    captured = capsys.readouterr()
    # A console shows the report (stdout), then the summary line (stderr), then `$ echo $?` and the exit code.
    shown, _, exit_code = output.partition("$ echo $?\n")
    assert captured.out + captured.err == shown
    assert exit_code == f"{code}\n"


def test_the_import_scan_reads_statements_that_open_a_line_and_nothing_else(tmp_path):
    """An import is a statement at the start of a line (after blanks): the same words in a comment, a string or
    after other code on the line link nothing (the scan searches for the keyword, then checks its line)."""
    from rollout_consistency.lint.imports import import_edges

    for name, text in {
        "pkg/__init__.py": "",
        "pkg/mod.py": "X = 1\n",
        "pkg/other.py": "Y = 2\n",
        "words.py": 'x = 1  # from pkg import mod\ns = "from pkg import (other)"\nt = 2; u = "import pkg.mod"\n',
        "code.py": "def f():\n    from pkg import mod\n\timport pkg.other\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    files = [
        (str(tmp_path / p), tuple(p.removesuffix(".py").split("/")))
        for p in ("pkg/__init__.py", "pkg/mod.py", "pkg/other.py", "words.py", "code.py")
    ]
    edges = import_edges(files)
    assert edges.get(str(tmp_path / "words.py"), set()) == set()
    assert {str(tmp_path / "pkg/mod.py"), str(tmp_path / "pkg/other.py")} <= edges[str(tmp_path / "code.py")]
