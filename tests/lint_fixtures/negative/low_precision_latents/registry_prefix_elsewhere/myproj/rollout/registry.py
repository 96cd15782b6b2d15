"""The rollout registry: a rollout is a module of `myproj.rollout` named by the config (`rollout: sde` loads
`myproj/rollout/sde_rollout.py`), as verl loads its rollouts (written for the lint's tests).

Lint fixture: parsed, never imported or run.
"""

import importlib


def get_rollout_class(name):
    module = importlib.import_module(f"myproj.rollout.{name}_rollout")
    return getattr(module, "Rollout")
