"""Lint fixture: parsed, never imported or run."""

from .dp_actor import DataParallelPPOActor
