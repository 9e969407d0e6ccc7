"""GitLab CI on Catacloud end to end: the fake GitLab (a thread of this process) sends Job events
to the live server; a real worker and beat dispatch; the local provider's agents run the
stand-in gitlab-runner (``run-single``), which takes a job from the fake, runs its script,
reports, exits; the runner is deleted at GitLab. Then the sixty-job proof of the GitHub
adapter, for GitLab; then GitHub and GitLab jobs interleaved on one pool."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from apps.gitlab.models import GitLabJob
from apps.jobs.choices import JOB_LIVE
from apps.jobs.models import Job, JobLogChunk
from apps.pools.services import pool_create, pool_refill
from testkit.gitlab_fake import DONE, FakeGitLab
from testkit.gitlab_kit import WEBHOOK_PATH, connect, expose_runner
from tests.ci_common import (
    budget_held,
    leftovers,
    machines_over_quota,
    nothing_held,
    sixty_jobs_with_faults,
    three_classes,
    wait_every_job,
)
from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
TAGS = ["catacloud", "linux-2cpu"]
PROJECTS = [(12, "acme/app"), (13, "acme/web")]


@dataclass
class GitLabStack:
    stack: Stack
    fake: FakeGitLab
    classes: list[Any]
    pool: Any

    def all_finished(self, ids: list[int]) -> bool:
        return not self.fake.unfinished(ids)


@pytest.fixture
def gitlab(stack: Stack) -> Iterator[GitLabStack]:
    fake = FakeGitLab(
        token="glpat-e2e-token", webhook_token="e2e-webhook-token", webhook_url=stack.url + WEBHOOK_PATH
    ).start()
    for project_id, path in PROJECTS:
        fake.add_project(project_id, path)
    world = stack.world
    # gitlab-runner is part of the machines' "image": shown before the pool's first machine starts.
    expose_runner(world.account)
    pool = pool_create(
        org=world.org, name="ci-small", machine_type=world.machine_type, target_size=2, max_size=6
    )
    pool_refill(pool_id=pool.pk)
    classes = connect(
        world.org,
        fake,
        projects=PROJECTS,
        classes=[{"name": "small", "tags": TAGS, "machine_type": world.machine_type, "pool": pool}],
    )
    try:
        yield GitLabStack(stack, fake, classes, pool)
    finally:
        fake.stop()


def _runner_jobs() -> Any:
    return Job.objects.filter(gitlab_runner__isnull=False)


def test_ci_jobs_run_on_catacloud_machines(gitlab: GitLabStack) -> None:
    fake, stack = gitlab.fake, gitlab.stack
    ids = [
        fake.queue_job(
            project, TAGS, ["echo step one in $(pwd)", "sleep 1"], pipeline="CI", name=f"build-{i}"
        )
        for i, project in enumerate(["acme/app", "acme/app", "acme/web", "acme/app"])
    ]
    stack.wait(lambda: gitlab.all_finished(ids), 120, "every CI job to finish")
    assert {fake.job(i).status for i in ids} == {"success"}
    ran_on = {fake.runners_seen[fake.job(i).runner_id or 0] for i in ids}
    assert all(name.startswith("catacloud-") for name in ran_on)
    # a runner for each job; a machine whose paid hour goes on may serve several
    took = [fake.job(i).runner_id for i in ids]
    assert len(set(took)) == 4 and 1 <= len(ran_on) <= 4, (took, ran_on)
    stack.on_timeout = lambda: list(_runner_jobs().values_list("status", "pending_reason", "exit_code"))
    stack.wait(lambda: not _runner_jobs().filter(status__in=JOB_LIVE).exists(), 90, "the runner jobs to end")
    ended = list(_runner_jobs().values_list("status", flat=True))
    assert ended.count("succeeded") == 4, ended  # a runner per job, each ran its job and exited
    stack.wait(
        lambda: set(GitLabJob.objects.values_list("status", flat=True)) == {"success"},
        30,
        "every CI job record to be success",
    )
    assert all(r.job_id for r in GitLabJob.objects.all())
    # each runner is deleted at GitLab once it took its job: nothing stays registered
    stack.wait(lambda: not fake.runners, 30, "every runner to be deleted at GitLab")
    job = _runner_jobs().first()
    assert job is not None
    text = "".join(JobLogChunk.objects.filter(job=job).values_list("data", flat=True))
    assert "received job=" in text and "Job succeeded" in text
    everything = "".join(JobLogChunk.objects.values_list("data", flat=True))
    assert fake.issued_tokens and not any(t in everything for t in fake.issued_tokens)  # never in a log
    costs = stack.api("viewer").get("/api/v1/costs/?group_by=repository").json()
    assert {"acme/app", "acme/web"} <= {r["key"] for r in costs["results"]}
    # per job: its tags looked up, its runner created, its runner deleted (reconciles aside)
    made, deleted = fake.count("POST", "/user/runners"), fake.count("DELETE", "/runners/")
    assert made == 4 and deleted == 4, (
        made,
        deleted,
        list(
            _runner_jobs().values_list(
                "status", "attempt", "failure_reason", "gitlab_runner__retire_requested_at"
            )
        ),
    )


def _sampler(
    fake: FakeGitLab, world: Any, targets: int, violations: list[str], stop: threading.Event
) -> None:
    from django.db import connection

    from apps.gitlab.models import GitLabRunner

    try:
        while not stop.wait(0.5):
            # GitLab's view: registered runners never exceed the jobs they may run plus the pools'
            # targets (+2: a registration between two counts; +finished runners a moment before
            # their deletion)
            view = fake.summary()
            jobs, registered = view["jobs"], len(view["runners"])
            busy = jobs.get("pending", 0) + jobs.get("running", 0) + jobs.get("created", 0)
            if registered > busy + targets + 4:
                # each registered runner: its state at GitLab and what its runner job is here
                ours = dict(
                    GitLabRunner.objects.filter(
                        gitlab_runner_id__in=[r["id"] for r in view["runners"]]
                    ).values_list("gitlab_runner_id", "job__status")
                )
                kinds = Counter(
                    f"{r['status']}{' paused' if r['paused'] else ''}/{ours.get(r['id'], 'not ours')}"
                    for r in view["runners"]
                )
                violations.append(
                    f"{time.strftime('%H:%M:%S')} {registered} runners registered ({dict(kinds)}) for {jobs}"
                )
            # ours: runners not yet given a job never exceed the pending jobs we know of
            supply = GitLabRunner.objects.filter(
                job__status__in=JOB_LIVE, gitlab_job__isnull=True, retire_requested_at__isnull=True
            ).count()
            known = GitLabJob.objects.filter(status="pending").count()
            if supply > known + targets:
                violations.append(f"{supply} unbound runners for {known} pending jobs")
            violations.extend(machines_over_quota(world))
    finally:
        connection.close()


def _failed(fake: Any, ids: list[int]) -> list[str]:
    """Each failed CI job: why GitLab failed it, when, and how the runner job here ended."""
    from apps.gitlab.models import GitLabJob

    here = {g.gitlab_id: g.job for g in GitLabJob.objects.filter(gitlab_id__in=ids).select_related("job")}
    failed = []
    for i in ids:
        job = fake.job(i)
        if job.status != "failed":
            continue
        ran = here.get(i)
        failed.append(
            f"{i}: {job.failure_reason}, ran {(job.finished_at or 0) - (job.started_at or 0):.1f}s, "
            f"last update {(job.finished_at or 0) - (job.updated_at or job.started_at or 0):.1f}s before; "
            f"runner job here: {ran.status + ' ' + ran.failure_reason if ran else 'none'}"
        )
    return failed


@pytest.mark.timeout(900)
def test_sixty_jobs_over_three_classes_with_faults_all_finish_and_nothing_is_left(
    gitlab: GitLabStack,
) -> None:
    """The GitHub proof, for GitLab: 60 CI jobs over 3 runner classes with 10 % of Job events
    dropped (GitLab never sends them again: only the poll finds them), duplicates, reordering,
    5 % GitLab 5xx, a rate-limit window (429), a runner that crashes, one that never connects,
    an agent and a worker killed, three jobs cancelled: every job finishes, nothing stays
    registered at GitLab or live here, runners never exceed pending jobs plus pool targets,
    quotas and the budget hold."""
    from apps.billing.budgets import budget_set
    from apps.gitlab.services import runner_class_save
    from apps.pools.models import InstancePool
    from testkit.gitlab_kit import RUNNER_PATH

    stack, fake = gitlab.stack, gitlab.fake
    world = stack.world
    fake.lost_after, fake.offline_after = 6.0, 5.0
    tags = {"a": TAGS, "b": ["catacloud", "class-b"], "c": ["catacloud", "class-c"]}
    three_classes(
        world,
        fake.url,
        save=runner_class_save,
        first=gitlab.classes[0],
        labels_field="tags",
        more={"b": tags["b"], "c": tags["c"]},
        runner_path=RUNNER_PATH,
    )
    budget = budget_set(org=world.org, amount="50.00", period="month", actor="test")
    targets = sum(InstancePool.objects.values_list("target_size", flat=True))
    fake.lost_rate, fake.duplicate_rate, fake.reorder_rate = 0.1, 0.1, 0.1
    fake.error_rate = 0.05
    fake.runner_faults.extend(["crash", "never_connect"])

    violations: list[str] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sampler, args=(fake, world, targets, violations, stop), daemon=True)
    sampler.start()
    ids = sixty_jobs_with_faults(
        stack,
        fake,
        lambda i, name: fake.queue_job(
            "acme/app" if i % 2 else "acme/web",
            tags[name],
            [f"echo job {i}", "sleep 1"],
            pipeline=f"pipeline-{name}",
            name=f"job-{i}",
        ),
        relation="gitlab_runner",
    )
    wait_every_job(stack, fake, lambda: gitlab.all_finished(ids), "every CI job to finish")
    last = time.monotonic()
    stack.on_timeout = lambda: leftovers(fake, "GitLab", "gitlab_runner")
    stack.wait(
        lambda: not fake.runners and nothing_held("gitlab_runner"),
        180,
        "no runner registered at GitLab and no machine held for one",
    )
    stop.set()
    sampler.join(5)
    statuses = [fake.job(i).status for i in ids]
    assert statuses.count("canceled") >= 3 and statuses.count("success") >= 50, _failed(fake, ids)
    assert set(statuses) <= set(DONE)
    assert not violations, violations[:5]
    assert budget_held(budget)
    # every job that ran is recorded here, the lost events' ones found by polling; a job cancelled
    # while it waited may end before any event or poll reached us (nothing ran: nothing to record)
    cancelled = {i for i in ids if fake.job(i).status == "canceled"}
    recorded = set(GitLabJob.objects.filter(gitlab_id__in=ids).values_list("gitlab_id", flat=True))
    assert set(ids) - cancelled <= recorded, sorted(set(ids) - cancelled - recorded)
    print(
        f"converged {time.monotonic() - last:.0f}s after the last job; "
        f"{fake.api_calls()} GitLab calls for 60 jobs"
    )
