"""The reaper's metrics, read from PostgreSQL at scrape time (the ``reaper`` heartbeat row the
tick writes), so every web process serves them whichever worker or beat leads the reaper:

- ``catacloud_reaper_tick_seconds``: a histogram of every tick's duration;
- ``catacloud_reaper_last_tick_timestamp_seconds``: when the last tick ended (Unix time; alert
  on ``time() - catacloud_reaper_last_tick_timestamp_seconds > 3 * CATACLOUD_REAPER_INTERVAL``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

from apps.control.reaper import TICK_BUCKETS
from apps.core.metrics import register_db_collector
from apps.core.models import Heartbeat


@register_db_collector
def reaper_metrics() -> Iterable[Metric]:
    row = Heartbeat.objects.filter(name="reaper").values("seen_at", "detail").first()
    last = GaugeMetricFamily(
        "catacloud_reaper_last_tick_timestamp_seconds", "When the last reaper tick ended (Unix time)"
    )
    ticks = HistogramMetricFamily("catacloud_reaper_tick_seconds", "Duration of each reaper tick")
    detail: dict[str, Any] = (row["detail"] if row is not None else None) or {}
    buckets = detail.get("buckets") or [0] * len(TICK_BUCKETS)
    if len(buckets) != len(TICK_BUCKETS):
        buckets = [0] * len(TICK_BUCKETS)
    count = int(detail.get("count", 0))
    pairs = [(f"{bound:g}", n) for bound, n in zip(TICK_BUCKETS, buckets, strict=True)]
    ticks.add_metric([], [*pairs, ("+Inf", count)], sum_value=float(detail.get("sum", 0.0)))
    yield ticks
    last.add_metric([], row["seen_at"].timestamp() if row is not None else 0.0)  # 0: never ticked
    yield last
