"""The reconciler's rules, one by one, against the fake GitHub: runners whose machine is gone,
runners that never came online, idle runners, missed webhooks found by polling (with backoff),
failed deliveries redelivered; and the reaper's GitHub rules (stored but unprocessed
deliveries, lost handoffs)."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.ci import reconcile as ci_reconcile
from apps.events.models import Event
from apps.github.client import GitHubClient
from apps.github.convergence import github_converge
from apps.github.demand import class_converge
from apps.github.dispatch import runner_handoff, runner_name
from apps.github.models import GitHubInstallation, Runner, WebhookDelivery, WorkflowJob
from apps.github.reconcile import installation_reconcile
from apps.jobs.models import Job
from apps.jobs.scheduler import schedule
from apps.machines.models import MachineInstance
from tests.ci_common import ready_agent
from tests.github.conftest import GitHubWorld, deliver, workflow_job
from tests.github.test_dispatch import queue

pytestmark = pytest.mark.django_db


def reconcile(gh: GitHubWorld) -> dict[str, int]:
    GitHubInstallation.objects.update(next_poll_at=None)  # poll now, whatever the backoff says
    return installation_reconcile(installation_id=gh.installation.pk)


def register(gh: GitHubWorld, name: str) -> int:
    client = GitHubClient(GitHubInstallation.objects.get(pk=gh.installation.pk))
    return client.generate_jitconfig(
        owner_path="/orgs/acme", name=name, labels=["x"], runner_group_id=1
    ).runner_id


def gone_runners(gh: GitHubWorld, n: int) -> None:
    """``n`` runners registered at GitHub whose machines are gone: the reconciler deletes them."""
    for _ in range(n):
        _, gone = ready_agent(gh)
        MachineInstance.objects.filter(pk=gone.pk).update(status="terminated", ended_at=timezone.now())
        register(gh, runner_name(gone.pk))


def reconcile_in_background(gh: GitHubWorld) -> tuple[threading.Thread, dict[str, int]]:
    """A reconcile in a thread of its own (its own connection); its report fills in at the end."""
    report: dict[str, int] = {}

    def run() -> None:
        from django.db import connection

        try:
            report.update(reconcile(gh))
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, report


def handed_off(gh: GitHubWorld) -> tuple[Job, MachineInstance, Runner]:
    _, instance = ready_agent(gh)
    job = queue(gh, 1)
    schedule()
    assert runner_handoff(job_id=job.pk) == "handed off"
    return Job.objects.get(pk=job.pk), instance, Runner.objects.get(job=job)


def test_runners_whose_machine_is_gone_are_deleted_and_nobody_elses(gh: GitHubWorld) -> None:
    _, gone = ready_agent(gh)
    MachineInstance.objects.filter(pk=gone.pk).update(status="terminated", ended_at=timezone.now())
    register(gh, runner_name(gone.pk))
    register(gh, runner_name(uuid.uuid4()))  # another Catacloud installation's machine
    register(gh, "a-hand-made-runner")
    busy_instance = ready_agent(gh)[1]
    busy = register(gh, runner_name(busy_instance.pk))
    with gh.fake.lock:
        gh.fake.runners[busy].job_id = 1
    report = reconcile(gh)
    assert report["runners_deleted"] == 1
    names = sorted(r["name"] for r in gh.fake.summary()["runners"])
    assert runner_name(gone.pk) not in names and len(names) == 3
    assert Event.objects.filter(kind="github.runner_deleted", instance_id=gone.pk).exists()


def test_a_reconcile_killed_mid_way_holds_its_installation_at_most_a_minute(gh: GitHubWorld) -> None:
    gone_runners(gh, 1)
    # a worker SIGKILLed mid-reconcile: its claim stays, nothing releases it
    GitHubInstallation.objects.update(reconcile_claimed_at=timezone.now() - timedelta(seconds=30))
    assert reconcile(gh) == {"skipped": 1}
    GitHubInstallation.objects.update(reconcile_claimed_at=timezone.now() - timedelta(seconds=61))
    assert reconcile(gh)["runners_deleted"] == 1
    assert not gh.fake.summary()["runners"]


@pytest.mark.django_db(transaction=True)
def test_a_long_reconcile_keeps_its_claim_so_no_second_one_runs_beside_it(
    gh: GitHubWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ci_reconcile, "CLAIM_FOR", timedelta(seconds=1))
    monkeypatch.setattr(ci_reconcile, "CLAIM_RENEW", timedelta(seconds=0.2))
    gone_runners(gh, 6)
    gh.fake.latency = 0.4  # each deletion takes 0.4 s: the first reconcile runs ~2.5 s
    thread, first = reconcile_in_background(gh)
    time.sleep(1.6)  # past CLAIM_FOR since the first one claimed
    assert thread.is_alive()
    assert reconcile(gh) == {"skipped": 1}
    thread.join(30)
    assert first["runners_deleted"] == 6


def test_a_live_runners_registration_is_kept(gh: GitHubWorld) -> None:
    _, _, runner = handed_off(gh)
    assert reconcile(gh).get("runners_deleted") == 0
    assert [r["id"] for r in gh.fake.summary()["runners"]] == [runner.github_runner_id]


def test_a_runner_that_never_came_online_has_its_machine_recycled(gh: GitHubWorld) -> None:
    job, instance, runner = handed_off(gh)
    assert reconcile(gh)["runners_recycled"] == 0  # within its deadline
    Runner.objects.filter(pk=runner.pk).update(
        registered_at=timezone.now() - timedelta(seconds=gh.runner_class.online_timeout_seconds + 1)
    )
    assert reconcile(gh)["runners_recycled"] == 1
    instance.refresh_from_db()
    assert instance.status in ("terminating", "terminated") and instance.end_cause == "runner_offline"
    assert Event.objects.filter(kind="github.runner_recycled", job_id=job.pk).exists()


def test_an_online_runner_is_not_recycled_and_an_idle_one_is_retired(gh: GitHubWorld) -> None:
    job, instance, runner = handed_off(gh)
    Runner.objects.filter(pk=runner.pk).update(registered_at=timezone.now() - timedelta(hours=1))
    with gh.fake.lock:  # the runner connected
        fake_runner = gh.fake.runners[runner.github_runner_id]
        fake_runner.session, fake_runner.last_seen = True, __import__("time").time()
    report = reconcile(gh)
    assert report["runners_recycled"] == 0 and report["runners_idle_retired"] == 0
    assert Runner.objects.get(pk=runner.pk).online_at is not None
    Runner.objects.filter(pk=runner.pk).update(
        online_at=timezone.now() - timedelta(seconds=gh.runner_class.idle_timeout_seconds + 1)
    )
    assert reconcile(gh)["runners_idle_retired"] == 1
    assert Runner.objects.get(pk=runner.pk).retire_requested_at is not None


def test_a_runner_job_requeued_after_its_runner_took_a_job_registers_an_unbound_runner(
    gh: GitHubWorld,
) -> None:
    """A machine lost while its runner ran a workflow job: the runner job is requeued, and its
    next attempt registers a new runner that has taken no job. It kept the lost runner's binding,
    so it was never retired when idle and stayed registered for ever (the sixty-job e2e's
    leftover: an online, idle runner of attempt 3). Now it is retired as any idle runner is."""
    from apps.core.causes import Cause
    from apps.jobs.reports import jobs_requeue_for_instance

    job, instance, runner = handed_off(gh)
    github_id = gh.fake.queue_job("acme/app", list(gh.runner_class.labels), ["true"])
    taken = workflow_job(github_id, "in_progress", runner_name=runner.name, runner_id=runner.github_runner_id)
    assert deliver("workflow_job", taken).status_code == 200
    assert Runner.objects.get(pk=runner.pk).workflow_job_id is not None  # it took the job
    MachineInstance.objects.filter(pk=instance.pk).update(status="lost", ended_at=timezone.now())
    assert jobs_requeue_for_instance(instance_id=instance.pk, cause=Cause.MACHINE_LOST) == 1
    _, other = ready_agent(gh)
    schedule()
    assert runner_handoff(job_id=job.pk) == "handed off"
    again = Runner.objects.get(pk=runner.pk)
    assert again.github_runner_id != runner.github_runner_id and again.workflow_job_id is None
    with gh.fake.lock:  # the new runner connected, and GitHub gives it nothing
        fake_runner = gh.fake.runners[again.github_runner_id]
        fake_runner.session, fake_runner.last_seen = True, time.time()
    Runner.objects.filter(pk=runner.pk).update(registered_at=timezone.now() - timedelta(hours=1))
    reconcile(gh)
    Runner.objects.filter(pk=runner.pk).update(
        online_at=timezone.now() - timedelta(seconds=gh.runner_class.idle_timeout_seconds + 1)
    )
    assert reconcile(gh)["runners_idle_retired"] == 1


def test_a_runner_that_crashed_in_its_job_has_its_registration_deleted_at_the_next_reconcile(
    gh: GitHubWorld,
) -> None:
    """A just-in-time runner that ended its job normally is gone from GitHub; one that crashed
    in it stays registered (offline; GitHub removes it only after a day). Its runner job's
    failure makes the next reconcile list the runners and delete it, not the 10-minute listing
    (the two-forge e2e's leftover: an offline runner, no live runner job)."""
    from apps.jobs.reports import job_finished, job_started

    job, instance, runner = handed_off(gh)
    github_id = gh.fake.queue_job("acme/app", list(gh.runner_class.labels), ["true"])
    taken = workflow_job(github_id, "in_progress", runner_name=runner.name, runner_id=runner.github_runner_id)
    assert deliver("workflow_job", taken).status_code == 200
    job_started(instance=instance, job_id=job.pk)
    job_finished(instance=instance, job_id=job.pk, outcome="failed", exit_code=1)  # it crashed
    GitHubInstallation.objects.update(runners_listed_at=timezone.now() - timedelta(seconds=5))
    assert runner.github_runner_id in gh.fake.runners
    assert reconcile(gh)["runners_deleted"] == 1
    assert runner.github_runner_id not in gh.fake.runners


def test_a_registration_left_for_a_later_pass_is_deleted_at_the_next_reconcile(gh: GitHubWorld) -> None:
    """A runner whose job ended is not deleted while a registration of its machine is in flight
    (a machine kept for reuse, already registering the next runner job's runner: it may be that
    one). That listing is not counted: the next reconcile lists again and deletes it, instead
    of the 10-minute listing (the two-forge e2e's leftover: an offline runner, no live job)."""
    from apps.jobs.reports import job_finished, job_started

    job, instance, runner = handed_off(gh)
    job_started(instance=instance, job_id=job.pk)
    job_finished(instance=instance, job_id=job.pk, outcome="failed", exit_code=1)  # it never took a job
    nxt = queue(gh, 2)
    Runner.objects.filter(job=nxt).update(registering_instance=instance.pk, registering_at=timezone.now())
    assert reconcile(gh)["runners_deleted"] == 0  # it may be the one in flight: left for now
    Runner.objects.filter(job=nxt).update(registering_at=timezone.now() - timedelta(hours=1))
    assert reconcile(gh)["runners_deleted"] == 1
    assert runner.github_runner_id not in gh.fake.runners


@pytest.mark.parametrize("earlier", ["machine lost", "answer lost"])
def test_an_earlier_attempts_registration_is_deleted_at_the_next_reconcile(
    gh: GitHubWorld, earlier: str
) -> None:
    """A runner job's registration replaced by a later attempt's is named by no row: only a
    listing finds it. The two-forge e2e left two such runners registered (offline) at GitHub
    past its 3-minute wait, until the 10-minute listing: one whose machine was lost (the runner
    job was requeued and registered again elsewhere). Likewise a registration GitHub made whose
    answer never came (a timeout, a 5xx): the job was requeued and registered on another
    machine. The next reconcile lists now."""
    from apps.core.causes import Cause
    from apps.jobs.handoff import job_handoff_failed
    from apps.jobs.reports import jobs_requeue_for_instance

    _, instance = ready_agent(gh)
    job = queue(gh, 1)
    schedule()
    if earlier == "machine lost":
        assert runner_handoff(job_id=job.pk) == "handed off"
        old_id = Runner.objects.get(job=job).github_runner_id
        reconcile(gh)  # a listing: the next one is 10 minutes away
        MachineInstance.objects.filter(pk=instance.pk).update(status="lost", ended_at=timezone.now())
        assert jobs_requeue_for_instance(instance_id=instance.pk, cause=Cause.MACHINE_LOST) == 1
        ready_agent(gh)
        schedule()
    else:
        reconcile(gh)
        # the hand-off asked, GitHub made the runner, its answer was lost: the job is requeued
        Runner.objects.filter(job=job).update(registering_instance=instance.pk, registering_at=timezone.now())
        old_id = register(gh, runner_name(instance.pk))
        assert job_handoff_failed(
            job_id=job.pk,
            instance_id=instance.pk,
            cause=Cause.GITHUB_UNAVAILABLE,
            detail="timed out",
            actor="test",
        )
        MachineInstance.objects.filter(pk=instance.pk).update(status="terminated", ended_at=timezone.now())
        ready_agent(gh)
        schedule()
    assert runner_handoff(job_id=job.pk) == "handed off"
    assert Runner.objects.get(job=job).github_runner_id != old_id
    assert old_id in gh.fake.runners
    report = reconcile(gh)
    assert report["runners_listed"] == 1 and report["runners_deleted"] == 1, report
    assert old_id not in gh.fake.runners and Runner.objects.get(job=job).github_runner_id in gh.fake.runners


def test_a_runner_made_for_a_job_that_moved_on_is_deleted_by_the_next_reconcile(
    gh: GitHubWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner job was cancelled (demand fell) while its hand-off asked GitHub for a runner:
    the runner made is nobody's and is deleted at once; when that deletion fails, no row names
    it, so it waited for the 10-minute listing. The next reconcile lists now."""
    from apps.github.ops import GitHubOps
    from apps.jobs.submission import job_cancel

    _, instance = ready_agent(gh)
    job = queue(gh, 1)
    schedule()
    reconcile(gh)  # a listing: the next one is 10 minutes away
    register_now = GitHubOps.register

    def register_while_cancelled(self: Any, client: Any, runner: Any, name: str) -> Any:
        made = register_now(self, client, runner, name)
        job_cancel(job=Job.objects.get(pk=job.pk), actor="test")  # meanwhile, demand fell
        gh.fake.fail_next("DELETE .*/actions/runners/", 503, times=10)  # and GitHub errs a while
        return made

    monkeypatch.setattr(GitHubOps, "register", register_while_cancelled)
    assert runner_handoff(job_id=job.pk) == "job moved on"
    monkeypatch.undo()
    made = [r["id"] for r in gh.fake.summary()["runners"]]
    assert len(made) == 1 and Runner.objects.get(job=job).github_runner_id is None
    gh.fake._fail_next.clear()
    GitHubInstallation.objects.update(unavailable_until=None)  # its 15 s back-off has passed
    report = reconcile(gh)
    assert report.get("runners_listed") == 1 and report["runners_deleted"] == 1, report
    assert not gh.fake.summary()["runners"]


def test_a_lost_queued_webhook_is_found_by_polling(gh: GitHubWorld) -> None:
    gh.fake.lost_rate = 1.0  # GitHub never sends it
    github_id = gh.fake.queue_job("acme/lib", list(gh.runner_class.labels), ["true"], workflow="Nightly")
    assert not WorkflowJob.objects.exists()
    assert reconcile(gh)["missed_jobs_found"] == 1
    record = WorkflowJob.objects.get()
    assert (record.github_id, record.repository, record.workflow, record.status) == (
        github_id,
        "acme/lib",
        "Nightly",
        "queued",
    )
    class_converge(runner_class_id=gh.runner_class.pk)
    assert Job.objects.get().labels["repository"] == "acme/lib"


def test_a_lost_completion_is_found_and_the_runner_retired(gh: GitHubWorld) -> None:
    github_id = gh.fake.queue_job("acme/app", list(gh.runner_class.labels), ["true"])
    deliver(
        "workflow_job",
        {**workflow_job(github_id, "queued"), "workflow_job": gh.fake.job(github_id).as_json()},
    )
    class_converge(runner_class_id=gh.runner_class.pk)
    gh.fake.lost_rate = 1.0
    gh.fake.cancel_job(github_id)  # its completed delivery is lost
    WorkflowJob.objects.update(status_changed_at=timezone.now() - timedelta(minutes=5))
    report = reconcile(gh)
    assert report["jobs_looked_up"] == 1 and report["missed_jobs_found"] == 1
    assert WorkflowJob.objects.get().status == "completed"
    class_converge(runner_class_id=gh.runner_class.pk)
    assert Job.objects.get().status == "cancelled"


def test_polling_backs_off_while_it_finds_nothing(gh: GitHubWorld) -> None:
    intervals = []
    for _ in range(3):
        reconcile(gh)
        intervals.append(GitHubInstallation.objects.get().poll_interval_seconds)
    assert intervals == [60.0, 120.0, 240.0]
    gh.fake.lost_rate = 1.0
    gh.fake.queue_job("acme/app", list(gh.runner_class.labels), ["true"])
    reconcile(gh)  # the hourly sweep of every repository was the first poll's: not yet again
    assert GitHubInstallation.objects.get().poll_interval_seconds == 480.0
    GitHubInstallation.objects.update(swept_at=timezone.now() - timedelta(hours=1, seconds=1))
    reconcile(gh)  # an hour later, quiet: every repository again, and the lost job is found
    assert GitHubInstallation.objects.get().poll_interval_seconds == 30.0
    before = gh.fake.api_calls()
    installation_reconcile(installation_id=gh.installation.pk)  # not due: no poll calls
    assert gh.fake.count("GET", "/installation/repositories") == 2  # the two sweeps only
    assert gh.fake.api_calls() - before == 0  # nothing unaccounted for: not even the runners list


def test_a_burst_after_a_quiet_spell_has_its_lost_webhooks_found_within_one_interval(
    gh: GitHubWorld,
) -> None:
    """The 70 s stall of a 1,000-job burst: polls that found nothing had stretched the interval,
    so the burst's lost `queued` webhooks (GitHub lists only the last 100 deliveries for
    redelivery) waited for a backed-off poll. A delivery now brings the poll back to the base
    interval (30 s here)."""
    for _ in range(3):
        reconcile(gh)  # a quiet spell: nothing missed, the interval doubles to 4 minutes
    assert GitHubInstallation.objects.get().poll_interval_seconds == 240.0
    labels = list(gh.runner_class.labels)
    gh.fake.lost_rate = 1.0
    delivered = gh.fake.queue_job("acme/app", labels, ["true"])
    deliver("workflow_job", workflow_job(delivered, "queued", labels=labels))  # the burst begins
    lost = gh.fake.queue_job("acme/app", labels, ["true"])  # its webhook never comes
    at = timezone.now() + timedelta(seconds=31)
    assert installation_reconcile(installation_id=gh.installation.pk, now=at)["missed_jobs_found"] == 1
    assert set(WorkflowJob.objects.values_list("github_id", flat=True)) == {delivered, lost}


def test_failed_deliveries_are_redelivered_once(gh: GitHubWorld) -> None:
    gh.fake.drop_rate = 1.0  # GitHub could not deliver: listed as failed
    gh.fake.queue_job("acme/app", list(gh.runner_class.labels), ["true"])
    delivered = gh.fake.queue_job("acme/app", list(gh.runner_class.labels), ["true"])
    stored_guid = gh.fake.deliveries[-1].guid  # this one reached us another way
    WebhookDelivery.objects.create(
        guid=stored_guid, installation=gh.installation, org=gh.world.org, event="workflow_job", payload={}
    )
    assert reconcile(gh)["redelivered"] == 1
    assert gh.fake.count("POST", "/app/hook/deliveries/") == 1
    assert Event.objects.filter(kind="github.redelivered").count() == 1
    assert reconcile(gh).get("redelivered", 0) == 0  # checked once per interval
    assert delivered


def test_the_reaper_acts_on_stored_unprocessed_deliveries_and_redrives_lost_handoffs(gh: GitHubWorld) -> None:
    from apps.github.webhooks import delivery_process

    payload: dict[str, Any] = workflow_job(9, "queued")
    WebhookDelivery.objects.create(
        guid="crashed-before-acting",
        installation=gh.installation,
        org=gh.world.org,
        event="workflow_job",
        action="queued",
        payload=payload,
    )
    WebhookDelivery.objects.update(received_at=timezone.now() - timedelta(minutes=1))
    report = github_converge(now=timezone.now())
    assert report["github_deliveries_processed"] == 1 and report["github_runners_started"] == 1
    assert WorkflowJob.objects.get().github_id == 9
    assert delivery_process(guid="crashed-before-acting") == "done"  # once only
    ready_agent(gh)
    schedule()
    Job.objects.update(status_changed_at=timezone.now() - timedelta(minutes=1))
    assert github_converge(now=timezone.now())["github_handoffs_redriven"] == 1


@pytest.mark.django_db(transaction=True)
def test_a_reconcile_whose_claim_was_taken_stops_and_leaves_the_new_claim(
    gh: GitHubWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ci_reconcile, "CLAIM_RENEW", timedelta(seconds=0.2))
    gone_runners(gh, 6)
    gh.fake.latency = 0.4
    thread, first = reconcile_in_background(gh)
    time.sleep(1.0)
    taken = timezone.now()  # another reconcile took the endpoint (this one was too slow)
    GitHubInstallation.objects.update(reconcile_claimed_at=taken)
    thread.join(30)
    assert first.get("claim_lost") == 1
    assert len(gh.fake.summary()["runners"]) > 0  # it stopped part-way
    assert GitHubInstallation.objects.get().reconcile_claimed_at == taken  # and left the claim alone
