"""The GPU's clocks, power and clock-event (throttle) reasons, read from ``nvidia-smi``: ``bench step``
records them after each mode's timed iterations, and the report prints them (``describe_gpu_state``).
Light on purpose (torch is imported only to read a device index) so that the report can use it."""

from __future__ import annotations

GPU_STATE_FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "power.limit", "temperature.gpu")
# the throttle-reason bit mask's name since driver 535, then before it
GPU_REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


# nvidia-smi's clock-event reason bits (``nvidia-smi --help-query-gpu``)
CLOCK_EVENT_BITS = {0x1: "gpu idle", 0x2: "applications clocks setting", 0x4: "sw power cap", 0x8: "hw slowdown",
                    0x10: "sync boost", 0x20: "sw thermal slowdown", 0x40: "hw thermal slowdown",
                    0x80: "hw power brake slowdown", 0x100: "display clock setting"}


def describe_gpu_state(state: dict[str, str] | None) -> str | None:
    """One line of ``gpu_state``: clocks, power against its limit, temperature and the named
    clock-event reasons (e.g. "sw power cap": the SM clock is lowered to hold the power limit)."""
    if not state:
        return None
    reason = next((state[f] for f in GPU_REASON_FIELDS if f in state), None)
    try:
        bits = int(reason, 16) if reason else 0
        names = [name for bit, name in CLOCK_EVENT_BITS.items() if bits & bit] or ["none"]
    except ValueError:
        names = [reason]
    return (f"SM {state['clocks.sm']} MHz, memory {state['clocks.mem']} MHz, {state['power.draw']} W of "
            f"{state['power.limit']} W, {state['temperature.gpu']} C, clock events: {', '.join(names)}")


def gpu_state(device) -> dict[str, str] | None:
    """The GPU's SM / memory clocks (MHz), power draw and limit (W), temperature (C) and active
    clock-event (throttle) reasons from ``nvidia-smi``, read now; None off CUDA or without it. Two
    machines of the same GPU model differ in T_iter by a few percent: this says whether clocks differed."""
    import shutil
    import subprocess

    import torch

    device = torch.device(device)
    if device.type != "cuda" or shutil.which("nvidia-smi") is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    for reason in GPU_REASON_FIELDS:
        fields = (*GPU_STATE_FIELDS, reason)
        try:
            out = subprocess.run(["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(fields)}",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10,
                                 check=True)
        except (OSError, subprocess.SubprocessError):
            continue
        values = [v.strip() for v in out.stdout.strip().split(",")]
        if len(values) == len(fields):
            return dict(zip(fields, values))
    return None
