"""Benchmarks: synthetic context, forced acceptance (benchmark-only knobs), the bytes floor, and the
``wmtp bench`` commands. Nothing here is reachable from the generation API."""
