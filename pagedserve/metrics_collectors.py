"""The labelled series of one engine's metrics (`pagedserve.metrics`), in collectors that the
engines of one registry share (data parallelism: each engine with its own `engine` label)."""

import weakref
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_PREFIX = "pagedserve:"

_FAMILIES: "weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Any]]" = (
    weakref.WeakKeyDictionary()
)


class EngineCollectors:
    """Makes (or, for the engines after the first, finds) the collectors of `registry`, and
    hands out their series labelled `labels` (`model_name`, and `engine` if any)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels
        # The collectors made in `registry` so far, by metric name (without the prefix).
        self._families = _FAMILIES.setdefault(registry, {})

    def family(
        self, kind: Any, metric: str, doc: str, extra: tuple[str, ...] = (), **kw: Any
    ) -> Any:
        """The collector `metric` of this registry (made by the first engine's metrics),
        checked to have this engine's label names."""
        label_names = (*self.labels, *extra)
        collector = self._families.get(metric)
        if collector is None:
            collector = kind(_PREFIX + metric, doc, label_names, registry=self.registry, **kw)
            self._families[metric] = collector
        elif tuple(collector._labelnames) != label_names:
            raise ValueError(
                f"metric {metric} is registered with labels {collector._labelnames}, not "
                f"{label_names}: give every engine of one registry an engine label, or none"
            )
        return collector

    def gauge(self, metric: str, doc: str) -> Gauge:
        return self.family(Gauge, metric, doc).labels(**self.labels)  # type: ignore[no-any-return]

    def counter(self, metric: str, doc: str) -> Counter:
        collector = self.family(Counter, metric, doc)
        return collector.labels(**self.labels)  # type: ignore[no-any-return]

    def histogram(self, metric: str, doc: str, buckets: list[float]) -> Histogram:
        collector = self.family(Histogram, metric, doc, buckets=buckets)
        return collector.labels(**self.labels)  # type: ignore[no-any-return]
