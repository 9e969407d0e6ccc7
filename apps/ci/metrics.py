"""The CI integrations' limits as metrics, read from PostgreSQL at scrape time (every forge's
endpoints and classes), so any web process answers the same:

- ``catacloud_ci_limit_answers_total{forge}``: limit answers the forges gave (primary or
  secondary, 403 or 429), summed over their endpoints;
- ``catacloud_ci_endpoints_limited{forge,kind}``: endpoints waiting now, for a limit answer
  (``limited``), an outage (``unavailable``), or our pacing below a documented limit (``paced``);
- ``catacloud_ci_runner_jobs_held{forge}``: runner jobs held in the queue by a limit;
- ``catacloud_ci_classes_blocked{forge}``: runner classes starting no runner (their runner is a
  version the forge no longer accepts);
- ``catacloud_ci_last_reconcile_timestamp_seconds{forge}``: the newest reconcile of any endpoint
  (Unix time; it must keep moving while a forge limits us: alert on it standing still).
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import Max, Q, Sum
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from apps.ci.availability import is_limit
from apps.ci.forge import forges
from apps.core.metrics import register_db_collector
from apps.jobs.choices import JobStatus


@register_db_collector
def ci_metrics() -> Iterable[Metric]:
    now = timezone.now()
    answers = CounterMetricFamily(
        "catacloud_ci_limit_answers", "Limit answers the forge gave", labels=["forge"]
    )
    waiting = GaugeMetricFamily(
        "catacloud_ci_endpoints_limited", "Endpoints waiting now, by why", labels=["forge", "kind"]
    )
    held = GaugeMetricFamily("catacloud_ci_runner_jobs_held", "Runner jobs held by a limit", labels=["forge"])
    blocked = GaugeMetricFamily(
        "catacloud_ci_classes_blocked", "Runner classes starting no runner", labels=["forge"]
    )
    reconciled = GaugeMetricFamily(
        "catacloud_ci_last_reconcile_timestamp_seconds", "The newest reconcile (Unix time)", labels=["forge"]
    )
    for forge in forges():
        endpoints = forge.endpoint.objects
        totals = endpoints.aggregate(limited=Sum("limited_total"), last=Max("reconciled_at"))
        answers.add_metric([forge.name], float(totals["limited"] or 0))
        paused = list(
            endpoints.filter(unavailable_until__gt=now).values_list("unavailable_reason", flat=True)
        )
        limited = sum(1 for reason in paused if is_limit(reason))
        waiting.add_metric([forge.name, "limited"], limited)
        waiting.add_metric([forge.name, "unavailable"], len(paused) - limited)
        waiting.add_metric([forge.name, "paced"], endpoints.filter(paced_until__gt=now).count())
        held.add_metric(
            [forge.name],
            forge.runner.objects.filter(job__status=JobStatus.QUEUED)
            .filter(Q(held_until__gt=now) | ~Q(job__hold_reason=""))
            .count(),
        )
        blocked.add_metric([forge.name], forge.runner_class.objects.filter(blocked_at__isnull=False).count())
        reconciled.add_metric([forge.name], totals["last"].timestamp() if totals["last"] else 0.0)
    yield from (answers, waiting, held, blocked, reconciled)
