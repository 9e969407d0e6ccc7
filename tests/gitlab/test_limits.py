"""GitLab's limits against the strict fake (issue 49, items 5, 6): GitLab.com's runner cap is a
pending reason, never a failure, and a runner-per-job class never asks beyond a cap it knows; a
class runner (one token, a runner manager per machine) needs no runner per job and is rotated;
two projects' jobs on one project-scoped class count their own runners."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.ci.demand import class_converge
from apps.ci.dispatch import runner_handoff
from apps.ci.records import ci_job_apply
from apps.events.models import Event
from apps.gitlab.client import JobInfo
from apps.gitlab.forge import GITLAB
from apps.gitlab.models import GitLabClassRunner, GitLabConnection, GitLabRunner, GitLabRunnerClass
from apps.gitlab.ops import api_report
from apps.gitlab.runners import class_runners_rotate
from apps.gitlab.services import SYSTEM_ID_ENV, TOKEN_ENV, runner_class_save
from apps.jobs.models import Job
from apps.jobs.scheduler import schedule
from tests.ci_common import ready_agent
from tests.gitlab.conftest import APP, LIB, TAGS, GitLabWorld, deliver, job_event
from tests.gitlab.test_dispatch import queue

pytestmark = pytest.mark.django_db


def hand_off_all(gl: GitLabWorld, machines: int) -> list[str]:
    for _ in range(machines):
        ready_agent(gl)
    schedule()
    return [runner_handoff(forge=GITLAB, job_id=job.pk) for job in Job.objects.filter(status="assigned")]


def test_the_runner_cap_is_a_pending_reason_and_never_asked_beyond(gl: GitLabWorld) -> None:
    """Item 5: GitLab.com Free allows 50 runners a project in seven days; the 51st job's refusal
    failed it, and every pass asked again."""
    gl.fake.runner_cap = 2
    for job_id in (1, 2, 3):
        queue(gl, job_id)
    outcomes = hand_off_all(gl, 3)
    assert sorted(outcomes) == ["gitlab unavailable", "handed off", "handed off"]
    held = Job.objects.get(status="queued")
    assert held.failure_reason == "" and "GitLab's runner cap: 2 runners" in held.pending_reason
    assert GitLabConnection.objects.get().runner_cap == 2  # learnt from the refusal
    assert Event.objects.filter(kind="gitlab.runner_cap_reached").count() == 1
    assert gl.fake.cap_refusals == 1
    # the reaper releases it when its wait is over; the cap is known now: no call beyond it
    GitLabRunner.objects.update(held_until=timezone.now() - timedelta(seconds=1))
    from apps.ci.availability import held_release

    held_release(forge=GITLAB, now=timezone.now())
    creations = gl.fake.count("POST", "/user/runners")
    hand_off_all(gl, 1)
    assert gl.fake.count("POST", "/user/runners") == creations and gl.fake.cap_refusals == 1
    assert Job.objects.get(pk=held.pk).status == "queued"


def test_a_class_runner_serves_every_job_with_one_runner_and_a_manager_each(gl: GitLabWorld) -> None:
    gl.fake.runner_cap = 2
    runner_class_save(org=gl.world.org, runner_class=gl.runner_class, runner_mode="class")
    for job_id in range(1, 6):
        queue(gl, job_id)
    assert hand_off_all(gl, 5) == ["handed off"] * 5
    assert gl.fake.count("POST", "/user/runners") == 1 and gl.fake.cap_refusals == 0
    (class_runner,) = GitLabClassRunner.objects.all()
    secrets = [Job.objects.get(pk=r.job_id).secret_env for r in GitLabRunner.objects.all()]
    assert {s[TOKEN_ENV] for s in secrets} == {class_runner.token}
    system_ids = {s[SYSTEM_ID_ENV] for s in secrets}
    assert len(system_ids) == 5 and all(s.startswith("s_") and len(s) == 14 for s in system_ids)
    # GitLab says which runner manager took a job (the jobs API): that machine's runner is bound
    ours = GitLabRunner.objects.order_by("created_at")[3]
    job = JobInfo.from_api(
        {
            "id": 2,
            "status": "running",
            "tag_list": TAGS,
            "runner": {"id": class_runner.gitlab_runner_id, "description": ours.name},
            "runner_manager": {"system_id": ours.system_id},
        }
    )
    report = api_report(job, APP, "acme/app")
    assert not isinstance(report, str)
    ci_job_apply(forge=GITLAB, endpoint=gl.connection, report=report, source="poll")
    assert GitLabRunner.objects.get(pk=ours.pk).gitlab_job.gitlab_id == 2
    assert GitLabRunner.objects.filter(gitlab_job__isnull=False).count() == 1
    # its job ended: nothing deleted at GitLab (the runner serves the class's other machines)
    assert gl.fake.count("DELETE", "/runners/") == 0


def test_a_class_runners_token_is_rotated_and_its_waiting_machines_retired(gl: GitLabWorld) -> None:
    runner_class_save(org=gl.world.org, runner_class=gl.runner_class, runner_mode="class", rotate_hours=24)
    queue(gl, 1)
    hand_off_all(gl, 1)
    (class_runner,) = GitLabClassRunner.objects.all()
    old = class_runner.token
    assert class_runners_rotate(runner_class=GitLabRunnerClass.objects.get(), actor="test") == 1
    assert GitLabClassRunner.objects.get().token != old
    assert GitLabRunner.objects.get().retire_requested_at is not None
    assert Event.objects.filter(kind="gitlab.runner_token_rotated").exists()
    # on its schedule: the reconciler rotates a token older than rotate_hours
    GitLabClassRunner.objects.update(rotated_at=timezone.now() - timedelta(hours=25))
    from apps.ci.reconcile import endpoint_reconcile

    assert endpoint_reconcile(forge=GITLAB, endpoint_id=gl.connection.pk)["class_runner_tokens_rotated"] == 1


def test_two_projects_jobs_on_one_class_count_their_own_runners(gl: GitLabWorld) -> None:
    """Item 6: a project runner started for project A counted as supply for project B's job,
    which waited for A's runner to retire as idle."""
    deliver(job_event(1, "pending", tags=TAGS, project_id=APP))
    assert class_converge(forge=GITLAB, runner_class_id=gl.runner_class.pk) == {"started": 1, "retired": 0}
    deliver(job_event(1, "canceled", tags=TAGS, project_id=APP))
    deliver(job_event(2, "pending", tags=TAGS, project_id=LIB))
    assert class_converge(forge=GITLAB, runner_class_id=gl.runner_class.pk) == {"started": 1, "retired": 1}
    live = GitLabRunner.objects.filter(job__status="queued")
    assert [r.created_for.project_id for r in live] == [LIB]
