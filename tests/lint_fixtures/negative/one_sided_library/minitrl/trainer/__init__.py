"""The trainers' index. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

from .ddpo_trainer import DDPOConfig, DDPOTrainer
from .grpo_trainer import GRPOTrainer

__all__ = ["DDPOConfig", "DDPOTrainer", "GRPOTrainer"]
