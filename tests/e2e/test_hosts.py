"""Enrolled hosts, end to end: machines the user owns beside bought ones.

Three hosts run on this machine as `catacloud host` processes (each told a capacity of 2 cpus),
enrolled with tokens of a provider account of kind ``hosts``; a machine type on them takes one
cpu a job. Real worker, beat and live API; each slot is a sandboxed machine with its own agent
on its host, as on a user's server.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from apps.jobs.models import Job
from apps.machines.hosts import enrolment_token_create
from apps.machines.models import Host, MachineInstance, MachineType, ProviderAccount
from testkit.builders import granted_type, provider_account
from testkit.processes import ROOT, Proc, stop_local_machines
from tests.e2e.conftest import Stack
from tests.e2e.test_jobs_and_agent import job, logs

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

CAPACITY = 2
ENDED = ("succeeded", "failed", "cancelled", "timed_out")


@dataclass
class Hosts:
    """The ``hosts`` provider account, its machine type, and the host processes started."""

    stack: Stack
    account: ProviderAccount
    machine_type: MachineType
    procs: dict[str, Proc] = field(default_factory=dict)
    folders: dict[str, Path] = field(default_factory=dict)

    def token(self, org: Any = "own", uses: int = 1, **labels: str) -> str:
        return enrolment_token_create(
            provider_account=self.account,
            org=self.stack.world.org if org == "own" else org,
            labels=labels,
            max_uses=uses,
        )[1]

    def start(self, name: str, token: str = "", cpus: int = CAPACITY) -> Proc:
        """A host process (or the same host again, resuming its enrolment)."""
        folder = self.folders.setdefault(name, self.stack.tmp / f"host-{name}")
        folder.mkdir(exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        if token:
            env["CATACLOUD_ENROLMENT_TOKEN"] = token
        args = [sys.executable, "-m", "catacloud.agent", "host", "--url", self.stack.url]
        args += ["--state-file", str(folder / "host.json"), "--slots-dir", str(folder / "slots")]
        args += ["--cpus", str(cpus), "--memory-mb", "8192"]
        proc = Proc(f"host-{name}", args, env, folder / f"host-{len(self.procs)}.log")
        self.procs[name] = proc
        return proc

    def crash(self, name: str) -> None:
        """The host goes down with everything on it (its power cut)."""
        self.procs[name].kill()
        stop_local_machines(self.folders[name] / "slots", stop_timeout=0)

    def stop(self) -> None:
        for name, proc in self.procs.items():
            proc.stop()
            stop_local_machines(self.folders[name] / "slots", stop_timeout=1)


@pytest.fixture
def hosts(stack: Stack) -> Iterator[Hosts]:
    account = provider_account("hosts", "rack", {})
    mt, _ = granted_type(
        stack.world.org,
        account,
        "on-hosts",
        cpus=1,
        memory_mb=512,
        server_type="slot",
        price_per_hour=Decimal("0"),
        billing_increment_seconds=1,
        grant={"max_instances": 100, "max_concurrent_jobs": 100, "max_pool_size": 10},
    )
    group = Hosts(stack=stack, account=account, machine_type=mt)
    try:
        yield group
    finally:
        group.stop()


def config(stack: Stack, mt: MachineType, name: str, command: str, **fields: Any) -> str:
    body = {"name": name, "machine_type": str(mt.pk), "command": command, **fields}
    response = stack.api("admin").post("/api/v1/job-configs/", body, format="json")
    assert response.status_code == 201, response.content
    return str(response.json()["id"])


def submit_many(stack: Stack, config_id: str, n: int) -> list[str]:
    ids = []
    for _ in range(n):
        response = stack.api("member").post("/api/v1/jobs/", {"config": config_id}, format="json")
        assert response.status_code == 201, response.content
        ids.append(response.json()["id"])
    return ids


def wait_ended(stack: Stack, ids: list[str], timeout: float) -> list[dict[str, Any]]:
    stack.wait(lambda: all(job(stack, j)["status"] in ENDED for j in ids), timeout, f"{len(ids)} jobs to end")
    return [job(stack, j) for j in ids]


def enrolled(stack: Stack, n: int) -> list[Host]:
    return stack.wait(
        lambda: (h := list(Host.objects.all())) and len(h) >= n and h, 30, f"{n} hosts to enroll"
    )


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that overlap at one moment."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    level = best = 0
    for _, step in points:
        level += step
        best = max(best, level)
    return best


def per_host(job_ids: list[str]) -> dict[Any, list[tuple[float, float]]]:
    """Each host's jobs as (started, finished) intervals (the attempt that finished)."""
    found: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for row in Job.objects.filter(pk__in=job_ids).values("instance__host_id", "started_at", "finished_at"):
        span = (row["started_at"].timestamp(), row["finished_at"].timestamp())
        found[row["instance__host_id"]].append(span)
    return found


def test_jobs_run_on_enrolled_hosts_in_slots_at_most_their_capacity_at_once(
    stack: Stack, hosts: Hosts
) -> None:
    token = hosts.token(uses=3, site="lab")
    for name in ("a", "b", "c"):
        hosts.start(name, token)
    found = enrolled(stack, 3)
    assert {h.labels.get("site") for h in found} == {"lab"} and all(h.cpus == CAPACITY for h in found)
    cfg = config(stack, hosts.machine_type, "on-host", "echo on $(hostname); sleep 2", reuse="reuse")
    ids = submit_many(stack, cfg, 20)
    done = wait_ended(stack, ids, 240)
    assert [j["status"] for j in done] == ["succeeded"] * 20, done
    runs = per_host(ids)
    assert None not in runs and len(runs) == 3, runs.keys()  # every job ran on a host slot
    assert all(most_at_once(spans) <= CAPACITY for spans in runs.values()), runs
    assert max(most_at_once(spans) for spans in runs.values()) == CAPACITY  # slots, not one at a time
    assert all("on cc-" in logs(stack, j) for j in ids[:3])
    # Nothing was bought: every machine of the type is a slot of one of the three hosts.
    slots = MachineInstance.objects.filter(machine_type=hosts.machine_type)
    assert slots.filter(host__isnull=True).count() == 0
