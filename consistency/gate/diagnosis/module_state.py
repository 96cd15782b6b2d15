# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What a module's forward computes besides its weights and inputs, read from the module as it runs, and the
differences between the two sides' modules of the same name.

    state             `module_state(module)` -> a JSON-able dict of what applies to that module:
                      ``training``; ``dropout`` (the ``p`` of a dropout layer); a peft LoRA layer's ``scaling``
                      (adapter -> scale), ``active_adapters``, ``merged`` and ``adapters_disabled``; an attention
                      module's ``processor`` (its class) and ``attention_backend`` (diffusers' dispatch backend, when
                      the processor names one); ``dtype`` (the module's own parameters' dtypes)
    differences       `state_differences(rollout, trainer)` -> each field whose value differs in a way the forward
                      can see, with the cause it names (`CAUSES`)

A training flag differs in what a forward computes only where it switches a dropout of ``p > 0`` on (`train-mode`);
the flags of other modules are not reported. Adapters (peft's LoRA layers: scaling, active adapters, merged or
disabled) name `adapter-scale`; the attention processor's class `attention-processor`, the same class on another
dispatch backend `attention-kernel` (rounding of two kernels, no bug); a module's parameter dtype
`forward-precision`. peft is not imported: a LoRA layer is read by the attributes it carries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: State field -> the cause a difference in it names.
CAUSES: Mapping[str, str] = {
    "training": "train-mode",
    "dropout": "train-mode",
    "scaling": "adapter-scale",
    "active_adapters": "adapter-scale",
    "merged": "adapter-scale",
    "adapters_disabled": "adapter-scale",
    "processor": "attention-processor",
    "attention_backend": "attention-kernel",
    "dtype": "forward-precision",
}


@dataclass(frozen=True)
class StateDifference:
    """One field of one module whose value differs between the sides (``rollout``, ``trainer``: its values)."""

    module: str
    field: str
    rollout: Any
    trainer: Any

    @property
    def cause(self) -> str:
        return CAUSES[self.field]

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "field": self.field, "rollout": self.rollout, "trainer": self.trainer}


def module_state(module: Any) -> dict[str, Any]:
    """The state of `module` that decides what its forward computes (see the module docstring), JSON-able."""
    import torch

    state: dict[str, Any] = {"training": bool(module.training)}
    if isinstance(module, _dropouts()):
        state["dropout"] = float(module.p)
    scaling = getattr(module, "scaling", None)
    if isinstance(scaling, Mapping) and hasattr(module, "merged"):  # a peft LoRA layer (BaseTunerLayer)
        state["scaling"] = {str(k): float(v) for k, v in sorted(scaling.items())}
        state["active_adapters"] = sorted(str(a) for a in _as_list(getattr(module, "active_adapters", ())))
        state["merged"] = bool(module.merged)
        state["adapters_disabled"] = bool(getattr(module, "disable_adapters", False))
    processor = getattr(module, "processor", None)
    if processor is not None and callable(processor) and not isinstance(processor, torch.nn.Module):
        state["processor"] = type(processor).__name__
        backend = getattr(processor, "_attention_backend", None)
        if backend is not None:
            state["attention_backend"] = str(getattr(backend, "value", backend))
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in module.parameters(recurse=False)})
    if dtypes:
        state["dtype"] = "/".join(dtypes)
    return state


def state_differences(
    rollout: Mapping[str, Mapping[str, Any]], trainer: Mapping[str, Mapping[str, Any]]
) -> list[StateDifference]:
    """Every field that differs between the sides' modules of the same name, in the rollout's module order.

    Args:
        rollout, trainer: module name -> its `module_state`.
    """
    out = []
    for name, a in rollout.items():
        b = trainer.get(name)
        if b is None:
            continue
        for field in CAUSES:
            x, y = a.get(field), b.get(field)
            if x == y or not _visible(field, a, b):
                continue
            out.append(StateDifference(name, field, x, y))
    return out


def describe(module: str, field: str, rollout: Mapping[str, Any], trainer: Mapping[str, Any]) -> str:
    """Both sides' values of `field` (with ``p`` and ``training`` for a dropout), as measured:
    ``rollout: X.lora_dropout.default p=0.1 training=False; trainer: p=0.1 training=True``."""
    fields = ("dropout", "training") if CAUSES[field] == "train-mode" else (field,)

    def said(state: Mapping[str, Any]) -> str:
        return " ".join(f"{_label(f)}={_value(state[f])}" for f in fields if f in state) or f"no {_label(field)}"

    return f"rollout: {module} {said(rollout)}; trainer: {said(trainer)}"


# ----------------------------------------------------------------------------------------------------
def _dropouts() -> tuple[type, ...]:
    import torch

    nn = torch.nn
    return (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _visible(field: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether a difference in `field` changes what the forward computes."""
    if field == "training":  # only where it switches a dropout of p > 0 on
        return any(s.get("dropout", 0.0) > 0 for s in (a, b) if s.get("training"))
    if field == "dropout":  # another p matters only where a side drops out
        return bool(a.get("training") or b.get("training"))
    return True


def _as_list(value: Any) -> list[Any]:
    return [value] if isinstance(value, str) else list(value or ())


def _label(field: str) -> str:
    return {"dropout": "p", "attention_backend": "backend"}.get(field, field)


def _value(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
