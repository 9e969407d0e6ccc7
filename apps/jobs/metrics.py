"""Job metrics, read from PostgreSQL at scrape time: live jobs by status, and job wait time.

Wait time is computed from the rows rather than observed in the process that assigns the job:
the scheduler runs in Celery workers, the scrape is served by web processes, and a histogram
kept in a worker's memory never reached the scrape (``catacloud_job_wait_seconds`` stayed 0).
From the rows, every web process answers the same, wherever the workers run.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import connection
from django.db.models import Count
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

from apps.core.metrics import register_db_collector

WAIT_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


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


@register_db_collector
def job_wait_histogram() -> Iterable[Metric]:
    """Seconds from a job's (latest) queueing to its machine, over every job that got one:
    one aggregate query, cumulative buckets as Prometheus expects."""
    from apps.jobs.models import Job

    wait = "EXTRACT(EPOCH FROM (assigned_at - queued_at))"
    buckets = ", ".join(f"COUNT(*) FILTER (WHERE {wait} <= %s)" for _ in WAIT_BUCKETS)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {buckets}, COUNT(*), COALESCE(SUM(GREATEST({wait}, 0)), 0) "
            f"FROM {Job._meta.db_table} WHERE assigned_at IS NOT NULL",
            list(WAIT_BUCKETS),
        )
        row = cursor.fetchone()
    counts, total, seconds = row[: len(WAIT_BUCKETS)], row[-2], float(row[-1])
    family = HistogramMetricFamily(
        "catacloud_job_wait_seconds",
        "Time from submission (queued) to a machine (assigned), per job (its latest attempt)",
    )
    cumulative = [(repr(float(b)), int(c)) for b, c in zip(WAIT_BUCKETS, counts, strict=True)]
    family.add_metric([], [*cumulative, ("+Inf", int(total))], sum_value=seconds)
    yield family
