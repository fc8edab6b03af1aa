"""Analysis of measurements: statistics, acceptance probes, output diffs and the markdown report."""
