"""GitHub Actions on Catacloud end to end: the fake GitHub (a thread of this process) sends
signed deliveries to the live server; a real worker and beat dispatch; the local provider's
agents run the stand-in runner, which registers with the fake, takes a job, runs its steps."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import pytest

from apps.github.models import WorkflowJob
from apps.jobs.models import Job, JobLogChunk
from apps.pools.services import pool_create, pool_refill
from testkit.github_fake import FakeGitHub, app_keypair
from testkit.github_kit import WEBHOOK_PATH, allow_loopback, connect, expose_runner
from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
LABELS = ["self-hosted", "catacloud-linux-2cpu"]


@dataclass
class GitHubStack:
    stack: Stack
    fake: FakeGitHub
    classes: list[Any]

    def all_completed(self, ids: list[int]) -> bool:
        return all(self.fake.job(i).status == "completed" for i in ids)


@pytest.fixture
def github(stack: Stack) -> Iterator[GitHubStack]:
    private, public = app_keypair()
    fake = FakeGitHub(
        app_id=11,
        public_key=public,
        webhook_secret="e2e-webhook-secret",
        webhook_url=stack.url + WEBHOOK_PATH,
    ).start()
    fake.add_installation(5, "acme", ["acme/app", "acme/web"])
    world = stack.world
    # The runner folder is part of the machines' "image": shown before the pool's first machine starts.
    expose_runner(world.account)
    pool = pool_create(
        org=world.org, name="ci-small", machine_type=world.machine_type, target_size=2, max_size=6
    )
    pool_refill(pool_id=pool.pk)
    classes = connect(
        world.org,
        fake,
        private,
        installation_id=5,
        account="acme",
        classes=[{"name": "small", "labels": LABELS, "machine_type": world.machine_type, "pool": pool}],
    )
    try:
        yield GitHubStack(stack, fake, classes)
    finally:
        fake.stop()


def test_workflow_jobs_run_on_catacloud_machines(github: GitHubStack) -> None:
    fake, stack = github.fake, github.stack
    ids = [
        fake.queue_job(repo, LABELS, ["echo step one in $(pwd)", "sleep 1"], workflow="CI", name=f"build-{i}")
        for i, repo in enumerate(["acme/app", "acme/app", "acme/web", "acme/app"])
    ]
    stack.wait(lambda: github.all_completed(ids), 120, "every workflow job to complete")
    assert {fake.job(i).conclusion for i in ids} == {"success"}
    ran_on = {fake.job(i).runner_name for i in ids}
    assert all(name and name.startswith("catacloud-") for name in ran_on)
    # a just-in-time runner for each job; a machine whose paid hour goes on may serve several
    assert len({fake.job(i).runner_id for i in ids}) == 4 and 1 <= len(ran_on) <= 4
    stack.wait(
        lambda: Job.objects.filter(runner__isnull=False).exclude(status="succeeded").count() == 0,
        60,
        "the runner jobs to end",
    )
    assert Job.objects.filter(runner__isnull=False, status="succeeded").count() == 4
    # our records follow GitHub's deliveries: a runner may exit before its job's `completed`
    # delivery is in (a machine that serves several runners in a row is quick to report)
    stack.wait(
        lambda: set(WorkflowJob.objects.values_list("status", flat=True)) == {"completed"},
        30,
        "every workflow job record to be completed",
    )
    assert all(r.job_id for r in WorkflowJob.objects.all())
    assert fake.summary()["runners"] == []  # just-in-time runners are gone with their job
    job = Job.objects.filter(runner__isnull=False).first()
    assert job is not None
    text = "".join(JobLogChunk.objects.filter(job=job).values_list("data", flat=True))
    assert "Running job" in text and "completed with result: success" in text
    everything = "".join(JobLogChunk.objects.values_list("data", flat=True))
    assert fake.issued_configs and not any(c in everything for c in fake.issued_configs)  # masked
    costs = stack.api("viewer").get("/api/v1/costs/?group_by=repository").json()
    assert {"acme/app", "acme/web"} <= {r["key"] for r in costs["results"]}
    # about 1-2 GitHub calls per job (the registration; a token now and then; reconciles)
    assert fake.count("POST", "/orgs/acme/actions/runners/generate-jitconfig") == 4


def _kill_an_agent_running_a_runner(stack: Stack) -> str | None:
    """SIGKILL the agent (and its runner) of one machine running a runner job: a machine lost."""
    from apps.machines.models import MachineInstance
    from testkit.processes import agent_tree, local_machines

    busy = {
        str(pk)
        for pk in MachineInstance.objects.filter(
            status="claimed", jobs__runner__isnull=False, jobs__status="running"
        )
        .values_list("pk", flat=True)
        .distinct()
    }
    for record in local_machines(stack.world.account.config["state_dir"]):
        if record.get("instance_id") in busy:
            for proc in agent_tree(record):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            return str(record["instance_id"])
    return None


@pytest.mark.timeout(900)
def test_sixty_jobs_over_three_classes_with_faults_all_complete_and_nothing_is_left(
    github: GitHubStack,
) -> None:
    """The issue's proof: 60 workflow jobs over 3 runner classes with 10 % of deliveries
    dropped (half lost for good, half redeliverable), duplicates, reordering, 5 % GitHub 5xx, a
    rate-limit window, a runner that crashes, one that never connects, an agent and a worker
    killed, three jobs cancelled: every job completes, nothing stays registered or claimed,
    runners never exceed queued jobs plus pool targets, quotas and the budget hold."""
    from apps.billing.budgets import budget_set
    from apps.github.models import Runner
    from apps.github.services import runner_class_save
    from apps.jobs.choices import JOB_LIVE
    from apps.machines.choices import INSTANCE_COUNTED
    from apps.machines.models import MachineInstance, OrgMachineType
    from apps.pools.models import InstancePool
    from testkit.builders import granted_type
    from testkit.processes import TESTS

    stack, fake = github.stack, github.fake
    world = stack.world
    fake.lost_after, fake.offline_after = 6.0, 5.0
    OrgMachineType.objects.filter(pk=world.grant.pk).update(max_instances=8, max_concurrent_jobs=8)
    labels = {"a": LABELS}
    for name in ("b", "c"):
        mt, _ = granted_type(
            world.org,
            world.account,
            f"ci-{name}",
            grant={"max_instances": 8, "max_concurrent_jobs": 8, "max_pool_size": 8},
        )
        allow_loopback(mt, fake.url)  # its runners reach the fake GitHub, as connect() lets the first
        pool = pool_create(org=world.org, name=f"ci-{name}", machine_type=mt, target_size=2, max_size=8)
        pool_refill(pool_id=pool.pk)
        labels[name] = ["self-hosted", f"catacloud-{name}"]
        runner_class_save(
            org=world.org,
            name=name,
            labels=labels[name],
            machine_type=mt,
            pool=pool,
            runner_dir=github.classes[0].runner_dir,
            online_timeout_seconds=20,
            idle_timeout_seconds=60,
        )
    runner_class_save(
        org=world.org, runner_class=github.classes[0], online_timeout_seconds=20, idle_timeout_seconds=60
    )
    budget = budget_set(org=world.org, amount="50.00", period="month", actor="test")
    targets = sum(InstancePool.objects.values_list("target_size", flat=True))
    fake.drop_rate, fake.lost_rate, fake.duplicate_rate, fake.reorder_rate = 0.05, 0.05, 0.1, 0.1
    fake.error_rate = 0.05
    fake.runner_faults.extend(["crash", "never_connect"])

    violations: list[str] = []
    stop = threading.Event()

    def sample() -> None:
        from django.db import connection

        try:
            while not stop.wait(0.5):
                # GitHub's view: registered runners never exceed the jobs they may run plus the
                # pools' targets (+2: a registration between the fake's two counts)
                github_view = fake.summary()
                jobs, registered = github_view["jobs"], len(github_view["runners"])
                if registered > jobs["queued"] + jobs["in_progress"] + targets + 2:
                    kinds = Counter(
                        ("busy" if r["busy"] else "idle") + " " + r["status"] for r in github_view["runners"]
                    )
                    violations.append(f"{registered} runners registered ({dict(kinds)}) for {jobs}")
                # ours: runners not yet given a job never exceed the queued jobs we know of
                supply = Runner.objects.filter(
                    job__status__in=JOB_LIVE, workflow_job__isnull=True, retire_requested_at__isnull=True
                ).count()
                known = WorkflowJob.objects.filter(status="queued").count()
                if supply > known + targets:
                    violations.append(f"{supply} unbound runners for {known} queued jobs")
                for grant in OrgMachineType.objects.filter(org=world.org):
                    live = MachineInstance.objects.filter(
                        org=world.org, machine_type_id=grant.machine_type_id, status__in=INSTANCE_COUNTED
                    ).count()
                    if live > grant.max_instances:
                        violations.append(
                            f"{live} machines of {grant.machine_type_id} over {grant.max_instances}"
                        )
        finally:
            connection.close()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ids: list[int] = []
    with TESTS.celery_worker(stack.tmp, concurrency=2, **{"CATACLOUD_PUBLIC_URL": stack.url}) as extra:
        for i in range(60):
            name = "abc"[i % 3]
            ids.append(
                fake.queue_job(
                    f"acme/{'app' if i % 2 else 'web'}",
                    labels[name],
                    [f"echo job {i}", "sleep 1"],
                    workflow=f"wf-{name}",
                    name=f"job-{i}",
                )
            )
            if i == 10:
                fake.rate_limit_for(3)
            if i == 20:
                for victim in ids[-3:]:
                    fake.cancel_job(victim)
            time.sleep(0.15)
        stack.wait(
            lambda: _kill_an_agent_running_a_runner(stack) is not None, 60, "an agent running a runner"
        )
        extra.kill()

    def done() -> bool:
        if int(time.monotonic()) % 15 == 0:
            print(time.strftime("%H:%M:%S"), fake.summary()["jobs"], flush=True)
        return github.all_completed(ids)

    stack.wait(done, 400, "every workflow job to complete")
    last = time.monotonic()

    def leftovers() -> str:
        jobs = list(
            Job.objects.filter(runner__isnull=False, status__in=JOB_LIVE).values_list(
                "status", "pending_reason", "hold_reason", "handed_off_to", "instance__status", "attempt"
            )
        )
        return f"runners at GitHub: {fake.summary()['runners']}; live runner jobs: {jobs}"

    stack.on_timeout = leftovers
    stack.wait(
        lambda: (
            not fake.summary()["runners"]
            and not Job.objects.filter(runner__isnull=False, status__in=JOB_LIVE).exists()
            and not MachineInstance.objects.filter(
                status="claimed", jobs__runner__isnull=False, jobs__status__in=JOB_LIVE
            ).exists()
        ),
        180,
        "no runner registered and no machine held for one",
    )
    stop.set()
    sampler.join(5)
    conclusions = [fake.job(i).conclusion for i in ids]
    assert conclusions.count("cancelled") >= 3 and conclusions.count("success") >= 50, conclusions
    assert not violations, violations[:5]
    from django.utils import timezone

    from apps.machines.budgets import budget_spends

    assert budget_spends([budget], now=timezone.now())[budget.pk] <= budget.amount
    assert WorkflowJob.objects.filter(github_id__in=ids).count() == 60  # the lost ones found by polling
    print(
        f"converged {time.monotonic() - last:.0f}s after the last job; "
        f"{fake.api_calls()} GitHub calls for 60 jobs"
    )
