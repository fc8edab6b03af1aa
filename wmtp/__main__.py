"""``python -m wmtp`` = the ``wmtp`` command (where the package is on the path but not installed)."""

from wmtp.cli import main

if __name__ == "__main__":  # tensor-parallel ranks are spawned processes that import this module again
    raise SystemExit(main())
