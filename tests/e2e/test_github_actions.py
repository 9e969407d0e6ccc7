"""GitHub Actions on Catacloud end to end: the fake GitHub (a thread of this process) sends
signed deliveries to the live server; a real worker and beat dispatch; the local provider's
agents run the stand-in runner, which registers with the fake, takes a job, runs its steps."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from apps.github.models import WorkflowJob
from apps.jobs.models import Job, JobLogChunk
from apps.pools.services import pool_create, pool_refill
from testkit.github_fake import FakeGitHub, app_keypair
from testkit.github_kit import WEBHOOK_PATH, connect
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
    assert all(name and name.startswith("catacloud-") for name in ran_on) and len(ran_on) == 4
    stack.wait(
        lambda: Job.objects.filter(runner__isnull=False).exclude(status="succeeded").count() == 0,
        60,
        "the runner jobs to end",
    )
    assert Job.objects.filter(runner__isnull=False, status="succeeded").count() == 4
    records = WorkflowJob.objects.all()
    assert {r.status for r in records} == {"completed"} and all(r.job_id for r in records)
    assert fake.summary()["runners"] == []  # just-in-time runners are gone with their job
    job = Job.objects.filter(runner__isnull=False).first()
    assert job is not None
    text = "".join(JobLogChunk.objects.filter(job=job).values_list("data", flat=True))
    assert "Running job" in text and "completed with result: success" in text
    assert fake.jit_issued_at and all(name not in text for name in ())
    costs = stack.api("viewer").get("/api/v1/costs/?group_by=repository").json()
    assert {"acme/app", "acme/web"} <= {r["key"] for r in costs["results"]}
    # about 1-2 GitHub calls per job (the registration; a token now and then; reconciles)
    assert fake.count("POST", "/orgs/acme/actions/runners/generate-jitconfig") == 4
