"""Enrolled hosts, end to end: machines the user owns beside bought ones.

Three hosts run on this machine as `catacloud host` processes (each told a capacity of 2 cpus),
enrolled with tokens of a provider account of kind ``hosts``; a machine type on them takes one
cpu a job. Real worker, beat and live API; each slot is a sandboxed machine with its own agent
on its host, as on a user's server.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import psutil
import pytest

from apps.jobs.models import Job
from apps.machines.hosts import enrolment_token_create
from apps.machines.models import Host, MachineInstance, MachineType, ProviderAccount
from catacloud.providers.local import end_processes, machine_processes
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

    def start(self, name: str, token: str = "", cpus: int = CAPACITY, mounts: tuple[dict, ...] = ()) -> Proc:
        """A host process (or the same host again, resuming its enrolment)."""
        folder = self.folders.setdefault(name, self.stack.tmp / f"host-{name}")
        folder.mkdir(exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        if token:
            env["CATACLOUD_ENROLMENT_TOKEN"] = token
        args = [sys.executable, "-m", "catacloud.agent", "host", "--url", self.stack.url]
        args += ["--state-file", str(folder / "host.json"), "--slots-dir", str(folder / "slots")]
        args += ["--cpus", str(cpus), "--memory-mb", "8192"]
        for mount in mounts:  # what the host has installed, shown in its slots (a runner)
            args += ["--mount", f"{mount['source']}:{mount['target']}"]
        proc = Proc(f"host-{name}", args, env, folder / f"host-{len(self.procs)}.log")
        self.procs[name] = proc
        return proc

    def host(self, name: str) -> Host:
        """The host this process enrolled as (its saved credential names it)."""
        import json

        path = self.folders[name] / "host.json"
        self.stack.wait(path.exists, 30, f"host {name} to enroll")
        return Host.objects.get(pk=json.loads(path.read_text())["host_id"])

    def crash(self, name: str) -> None:
        """The host goes down with everything on it (its power cut): no process of it answers a
        signal or sends a report. Its slots are frozen first, then everything is killed (a
        SIGTERM lets a slot's agent report its job failed before the SIGKILL, which a power cut
        never does; once a job's output went with its report, that report was quick enough to
        land now and then)."""
        slots = [p for procs in machine_processes(self.folders[name] / "slots").values() for p in procs]
        for proc in slots:
            with contextlib.suppress(psutil.Error):
                proc.suspend()
        self.procs[name].kill()
        end_processes(slots)
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


def running_on(stack: Stack, ids: list[str], n: int, timeout: float = 60) -> dict[str, Any]:
    """Wait until ``n`` of the jobs run; their hosts by job id."""

    def hosts_now() -> dict[str, Any] | None:
        rows = Job.objects.filter(pk__in=ids, status="running").values_list("pk", "instance__host_id")
        found = {str(pk): host for pk, host in rows}
        return found if len(found) >= n else None

    return stack.wait(hosts_now, timeout, f"{n} jobs running")


def test_a_host_killed_mid_job_has_its_jobs_requeued_elsewhere_and_comes_back_without_enrolling(
    stack: Stack, hosts: Hosts
) -> None:
    token = hosts.token(uses=2)
    hosts.start("a", token)
    hosts.start("b", token)
    a, b = hosts.host("a"), hosts.host("b")
    cfg = config(
        stack, hosts.machine_type, "work", "echo attempt $CATACLOUD_ATTEMPT; sleep 5", reuse="ephemeral"
    )
    ids = submit_many(stack, cfg, 4)
    on = running_on(stack, ids, 4)
    crashed = [j for j, host in on.items() if host == a.pk]
    assert len(crashed) == CAPACITY, on
    hosts.crash("a")
    done = wait_ended(stack, ids, 120)
    assert [j["status"] for j in done] == ["succeeded"] * 4, [
        (j["status"], j.get("failure_reason")) for j in done
    ]
    for row in Job.objects.filter(pk__in=crashed):
        assert row.attempt == 2 and row.requeue_reason == "machine_lost", (row.attempt, row.requeue_reason)
        assert row.instance.host_id == b.pk  # its second attempt ran on the host that lived
        text = logs(stack, str(row.pk))
        assert text.count("attempt 2") == 1, text  # never run twice: one attempt finished, once
    stack.wait(lambda: Host.objects.get(pk=a.pk).status == "lost", 30, "host a to be lost")
    hosts.start("a")  # no token: it resumes with its own credential
    stack.wait(lambda: Host.objects.get(pk=a.pk).status == "active", 30, "host a to come back")
    assert Host.objects.count() == 2  # the same host, not a new enrolment
    again = submit_many(stack, cfg, 4)
    assert [j["status"] for j in wait_ended(stack, again, 120)] == ["succeeded"] * 4
    assert {h for h in per_host(again)} == {a.pk, b.pk}  # it takes jobs again


def test_a_cordoned_host_takes_nothing_new_and_a_drained_one_finishes_its_jobs(
    stack: Stack, hosts: Hosts
) -> None:
    from apps.machines.hostops import host_cordon, host_uncordon

    token = hosts.token(uses=2)
    hosts.start("a", token)
    hosts.start("b", token)
    a, b = hosts.host("a"), hosts.host("b")
    host_cordon(host_id=a.pk)
    cfg = config(stack, hosts.machine_type, "work", "sleep 4", reuse="ephemeral")
    ids = submit_many(stack, cfg, 4)
    on = running_on(stack, ids, 2)  # b's two slots; a takes nothing new
    assert set(on.values()) == {b.pk}, on
    host_cordon(host_id=b.pk, drain_seconds=60)  # both cordoned now: nothing goes anywhere
    done = wait_ended(stack, list(on), 60)
    assert [j["status"] for j in done] == ["succeeded"] * 2  # drained: its jobs finished
    waiting = [j for j in ids if j not in on]
    reasons = [job(stack, j)["pending_reason"] for j in waiting]
    assert all(job(stack, j)["status"] == "waiting_for_machine" for j in waiting), reasons
    assert all("host" in reason for reason in reasons), reasons
    assert not MachineInstance.objects.filter(host__in=[a.pk, b.pk], status__in=["ready", "claimed"]).exists()
    host_uncordon(host_id=a.pk)
    assert [j["status"] for j in wait_ended(stack, waiting, 60)] == ["succeeded"] * 2
    assert set(per_host(waiting)) == {a.pk}


def test_a_host_of_one_organization_never_runs_anothers_job(stack: Stack, hosts: Hosts) -> None:
    from apps.machines.models import OrgMachineType

    world = stack.world
    OrgMachineType.objects.create(org=world.other_org, machine_type=hosts.machine_type, max_instances=50)
    hosts.start("own", hosts.token())  # acme's own host
    hosts.start("shared", hosts.token(org=None))  # the operator's, for every granted org
    own, shared = hosts.host("own"), hosts.host("shared")
    assert own.org_id == world.org.pk and shared.org_id is None
    cfg = config(stack, hosts.machine_type, "work", "sleep 2", reuse="ephemeral")
    theirs = stack.api("outsider").post(
        "/api/v1/job-configs/",
        {
            "name": "theirs",
            "machine_type": str(hosts.machine_type.pk),
            "command": "sleep 2",
            "reuse": "ephemeral",
        },
        format="json",
    )
    assert theirs.status_code == 201, theirs.content
    rival = [
        stack.api("outsider")
        .post("/api/v1/jobs/", {"config": theirs.json()["id"]}, format="json")
        .json()["id"]
        for _ in range(4)
    ]
    ours = submit_many(stack, cfg, 4)
    stack.wait(
        lambda: Job.objects.filter(pk__in=rival + ours, status="succeeded").count() == 8,
        120,
        "8 jobs to succeed",
    )
    assert set(per_host(rival)) == {shared.pk}  # never on acme's own host
    assert set(per_host(ours)) <= {own.pk, shared.pk}


def test_a_job_overflows_to_a_bought_machine_only_after_its_bound_and_costs_split_owned_and_bought(
    stack: Stack, hosts: Hosts
) -> None:
    from apps.events.models import Event
    from apps.machines.hostops import host_update

    hosts.start("a", hosts.token(), cpus=1)  # one slot
    a = hosts.host("a")
    host_update(host_id=a.pk, monthly_price="730")  # 1 an hour for the whole host
    bound = 4
    cfg = config(
        stack,
        hosts.machine_type,
        "burst",
        "sleep 6",
        reuse="ephemeral",
        overflow_machine_type=stack.world.machine_type.name,
        overflow_after_seconds=bound,
    )
    ids = submit_many(stack, cfg, 3)
    done = wait_ended(stack, ids, 120)
    assert [j["status"] for j in done] == ["succeeded"] * 3, done
    runs = Job.objects.filter(pk__in=ids).select_related("instance")
    on_host = [j for j in runs if j.instance.host_id == a.pk]
    bought = [j for j in runs if j.instance.host_id is None]
    assert len(on_host) == 1 and len(bought) == 2, [(j.pk, j.instance.host_id) for j in runs]
    for j in bought:
        moved = Event.objects.get(kind="job.overflowed", job_id=j.pk)
        admitted = Event.objects.filter(kind="job.admitted", job_id=j.pk).order_by("created_at").first()
        assert admitted is not None and (moved.created_at - admitted.created_at).total_seconds() >= bound
        assert j.instance.created_at >= moved.created_at  # nothing bought before the bound
    assert not Event.objects.filter(kind="job.overflowed", job_id=on_host[0].pk).exists()
    report = stack.api("viewer").get("/api/v1/costs/", {"group_by": "owner"}).json()
    by_owner = {r["key"]: Decimal(r["total"]) for r in report["results"]}
    assert by_owner.get("owned", 0) > 0 and by_owner.get("bought", 0) > 0, report


def test_github_and_gitlab_runner_jobs_run_on_enrolled_hosts(stack: Stack, hosts: Hosts) -> None:
    from testkit import github_kit, gitlab_kit
    from testkit.github_fake import FakeGitHub, app_keypair
    from testkit.gitlab_fake import FakeGitLab

    world = stack.world
    private, public = app_keypair()
    github = FakeGitHub(
        app_id=31,
        public_key=public,
        webhook_secret="hosts-gh",
        webhook_url=stack.url + github_kit.WEBHOOK_PATH,
    ).start()
    gitlab = FakeGitLab(
        token="glpat-hosts", webhook_token="hosts-gl", webhook_url=stack.url + gitlab_kit.WEBHOOK_PATH
    ).start()
    try:
        github.add_installation(9, "acme", ["acme/app"])
        gitlab.add_project(13, "acme/app")
        token = hosts.token(uses=2)
        for name in ("a", "b"):  # the runners are installed on the hosts, as on a user's server
            hosts.start(name, token, mounts=(github_kit.RUNNER_MOUNT, gitlab_kit.RUNNER_MOUNT))
        a, b = hosts.host("a"), hosts.host("b")
        mt = hosts.machine_type
        github_kit.connect(
            world.org,
            github,
            private,
            installation_id=9,
            account="acme",
            classes=[{"name": "on-hosts", "labels": ["self-hosted", "on-hosts"], "machine_type": mt}],
        )
        gitlab_kit.connect(
            world.org,
            gitlab,
            projects=[(13, "acme/app")],
            classes=[{"name": "on-hosts", "tags": ["on-hosts"], "machine_type": mt}],
        )
        gh = [
            github.queue_job("acme/app", ["self-hosted", "on-hosts"], ["echo gh", "sleep 1"])
            for _ in range(3)
        ]
        gl = [gitlab.queue_job("acme/app", ["on-hosts"], ["echo gl", "sleep 1"]) for _ in range(3)]
        stack.wait(
            lambda: all(github.job(i).status == "completed" for i in gh) and not gitlab.unfinished(gl),
            240,
            "every workflow and CI job to finish",
        )
        assert {github.job(i).conclusion for i in gh} == {"success"}
        assert {gitlab.job(i).status for i in gl} == {"success"}
        runner_jobs = Job.objects.filter(machine_type=mt).exclude(instance=None)
        assert runner_jobs.count() >= 6
        assert set(runner_jobs.values_list("instance__host_id", flat=True)) <= {a.pk, b.pk}
    finally:
        github.stop()
        gitlab.stop()
