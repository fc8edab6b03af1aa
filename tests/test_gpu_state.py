"""``gpu_state``: the clocks / power / throttle reasons bench step records, read from nvidia-smi."""

import os
import stat

import torch

from wmtp.bench.gpu_state import GPU_REASON_FIELDS, GPU_STATE_FIELDS, describe_gpu_state, gpu_state


def _fake_smi(tmp_path, monkeypatch, script: str) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + script)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_none_off_cuda_or_without_nvidia_smi(tmp_path, monkeypatch):
    assert gpu_state(torch.device("cpu")) is None
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi here
    assert gpu_state(torch.device("cuda:0")) is None


def test_reads_the_fields_and_falls_back_to_the_legacy_reason_name(tmp_path, monkeypatch):
    # a driver before 535 knows only clocks_throttle_reasons: the first query fails
    _fake_smi(tmp_path, monkeypatch, 'case "$*" in *clocks_event_reasons*) echo "unknown field" >&2; exit 2;; esac\n'
                                     'echo "1980, 3201, 512.30, 700.00, 45, 0x0000000000000004"\n')
    state = gpu_state(torch.device("cuda:1"))
    assert state == dict(zip((*GPU_STATE_FIELDS, GPU_REASON_FIELDS[1]),
                             ["1980", "3201", "512.30", "700.00", "45", "0x0000000000000004"]))


def test_a_malformed_answer_is_none(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, 'echo "[N/A]"\n')
    assert gpu_state(torch.device("cuda:0")) is None


def test_describe_names_the_clock_event_reasons():
    state = dict(zip((*GPU_STATE_FIELDS, GPU_REASON_FIELDS[0]), ["1950", "3201", "688.31", "700.00", "57", "0x4"]))
    assert describe_gpu_state(state) == "SM 1950 MHz, memory 3201 MHz, 688.31 W of 700.00 W, 57 C, clock events: sw power cap"
    state[GPU_REASON_FIELDS[0]] = "0x0000000000000045"  # idle + power cap + hw thermal
    assert describe_gpu_state(state).endswith("clock events: gpu idle, sw power cap, hw thermal slowdown")
    state[GPU_REASON_FIELDS[0]] = "0x0000000000000000"
    assert describe_gpu_state(state).endswith("clock events: none")
    state[GPU_REASON_FIELDS[0]] = "[N/A]"
    assert describe_gpu_state(state).endswith("clock events: [N/A]")
    assert describe_gpu_state(None) is None
