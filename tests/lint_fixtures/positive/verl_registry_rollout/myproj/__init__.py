"""A verl-style project whose rollout is chosen by name from the config (written for the lint's tests).

Lint fixture: parsed, never imported or run.
"""
