"""A plugin loader no program calls: its load by a run-time name never runs, so it does not make the registry's
repository unanswerable (written for the lint's tests).

Lint fixture: parsed, never imported or run.
"""

import importlib


def load_plugin(name):
    return importlib.import_module(name)
