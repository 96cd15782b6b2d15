# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`python -m rollout_consistency` runs the command line (see consistency/cli.py)."""

from rollout_consistency.cli import main

raise SystemExit(main())
