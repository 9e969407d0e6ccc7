"""/metrics under a real gunicorn with two workers: every scrape tells the same figures,
whichever worker serves it (prometheus_client multiprocess mode for in-process counters;
PostgreSQL at scrape time for what workers record, such as job wait times)."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import requests
from django.utils import timezone

from testkit.builders import job_config, job_row
from testkit.processes import TESTS, wait_for
from tests.conftest import World

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TOKEN = "metrics-test-token"
SAMPLE = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def _samples(body: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in body.splitlines():
        m = SAMPLE.match(line)
        if m:
            out[(m["name"], m["labels"] or "")] = float(m["value"])
    return out


def _scrape_by_worker(url: str, log: Path, want_workers: int = 2, tries: int = 60) -> dict[str, list[dict]]:
    """Scrape on fresh connections until ``want_workers`` different gunicorn workers have
    answered (the access log names the pid that served each request)."""
    by_pid: dict[str, list[dict]] = {}
    for _ in range(tries):
        before = log.read_text().count("GET /metrics")
        response = requests.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert response.status_code == 200, response.text
        wait_for(lambda b=before: log.read_text().count("GET /metrics") > b, 10, "the access log line")
        pid = [line for line in log.read_text().splitlines() if "GET /metrics" in line][-1].split()[0]
        by_pid.setdefault(pid, []).append(_samples(response.text))
        if len(by_pid) >= want_workers and all(len(v) >= 2 for v in by_pid.values()):
            break
    assert len(by_pid) >= want_workers, f"only workers {list(by_pid)} answered"
    return by_pid


def test_two_workers_serve_the_same_figures(tworld: World, tmp_path: Path) -> None:
    from apps.jobs.models import Job

    # Jobs the scheduler (a Celery worker, elsewhere) assigned: waits of 3 s and 40 s.
    config = job_config(tworld.org, tworld.machine_type, "c", "true")
    assigned = timezone.now() - timedelta(seconds=5)
    for wait in (3, 40):
        job = job_row(config, status="succeeded", assigned_at=assigned)
        Job.objects.filter(pk=job.pk).update(queued_at=assigned - timedelta(seconds=wait))  # auto_now_add

    args = ("--access-logfile", "-", "--access-logformat", "%(p)s %(r)s %(s)s")
    with TESTS.gunicorn(tmp_path, workers=2, threads=2, args=args, CATACLOUD_METRICS_TOKEN=TOKEN) as (
        url,
        web,
    ):
        # Requests spread over both workers (a fresh connection each).
        for _ in range(30):
            assert requests.get(f"{url}/api/v1/machine-types/", timeout=10).status_code == 401
        time.sleep(0.5)
        by_pid = _scrape_by_worker(url, web.log)

    counter = ("catacloud_http_requests_total", 'method="GET",route="/api/v1/machine-types/",status="401"')
    wait_count = ("catacloud_job_wait_seconds_count", "")
    wait_le_5 = ("catacloud_job_wait_seconds_bucket", 'le="5.0"')
    wait_sum = ("catacloud_job_wait_seconds_sum", "")
    for pid, scrapes in by_pid.items():
        for samples in scrapes:
            assert samples[counter] == 30, (pid, samples.get(counter))  # not 30 split in two
            assert samples[wait_count] == 2 and samples[wait_le_5] == 1, (pid, samples.get(wait_count))
            assert samples[wait_sum] == pytest.approx(43, abs=0.01)
            # One route-label style: URL paths with {name} for every parameter.
            routes = {re.search(r'route="([^"]*)"', k[1]).group(1) for k in samples if 'route="' in k[1]}
            assert all(r.startswith("/") and "(?P" not in r and "<" not in r for r in routes), routes
