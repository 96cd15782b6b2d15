# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""placeholder"""
