"""Every job is one trace (apps/core/tracing.py): the web, the agent server, the worker and the
agent's reports all put their spans in it, and `jobs show --timing` says where the start went.
Real processes (gunicorn, the agent server, a worker, beat, a local machine's agent), tracing on
with the standard variables and Catacloud's file exporter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import requests

from apps.core import tracing
from apps.jobs.models import Job
from testkit.builders import job_config
from testkit.processes import TESTS, purge_redis, stop_local_machines, wait_for
from tests.conftest import World
from tests.e2e.conftest import FAST

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_job_is_one_trace_from_its_submit_to_its_agents_reports(tworld: World, tmp_path: Path) -> None:
    from apps.orgs.services import api_token_create
    from apps.pools.services import pool_create

    purge_redis()
    traces = tmp_path / "traces.jsonl"
    env = {
        **FAST,
        "OTEL_TRACES_EXPORTER": "file",
        "CATACLOUD_TRACES_FILE": str(traces),
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    state_dir = tworld.account.config["state_dir"]
    try:
        with (
            TESTS.gunicorn(tmp_path, **env) as (url, _),
            TESTS.agent_server(tmp_path, **env) as (agent_url, _),
        ):
            wenv = {**env, "CATACLOUD_PUBLIC_URL": url, "CATACLOUD_AGENT_URL": agent_url}
            with TESTS.celery_worker(tmp_path, **wenv), TESTS.celery_beat(tmp_path, **wenv):
                pool = pool_create(
                    org=tworld.org, name="traced", machine_type=tworld.machine_type, target_size=1, max_size=1
                )
                from apps.pools.services import pool_refill

                pool_refill(pool_id=pool.pk)
                wait_for(
                    lambda: pool.members.filter(status="ready").exists(), 90, "a ready member", interval=0.1
                )
                config = job_config(tworld.org, tworld.machine_type, "traced", "true")
                token = api_token_create(org=tworld.org, user=tworld.users["member"])[1]
                api = requests.Session()
                api.headers["Authorization"] = f"Bearer {token}"
                r = api.post(f"{url}/api/v1/jobs/", json={"config": str(config.pk)}, timeout=30)
                assert r.status_code == 201, r.text
                job_id = r.json()["id"]
                wait_for(
                    lambda: Job.objects.get(pk=job_id).status == "succeeded", 60, "the job to succeed", 0.1
                )
                job = Job.objects.get(pk=job_id)
                trace = tracing.trace_id(job.traceparent)
                assert trace, "the submit gave the job a trace"
                wanted = {
                    "job.submit",
                    "admission",
                    "placement",
                    "claim",
                    "wake-up",
                    "poll answer",
                    "agent start",
                }

                def names() -> set[str]:
                    return {s["name"] for s in _spans(traces) if s["trace_id"] == trace}

                try:
                    wait_for(lambda: wanted <= names(), 20, "the job's spans exported", 0.2)
                except AssertionError:
                    raise AssertionError(f"spans of the job's trace: {sorted(names())}") from None
                spans = [s for s in _spans(traces) if s["trace_id"] == trace]
                services = {s["service"] for s in spans}
                # the web (submit), the agent server (poll answer, the agent's reports), the
                # agent's `started` and `finished` came back in the same trace (its header)
                assert {"catacloud-web", "catacloud-agent-server"} <= services, services
                reports = [
                    s for s in spans if s["service"] == "catacloud-agent-server" and "started" in s["name"]
                ]
                assert reports, sorted({s["name"] for s in spans})
                assert any(s["attributes"].get("db.system") or "SELECT" in s["name"] for s in spans), (
                    "psycopg's spans are in the job's trace"
                )
                timing = api.get(f"{url}/api/v1/jobs/{job_id}/timing/", timeout=30).json()
                assert timing["trace_id"] == trace
                assert [st["name"] for st in timing["stages"]] == [
                    "admission",
                    "placement",
                    "wake-up and poll",
                    "agent",
                    "network and report",
                ]
                assert all(st["ms"] is not None for st in timing["stages"]), timing
                parts = sum(st["ms"] for st in timing["stages"])
                assert abs(parts - timing["submit_to_running_ms"]) < 1.0, timing
                # then, on the machine: started -> its command launched, as its agent reported it
                launch = timing["launch"]
                assert launch and launch["ms"] > 0 and launch["network"] in ("ahead", "at start", "none")
    finally:
        stop_local_machines(state_dir)


def test_tracing_is_off_unless_the_standard_variables_ask_for_it() -> None:
    assert not tracing.wanted({})
    assert not tracing.wanted({"OTEL_TRACES_EXPORTER": "none"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "otlp"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"})
    assert tracing.trace_id("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01") == (
        "0af7651916cd43dd8448eb211c80319c"
    )
