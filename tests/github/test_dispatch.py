"""Dispatch against the fake GitHub: a runner job on a warm machine gets a just-in-time runner
registration, handed to the agent as a secret only then; GitHub down keeps jobs queued with no
machine bought; a refused registration fails the job; demand follows GitHub's queue, including
jobs taken by other runners and jobs our runners take that were not theirs."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.events.models import Event
from apps.github.demand import class_converge
from apps.github.dispatch import runner_handoff, runner_name, runner_retire
from apps.github.models import GitHubInstallation, Runner, WorkflowJob
from apps.github.reconcile import installation_reconcile
from apps.github.services import JIT_ENV
from apps.jobs.models import Job
from apps.jobs.scheduler import schedule
from apps.jobs.submission import job_cancel
from apps.machines.models import MachineInstance
from tests.ci_common import poll, ready_agent, tasks_sent
from tests.github.conftest import GitHubWorld, deliver, workflow_job

pytestmark = pytest.mark.django_db


def queue(gh: GitHubWorld, job_id: int, **kw: Any) -> Job:
    """GitHub queues workflow job ``job_id``: its delivery, then the class's convergence."""
    assert deliver("workflow_job", workflow_job(job_id, "queued", **kw)).status_code == 200
    class_converge(runner_class_id=gh.runner_class.pk)
    return Job.objects.get(runner__created_for__github_id=job_id)


def test_the_agent_gets_the_job_only_with_its_runner_registration(gh: GitHubWorld) -> None:
    agent, instance = ready_agent(gh)
    job = queue(gh, 1)
    schedule()
    job.refresh_from_db()
    assert (job.status, job.instance_id) == ("assigned", instance.pk)
    assert poll(agent).status_code == 204  # assigned, but GitHub has not registered its runner yet

    assert runner_handoff(job_id=job.pk) == "handed off"
    registered = gh.fake.summary()["runners"]
    assert [r["name"] for r in registered] == [runner_name(instance.pk)]
    assert {label["name"] for label in registered[0]["labels"]} == set(gh.runner_class.labels)
    answer = poll(agent)
    assert answer.status_code == 200
    payload = answer.json()["job"]
    config = payload["env"][JIT_ENV]
    assert JIT_ENV in payload["secret_env_names"]  # the agent masks it in the output and its log
    assert json.loads(__import__("base64").b64decode(config))["name"] == runner_name(instance.pk)
    # the runner reads it from its environment: never on a command line, which /proc shows to all
    assert payload["command"].endswith("exec ./run.sh") and JIT_ENV not in payload["command"]
    # never in an API answer or an event
    api = gh.world.client("admin").get(f"/api/v1/jobs/{job.pk}/")
    assert api.status_code == 200 and config not in api.content.decode()
    assert api.json()["secret_env_keys"] == [JIT_ENV]
    events = json.dumps(list(Event.objects.values_list("data", "reason")))
    assert config not in events
    assert Event.objects.filter(kind="github.runner_registered", job_id=job.pk).exists()
    # a second handoff of the same job changes nothing
    assert runner_handoff(job_id=job.pk) == "nothing to do"


@pytest.mark.django_db(transaction=True)
def test_the_convergence_task_hands_off_the_first_placed_runner_job_itself_and_sends_the_rest_to_tasks(
    tgh: GitHubWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    from apps.ci import dispatch
    from apps.github.tasks import converge_task

    sent = tasks_sent(monkeypatch, dispatch)
    agents = dict(ready_agent(tgh)[::-1] for _ in range(2))  # machine -> its agent
    for github_id in (1, 2):
        assert deliver("workflow_job", workflow_job(github_id, "queued")).status_code == 200
    sent.clear()  # what the deliveries sent (the convergence's task, run here instead)

    converge_task(str(tgh.runner_class.pk))  # a worker's task, called as the worker calls it

    jobs = list(Job.objects.filter(runner__isnull=False).order_by("queued_at"))
    assert [j.status for j in jobs] == ["assigned", "assigned"]
    first, second = jobs
    # the first one's runner was registered and handed to its machine in the convergence task:
    # its agent gets it on its next poll, no worker needed
    assert first.handed_off_to == first.instance_id
    assert poll(agents[first.instance]).status_code == 200
    # the second waits for its own hand-off task
    assert second.handed_off_to is None and poll(agents[second.instance]).status_code == 204
    assert [args for task, args in sent if task.endswith("handoff_task")] == [(str(second.pk),)]
    assert len(tgh.fake.summary()["runners"]) == 1


@pytest.mark.django_db(transaction=True)
def test_a_handoff_that_fails_in_the_convergence_task_is_left_to_its_task(
    tgh: GitHubWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    from apps.ci import dispatch
    from apps.github.tasks import converge_task

    sent = tasks_sent(monkeypatch, dispatch)
    agent, _ = ready_agent(tgh)
    assert deliver("workflow_job", workflow_job(1, "queued")).status_code == 200
    with monkeypatch.context() as m:
        m.setattr(dispatch, "runner_handoff", lambda **kw: 1 / 0)  # a bug, or the database gone
        converge_task(str(tgh.runner_class.pk))
    job = Job.objects.get(runner__isnull=False)
    assert job.status == "assigned" and job.handed_off_to is None
    assert [args for task, args in sent if task.endswith("handoff_task")] == [(str(job.pk),)]
    assert runner_handoff(job_id=job.pk) == "handed off"  # what the task does
    assert poll(agent).status_code == 200


def test_at_most_two_github_calls_for_a_job_and_one_once_the_token_is_cached(gh: GitHubWorld) -> None:
    ready_agent(gh)
    ready_agent(gh)
    first, second = queue(gh, 1), queue(gh, 2)
    schedule()
    runner_handoff(job_id=first.pk)
    assert gh.fake.api_calls() == 2  # the installation token, the registration
    runner_handoff(job_id=second.pk)
    assert gh.fake.api_calls() == 3  # the registration only
    assert gh.fake.count("POST", "/app/installations/") == 1


def test_a_registration_left_by_a_crash_is_replaced(gh: GitHubWorld) -> None:
    """A handoff that died after GitHub answered left a runner with this name: it is deleted
    and registered again (GitHub answers 409 to a duplicate name)."""
    _, instance = ready_agent(gh)
    job = queue(gh, 1)
    schedule()
    client = __import__("apps.github.client", fromlist=["GitHubClient"]).GitHubClient(gh.installation)
    stale = client.generate_jitconfig(
        owner_path="/orgs/acme", name=runner_name(instance.pk), labels=["x"], runner_group_id=1
    )
    assert runner_handoff(job_id=job.pk) == "handed off"
    runners = gh.fake.summary()["runners"]
    assert [r["name"] for r in runners] == [runner_name(instance.pk)] and runners[0]["id"] != stale.runner_id
    assert Runner.objects.get(job=job).github_runner_id == runners[0]["id"]


def test_github_down_keeps_jobs_queued_and_buys_no_machine(gh: GitHubWorld) -> None:
    agent, instance = ready_agent(gh)
    job = queue(gh, 1)
    schedule()
    gh.fake.error_rate = 1.0
    assert runner_handoff(job_id=job.pk) == "github unavailable"
    job.refresh_from_db()
    instance.refresh_from_db()
    assert job.status == "queued" and job.hold_reason.startswith("GitHub unavailable")
    assert job.pending_reason == job.hold_reason and job.attempt == 1  # not an attempt used
    assert instance.status == "ready"  # released, kept for reuse
    machines = MachineInstance.objects.count()
    later = queue(gh, 2)
    assert later.hold_reason.startswith("GitHub unavailable")
    schedule()
    schedule()
    assert set(Job.objects.values_list("status", flat=True)) == {"queued"}
    assert MachineInstance.objects.count() == machines  # nothing bought while GitHub is down
    assert poll(agent).status_code == 204
    # GitHub is back: the reconciler's probe (once the pause is over) releases them
    gh.fake.error_rate = 0.0
    GitHubInstallation.objects.update(unavailable_until=timezone.now() - timedelta(seconds=1))
    installation_reconcile(installation_id=gh.installation.pk)
    assert not Job.objects.exclude(hold_reason="").exists()
    assert Event.objects.filter(kind="github.available").exists()
    schedule()
    assert Job.objects.filter(status="assigned").count() == 1
    assert Job.objects.filter(status="waiting_for_machine").count() == 1  # the second buys one now


def test_a_refused_registration_fails_the_job_and_releases_the_machine(gh: GitHubWorld) -> None:
    _, instance = ready_agent(gh)
    job = queue(gh, 1)
    schedule()
    gh.fake.fail_next("generate-jitconfig", 403)
    assert runner_handoff(job_id=job.pk) == "refused"
    job.refresh_from_db()
    instance.refresh_from_db()
    assert job.status == "failed" and "GitHub refused" in job.failure_reason
    assert instance.status == "ready"
    assert Event.objects.filter(kind="github.runner_refused", job_id=job.pk).exists()


def test_cancelling_before_the_handoff_ends_the_job_and_frees_the_machine(gh: GitHubWorld) -> None:
    _, instance = ready_agent(gh)
    job = queue(gh, 1)
    schedule()
    job_cancel(job=Job.objects.get(pk=job.pk), actor="test")
    job.refresh_from_db()
    instance.refresh_from_db()
    assert job.status == "cancelled" and instance.status == "ready"
    assert runner_handoff(job_id=job.pk) == "nothing to do"
    assert gh.fake.api_calls() == 0


def test_a_job_taken_by_another_runner_retires_one_of_ours(gh: GitHubWorld) -> None:
    """The stolen-job case: GitHub gave the job to a runner that is not ours; ours, registered
    and idle, is deleted at GitHub and its job cancelled (its machine is then released)."""
    _, instance = ready_agent(gh)
    job = queue(gh, 1)
    schedule()
    runner_handoff(job_id=job.pk)
    assert len(gh.fake.summary()["runners"]) == 1
    deliver("workflow_job", workflow_job(1, "in_progress", runner_name="their-own-runner"))
    class_converge(runner_class_id=gh.runner_class.pk)
    runner = Runner.objects.get(job=job)
    assert runner.retire_requested_at is not None and runner.workflow_job is None
    assert runner_retire(job_id=job.pk) == "retired"
    assert gh.fake.summary()["runners"] == []
    job.refresh_from_db()
    assert job.cancel_requested  # the agent stops the runner; the job then ends cancelled
    assert Event.objects.filter(kind="github.runner_deleted", job_id=job.pk).exists()


def test_our_runner_taking_another_job_is_bound_to_it_and_demand_balances(gh: GitHubWorld) -> None:
    """GitHub may give our runner any queued job with its labels: the runner started for job 1
    runs job 2; it counts as job 2's, and job 1 still has a runner (the one started for 2)."""
    _, instance = ready_agent(gh)
    first = queue(gh, 1)
    schedule()  # job 1's runner gets the machine; job 2's waits for one
    second = queue(gh, 2)
    assert runner_handoff(job_id=first.pk) == "handed off"
    ours = Runner.objects.get(job=first)
    deliver(
        "workflow_job", workflow_job(2, "in_progress", runner_name=ours.name, runner_id=ours.github_runner_id)
    )
    runner = Runner.objects.get(job=first)
    assert runner.workflow_job == WorkflowJob.objects.get(github_id=2)
    first.refresh_from_db()
    assert first.labels["github_job_id"] == 2 and first.labels["job_name"] == "build-2"
    assert class_converge(runner_class_id=gh.runner_class.pk) == {"started": 0, "retired": 0}
    # job 1 is cancelled on GitHub while queued: the runner started for job 2 is not needed
    deliver("workflow_job", workflow_job(1, "completed", conclusion="cancelled"))
    assert class_converge(runner_class_id=gh.runner_class.pk) == {"started": 0, "retired": 1}
    second.refresh_from_db()
    assert second.status == "cancelled"  # it had no machine yet: ended at once


def test_never_more_runners_than_queued_jobs(gh: GitHubWorld) -> None:
    for i in range(1, 6):
        deliver("workflow_job", workflow_job(i, "queued"))
    assert class_converge(runner_class_id=gh.runner_class.pk) == {"started": 5, "retired": 0}
    assert class_converge(runner_class_id=gh.runner_class.pk) == {"started": 0, "retired": 0}  # idempotent
    for i in range(1, 4):  # three run elsewhere
        deliver("workflow_job", workflow_job(i, "in_progress", runner_name=f"other-{i}"))
    assert class_converge(runner_class_id=gh.runner_class.pk) == {"started": 0, "retired": 3}
    live = Job.objects.filter(status__in=["queued", "waiting_for_machine", "assigned", "running"]).count()
    assert live == WorkflowJob.objects.filter(status="queued").count() == 2


def test_a_busy_runner_is_not_deleted(gh: GitHubWorld) -> None:
    _, instance = ready_agent(gh)
    job = queue(gh, 1)
    schedule()
    runner_handoff(job_id=job.pk)
    runner = Runner.objects.get(job=job)
    with gh.fake.lock:  # GitHub handed it a job a moment ago (its delivery not here yet)
        gh.fake.runners[runner.github_runner_id].job_id = 12345
    Runner.objects.filter(pk=runner.pk).update(retire_requested_at=timezone.now())
    assert runner_retire(job_id=job.pk) == "busy"
    job.refresh_from_db()
    assert not job.cancel_requested and job.status == "assigned"
    assert Runner.objects.get(job=job).retire_requested_at is None


def test_a_late_completion_binds_the_runner_that_ran_the_job_not_its_machines_next_one(
    gh: GitHubWorld,
) -> None:
    """A machine's runners share its name: the next runner on it may be registered before the
    previous one's ``completed`` delivery arrives. GitHub's runner id tells them apart (found by
    the ci benchmark: the next runner was taken for busy, and a surplus then cancelled)."""
    from apps.jobs.reports import job_finished, job_started

    _, instance = ready_agent(gh)
    first = queue(gh, 1)
    schedule()
    runner_handoff(job_id=first.pk)
    a = Runner.objects.get(job=first)
    deliver("workflow_job", workflow_job(1, "in_progress", runner_name=a.name, runner_id=a.github_runner_id))
    job_started(instance=instance, job_id=first.pk)
    job_finished(instance=instance, job_id=first.pk, outcome="succeeded", exit_code=0)
    instance.refresh_from_db()
    assert instance.status == "ready"  # kept for the class's next runner
    second = queue(gh, 2)
    schedule()
    assert runner_handoff(job_id=second.pk) == "handed off"
    b = Runner.objects.get(job=second)
    assert b.name == a.name and b.github_runner_id != a.github_runner_id
    deliver(
        "workflow_job",
        workflow_job(1, "completed", runner_name=a.name, runner_id=a.github_runner_id, conclusion="success"),
    )
    assert Runner.objects.get(job=second).workflow_job is None  # still free for job 2
    assert class_converge(runner_class_id=gh.runner_class.pk) == {"started": 0, "retired": 0}
