"""``python -m wmtp`` = the ``wmtp`` command (where the package is on the path but not installed)."""

from wmtp.cli import main

raise SystemExit(main())
