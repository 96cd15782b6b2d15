"""A library in trl's shape: the package index imports every trainer and the vLLM client for type checkers
(and lazily at run time). `import minitrl` is the whole library, not a data flow between its parts.
Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

from typing import TYPE_CHECKING

_import_structure = {
    "extras.vllm_client": ["VLLMClient"],
    "trainer": ["DDPOConfig", "DDPOTrainer", "GRPOTrainer"],
}

if TYPE_CHECKING:
    from .extras.vllm_client import VLLMClient
    from .trainer import DDPOConfig, DDPOTrainer, GRPOTrainer
