"""Pool metrics: members by pool and status (from PostgreSQL at scrape time), claim latency."""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import Count
from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from apps.core.metrics import register_db_collector
from apps.machines.choices import INSTANCE_LIVE
from apps.machines.models import MachineInstance

CLAIM_LATENCY = Histogram(
    "catacloud_pool_claim_seconds",
    "Time to claim a warm pool member (the claim service: API acquires and job placement)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)


@register_db_collector
def pool_member_gauges() -> Iterable[Metric]:
    gauge = GaugeMetricFamily(
        "catacloud_pool_members", "Live pool members by pool and status", labels=["org", "pool", "status"]
    )
    rows = (
        MachineInstance.objects.filter(pool__isnull=False, status__in=INSTANCE_LIVE)
        .values("pool__org__slug", "pool__name", "status")
        .annotate(n=Count("id"))
    )
    for row in rows:
        gauge.add_metric([row["pool__org__slug"], row["pool__name"], row["status"]], row["n"])
    yield gauge
