"""CPU platform shims that let vLLM-omni's own `DiffusionModelRunner` run the rollout pipeline in CI.

vLLM-omni 0.30.0 supports CUDA, ROCm, NPU, XPU and MUSA; on a CPU-only machine it resolves its
`UnspecifiedOmniPlatform`, whose device hooks raise `NotImplementedError`. Everything else the runner does
(the diffusers loader, the pipeline class named in `custom_pipeline_args`, request waves, step batches,
`InputBatch`, the warm-up request, the output envelope and its serialiser) is plain PyTorch / Python and runs
unchanged. These shims replace only the device hooks, each documented below with why it is needed and what
it leaves unexercised. Together they do NOT exercise: the CUDA kernels (FlashAttention, the fused Triton
QK-norm + RoPE, cuBLAS bf16 GEMMs), CUDA graphs, `torch.compile` (the engine runs eager, as the rollout
pipeline requires anyway), multi-process workers and the ZMQ transport between them, and GPU memory
accounting. Those run only in the GPU tests (`make test-gpu`, docs/vllm-omni.md).

All shims live here and nowhere else. [`install`] must run before anything imports `vllm_omni`'s
runtime modules (they bind `current_omni_platform` at import time): tests/conftest.py calls it at session
start when vLLM-omni is importable.
"""

from __future__ import annotations

import os

import psutil
import torch

__all__ = ["CpuOmniPlatform", "CpuSDPABackend", "install", "register_wan2_2_package"]

# vLLM resolves its platform once, on first use, from this variable (its CUDA wheel finds no GPU here and
# would resolve `UnspecifiedPlatform`, which has no dtype or device rules). Set before vLLM is imported.
os.environ["VLLM_TARGET_DEVICE"] = "cpu"

from vllm_omni.platforms.interface import UnspecifiedOmniPlatform

#: The platform-default runner on CUDA; the class under test.
RUNNER = "vllm_omni.diffusion.worker.diffusion_model_runner.DiffusionModelRunner"


class CpuOmniPlatform(UnspecifiedOmniPlatform):
    """`UnspecifiedOmniPlatform` (device "cpu") with the device hooks the runner calls made to answer.

    Each override says why it is needed; none of them runs a CUDA code path.
    """

    # The worker group's torch.distributed backend (world size 1 here); NCCL on CUDA, gloo is CPU's.
    dist_backend = "gloo"

    @classmethod
    def get_device_count(cls) -> int:
        # The worker sizes its world (num_gpus) from this; 0 would refuse to start one worker.
        return 1

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        # Each worker binds its rank's device (torch.cuda.set_device); there is one CPU, nothing to bind.
        return None

    @classmethod
    def get_device_version(cls) -> str | None:
        # Logged and used to pick kernels on CUDA; there is no device version on a CPU.
        return None

    @classmethod
    def synchronize(cls) -> None:
        # The runner synchronises after loading and after each forward; CPU ops are already synchronous.
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        # Memory profiling reads device memory; host memory stands in (no GPU accounting is exercised).
        return int(psutil.virtual_memory().available)

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return int(memory.available), int(memory.total)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return int(psutil.virtual_memory().total)

    # Peak-memory statistics (torch.cuda.reset_peak_memory_stats / max_memory_*): the runner records a
    # request's peak GPU memory in its output. torch.cpu has no such counters; report none.
    @classmethod
    def reset_peak_memory_stats(cls, device: torch.device | None = None) -> None:
        return None

    @classmethod
    def max_memory_allocated(cls, device: torch.device | None = None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device: torch.device | None = None) -> int:
        return 0

    @classmethod
    def empty_cache(cls) -> None:
        # torch.cuda.empty_cache after loading and between requests; the CPU allocator has no cache to free.
        return None

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def get_diffusion_attn_backend_cls(
        cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
    ) -> str:
        # Every attention layer asks the platform for its backend; on CPU only SDPA exists. This is the
        # main difference from a GPU run, where FlashAttention is the default (docs/vllm-omni.md).
        return f"{CpuSDPABackend.__module__}.{CpuSDPABackend.__qualname__}"

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        # The rollout engine runs eager (enforce_eager=True); never compile on the CI machine.
        return False

    @classmethod
    def get_diffusion_model_runner_cls(cls) -> str:
        # The same runner class CUDA uses.
        return RUNNER


def install() -> type[CpuOmniPlatform]:
    """Make vLLM-omni resolve [`CpuOmniPlatform`] in this process. Idempotent; runs when this module is imported.

    It must run before `vllm_omni.diffusion` is imported: its runtime modules bind `current_omni_platform`
    at import time. tests/conftest.py imports this module at session start when vLLM-omni is importable.
    """
    import vllm_omni.platforms as omni_platforms

    if not isinstance(omni_platforms.current_omni_platform, CpuOmniPlatform):
        omni_platforms.current_omni_platform = CpuOmniPlatform()
    return CpuOmniPlatform


install()


def register_wan2_2_package() -> None:
    """Make `vllm_omni.diffusion.models.wan2_2` importable without running its `__init__`. Idempotent.

    Its `__init__` imports every Wan 2.2 pipeline; the image-to-video one imports torchvision, and the only
    torchvision that PyPI has for torch 2.13.0 (0.28.0) is built for CUDA torch: its operators do not load on the
    CPU build ("operator torchvision::nms does not exist"), so the import fails. Registered as a plain package, its
    text-to-video modules (`pipeline_wan2_2`, `wan2_2_transformer`) import as they are. Leaves unexercised: the
    I2V, S2V and VACE pipelines (this project drives text-to-video only).
    """
    import importlib.util
    import sys
    import types

    name = "vllm_omni.diffusion.models.wan2_2"
    if name in sys.modules:
        return
    parent = importlib.util.find_spec("vllm_omni.diffusion.models")
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(os.path.dirname(parent.origin), "wan2_2")]
    sys.modules[name] = package


register_wan2_2_package()

# Imported only now: vLLM-omni's attention backends bind the platform at import.
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl  # noqa: E402


class CpuSDPAImpl(SDPAImpl):
    """vLLM-omni's SDPA attention, dispatched as on CUDA.

    Its base class picks `forward_cuda` / `forward_hip` / ... from the platform and has no CPU branch; all
    but NPU run the same `torch.nn.functional.scaled_dot_product_attention` call (mask broadcast over keys).
    """

    def forward(self, query, key, value, attn_metadata=None):
        return self.forward_cuda(query, key, value, attn_metadata)


class CpuSDPABackend(SDPABackend):
    """vLLM-omni's `TORCH_SDPA` backend with [`CpuSDPAImpl`]."""

    @staticmethod
    def get_impl_cls() -> type[SDPAImpl]:
        return CpuSDPAImpl
