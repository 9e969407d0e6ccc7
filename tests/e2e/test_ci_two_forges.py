"""GitHub Actions and GitLab CI on one Catacloud, one pool: workflow jobs of the fake GitHub and
CI jobs of the fake GitLab, interleaved, with the faults of the sixty-job proofs, run on the
same pool's machines (a machine kept for reuse serves either forge's next runner) within one
quota and one budget; every job finishes and nothing is left registered at either forge."""

from __future__ import annotations

import threading
import time

import pytest

from apps.github.models import WorkflowJob
from apps.gitlab.models import GitLabJob
from apps.jobs.choices import JOB_LIVE
from apps.jobs.models import Job
from apps.pools.services import pool_create, pool_refill
from testkit import github_kit, gitlab_kit
from testkit.github_fake import FakeGitHub, app_keypair
from testkit.gitlab_fake import FakeGitLab
from tests.ci_common import kill_an_agent_running_a_runner
from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
GH_LABELS = ["self-hosted", "catacloud-linux-2cpu"]
GL_TAGS = ["catacloud", "linux-2cpu"]


def _runner_jobs() -> tuple[object, object]:
    return Job.objects.filter(runner__isnull=False), Job.objects.filter(gitlab_runner__isnull=False)


def _history(runners: list[dict[str, object]]) -> list[object]:
    """What Catacloud recorded of runners still registered at a forge: the events naming each
    (or its machine, after its registration), and the runner jobs that named it."""
    from apps.events.models import Event
    from apps.github.models import Runner

    told = []
    for runner in runners:
        name, rid = str(runner["name"]), runner["id"]
        named = Event.objects.filter(data__runner=name) | Event.objects.filter(data__runner_id=rid)
        first = named.order_by("id").first()
        machine = Event.objects.none()
        if first is not None and first.instance_id is not None:
            machine = Event.objects.filter(instance_id=first.instance_id, id__gte=first.id)
        events = (named | machine).order_by("id").values_list("created_at", "kind", "job_id", "reason")
        rows = Runner.objects.filter(name=name).values_list("job_id", "job__status", "job__attempt")
        told.append(
            (
                name,
                [(t.strftime("%H:%M:%S.%f")[:-3], k, str(j)[:8], r[:80]) for t, k, j, r in events[:40]],
                [(str(j)[:8], st, a) for j, st, a in rows],
            )
        )
    return told


@pytest.mark.timeout(900)
def test_github_and_gitlab_jobs_interleaved_on_one_pool_all_finish(stack: Stack) -> None:
    from django.utils import timezone

    from apps.billing.budgets import budget_set
    from apps.machines.budgets import budget_spends
    from apps.machines.choices import INSTANCE_COUNTED
    from apps.machines.models import MachineInstance, OrgMachineType
    from testkit.processes import TESTS

    world = stack.world
    private, public = app_keypair()
    github = FakeGitHub(
        app_id=21,
        public_key=public,
        webhook_secret="two-forges-github",
        webhook_url=stack.url + github_kit.WEBHOOK_PATH,
    ).start()
    gitlab = FakeGitLab(
        token="glpat-two-forges",
        webhook_token="two-forges-gitlab",
        webhook_url=stack.url + gitlab_kit.WEBHOOK_PATH,
    ).start()
    stop = threading.Event()  # the sampler's end (also when a wait failed: it must not outlive the test)
    try:
        github.add_installation(8, "acme", ["acme/app"])
        gitlab.add_project(12, "acme/app")
        for fake in (github, gitlab):
            fake.lost_after, fake.offline_after = 6.0, 5.0
        OrgMachineType.objects.filter(pk=world.grant.pk).update(max_instances=6, max_concurrent_jobs=6)
        github_kit.expose_runner(world.account)
        gitlab_kit.expose_runner(world.account)
        pool = pool_create(
            org=world.org, name="ci", machine_type=world.machine_type, target_size=2, max_size=6
        )
        pool_refill(pool_id=pool.pk)
        timeouts = {"online_timeout_seconds": 20, "idle_timeout_seconds": 60}
        github_kit.connect(
            world.org,
            github,
            private,
            installation_id=8,
            account="acme",
            classes=[
                {
                    "name": "shared",
                    "labels": GH_LABELS,
                    "machine_type": world.machine_type,
                    "pool": pool,
                    **timeouts,
                }
            ],
        )
        gitlab_kit.connect(
            world.org,
            gitlab,
            projects=[(12, "acme/app")],
            classes=[
                {
                    "name": "shared",
                    "tags": GL_TAGS,
                    "machine_type": world.machine_type,
                    "pool": pool,
                    **timeouts,
                }
            ],
        )
        budget = budget_set(org=world.org, amount="50.00", period="month", actor="test")
        github.drop_rate, github.lost_rate, github.duplicate_rate, github.reorder_rate = 0.05, 0.05, 0.1, 0.1
        gitlab.lost_rate, gitlab.duplicate_rate, gitlab.reorder_rate = 0.1, 0.1, 0.1
        github.error_rate = gitlab.error_rate = 0.05
        github.runner_faults.append("crash")
        gitlab.runner_faults.append("never_connect")

        over: list[str] = []

        def sample() -> None:
            from django.db import connection

            try:
                while not stop.wait(0.5):
                    live = MachineInstance.objects.filter(
                        org=world.org, machine_type=world.machine_type, status__in=INSTANCE_COUNTED
                    ).count()
                    if live > 6:
                        over.append(f"{live} machines over the quota of 6")
            finally:
                connection.close()

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        gh_ids: list[int] = []
        gl_ids: list[int] = []
        with TESTS.celery_worker(stack.tmp, concurrency=2, **{"CATACLOUD_PUBLIC_URL": stack.url}) as extra:
            for i in range(30):
                gh_ids.append(
                    github.queue_job(
                        "acme/app", GH_LABELS, [f"echo gh {i}", "sleep 1"], workflow="gh-ci", name=f"gh-{i}"
                    )
                )
                gl_ids.append(
                    gitlab.queue_job(
                        "acme/app", GL_TAGS, [f"echo gl {i}", "sleep 1"], pipeline="gl-ci", name=f"gl-{i}"
                    )
                )
                if i == 8:
                    github.rate_limit_for(3)
                    gitlab.rate_limit_for(3)
                if i == 12:
                    github.cancel_job(gh_ids[-1])
                    gitlab.cancel_job(gl_ids[-1])
                time.sleep(0.15)
            stack.wait(
                lambda: kill_an_agent_running_a_runner(stack, "runner") is not None,
                60,
                "an agent running a runner",
            )
            extra.kill()

        def done() -> bool:
            if int(time.monotonic()) % 15 == 0:
                print(
                    time.strftime("%H:%M:%S"), github.summary()["jobs"], gitlab.summary()["jobs"], flush=True
                )
            return all(github.job(i).status == "completed" for i in gh_ids) and not gitlab.unfinished(gl_ids)

        stack.wait(done, 400, "every job of both forges to finish")
        gh_jobs, gl_jobs = _runner_jobs()
        fields = ("status", "pending_reason", "hold_reason", "handed_off_to", "instance__status", "attempt")
        stack.on_timeout = lambda: (
            f"runners at GitHub: {github.summary()['runners']}; at GitLab: {gitlab.summary()['runners']}; "
            f"live runner jobs: {list(gh_jobs.filter(status__in=JOB_LIVE).values_list(*fields))} "
            f"{list(gl_jobs.filter(status__in=JOB_LIVE).values_list(*fields))}; "
            f"what happened to GitHub's: {_history(github.summary()['runners'])}"
        )
        stack.wait(
            lambda: (
                not github.summary()["runners"]
                and not gitlab.runners
                and not gh_jobs.filter(status__in=JOB_LIVE).exists()
                and not gl_jobs.filter(status__in=JOB_LIVE).exists()
            ),
            180,
            "no runner registered at either forge and none live here",
        )
        stop.set()
        sampler.join(5)
        gh_end = [github.job(i).conclusion for i in gh_ids]
        gl_end = [gitlab.job(i).status for i in gl_ids]
        assert gh_end.count("cancelled") >= 1 and gh_end.count("success") >= 25, gh_end
        assert gl_end.count("canceled") >= 1 and gl_end.count("success") >= 25, gl_end
        assert not over, over[:3]
        assert budget_spends([budget], now=timezone.now())[budget.pk] <= budget.amount
        assert WorkflowJob.objects.filter(github_id__in=gh_ids).count() == 30
        assert GitLabJob.objects.filter(gitlab_id__in=gl_ids).count() == 30
        # one pool, one fleet: machines served runners of both forges
        gh_machines = set(gh_jobs.exclude(instance=None).values_list("instance_id", flat=True))
        gl_machines = set(gl_jobs.exclude(instance=None).values_list("instance_id", flat=True))
        assert gh_machines & gl_machines, (len(gh_machines), len(gl_machines))
        costs = stack.api("viewer").get("/api/v1/costs/?group_by=workflow").json()
        # one cost report: GitHub's workflow and GitLab's pipeline side by side
        assert {"gh-ci", "gl-ci"} <= {r["key"] for r in costs["results"]}, costs["results"]
    finally:
        stop.set()
        github.stop()
        gitlab.stop()
