"""Job metrics: queue depth by status (from PostgreSQL at scrape time) and wait time."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db.models import Count
from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from apps.core.metrics import register_db_collector

JOB_WAIT = Histogram(
    "catacloud_job_wait_seconds",
    "Time from submission (queued) to a machine (assigned)",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
)


def observe_wait(job: Any, now: datetime) -> None:
    JOB_WAIT.observe(max(0.0, (now - job.queued_at).total_seconds()))


@register_db_collector
def job_queue_gauges() -> Iterable[Metric]:
    from apps.jobs.choices import JOB_LIVE
    from apps.jobs.models import Job

    gauge = GaugeMetricFamily(
        "catacloud_jobs",
        "Live jobs by org, machine type and status",
        labels=["org", "machine_type", "status"],
    )
    rows = (
        Job.objects.filter(status__in=JOB_LIVE)
        .values("org__slug", "machine_type__name", "status")
        .annotate(n=Count("id"))
    )
    for row in rows:
        gauge.add_metric([row["org__slug"], row["machine_type__name"], row["status"]], row["n"])
    yield gauge
