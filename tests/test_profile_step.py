"""benchmarks/profile_step.py's depth comparison (its kernel tables need a GPU; the arithmetic does not)."""

from __future__ import annotations

import pytest

from benchmarks.profile_step import depth_diff, parse_depths


def test_depth_diff_orders_kernels_by_their_change_and_sums_it():
    lo = {"_attn_split_kernel": 1000.0, "_skinny_linear_kernel": 500.0, "gone": 40.0}
    hi = {"_attn_split_kernel": 1100.0, "_skinny_linear_kernel": 900.0, "new": 20.0}
    lines = depth_diff(lo, hi, 3, 4).splitlines()
    assert lines[0].split() == ["d", "=", "3", "(ms)", "d", "=", "4", "(ms)", "change", "(ms)"]
    assert [ln.split()[-1] for ln in lines[1:-1]] == ["_skinny_linear_kernel", "_attn_split_kernel", "gone", "new"]
    assert lines[1].split()[:3] == ["0.500", "0.900", "+0.400"]
    assert lines[3].split()[:3] == ["0.040", "0.000", "-0.040"]
    assert lines[-1].split() == ["+0.480", "all", "kernels"]


@pytest.mark.parametrize("spec,want", [("7", [7]), ("3,4", [3, 4]), ("2,3,9", [2, 3, 9])])
def test_parse_depths(spec, want):
    assert parse_depths(spec) == want


@pytest.mark.parametrize("spec", ["", "0", "3,x", "3,-1"])
def test_parse_depths_names_a_bad_value(spec):
    with pytest.raises(SystemExit, match=f"-d {spec!r} must be depths >= 1"):
        parse_depths(spec)
