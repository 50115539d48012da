"""Timing work on a device: wait for what is queued before reading the clock, median of repeated calls.

Shared by the kernel benchmark (bench_kernels.py) and the performance model's calibration
(calibrate.py), which time the same way on a CPU and on CUDA.
"""

from __future__ import annotations

import statistics
import time

import torch


def synchronizer(device: torch.device | None):
    """What waits for the device's queued work before a clock is read: ``torch.cuda.synchronize``
    on CUDA, nothing on the CPU (None: the CPU), where every call returns when its work is done."""
    return torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)


def median_seconds(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Run ``fn`` ``warmup`` times, then time ``repeats`` calls one by one; return the median.

    On CUDA each timed call is bracketed by ``torch.cuda.synchronize`` so the time covers the
    kernels, not just their launch.
    """
    sync = synchronizer(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
