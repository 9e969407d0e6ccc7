"""Dispatch against the fake GitLab: a runner job on a warm machine gets a runner created at
GitLab for that machine, its token handed to the agent as a secret only then; a runner is
deleted at GitLab when its job ends; GitLab down keeps jobs queued with no machine bought; a
refused runner fails the job; demand follows GitLab's pending jobs, including jobs taken by
other runners and jobs our runners take that were not theirs."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.ci.demand import class_converge
from apps.ci.dispatch import runner_handoff, runner_name, runner_retire, runner_unregister
from apps.ci.errors import ForgeRateLimited
from apps.ci.reconcile import endpoint_reconcile
from apps.events.models import Event
from apps.gitlab.client import GitLabClient
from apps.gitlab.forge import GITLAB
from apps.gitlab.intake import delivery_resolve
from apps.gitlab.models import GitLabConnection, GitLabJob, GitLabRunner
from apps.gitlab.services import TOKEN_ENV
from apps.jobs.models import Job
from apps.jobs.scheduler import schedule
from apps.jobs.submission import job_cancel
from apps.machines.models import MachineInstance
from tests.ci_common import poll, ready_agent, tasks_sent
from tests.gitlab.conftest import APP, TAGS, GitLabWorld, deliver, job_event

pytestmark = pytest.mark.django_db


def queue(gl: GitLabWorld, job_id: int, **kw: Any) -> Job:
    """GitLab's job ``job_id`` is pending: its event (with its tags), then the class's convergence."""
    assert deliver(job_event(job_id, "pending", tags=kw.pop("tags", TAGS), **kw)).status_code == 200
    class_converge(forge=GITLAB, runner_class_id=gl.runner_class.pk)
    return Job.objects.get(gitlab_runner__created_for__gitlab_id=job_id)


def handoff(job: Job) -> str:
    return runner_handoff(forge=GITLAB, job_id=job.pk)


@pytest.mark.django_db(transaction=True)
def test_the_look_up_task_converges_the_class_and_hands_off_the_runner_itself(
    tgl: GitLabWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pending job's event carries no tags: the task that looks them up also starts, places
    and hands off its runner, once the delivery committed, with no other task in between (a
    failure there leaves it to the convergence task)."""
    from apps.ci import demand, dispatch
    from apps.gitlab.tasks import resolve_task

    sent = tasks_sent(monkeypatch, dispatch, demand)
    agent, instance = ready_agent(tgl)
    first, second = (tgl.fake.queue_job("acme/app", TAGS) for _ in range(2))
    for job_id, key in ((first, "first-event"), (second, "second-event")):
        assert deliver(job_event(job_id, "pending"), key=key).json()["status"] == "deferred"

    resolve_task("first-event")  # a worker's task, called as the worker calls it
    job = Job.objects.get(gitlab_runner__created_for__gitlab_id=first)
    assert (job.status, job.instance_id, job.handed_off_to) == ("assigned", instance.pk, instance.pk)
    answer = poll(agent)
    assert answer.status_code == 200 and TOKEN_ENV in answer.json()["job"]["secret_env_names"]
    assert not [t for t, _ in sent if t.endswith(("converge_task", "handoff_task"))], sent

    with monkeypatch.context() as m:  # a bug, or the database gone, while it converges
        m.setattr(demand, "class_converge", lambda **kw: 1 / 0)
        resolve_task("second-event")
    assert GitLabJob.objects.get(gitlab_id=second).runner_class_id == tgl.runner_class.pk
    assert [t for t, _ in sent if t.endswith("converge_task")] == ["apps.gitlab.tasks.converge_task"]


def test_the_agent_gets_the_job_only_with_its_runner_token(gl: GitLabWorld) -> None:
    agent, instance = ready_agent(gl)
    job = queue(gl, 1)
    schedule()
    job.refresh_from_db()
    assert (job.status, job.instance_id) == ("assigned", instance.pk)
    assert poll(agent).status_code == 204  # assigned, but GitLab has not created its runner yet

    assert handoff(job) == "handed off"
    (created,) = gl.fake.runners.values()
    assert created.description == runner_name(instance.pk)
    assert sorted(created.tags) == sorted(TAGS) and created.run_untagged is False
    assert (created.runner_type, created.project_id) == ("project_type", APP)
    assert created.maximum_timeout >= 600
    answer = poll(agent)
    assert answer.status_code == 200
    payload = answer.json()["job"]
    token = payload["env"][TOKEN_ENV]
    assert token == created.token and token.startswith("glrt-")
    assert TOKEN_ENV in payload["secret_env_names"]  # the agent masks it in the output and its log
    assert payload["env"]["CI_SERVER_URL"] == gl.fake.url
    command = payload["command"]
    assert "run-single" in command and "--max-builds 1" in command and token not in command
    # the token goes to gitlab-runner in a config it reads once, never on its command line nor in
    # its environment (which its shell executor gives the CI job)
    assert "--token" not in command and f"unset {TOKEN_ENV}" in command and "--config" in command
    assert 'executor = "shell"' in command
    # never in an API answer or an event
    api = gl.world.client("admin").get(f"/api/v1/jobs/{job.pk}/")
    assert api.status_code == 200 and token not in api.content.decode()
    assert api.json()["secret_env_keys"] == [TOKEN_ENV]
    assert token not in json.dumps(list(Event.objects.values_list("data", "reason")))
    assert Event.objects.filter(kind="gitlab.runner_registered", job_id=job.pk).exists()
    assert handoff(job) == "nothing to do"  # a second handoff changes nothing


def test_a_job_costs_three_gitlab_calls_and_leaves_no_runner_behind(gl: GitLabWorld) -> None:
    """The look-up of its tags, the runner's creation, the runner's deletion when the job ended."""
    ready_agent(gl)
    gitlab_id = gl.fake.queue_job("acme/app", TAGS, ["true"])
    deliver(job_event(gitlab_id, "pending"), key="k-1")
    delivery_resolve(key="k-1")
    class_converge(forge=GITLAB, runner_class_id=gl.runner_class.pk)
    schedule()
    job = Job.objects.get()
    assert handoff(job) == "handed off"
    runner = GitLabRunner.objects.get(job=job)
    ours = {"id": runner.gitlab_runner_id, "description": runner.name}
    deliver(job_event(gitlab_id, "running", runner=ours))
    deliver(job_event(gitlab_id, "success", runner=ours))
    assert GitLabRunner.objects.get(job=job).gitlab_job == GitLabJob.objects.get(gitlab_id=gitlab_id)
    assert runner_unregister(forge=GITLAB, job_id=job.pk) == "unregistered"  # the task the success sent
    assert gl.fake.runners == {} and gl.fake.api_calls() == 3
    assert Event.objects.filter(kind="gitlab.runner_deleted", job_id=job.pk).exists()
    assert runner_unregister(forge=GITLAB, job_id=job.pk) == "nothing to do"  # again: no second call
    assert gl.fake.api_calls() == 3
    assert Event.objects.filter(kind="gitlab.runner_deleted", job_id=job.pk).count() == 1


def _runner_api(fake: Any, method: str, path: str, body: dict[str, Any], **headers: str) -> tuple[int, Any]:
    """A call of GitLab's runner API, as gitlab-runner (or whoever holds a token) makes it."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        fake.url + path,
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **headers},
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            raw = answer.read()
            return answer.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, None


def test_a_runner_that_took_its_job_is_deleted_and_its_token_takes_no_other(gl: GitLabWorld) -> None:
    """GitLab hands a job to whoever asks with a live runner token, whatever that runner runs
    already: so our runner is deleted as soon as GitLab says it took its job. Its token then
    takes nothing more (403), and the job it runs goes on with its own job token to success."""
    agent, _ = ready_agent(gl)
    first = gl.fake.queue_job("acme/app", TAGS, ["true"])
    job = queue(gl, first)
    schedule()
    assert handoff(job) == "handed off"
    token = poll(agent).json()["job"]["env"][TOKEN_ENV]
    status, taken = _runner_api(gl.fake, "POST", "/api/v4/jobs/request", {"token": token})
    assert status == 201 and taken["id"] == first  # gitlab-runner takes its job
    runner = GitLabRunner.objects.get(job=job)
    ours = {"id": runner.gitlab_runner_id, "description": runner.name}
    assert deliver(job_event(first, "running", runner=ours)).status_code == 200
    assert runner_unregister(forge=GITLAB, job_id=job.pk) == "unregistered"  # the task it sent
    assert runner.gitlab_runner_id not in gl.fake.runners
    assert Event.objects.get(kind="gitlab.runner_deleted", job_id=job.pk).reason == "it took its job"

    second = gl.fake.queue_job("acme/app", TAGS, ["true"])
    assert _runner_api(gl.fake, "POST", "/api/v4/jobs/request", {"token": token})[0] == 403
    assert gl.fake.job(second).status == "pending" and gl.fake.job(second).runner_id is None
    # the running job reports with its own token: a trace update, then its end
    job_token = taken["token"]
    trace = _runner_api(gl.fake, "PATCH", f"/api/v4/jobs/{first}/trace", {}, **{"JOB-TOKEN": job_token})
    assert trace[0] == 202
    done = {"token": job_token, "state": "success"}
    assert _runner_api(gl.fake, "PUT", f"/api/v4/jobs/{first}", done)[0] == 200
    assert gl.fake.job(first).status == "success"
    deliver(job_event(first, "success", runner=None))  # GitLab names no runner: it is gone
    record = GitLabJob.objects.get(gitlab_id=first)
    assert (record.status, record.runner_name, record.job_id) == ("success", runner.name, job.pk)


def _runner_that_took_its_job(gl: GitLabWorld) -> tuple[Job, GitLabRunner, int]:
    """A runner job handed off, its runner reported running its CI job (to be deleted now); the
    CI job's id at GitLab."""
    ready_agent(gl)
    first = gl.fake.queue_job("acme/app", TAGS, ["true"])
    job = queue(gl, first)
    schedule()
    assert handoff(job) == "handed off"
    runner = GitLabRunner.objects.get(job=job)
    ours = {"id": runner.gitlab_runner_id, "description": runner.name}
    assert deliver(job_event(first, "running", runner=ours)).status_code == 200
    return job, runner, first


def test_a_runner_is_deleted_once_however_many_reports_name_it(
    gl: GitLabWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every Job event after our runner took its job names that runner (running, a redelivery,
    its end while the runner still exists): the deletion is asked once, when the first report
    binds it, not once a report (it had cost 1.67 DELETEs a job in the ci benchmark). A
    deletion that fails is the reconciler's (a bound runner it still lists)."""
    import apps.ci.records as records

    sent: list[tuple[str, tuple[Any, ...]]] = []
    monkeypatch.setattr(records, "enqueue_on_commit", lambda task, *args: sent.append((str(task), args)))
    job, runner, first = _runner_that_took_its_job(gl)
    ours = {"id": runner.gitlab_runner_id, "description": runner.name}
    assert deliver(job_event(first, "running", runner=ours), key="again").status_code == 200
    assert deliver(job_event(first, "success", runner=ours)).status_code == 200
    deletions = [args for task, args in sent if task == GITLAB.tasks.finished]
    assert deletions == [(str(runner.pk),)]
    assert runner_unregister(forge=GITLAB, job_id=job.pk) == "unregistered"
    assert gl.fake.count("DELETE", "/runners/") == 1 and runner.gitlab_runner_id not in gl.fake.runners


@pytest.mark.django_db(transaction=True)
def test_the_job_end_and_a_reconcile_deleting_one_runner_at_once_send_one_delete(gl: GitLabWorld) -> None:
    """The job's end (its task) and a reconcile that still lists the bound runner both delete it;
    while one asks GitLab (slow here), the other makes no call of its own (it had cost an extra
    DELETE, answered 404, in the four-job end-to-end test)."""
    from django.db import connection

    job, runner, _ = _runner_that_took_its_job(gl)
    gl.fake.latency = 0.3
    start = threading.Barrier(2)
    outcomes: list[str] = []

    def unregister() -> None:
        try:
            start.wait(10)
            outcomes.append(runner_unregister(forge=GITLAB, job_id=job.pk))
        finally:
            connection.close()

    threads = [threading.Thread(target=unregister) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(outcomes) == ["nothing to do", "unregistered"]
    assert gl.fake.count("DELETE", "/runners/") == 1 and runner.gitlab_runner_id not in gl.fake.runners


def test_a_failed_deletion_is_tried_again_by_the_next_caller(gl: GitLabWorld) -> None:
    """GitLab down when the job ended: the claim is let go, so the reconciler's call deletes it."""
    job, runner, _ = _runner_that_took_its_job(gl)
    gl.fake.error_rate = 1.0
    assert runner_unregister(forge=GITLAB, job_id=job.pk) == "gitlab unavailable"
    assert runner.gitlab_runner_id in gl.fake.runners
    gl.fake.error_rate = 0.0  # back, and its pause over: the reconciler's call
    GitLabConnection.objects.update(unavailable_until=timezone.now() - timedelta(seconds=1))
    assert runner_unregister(forge=GITLAB, job_id=job.pk) == "unregistered"
    assert runner.gitlab_runner_id not in gl.fake.runners


def test_gitlab_down_keeps_jobs_queued_and_buys_no_machine(gl: GitLabWorld) -> None:
    agent, instance = ready_agent(gl)
    job = queue(gl, 1)
    schedule()
    gl.fake.error_rate = 1.0
    assert handoff(job) == "gitlab unavailable"
    job.refresh_from_db()
    instance.refresh_from_db()
    assert job.status == "queued" and job.hold_reason.startswith("GitLab unavailable")
    assert job.pending_reason == job.hold_reason and job.attempt == 1  # not an attempt used
    assert instance.status == "ready"  # released, kept for reuse
    machines = MachineInstance.objects.count()
    later = queue(gl, 2)
    assert later.hold_reason.startswith("GitLab unavailable")
    schedule()
    assert set(Job.objects.values_list("status", flat=True)) == {"queued"}
    assert MachineInstance.objects.count() == machines  # nothing bought while GitLab is down
    assert poll(agent).status_code == 204
    # GitLab is back: the reconciler's probe (once the pause is over) releases them
    gl.fake.error_rate = 0.0
    GitLabConnection.objects.update(unavailable_until=timezone.now() - timedelta(seconds=1))
    endpoint_reconcile(forge=GITLAB, endpoint_id=gl.connection.pk)
    assert not Job.objects.exclude(hold_reason="").exists()
    assert Event.objects.filter(kind="gitlab.available").exists()
    schedule()
    assert Job.objects.filter(status="assigned").count() == 1


def test_a_rate_limit_is_honoured_without_calling_again(gl: GitLabWorld) -> None:
    client = GitLabClient(GitLabConnection.objects.get())
    client.runners()
    conn = GitLabConnection.objects.get()
    assert conn.rate_remaining is not None and conn.rate_reset_at is not None  # RateLimit-* recorded
    gl.fake.rate_limit_for(20)
    with pytest.raises(ForgeRateLimited) as limited:
        client.runners()
    assert 15 < limited.value.retry_after <= 22  # Retry-After
    calls = len(gl.fake.calls)
    with pytest.raises(ForgeRateLimited):
        client.runners()  # known limited: no call
    assert len(gl.fake.calls) == calls
    conn = GitLabConnection.objects.get()
    assert not conn.is_available() and "rate limited" in conn.unavailable_reason
    assert Event.objects.filter(kind="gitlab.unavailable").count() == 1


def test_the_request_budget_keeps_a_reserve_for_dispatch(gl: GitLabWorld, settings: Any) -> None:
    settings.CATACLOUD_GITLAB_REQUEST_BUDGET = 10
    client = GitLabClient(GitLabConnection.objects.get())
    GitLabConnection.objects.update(window_calls=8, window_started_at=timezone.now())
    with pytest.raises(ForgeRateLimited, match="budget"):
        client.runners()  # background: stops at 80 %
    assert client.delete_runner(12345) is False  # dispatch: allowed up to 100 % (404: gone)
    GitLabConnection.objects.update(window_calls=10)
    with pytest.raises(ForgeRateLimited, match="budget"):
        client.delete_runner(12345)


def test_a_refused_runner_fails_the_job_and_releases_the_machine(gl: GitLabWorld) -> None:
    _, instance = ready_agent(gl)
    job = queue(gl, 1)
    schedule()
    gl.fake.fail_next("POST /user/runners", 403)
    assert handoff(job) == "refused"
    job.refresh_from_db()
    instance.refresh_from_db()
    assert job.status == "failed" and "GitLab refused" in job.failure_reason
    assert instance.status == "ready"
    assert Event.objects.filter(kind="gitlab.runner_refused", job_id=job.pk).exists()


def test_cancelling_before_the_handoff_ends_the_job_with_no_gitlab_call(gl: GitLabWorld) -> None:
    _, instance = ready_agent(gl)
    job = queue(gl, 1)
    schedule()
    job_cancel(job=Job.objects.get(pk=job.pk), actor=GITLAB.actor)
    job.refresh_from_db()
    instance.refresh_from_db()
    assert job.status == "cancelled" and instance.status == "ready"
    assert handoff(job) == "nothing to do"
    assert gl.fake.api_calls() == 0


def test_a_job_taken_by_another_runner_retires_one_of_ours(gl: GitLabWorld) -> None:
    """GitLab gave the job to a runner that is not ours; ours, registered and idle, is paused,
    checked, deleted at GitLab and its job cancelled (its machine is then released)."""
    ready_agent(gl)
    job = queue(gl, 1)
    schedule()
    handoff(job)
    assert len(gl.fake.runners) == 1
    deliver(job_event(1, "running", tags=TAGS, runner={"id": 9, "description": "their-own-runner"}))
    class_converge(forge=GITLAB, runner_class_id=gl.runner_class.pk)
    runner = GitLabRunner.objects.get(job=job)
    assert runner.retire_requested_at is not None and runner.gitlab_job is None
    assert runner_retire(forge=GITLAB, job_id=job.pk) == "retired"
    assert gl.fake.runners == {}
    job.refresh_from_db()
    assert job.cancel_requested  # the agent stops the runner; the job then ends cancelled
    assert Event.objects.filter(kind="gitlab.runner_deleted", job_id=job.pk).exists()


def test_a_busy_runner_is_not_deleted(gl: GitLabWorld) -> None:
    ready_agent(gl)
    job = queue(gl, 1)
    schedule()
    handoff(job)
    runner = GitLabRunner.objects.get(job=job)
    with gl.fake.lock:  # GitLab gave it a job a moment ago (its event not here yet)
        fake_runner = gl.fake.runners[runner.gitlab_runner_id]
        gitlab_job = gl.fake.jobs[gl.fake.queue_job("acme/app", TAGS)]
        gitlab_job.status, gitlab_job.runner_id = "running", fake_runner.id
    GitLabRunner.objects.filter(pk=runner.pk).update(retire_requested_at=timezone.now())
    assert runner_retire(forge=GITLAB, job_id=job.pk) == "busy"
    assert runner.gitlab_runner_id in gl.fake.runners and gl.fake.runners[runner.gitlab_runner_id].paused
    job.refresh_from_db()
    assert not job.cancel_requested and job.status == "assigned"
    assert GitLabRunner.objects.get(job=job).retire_requested_at is None


def test_our_runner_taking_another_job_is_bound_to_it_and_demand_balances(gl: GitLabWorld) -> None:
    """GitLab may give our runner any pending job with its tags: the runner started for job 1
    runs job 2; it counts as job 2's, and job 1 still has a runner (the one started for 2)."""
    ready_agent(gl)
    first = queue(gl, 1)
    schedule()
    second = queue(gl, 2)
    assert handoff(first) == "handed off"
    ours = GitLabRunner.objects.get(job=first)
    deliver(
        job_event(2, "running", tags=TAGS, runner={"id": ours.gitlab_runner_id, "description": ours.name})
    )
    assert GitLabRunner.objects.get(job=first).gitlab_job == GitLabJob.objects.get(gitlab_id=2)
    first.refresh_from_db()
    assert first.labels["gitlab_job_id"] == 2 and first.labels["job_name"] == "build-2"
    assert class_converge(forge=GITLAB, runner_class_id=gl.runner_class.pk) == {"started": 0, "retired": 0}
    deliver(job_event(1, "canceled", tags=TAGS))  # job 1 canceled while pending
    assert class_converge(forge=GITLAB, runner_class_id=gl.runner_class.pk) == {"started": 0, "retired": 1}
    second.refresh_from_db()
    assert second.status == "cancelled"  # it had no machine yet: ended at once


def test_never_more_runners_than_pending_jobs(gl: GitLabWorld) -> None:
    for i in range(1, 6):
        deliver(job_event(i, "pending", tags=TAGS))
    assert class_converge(forge=GITLAB, runner_class_id=gl.runner_class.pk) == {"started": 5, "retired": 0}
    assert class_converge(forge=GITLAB, runner_class_id=gl.runner_class.pk) == {"started": 0, "retired": 0}
    for i in range(1, 4):  # three run elsewhere
        deliver(job_event(i, "running", tags=TAGS, runner={"id": 100 + i, "description": f"other-{i}"}))
    assert class_converge(forge=GITLAB, runner_class_id=gl.runner_class.pk) == {"started": 0, "retired": 3}
    live = Job.objects.filter(status__in=["queued", "waiting_for_machine", "assigned", "running"]).count()
    assert live == GitLabJob.objects.filter(status="pending").count() == 2


def test_a_group_class_creates_group_runners(gl: GitLabWorld) -> None:
    from apps.gitlab.services import runner_class_save

    runner_class_save(org=gl.world.org, runner_class=gl.runner_class, scope="group", group_id=7)
    ready_agent(gl)
    job = queue(gl, 1, project_id=13)
    schedule()
    assert handoff(job) == "handed off"
    (created,) = gl.fake.runners.values()
    assert (created.runner_type, created.group_id) == ("group_type", 7)
