"""Part 6: admission of queued jobs across many orgs with quotas (apps.jobs.admission.admit).

100 orgs, each granted one machine type with its own max_concurrent_jobs (and, for half of
them, a cpu quota), 100 queued jobs each. ``admit()`` is called until it admits nothing;
then every org's admitted jobs are counted against its quotas.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.harness import Figure, PartResult, Progress, analyze, median, say, tenant
from testkit.builders import job_config


def _setup(orgs: int, jobs_per_org: int) -> list[Any]:
    from apps.jobs.models import Job

    grants = []
    for i in range(orgs):
        quota = {"max_concurrent_jobs": 30 + (i % 5) * 10}
        if i % 2:
            quota["cpu_quota"] = 2 * (20 + (i % 4) * 10)  # machine type has 2 cpus
        t = tenant(f"adm{i}", **quota)
        cfg = job_config(t.org, t.machine_type, "ci", "true")
        Job.objects.bulk_create(
            Job(org=t.org, config=cfg, machine_type=t.machine_type, command="true")
            for _ in range(jobs_per_org)
        )
        grants.append(t.grant)
    analyze("jobs_job")
    return grants


def _reset() -> None:
    from apps.events.models import Event
    from apps.jobs.models import Job

    Job.objects.update(status="queued", admitted_at=None, pending_reason="")
    Event.objects.filter(kind="job.admitted").delete()
    analyze("jobs_job")


def _violations(grants: list[Any]) -> tuple[int, int]:
    from django.db.models import Count, Q

    from apps.jobs.choices import JOB_ADMITTED
    from apps.jobs.models import Job

    counts = dict(
        Job.objects.values_list("org_id").annotate(n=Count("id", filter=Q(status__in=JOB_ADMITTED)))
    )
    bad = expected = 0
    for g in grants:
        n = counts.get(g.org_id, 0)
        cap = g.max_concurrent_jobs
        if g.cpu_quota is not None:
            cap = min(cap, g.cpu_quota // 2)
        expected += min(cap, Job.objects.filter(org_id=g.org_id).count())
        if n > cap:
            bad += 1
    return bad, expected


def run(*, orgs: int = 100, jobs_per_org: int = 100, runs: int = 3, progress: Progress = say) -> PartResult:
    from apps.jobs.admission import admit

    result = PartResult(part="admission", title="Admission within quotas")
    progress(f"admission: creating {orgs} orgs x {jobs_per_org} queued jobs")
    grants = _setup(orgs, jobs_per_org)
    rates, admitted_runs, violations, expected = [], [], 0, 0
    for r in range(runs):
        if r:
            _reset()
        progress(f"admission: run {r + 1}/{runs} ({orgs * jobs_per_org} queued)")
        t0 = time.perf_counter()
        total = 0
        while n := admit(limit=500):
            total += n
        elapsed = time.perf_counter() - t0
        rates.append(total / elapsed)
        admitted_runs.append(total)
        bad, expected = _violations(grants)
        violations += bad
    rate = median(rates)
    result.data = {
        "orgs": orgs,
        "queued": orgs * jobs_per_org,
        "admitted": admitted_runs,
        "expected": expected,
        "rates": rates,
        "violations": violations,
    }
    result.figures += [
        Figure(
            "admissions per second",
            round(rate),
            "jobs/s",
            ">= 500/s",
            f"{admitted_runs[-1]} admitted of {orgs * jobs_per_org} queued",
            round(rate / 500, 2),
            rate >= 500,
        ),
        Figure("orgs over quota (all runs)", violations, "", "0", met=violations == 0),
        Figure(
            "admitted = what quotas allow",
            admitted_runs[-1],
            "jobs",
            f"{expected}",
            met=admitted_runs[-1] == expected,
        ),
    ]
    return result
