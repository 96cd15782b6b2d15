"""The training package's index, two levels deep (its name says no side). Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

from .dp import DataParallelPPOActor

__all__ = ["DataParallelPPOActor"]
