"""A worker's own dense matmul throughput, the figure its MFU is reported against."""

from __future__ import annotations

import time

from orch.plans.spec import Precision


def matmul_tflops(precision: str, device, seconds: float = 0.1) -> float:
    """This worker's sustained dense matmul throughput in the training precision, measured.

    MFU is reported against it: on CPU workers there is no datasheet peak to quote, and on
    GPUs a measured figure also reflects clocks and power limits. It runs before the first step,
    so it is kept short: a tenth of a second of 1024-wide matmuls gives the same figure as three
    tenths within a few percent on a CPU core. A GPU does a 1024-wide matmul in microseconds,
    less than it takes to launch one, so there the matmuls are 8192 wide (a first run on an H100
    measured 160 TFLOP/s at 1024, against the 680 its calibration measured at 8192: MFU over 200%).
    """
    import torch

    on_cuda = getattr(device, "type", "cpu") == "cuda"
    size = 8192 if on_cuda else 1024
    dtype = Precision(precision).dtype
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    a @ b  # warm-up
    if on_cuda:
        torch.cuda.synchronize(device)
    # The fastest call: on cores shared with other work (another worker starting, another run) it is
    # the least disturbed one, as the calibration's probes take their fastest window.
    fastest, started = float("inf"), time.perf_counter()
    while time.perf_counter() - started < seconds:
        call = time.perf_counter()
        a @ b
        if on_cuda:  # one at a time: the host would otherwise queue a second's worth before it waits
            torch.cuda.synchronize(device)
        fastest = min(fastest, time.perf_counter() - call)
    tflops = 2 * size**3 / fastest / 1e12
    del a, b
    if on_cuda:
        torch.cuda.empty_cache()  # the probe's 400 MB would otherwise stay reserved by the allocator
    return tflops
