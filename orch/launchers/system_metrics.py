"""Hardware use of every node of a run: CPU, memory, disk, network, and GPUs when present.

MLflow's own system-metrics monitors do the sampling (``mlflow.system_metrics``: ``psutil``, and
``pynvml`` on GPUs), on one worker per node, so the series come from the nodes that train, not
from the driver's machine. MLflow's ``SystemMetricsMonitor`` would also send them, but from the
worker straight to the tracking store, which a worker on another node may not reach (a local
sqlite file) and should not hold credentials for. Instead the samples travel to the driver with
the workers' progress, and the driver logs them as MLflow names them for several nodes:
``system/<node>/<metric>``.
"""

from __future__ import annotations

import threading
import time


def mlflow_monitors() -> list:
    """MLflow's CPU, disk and network monitors, and its GPU monitor where one can start."""
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    monitors = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    try:
        import torch

        if torch.cuda.is_available():
            from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

            monitors.append(GPUMonitor())
    except Exception:  # noqa: BLE001 - no pynvml, or no driver: CPU metrics only
        pass
    return monitors


class SystemSampler:
    """A daemon thread that samples the node every ``interval_s`` seconds.

    Each sample averages what the monitors collected over the interval (a sample a second, as
    MLflow's monitor aggregates them). :meth:`take` hands the samples gathered so far to the
    caller and forgets them. The monitors are made on the thread: importing MLflow takes a second
    of CPU, which the caller does not wait for. When the thread stops it keeps one last sample of
    the time since the previous one, so a run shorter than ``interval_s`` still records one
    (:meth:`finish`).
    """

    # How long finish() waits for the thread's last sample (it may still be importing MLflow).
    FINISH_TIMEOUT_S = 60.0

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._samples: list[dict[str, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orch-system-metrics", daemon=True)

    def start(self) -> SystemSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        import psutil

        # psutil's CPU percentage counts from the calling thread's previous call (a thread's first
        # returns 0.0): every call is made on this thread, the first before the slow MLflow import.
        psutil.cpu_percent()
        monitors = mlflow_monitors()
        tick = min(1.0, self.interval_s)
        next_sample = time.monotonic() + self.interval_s
        while not self._stop.wait(tick):
            for monitor in monitors:
                monitor.collect_metrics()
            if time.monotonic() < next_sample:
                continue
            next_sample += self.interval_s
            self._keep(monitors)
        for monitor in monitors:
            monitor.collect_metrics()
        self._keep(monitors)

    def _keep(self, monitors: list) -> None:
        sample: dict[str, float] = {}
        for monitor in monitors:
            sample.update(monitor.aggregate_metrics())
            monitor.clear_metrics()
        with self._lock:
            self._samples.append(sample)

    def take(self) -> list[dict[str, float]]:
        with self._lock:
            samples, self._samples = self._samples, []
        return samples

    def finish(self) -> None:
        """Stop sampling and wait for the last sample, for the caller's next :meth:`take`.

        Called when the node's training ends, before the driver learns that it has. A sampler
        never started (a run resumed at its last step runs none) starts now, for that one sample.
        """
        self._stop.set()
        if self._thread.ident is None:
            self._thread.start()
        self._thread.join(timeout=self.FINISH_TIMEOUT_S)

    def stop(self) -> None:
        self._stop.set()
