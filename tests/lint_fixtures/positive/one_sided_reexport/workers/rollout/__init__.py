"""The rollout package's index. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

from .vllm_rollout import vLLMRollout

__all__ = ["vLLMRollout"]
