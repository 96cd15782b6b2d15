"""The built-in family table: one `BuiltinFamily` record per built-in model family, tied to what its module
registers, and every list of built-in families in the package derived from it."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest
import torch

from rollout_consistency import adapters
from rollout_consistency.adapters import (
    BatchRequests,
    PipelineSettings,
    SamplingSettings,
    family_names,
    get_family,
    tiny,
)
from rollout_consistency.adapters.vllm_omni import protocol
from rollout_consistency.base.builtin_families import BUILTIN_FAMILIES, BuiltinFamily, builtin_option_keys
from rollout_consistency.gate.config import MODEL_FAMILIES, CheckConfig, ConfigError
from rollout_consistency.gate.sides.trajectory_checks import FAMILY_OPTION_KEYS, check_family_options
from rollout_consistency.schedulers import SDEWindow

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", BUILTIN_FAMILIES.names())
def test_each_record_is_what_its_module_registers(name):
    entry = BUILTIN_FAMILIES[name]
    module = importlib.import_module(entry.module)
    family = get_family(name)
    assert module.FAMILY is family and family.name == name
    assert entry.option_keys == {"height", "width"} | set(family.default_options)
    assert entry.tiny is not None and tiny.get_tiny(name) is getattr(tiny, entry.tiny.rpartition(":")[2])
    assert isinstance(tiny.get_tiny(name), tiny.TinyModel)
    assert {tiny.get_tiny(name)}  # hashable, as a record of functions is (its loaders compare by identity)
    if entry.vllm_omni_pipeline is not None:  # vLLM is not imported here: the class must be where the name says
        module_name, _, class_name = entry.vllm_omni_pipeline.rpartition(".")
        spec = importlib.util.find_spec(module_name)
        assert spec is not None and f"class {class_name}(" in Path(spec.origin).read_text()


@pytest.mark.parametrize("name", BUILTIN_FAMILIES.names())
def test_each_module_entry_points_run_its_own_family(name):
    """`rollout, recompute_log_probs = entry_points(FAMILY, __name__)` in each module: the module's `rollout` stamps
    its trajectories with its own family and its `recompute_log_probs` re-scores them bit for bit (same model, same
    batch); a binding to another family's `FAMILY` fails here."""
    module = importlib.import_module(BUILTIN_FAMILIES[name].module)
    assert (module.rollout.__module__, module.recompute_log_probs.__module__) == (module.__name__,) * 2
    settings = PipelineSettings(height=32, width=32, num_frames=5, max_sequence_length=8)
    model = tiny.get_tiny(name).load_transformer(dtype=torch.float32, device="cpu", seed=0)
    conditioning = tiny.get_tiny(name).prompt_encoder(model, settings)(["a red cat", "sky"], None)
    trajectory = module.rollout(
        model,
        conditioning,
        num_inference_steps=2,
        requests=BatchRequests(seeds=(1, 2), windows=SDEWindow(start=0, size=1, num_steps=2)),
        sampling=SamplingSettings(noise_level=0.7),
        **module.FAMILY.options(settings),
    )
    assert trajectory.model_family == name
    with torch.no_grad():
        assert torch.equal(module.recompute_log_probs(model, trajectory), trajectory.log_probs)


def test_every_list_of_built_in_families_is_the_table():
    names = BUILTIN_FAMILIES.names()
    assert names == ("qwen-image", "sd3", "flux", "wan")
    assert names == MODEL_FAMILIES
    assert set(names) <= set(family_names()) and set(names) <= set(tiny.tiny_names())
    assert dict(FAMILY_OPTION_KEYS) == {n: BUILTIN_FAMILIES[n].option_keys for n in names}
    assert all(builtin_option_keys(n) == BUILTIN_FAMILIES[n].option_keys for n in names)
    with_pipeline = {e.name: e.vllm_omni_pipeline for e in BUILTIN_FAMILIES.values() if e.vllm_omni_pipeline}
    assert with_pipeline == protocol.PIPELINE_CLASSES and protocol.SUPPORTED_FAMILIES == ("qwen-image", "wan")
    for entry in BUILTIN_FAMILIES.values():  # the adapters' face serves each family's module by its short name
        assert getattr(adapters, entry.module.rpartition(".")[2]).FAMILY is get_family(entry.name)


def test_every_family_module_of_the_adapters_has_a_record():
    """An adapters module that registers a `ModelFamily` at import is a built-in family: it has a record."""
    registering = set()
    for path in sorted((ROOT / "adapters").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level: `FAMILY = register_family(...)`
            call = node.value if isinstance(node, (ast.Assign, ast.Expr)) else None
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "register_family":
                registering.add(f"rollout_consistency.adapters.{path.stem}")
    assert registering == {entry.module for entry in BUILTIN_FAMILIES.values()}


def test_no_other_list_of_built_in_families_in_the_package():
    names = set(BUILTIN_FAMILIES.names())
    found = []
    for folder in ("consistency", "adapters"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "builtin_families.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                    items = node.keys if isinstance(node, ast.Dict) else node.elts
                    held = {n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)}
                    if len(held & names) >= 3:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_a_new_built_in_family_is_one_record():
    """A record makes a family known by name to the settings and the trajectory checks, without its module."""
    record = BuiltinFamily(
        "toy-video",
        module="rollout_consistency.adapters.wan",
        option_keys=frozenset({"height", "width", "num_frames"}),
    )
    with BUILTIN_FAMILIES.scoped():
        BUILTIN_FAMILIES.register(record)
        assert CheckConfig(model_family="toy-video").model_family == "toy-video"
        assert "toy-video" in family_names() and "toy-video" not in tiny.tiny_names()
        check_family_options("toy-video", {"height": 8, "num_frames": 5}, "toy.safetensors")
        with pytest.raises(ConfigError, match="'fps' is not read by the 'toy-video' family"):
            check_family_options("toy-video", {"fps": 8}, "toy.safetensors")
        with pytest.raises(ValueError, match="No tiny offline model for family 'toy-video'"):
            tiny.get_tiny("toy-video")
    assert "toy-video" not in BUILTIN_FAMILIES and "toy-video" not in family_names()
    with pytest.raises(ConfigError, match="model_family"):
        CheckConfig(model_family="toy-video")
