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

__all__ = ["CpuOmniPlatform", "install"]

#: vLLM-omni's SDPA backend: `torch.nn.functional.scaled_dot_product_attention`, the trainer's kernel family.
SDPA_BACKEND = "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend"
#: The platform-default runner on CUDA; the class under test.
RUNNER = "vllm_omni.diffusion.worker.diffusion_model_runner.DiffusionModelRunner"


def _platform_class() -> type:
    from vllm_omni.platforms.interface import UnspecifiedOmniPlatform

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
        def get_diffusion_attn_backend_cls(
            cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
        ) -> str:
            # Every attention layer asks the platform for its backend; on CPU only SDPA exists. This is the
            # main difference from a GPU run, where FlashAttention is the default (docs/vllm-omni.md).
            return SDPA_BACKEND

        @classmethod
        def supports_torch_inductor(cls) -> bool:
            # The rollout engine runs eager (enforce_eager=True); never compile on the CI machine.
            return False

        @classmethod
        def get_diffusion_model_runner_cls(cls) -> str:
            # The same runner class CUDA uses.
            return RUNNER

    return CpuOmniPlatform


CpuOmniPlatform: type | None = None


def install() -> type:
    """Make vLLM and vLLM-omni resolve CPU platforms in this process; returns the vLLM-omni platform class.

    * `VLLM_TARGET_DEVICE=cpu`: vLLM's own platform detection then picks its CPU platform (without it, the
      CUDA wheel finds no GPU and resolves `UnspecifiedPlatform`, which has no dtype or device rules).
    * `vllm_omni.platforms.current_omni_platform` is set to [`CpuOmniPlatform`] before any runtime module
      binds it.

    Idempotent. Call it before importing `vllm_omni.diffusion` or `vllm.platforms`.
    """
    global CpuOmniPlatform
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    import vllm_omni.platforms as omni_platforms

    if CpuOmniPlatform is None:
        CpuOmniPlatform = _platform_class()
    omni_platforms.current_omni_platform = CpuOmniPlatform()
    return CpuOmniPlatform
