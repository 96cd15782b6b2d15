# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`python -m consistency` runs the command line (see consistency/cli.py)."""

from consistency.cli import main

raise SystemExit(main())
