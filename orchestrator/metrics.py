"""remesh's Prometheus metrics, exported through Ray's metrics API.

Host actors set the per-host figures as their steps complete; the controller sets the job-wide
ones. Ray's metrics agent on each node serves them to Prometheus with the other Ray metrics (the
scrape configuration and Grafana dashboard in deploy/ read these names; a test checks they agree).
Created on first use, never at import: a bare worker process has no Ray.
"""

from __future__ import annotations

# name -> (kind, description, tag keys)
METRICS = {
    "remesh_step_seconds": ("gauge", "Wall time of the last training step on this host", ("job", "host")),
    "remesh_tokens_per_second": ("gauge", "Tokens per second of the last step (global batch)", ("job", "host")),
    "remesh_mfu": (
        "gauge",
        "Model FLOPs utilisation of the last step: XLA-counted FLOPs over the devices' peak",
        ("job", "host"),
    ),
    "remesh_step": ("gauge", "Last training step completed", ("job", "host")),
    "remesh_wait_seconds": (
        "gauge",
        "Time the last step waited for the devices and its peers, besides its input (a straggler waits least: the others wait for it)",
        ("job", "host"),
    ),
    "remesh_input_seconds": ("gauge", "Time the last step's input took on this host", ("job", "host")),
    "remesh_loss": ("gauge", "Training loss of the last step", ("job",)),
    "remesh_goodput_ratio": ("gauge", "Share of the job's wall time spent in useful steps", ("job",)),
    "remesh_badput_seconds": ("gauge", "Wall time lost so far, by kind (goodput.BADPUT)", ("job", "kind")),
    "remesh_devices": ("gauge", "Devices the current segment's plan uses", ("job",)),
    "remesh_host_losses_total": ("counter", "Hosts lost during the job", ("job",)),
}
# Of the per-host step metrics, the field of a step report (protocol.Step) each is set from.
STEP_GAUGES = {
    "remesh_step_seconds": "seconds",
    "remesh_tokens_per_second": "tokens_per_second",
    "remesh_mfu": "mfu",
    "remesh_step": "step",
    "remesh_wait_seconds": "wait_seconds",
    "remesh_input_seconds": "input_seconds",
}


class RayMetrics:
    """The metrics above as `ray.util.metrics` objects, made when first set."""

    def __init__(self):
        self._metrics: dict = {}

    def _get(self, name: str):
        if name not in self._metrics:
            from ray.util import metrics

            kind, description, tags = METRICS[name]
            cls = {"gauge": metrics.Gauge, "counter": metrics.Counter}[kind]
            self._metrics[name] = cls(name, description=description, tag_keys=tags)
        return self._metrics[name]

    def set(self, name: str, value: float, **tags: str) -> None:
        self._get(name).set(float(value), tags={k: str(v) for k, v in tags.items()})

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        self._get(name).inc(float(value), tags={k: str(v) for k, v in tags.items()})

    def step(self, job: str, host: int, report) -> None:
        """A host's `protocol.Step` report."""
        for name, field in STEP_GAUGES.items():
            self.set(name, getattr(report, field), job=job, host=host)
