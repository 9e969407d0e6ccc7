"""GitHub's limits against the strict fake (issue 49, items 1-4, 6, 7): a secondary limit is back
pressure (the job waits, held, its pending reason naming the limit; no call before the documented
wait), registrations are paced below the content-creation limit, polls cost the active
repositories, deliveries are paged by cursor and our own 4xx answers are not redelivered, user
accounts and public repositories get repository runners, demand is counted per repository for
repository runners, and a runner too old for GitHub fails naming it and blocks its class."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from apps.events.models import Event
from apps.github.demand import class_converge
from apps.github.dispatch import runner_handoff
from apps.github.models import GitHubInstallation, Runner, RunnerClass, WorkflowJob
from apps.github.reconcile import installation_reconcile
from apps.github.services import runner_class_save
from apps.jobs.models import Job
from apps.jobs.reports import job_finished, job_started
from apps.jobs.scheduler import schedule
from tests.ci_common import ready_agent
from tests.github.conftest import INSTALLATION, GitHubWorld, deliver, workflow_job
from tests.github.test_dispatch import queue

pytestmark = pytest.mark.django_db


def handed_off_or_held(gh: GitHubWorld, job_id: int, **kw: object) -> tuple[Job, str]:
    ready_agent(gh)
    job = queue(gh, job_id, **kw)
    schedule()
    outcome = runner_handoff(job_id=job.pk)
    return Job.objects.get(pk=job.pk), outcome


def test_a_secondary_limit_without_retry_after_holds_the_job_a_minute_and_calls_nothing(
    gh: GitHubWorld,
) -> None:
    """Item 1: a 403 with no retry-after and x-ratelimit-remaining > 0 failed the runner job and
    the next pass asked again. It is GitHub's secondary limit: wait at least a minute."""
    gh.fake.secondary_styles.clear()
    gh.fake.secondary_styles.extend(["bare_403"])
    gh.fake.fail_next("installation/repositories", 200, times=0)  # (no other faults)
    gh.fake.secondary_rate = 1.0
    job, outcome = handed_off_or_held(gh, 1)
    assert outcome == "github unavailable"
    assert job.status == "queued" and job.failure_reason == ""
    assert (
        job.hold_reason.startswith("waiting for GitHub's limit") and "secondary rate limit" in job.hold_reason
    )
    inst = GitHubInstallation.objects.get()
    wait = (inst.unavailable_until - timezone.now()).total_seconds()
    assert 55 < wait <= 60 and inst.limited_total >= 1
    assert Event.objects.filter(kind="github.rate_limited").exists()
    calls = gh.fake.api_calls()
    gh.fake.secondary_rate = 0.0
    schedule()
    for pending in Job.objects.filter(status="assigned"):
        runner_handoff(job_id=pending.pk)
    installation_reconcile(installation_id=inst.pk)
    assert gh.fake.api_calls() == calls and gh.fake.limit_violations == []  # nothing before the minute
    # a second limit answer in a row waits twice as long
    GitHubInstallation.objects.update(unavailable_until=timezone.now() - timedelta(seconds=1))
    gh.fake.secondary_rate = 1.0
    installation_reconcile(installation_id=inst.pk)
    inst.refresh_from_db()
    assert 115 < (inst.unavailable_until - timezone.now()).total_seconds() <= 120


def test_a_429_secondary_limit_is_a_limit_too(gh: GitHubWorld) -> None:
    gh.fake.secondary_styles.clear()
    gh.fake.secondary_styles.extend(["bare_429"])
    gh.fake.secondary_rate = 1.0
    job, outcome = handed_off_or_held(gh, 1)
    assert outcome == "github unavailable" and job.status == "queued" and "HTTP 429" in job.pending_reason


def test_registrations_wait_below_the_content_creation_limit_and_the_reconciler_goes_on(
    gh: GitHubWorld,
) -> None:
    """GitHub allows 80 content-creating requests a minute (500 an hour): our pacing keeps 72 a
    minute, and a registration beyond it waits, held, without a call, while everything else goes on."""
    now = time.time()
    GitHubInstallation.objects.update(spend={"creations a minute": [now, 72, 60.0]})
    job, outcome = handed_off_or_held(gh, 1)
    assert outcome == "github unavailable" and job.status == "queued"
    assert "content-creation limit (80 a minute" in job.pending_reason
    assert gh.fake.count("POST", "/orgs/acme/actions/runners/generate-jitconfig") == 0
    inst = GitHubInstallation.objects.get()
    assert inst.is_available() and inst.is_paced()
    later = queue(gh, 2)  # a new runner job is held at once, with the same reason
    assert later.hold_reason.startswith("waiting for GitHub's limit")
    report = installation_reconcile(installation_id=inst.pk)
    assert "github_errors" not in report  # the reconciler is not held by a registration's pacing
    # the window turns: the reaper releases them
    Runner.objects.update(held_until=timezone.now() - timedelta(seconds=1))
    GitHubInstallation.objects.update(spend={}, paced_until=None)
    from apps.ci.availability import held_release
    from apps.github.forge import GITHUB

    assert held_release(forge=GITHUB, now=timezone.now()) == 2
    assert not Job.objects.exclude(hold_reason="").exists()


@pytest.mark.django_db(transaction=True)
def test_registrations_held_by_our_pacing_are_released_when_the_window_turns(
    tgh: GitHubWorld, tmp_path: Path
) -> None:
    """Held runner jobs were released only at the reaper's next tick (a minute by default) after
    their window turned. The hold sends their release for the window's end: no beat runs here,
    so only that message can release them."""
    from testkit.processes import TESTS, purge_redis, wait_for

    purge_redis()
    turns_in = 4.0
    GitHubInstallation.objects.update(spend={"creations a minute": [time.time() - 60 + turns_in, 72, 60.0]})
    job, outcome = handed_off_or_held(tgh, 1)
    assert outcome == "github unavailable" and job.hold_reason.startswith("waiting for GitHub's limit")

    def released() -> bool:
        return not Job.objects.filter(pk=job.pk).exclude(hold_reason="").exists()

    with TESTS.celery_worker(tmp_path, concurrency=1):
        wait_for(released, 60, "the held runner job released when the window turned")
    assert Runner.objects.get(job_id=job.pk).held_until is None


def test_a_poll_costs_the_active_repositories_not_all_of_them(gh: GitHubWorld) -> None:
    """Item 2: a poll cost 1 + 2 x repositories calls; now the active ones, a few a pass."""
    repos = [f"acme/r{i}" for i in range(40)]
    gh.fake.add_installation(INSTALLATION, "acme", repos)
    installation_reconcile(installation_id=gh.installation.pk)  # quiet, never swept: one sweep
    deliver("workflow_job", workflow_job(1, "queued", repository="acme/r7"))
    GitHubInstallation.objects.update(next_poll_at=None)
    before = gh.fake.api_calls()
    installation_reconcile(installation_id=gh.installation.pk)
    assert gh.fake.api_calls() - before <= 3  # the runners list, acme/r7's queued runs (and a job)
    assert gh.fake.count("GET", "/installation/repositories") == 1
    # the polls' share of the budget used: the poll stops, the reconciler's runner upkeep goes on
    GitHubInstallation.objects.update(window_calls=2300, window_started_at=timezone.now(), next_poll_at=None)
    report = installation_reconcile(installation_id=gh.installation.pk)
    assert "github_errors" not in report and report["runners_deleted"] == 0


def test_deliveries_are_paged_by_cursor_and_our_own_4xx_answers_are_not_sent_again(gh: GitHubWorld) -> None:
    """Item 3: only the newest 100 were read, and deliveries we answered 4xx were redelivered."""
    labels = list(gh.runner_class.labels)
    gh.fake.drop_rate = 1.0
    lost = gh.fake.queue_job("acme/app", labels, ["true"])  # failed (502): worth sending again
    gh.fake.drop_rate = 0.0
    refused = gh.fake.queue_job("acme/app", labels, ["true"])
    with gh.fake.lock:
        gh.fake.deliveries[-1].status_code = 401  # our answer: a bad signature
    for _ in range(150):  # newer deliveries push them past the first page
        gh.fake.queue_job("acme/lib", ["somebody-elses"], ["true"])
    with gh.fake.lock:
        for d in gh.fake.deliveries[2:]:
            d.status_code = 200
    assert installation_reconcile(installation_id=gh.installation.pk)["redelivered"] == 1
    sent = [e.data["delivery"] for e in Event.objects.filter(kind="github.redelivered")]
    guid_lost = next(
        d.guid for d in gh.fake.deliveries if d.action == "queued" and f'"id": {lost},' in d.body.decode()
    )
    assert sent == [guid_lost] and refused
    assert gh.fake.count("GET", "/app/hook/deliveries") == 2  # two pages, by cursor


def test_an_app_installed_on_a_user_account_registers_repository_runners(gh: GitHubWorld) -> None:
    """Item 4: a user account has no /orgs/{login}; the 404 failed the job as a refusal."""
    gh.fake.add_installation(INSTALLATION, "acme", ["acme/app", "acme/lib"], account_type="User")
    job, outcome = handed_off_or_held(gh, 1)
    assert outcome == "handed off" and job.status == "assigned"
    assert GitHubInstallation.objects.get().account_type == "User"
    (registered,) = gh.fake.runners.values()
    assert registered.owner == "repo:acme/app"


def test_a_public_repositorys_job_gets_a_repository_runner_that_takes_it(gh: GitHubWorld) -> None:
    """Item 4: the Default group serves private repositories only: an organization runner never
    took a public repository's job, and another was started after each idle timeout."""
    gh.fake.add_installation(INSTALLATION, "acme", ["acme/app", "acme/lib"], public=["acme/app"])
    _, instance = ready_agent(gh)
    github_id = gh.fake.queue_job("acme/app", list(gh.runner_class.labels), ["true"])
    payload = workflow_job(github_id, "queued")
    payload["repository"].update(private=False, visibility="public")
    deliver("workflow_job", payload)
    class_converge(runner_class_id=gh.runner_class.pk)
    schedule()
    job = Job.objects.get()
    assert runner_handoff(job_id=job.pk) == "handed off"
    (registered,) = gh.fake.runners.values()
    assert registered.owner == "repo:acme/app"
    with gh.fake.lock:
        assert gh.fake._take(registered) is not None  # GitHub gives it the job


def test_two_repositories_jobs_on_one_class_count_their_own_runners(gh: GitHubWorld) -> None:
    """Item 6: a repository runner started for repository A counted as supply for B's job."""
    runner_class_save(org=gh.world.org, runner_class=gh.runner_class, scope="repo")
    deliver("workflow_job", workflow_job(1, "queued", repository="acme/app"))
    assert class_converge(runner_class_id=gh.runner_class.pk) == {"started": 1, "retired": 0}
    deliver("workflow_job", workflow_job(2, "queued", repository="acme/lib"))
    deliver("workflow_job", workflow_job(1, "completed", repository="acme/app", conclusion="cancelled"))
    # acme/app's runner is no use to acme/lib's job: one started for it, acme/app's retired
    assert class_converge(runner_class_id=gh.runner_class.pk) == {"started": 1, "retired": 1}
    live = Runner.objects.filter(job__status="queued")
    assert [r.created_for.repository for r in live] == ["acme/lib"]


def test_a_runner_too_old_for_github_fails_naming_it_and_blocks_its_class(gh: GitHubWorld) -> None:
    """Item 7: run.sh exited 0 for a deprecated runner; with the exit-code variables it exits 7,
    the runner job fails runner_outdated, and no runner starts for the class until it changes."""
    agent, instance = ready_agent(gh)
    job = queue(gh, 1)
    assert job.env["ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE"] == "1"
    assert job.env["RUNNER_MANUALLY_TRAP_SIG"] == "1"
    schedule()
    runner_handoff(job_id=job.pk)
    job_started(instance=instance, job_id=job.pk)
    ended = job_finished(instance=instance, job_id=job.pk, outcome="failed", exit_code=7)
    assert ended.status == "failed" and ended.failure_code == "runner_outdated"
    rc = RunnerClass.objects.get()
    assert rc.blocked_at is not None and "no longer accepts" in rc.blocked_reason
    assert Event.objects.filter(kind="github.runner_outdated").exists()
    deliver("workflow_job", workflow_job(2, "queued"))
    assert class_converge(runner_class_id=rc.pk) == {"started": 0, "retired": 0}
    runner_class_save(org=gh.world.org, runner_class=rc, runner_dir="/opt/actions-runner-2.330")
    assert RunnerClass.objects.get().blocked_at is None
    assert class_converge(runner_class_id=rc.pk)["started"] == 2
    assert WorkflowJob.objects.filter(status="queued").count() == 2
