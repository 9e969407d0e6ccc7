"""The GitLab reconciler's rules, one by one, against the fake GitLab: runners whose machine or
job is gone deleted, runners that never came online recycled, idle runners retired, lost Job
events found by polling the connected projects' pending jobs (with backoff); and the reaper's
rules for GitLab (stored but unprocessed events, events waiting for their tags)."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.ci.convergence import ci_converge
from apps.ci.demand import class_converge
from apps.ci.dispatch import runner_handoff, runner_name
from apps.ci.reconcile import endpoint_reconcile
from apps.events.models import Event
from apps.gitlab.client import GitLabClient
from apps.gitlab.forge import GITLAB
from apps.gitlab.models import GitLabConnection, GitLabDelivery, GitLabJob, GitLabRunner
from apps.jobs.models import Job
from apps.jobs.reports import job_finished, job_started
from apps.jobs.scheduler import schedule
from apps.machines.models import MachineInstance
from tests.ci_common import ready_agent
from tests.gitlab.conftest import APP, TAGS, GitLabWorld, deliver, job_event
from tests.gitlab.test_dispatch import queue

pytestmark = pytest.mark.django_db


def reconcile(gl: GitLabWorld) -> dict[str, int]:
    GitLabConnection.objects.update(next_poll_at=None)  # poll now, whatever the backoff says
    return endpoint_reconcile(forge=GITLAB, endpoint_id=gl.connection.pk)


def register(gl: GitLabWorld, name: str) -> int:
    client = GitLabClient(GitLabConnection.objects.get(pk=gl.connection.pk))
    body = {"runner_type": "project_type", "project_id": APP, "description": name, "tag_list": ["x"]}
    return client.create_runner(body).id


def handed_off(gl: GitLabWorld) -> tuple[Job, MachineInstance, GitLabRunner]:
    _, instance = ready_agent(gl)
    job = queue(gl, 1)
    schedule()
    assert runner_handoff(forge=GITLAB, job_id=job.pk) == "handed off"
    return Job.objects.get(pk=job.pk), instance, GitLabRunner.objects.get(job=job)


def test_runners_whose_machine_is_gone_are_deleted_and_nobody_elses(gl: GitLabWorld) -> None:
    _, gone = ready_agent(gl)
    MachineInstance.objects.filter(pk=gone.pk).update(status="terminated", ended_at=timezone.now())
    register(gl, runner_name(gone.pk))
    register(gl, runner_name(uuid.uuid4()))  # another Catacloud installation's machine
    register(gl, "a-hand-made-runner")
    report = reconcile(gl)
    assert report["runners_deleted"] == 1
    names = sorted(r.description for r in gl.fake.runners.values())
    assert runner_name(gone.pk) not in names and len(names) == 2
    assert Event.objects.filter(kind="gitlab.runner_deleted", instance_id=gone.pk).exists()


def test_a_runner_whose_job_ended_is_deleted(gl: GitLabWorld) -> None:
    """run-single exited (its one job done, or its wait over): the runner job ended, and its
    registration, which GitLab keeps until it is deleted, goes at the next reconcile."""
    job, instance, runner = handed_off(gl)
    assert reconcile(gl)["runners_deleted"] == 0  # live: kept
    job_started(instance=instance, job_id=job.pk)
    job_finished(instance=instance, job_id=job.pk, outcome="succeeded", exit_code=0)
    assert reconcile(gl)["runners_deleted"] == 1
    assert gl.fake.runners == {}


def test_a_deletion_that_failed_is_tried_again_at_the_next_reconcile(gl: GitLabWorld) -> None:
    """The listing that found a runner to delete counts only once the deletion is done: when
    the call failed (an outage), the next reconcile lists again and deletes it, not the
    10-minute listing (the two-forge e2e left registrations behind when it waited for that)."""
    job, instance, runner = handed_off(gl)
    job_started(instance=instance, job_id=job.pk)
    job_finished(instance=instance, job_id=job.pk, outcome="succeeded", exit_code=0)
    gl.fake.fail_next(r"^DELETE /runners/", status=503, times=3)  # and its two retries
    assert reconcile(gl).get("runners_deleted", 0) == 0
    assert runner.gitlab_runner_id in gl.fake.runners
    GitLabConnection.objects.update(unavailable_until=timezone.now() - timedelta(seconds=1))  # it waited
    assert reconcile(gl)["runners_deleted"] == 1
    assert gl.fake.runners == {}


def test_a_runner_still_registered_after_taking_its_job_is_deleted(gl: GitLabWorld) -> None:
    """Its deletion's message (or call) was lost: the next reconcile deletes the runner that runs
    a job, so its token takes no other; the job itself goes on."""
    job, _, runner = handed_off(gl)
    ours = {"id": runner.gitlab_runner_id, "description": runner.name}
    taken = gl.fake.queue_job("acme/app", TAGS)
    with gl.fake.lock:  # GitLab gave it this job
        gl.fake.jobs[taken].status, gl.fake.jobs[taken].runner_id = "running", runner.gitlab_runner_id
    deliver(job_event(taken, "running", tags=TAGS, runner=ours))  # its unregister task never runs here
    assert runner.gitlab_runner_id in gl.fake.runners
    assert reconcile(gl)["runners_with_their_job_deleted"] == 1
    assert runner.gitlab_runner_id not in gl.fake.runners and gl.fake.job(taken).status == "running"
    assert reconcile(gl)["runners_with_their_job_deleted"] == 0  # gone: nothing more to do
    job.refresh_from_db()
    assert job.status == "assigned" and not job.cancel_requested  # the runner job goes on


def test_a_runner_whose_one_deletion_failed_is_deleted_once_its_job_ended(gl: GitLabWorld) -> None:
    """A runner is deleted once, when its job's first report binds it. When that call failed
    (a limit, an outage) and the job ended before the next reconcile, the runners are listed at
    that reconcile (not only every 10 minutes) and the registration is deleted."""
    job, instance, runner = handed_off(gl)
    ours = {"id": runner.gitlab_runner_id, "description": runner.name}
    taken = gl.fake.queue_job("acme/app", TAGS)
    with gl.fake.lock:  # GitLab gave it this job
        gl.fake.jobs[taken].status, gl.fake.jobs[taken].runner_id = "running", runner.gitlab_runner_id
    deliver(job_event(taken, "running", tags=TAGS, runner=ours))  # its unregister task never runs here
    with gl.fake.lock:  # the CI job ended, and run-single with it
        gl.fake.jobs[taken].status = "success"
    job_started(instance=instance, job_id=job.pk)
    job_finished(instance=instance, job_id=job.pk, outcome="succeeded", exit_code=0)
    listed = timezone.now() - timedelta(seconds=5)  # listed lately: no 10-minute listing due
    GitLabConnection.objects.filter(pk=gl.connection.pk).update(runners_listed_at=listed)
    assert runner.gitlab_runner_id in gl.fake.runners
    assert reconcile(gl)["runners_deleted"] == 1
    assert runner.gitlab_runner_id not in gl.fake.runners


def test_a_runner_that_never_came_online_has_its_machine_recycled(gl: GitLabWorld) -> None:
    job, instance, runner = handed_off(gl)
    assert reconcile(gl)["runners_recycled"] == 0  # within its deadline
    GitLabRunner.objects.filter(pk=runner.pk).update(
        registered_at=timezone.now() - timedelta(seconds=gl.runner_class.online_timeout_seconds + 1)
    )
    assert reconcile(gl)["runners_recycled"] == 1
    instance.refresh_from_db()
    assert instance.status in ("terminating", "terminated") and instance.end_cause == "runner_offline"
    assert Event.objects.filter(kind="gitlab.runner_recycled", job_id=job.pk).exists()


def test_an_online_runner_is_not_recycled_and_an_idle_one_is_retired(gl: GitLabWorld) -> None:
    job, instance, runner = handed_off(gl)
    GitLabRunner.objects.filter(pk=runner.pk).update(registered_at=timezone.now() - timedelta(hours=1))
    with gl.fake.lock:  # the runner contacted GitLab
        gl.fake.runners[runner.gitlab_runner_id].contacted_at = time.time()
    report = reconcile(gl)
    assert report["runners_recycled"] == 0 and report["runners_idle_retired"] == 0
    assert GitLabRunner.objects.get(pk=runner.pk).online_at is not None
    GitLabRunner.objects.filter(pk=runner.pk).update(
        online_at=timezone.now() - timedelta(seconds=gl.runner_class.idle_timeout_seconds + 1)
    )
    assert reconcile(gl)["runners_idle_retired"] == 1
    assert GitLabRunner.objects.get(pk=runner.pk).retire_requested_at is not None


def test_a_lost_pending_event_is_found_by_polling(gl: GitLabWorld) -> None:
    gitlab_id = gl.fake.queue_job("acme/lib", TAGS, ["true"], pipeline="Nightly", ref="release")
    assert not GitLabJob.objects.exists()  # its events never reached us
    assert reconcile(gl)["missed_jobs_found"] == 1
    record = GitLabJob.objects.get()
    assert (record.gitlab_id, record.project, record.status, record.tags) == (
        gitlab_id,
        "acme/lib",
        "pending",
        sorted(TAGS),
    )
    assert record.pipeline == "release"  # the jobs API names no pipeline: its ref stands for it
    class_converge(forge=GITLAB, runner_class_id=gl.runner_class.pk)
    assert Job.objects.get().labels["repository"] == "acme/lib"


def test_a_lost_completion_is_found_and_the_runner_retired(gl: GitLabWorld) -> None:
    gitlab_id = gl.fake.queue_job("acme/app", TAGS, ["true"])
    deliver(job_event(gitlab_id, "pending", tags=TAGS))
    class_converge(forge=GITLAB, runner_class_id=gl.runner_class.pk)
    gl.fake.cancel_job(gitlab_id)  # its canceled event is lost
    GitLabJob.objects.update(status_changed_at=timezone.now() - timedelta(minutes=5))
    report = reconcile(gl)
    assert report["jobs_looked_up"] == 1 and report["missed_jobs_found"] == 1
    assert GitLabJob.objects.get().status == "canceled"
    class_converge(forge=GITLAB, runner_class_id=gl.runner_class.pk)
    assert Job.objects.get().status == "cancelled"


def test_a_job_deleted_at_gitlab_ends_here_too(gl: GitLabWorld) -> None:
    deliver(job_event(4242, "pending", tags=TAGS))  # GitLab no longer knows it (its pipeline deleted)
    GitLabJob.objects.update(status_changed_at=timezone.now() - timedelta(minutes=5))
    assert reconcile(gl)["jobs_looked_up"] == 1
    assert GitLabJob.objects.get().status == "canceled"


def test_polling_backs_off_while_it_finds_nothing(gl: GitLabWorld) -> None:
    intervals = []
    for _ in range(3):
        reconcile(gl)
        intervals.append(GitLabConnection.objects.get().poll_interval_seconds)
    assert intervals == [60.0, 120.0, 240.0]
    gl.fake.queue_job("acme/app", TAGS, ["true"])
    reconcile(gl)
    assert GitLabConnection.objects.get().poll_interval_seconds == 30.0
    before = gl.fake.api_calls()
    endpoint_reconcile(forge=GITLAB, endpoint_id=gl.connection.pk)  # not due: no poll calls
    assert gl.fake.count("GET", "/projects/{id}/jobs") == 4 * 2  # two projects a poll, none now
    assert gl.fake.api_calls() - before == 0  # nothing unaccounted for: not even the runners list


def test_an_event_after_a_quiet_spell_brings_polling_back_to_the_base_interval(gl: GitLabWorld) -> None:
    for _ in range(3):
        reconcile(gl)
    assert GitLabConnection.objects.get().poll_interval_seconds == 240.0
    delivered = gl.fake.queue_job("acme/app", TAGS, ["true"])
    deliver(job_event(delivered, "pending", tags=TAGS))  # busy again
    lost = gl.fake.queue_job("acme/app", TAGS, ["true"])  # its event is lost (GitLab never retries)
    at = timezone.now() + timedelta(seconds=31)
    assert endpoint_reconcile(forge=GITLAB, endpoint_id=gl.connection.pk, now=at)["missed_jobs_found"] == 1
    assert set(GitLabJob.objects.values_list("gitlab_id", flat=True)) == {delivered, lost}


def test_an_event_never_puts_off_a_poll_that_is_due_sooner(gl: GitLabWorld) -> None:
    reconcile(gl)
    reconcile(gl)  # backed off to 120 s; the next poll made due in 5 s
    due = timezone.now() + timedelta(seconds=5)
    GitLabConnection.objects.update(next_poll_at=due)
    job = gl.fake.queue_job("acme/app", TAGS, ["true"])
    deliver(job_event(job, "pending", tags=TAGS))
    conn = GitLabConnection.objects.get()
    assert conn.poll_interval_seconds == 30.0 and conn.next_poll_at == due


def test_the_reaper_acts_on_stored_events_and_redrives_lost_handoffs(gl: GitLabWorld) -> None:
    deliver(job_event(9, "waiting_for_resource", tags=TAGS))  # seen before: its class is known
    payload: dict[str, Any] = job_event(9, "pending")
    GitLabDelivery.objects.create(
        key="crashed-before-acting",
        connection=gl.connection,
        org=gl.world.org,
        event="Job Hook",
        payload=payload,
    )
    GitLabDelivery.objects.update(received_at=timezone.now() - timedelta(minutes=1))
    report = ci_converge(now=timezone.now())
    assert report["gitlab_deliveries_processed"] == 1 and report["gitlab_runners_started"] == 1
    assert "github_deliveries_processed" in report  # every forge's rules, one tick
    assert GitLabJob.objects.get().gitlab_id == 9
    ready_agent(gl)
    schedule()
    Job.objects.update(status_changed_at=timezone.now() - timedelta(minutes=1))
    assert ci_converge(now=timezone.now())["gitlab_handoffs_redriven"] == 1


def test_an_event_waiting_for_its_tags_is_looked_up_again_by_the_reaper(gl: GitLabWorld) -> None:
    gitlab_id = gl.fake.queue_job("acme/app", TAGS, ["true"])
    gl.fake.error_rate = 1.0  # the look-up task fails: the event waits, stored
    deliver(job_event(gitlab_id, "pending"), key="k-1")
    from apps.gitlab.intake import delivery_resolve

    assert delivery_resolve(key="k-1") == "waiting"
    gl.fake.error_rate = 0.0
    GitLabConnection.objects.update(unavailable_until=None)
    GitLabDelivery.objects.update(received_at=timezone.now() - timedelta(minutes=1))
    ci_converge(now=timezone.now())  # acts again: still no tags, so the look-up is sent again
    assert GitLabDelivery.objects.get().processed_at is None
    assert delivery_resolve(key="k-1") == "created"
    assert GitLabJob.objects.get().gitlab_id == gitlab_id
