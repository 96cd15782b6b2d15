"""Inside the first differing block: a module's state as it runs (training, dropout, LoRA scaling / active adapters /
merged, attention processor, dtype), the differences between the two sides that change what a forward computes
(each naming its cause with both values), the first submodule whose inputs agree and outputs differ, and a second
look that claims nothing where the sides do not re-run the same forward."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

from rollout_consistency import CheckConfig, run_step1_check
from rollout_consistency.gate.diagnosis.inside_block import ModuleRecord, compare_inside
from rollout_consistency.gate.diagnosis.module_state import describe, module_state, state_differences

CORPUS = Path(__file__).resolve().parent / "doctor_corpus"


class Tiny(nn.Module):
    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.drop = nn.Dropout(p)


def lora(model: nn.Module, *, alpha: int = 8, dropout: float = 0.0) -> nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    return inject_adapter_in_model(
        LoraConfig(r=4, lora_alpha=alpha, lora_dropout=dropout, target_modules=["proj"]), model
    )


def states(model: nn.Module) -> dict[str, dict]:
    return {name: module_state(module) for name, module in model.named_modules() if name}


def differences(a: nn.Module, b: nn.Module) -> list[tuple[str, str, object, object, str]]:
    return [(d.module, d.field, d.rollout, d.trainer, d.cause) for d in state_differences(states(a), states(b))]


# ----------------------------------------------------------------------------------------------------
def test_module_state_reads_a_peft_lora_layer_and_a_dropout():
    model = lora(Tiny())
    state = module_state(model.proj)
    assert state["scaling"] == {"default": 2.0} and state["active_adapters"] == ["default"]
    assert state["merged"] is False and state["adapters_disabled"] is False
    assert module_state(model.drop) == {"training": True, "dropout": 0.1}
    assert module_state(model.proj.lora_A["default"])["dtype"] == "float32"
    assert "scaling" not in module_state(model.proj.lora_A["default"])  # a plain Linear is no adapter


def test_a_training_flag_differs_only_where_it_switches_a_dropout_on():
    rollout, trainer = Tiny(p=0.1).eval(), Tiny(p=0.1).train()
    assert differences(rollout, trainer) == [("drop", "training", False, True, "train-mode")]
    # The trainer in train mode too: that side is read as well as the rollout.
    assert differences(trainer, rollout) == [("drop", "training", True, False, "train-mode")]
    # No dropout to switch on (p=0), or a Linear's flag: the forward is the same, nothing is reported.
    assert differences(Tiny(p=0.0).eval(), Tiny(p=0.0).train()) == []
    # Another p where neither side drops out: the same forward; where one does: another computation.
    assert differences(Tiny(p=0.1).eval(), Tiny(p=0.3).eval()) == []
    assert ("drop", "dropout", 0.1, 0.3, "train-mode") in differences(Tiny(p=0.1).train(), Tiny(p=0.3).train())


def test_adapter_scaling_active_adapters_and_merged_name_adapter_scale():
    a, b = lora(Tiny(p=0.0)), lora(Tiny(p=0.0), alpha=16)
    assert differences(a, b) == [("proj", "scaling", {"default": 2.0}, {"default": 4.0}, "adapter-scale")]
    merged = lora(Tiny(p=0.0))
    merged.proj.merge(adapter_names=["default"])
    assert differences(a, merged) == [("proj", "merged", False, True, "adapter-scale")]
    off = lora(Tiny(p=0.0))
    off.proj.enable_adapters(False)
    assert differences(a, off) == [("proj", "adapters_disabled", False, True, "adapter-scale")]

    def two_adapters(active: str) -> nn.Module:
        from peft import LoraConfig, inject_adapter_in_model

        model = lora(Tiny(p=0.0))
        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["proj"]), model, adapter_name="other")
        model.proj.set_adapter(active)
        return model

    assert differences(two_adapters("default"), two_adapters("other")) == [
        ("proj", "active_adapters", ["default"], ["other"], "adapter-scale")
    ]


def test_a_modules_dtype_and_its_attention_processor_are_compared():
    from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

    a, b = Tiny(p=0.0), Tiny(p=0.0)
    b.proj.to(torch.bfloat16)
    assert differences(a, b) == [("proj", "dtype", "float32", "bfloat16", "forward-precision")]
    x, y = Attention(8, heads=2, dim_head=4), Attention(8, heads=2, dim_head=4)
    x.set_processor(AttnProcessor2_0())
    y.set_processor(AttnProcessor())
    found = [
        (d.module, d.field, d.rollout, d.trainer, d.cause)
        for d in state_differences({"attn": module_state(x)}, {"attn": module_state(y)})
    ]
    assert found == [("attn", "processor", "AttnProcessor2_0", "AttnProcessor", "attention-processor")]


def test_an_attention_backend_of_the_same_processor_is_a_kernel_difference():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    first, second = FluxAttnProcessor(), FluxAttnProcessor()
    second._attention_backend = "_native_math"
    holder = nn.Module
    x, y = holder(), holder()
    x.processor, y.processor = first, second
    found = state_differences({"attn": module_state(x)}, {"attn": module_state(y)})
    assert [(d.field, d.rollout, d.trainer, d.cause) for d in found] == [
        ("attention_backend", None, "_native_math", "attention-kernel")
    ]


def test_describe_gives_both_sides_values_as_measured():
    rollout, trainer = {"training": False, "dropout": 0.1}, {"training": True, "dropout": 0.1}
    assert describe("blocks.0.attn.to_q.lora_dropout.default", "training", rollout, trainer) == (
        "rollout: blocks.0.attn.to_q.lora_dropout.default p=0.1 training=False; trainer: p=0.1 training=True"
    )
    assert describe("attn.to_q", "scaling", {"scaling": {"default": 1.0}}, {"scaling": {"default": 2.0}}) == (
        "rollout: attn.to_q scaling={default: 1}; trainer: scaling={default: 2}"
    )


# ----------------------------------------------------------------------------------------------------
def record(name, order, inputs, outputs, **state):
    as_tensor = lambda v: None if v is None else (str(v), torch.tensor([float(v)], dtype=torch.float64), 1)  # noqa: E731
    return ModuleRecord(name, {"training": False, **state}, as_tensor(inputs), as_tensor(outputs), order)


def test_the_first_module_whose_inputs_agree_and_outputs_differ_is_where_the_sides_part():
    # attn's processor differs: its projections agree, to_out.0 gets a differing input (not where it starts), attn
    # itself gets the same inputs and returns another output.
    rollout = {
        "attn.to_q": record("attn.to_q", 1, 1, 2),
        "attn.to_out.0": record("attn.to_out.0", 2, 3, 4),
        "attn": record("attn", 3, 1, 4, processor="A"),
        "block": record("block", 4, 0, 5),
    }
    trainer = {
        "attn.to_q": record("attn.to_q", 1, 1, 2),
        "attn.to_out.0": record("attn.to_out.0", 2, 3.5, 4.5),
        "attn": record("attn", 3, 1, 4.5, processor="B"),
        "block": record("block", 4, 0, 5.5),
    }
    found = compare_inside(rollout, trainer)
    assert found["first"] == {"module": "attn", "max_abs": 0.5, "sampled": 1, "values": 1}
    assert found["differences"] == [
        {"module": "attn", "field": "processor", "rollout": "A", "trainer": "B", "cause": "attention-processor"}
    ]


def test_a_state_difference_outside_the_submodule_where_the_sides_part_is_not_its_cause():
    rollout = {"a": record("a", 1, 1, 2), "b": record("b", 2, 1, 3, dtype="float32")}
    trainer = {"a": record("a", 1, 1, 2.5), "b": record("b", 2, 1, 3, dtype="bfloat16")}
    found = compare_inside(rollout, trainer)
    assert found["first"]["module"] == "a" and found["differences"] == []
    assert [d["module"] for d in found["elsewhere"]] == ["b"]


# ----------------------------------------------------------------------------------------------------
#: Counts the trainer's builds in this process: each build scales its LoRA by another factor, so a second run of
#: the trainer does not compute what the first did.
BUILDS = itertools.count(1)


class DriftingTrainer:
    def __init__(self, config):
        from doctor_corpus.loops import DiffusionActor, add_policy_lora

        self.actor = DiffusionActor(config)
        self.model = add_policy_lora(self.actor.module, lora_alpha=8 * (1 + next(BUILDS)))

    def __call__(self, batch, *, micro_batch_size):
        return self.actor(batch, micro_batch_size=micro_batch_size)


def make_drifting_trainer(config):
    return DriftingTrainer(config)


def make_lora_rollout(config):
    from doctor_corpus.loops import QwenImageRolloutAdapter, add_policy_lora

    rollout = QwenImageRolloutAdapter(config)
    add_policy_lora(rollout.transformer, lora_alpha=8)
    return rollout


def test_a_side_that_does_not_rerun_the_same_forward_gets_no_claim_inside_the_block():
    from doctor_corpus.loops import settings

    config = CheckConfig(
        rollout_backend=f"{__file__}:make_lora_rollout",
        trainer_backend=f"{__file__}:make_drifting_trainer",
        **settings("verl_omni"),
    )
    report = run_step1_check(config)
    top = report.diagnosis[0]
    inside = top["details"]["facts"]["inside"]
    assert inside["reproduced"] is False and top["cause"] != "adapter-scale", top
    assert any("did not reproduce the forward looked at" in e for e in top["evidence"]), top["evidence"]
    assert not any(e.startswith("first differing submodule") for e in top["evidence"])


@pytest.mark.parametrize(
    ("case", "module", "state"),
    [
        (
            "flow_grpo_lora_scale",
            "transformer_blocks.0.attn.to_q",
            "rollout: transformer_blocks.0.attn.to_q scaling={default: 1}; trainer: scaling={default: 2}",
        ),
        (
            "verl_omni_lora_dropout",
            "transformer_blocks.0.attn.to_q.lora_dropout.default",
            "rollout: transformer_blocks.0.attn.to_q.lora_dropout.default p=0.1 training=False; trainer: p=0.1 "
            "training=True",
        ),
        (
            "verl_omni_lora_dtype",
            "transformer_blocks.0.attn.to_q",
            "rollout: transformer_blocks.0.attn.to_q.lora_A.default dtype=float32; trainer: dtype=bfloat16",
        ),
        (
            "dance_grpo_attn_processor",
            "transformer_blocks.0.attn",
            "rollout: transformer_blocks.0.attn processor=FlashFluxAttnProcessor; trainer: processor=FluxAttnProcessor",
        ),
    ],
)
def test_the_doctor_names_the_submodule_and_both_states_in_a_users_loop(case, module, state):
    from test_doctor_corpus import outcome

    found = outcome(CORPUS / f"{case}.py")
    top = found.localised_report.diagnosis[0]
    evidence = top["evidence"]
    assert top["cause"] == found.expected, evidence
    located = [e for e in evidence if e.startswith("first differing submodule: ")]
    assert located and located[0].startswith(f"first differing submodule: {module} (max |Δ| "), evidence
    assert located[0].endswith("its input tensors agree bit for bit")
    assert state in evidence
    inside = top["details"]["facts"]["inside"]
    assert inside["reproduced"] is True and inside["first"]["max_abs"] > 0
