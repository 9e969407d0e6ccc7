"""Jobs enter and leave the queue: submit (scheduled in its own request when it fits), cancel in
every state, quotas under concurrent submits.
Services are called directly; the fake provider stands in for the cloud."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from apps.jobs.choices import JobStatus
from apps.jobs.models import Job
from apps.jobs.reports import job_finished, job_started
from apps.jobs.scheduler import schedule
from apps.jobs.submission import job_cancel, job_submit
from apps.machines.choices import InstanceStatus
from apps.machines.models import OrgMachineType
from apps.machines.services import grant_lock
from apps.pools.services import pool_create
from testkit.builders import enrolled_agent, idle_machine, job_config
from tests.concurrency import at_once
from tests.conftest import World
from tests.jobs.common import refresh, setup_type

J = JobStatus
S = InstanceStatus


@pytest.mark.django_db
def test_cancel_in_each_state(world: World) -> None:
    mt, _ = setup_type(world, max_instances=0)
    cfg = job_config(world.org, mt)
    queued = job_submit(org=world.org, config=cfg)
    assert job_cancel(job=queued).status == J.CANCELLED
    waiting = job_submit(org=world.org, config=cfg)
    schedule()
    refresh(waiting)
    assert waiting.status == J.WAITING_FOR_MACHINE
    assert job_cancel(job=waiting).status == J.CANCELLED
    OrgMachineType.objects.filter(machine_type=mt).update(max_instances=5)
    agent, machine = enrolled_agent(world.org, mt)
    beat = agent.post("/api/agent/v1/heartbeat", {}, format="json")  # the handshake: ready
    assert beat.json() == {"cancel": [], "terminate": False}
    running = job_submit(org=world.org, config=cfg)
    schedule()
    job_started(instance=machine, job_id=running.pk)
    cancelled = job_cancel(job=running)
    assert (cancelled.status, cancelled.cancel_requested) == (J.RUNNING, True)
    # the agent's next heartbeat names the job to kill
    beat = agent.post("/api/agent/v1/heartbeat", {}, format="json")
    assert beat.json() == {"cancel": [str(running.pk)], "terminate": False}
    # The agent killed it and reports; whatever it says, a requested cancel wins.
    job_finished(instance=machine, job_id=running.pk, outcome="failed", exit_code=-15)
    refresh(running)
    assert running.status == J.CANCELLED


@pytest.mark.django_db(transaction=True)
def test_a_job_that_fits_is_on_a_warm_machine_when_its_submit_returns(tworld: World) -> None:
    mt, _ = setup_type(tworld)
    pool = pool_create(org=tworld.org, name="warm", machine_type=mt, target_size=1, max_size=2)
    member = idle_machine(tworld.org, mt, pool=pool)
    job = job_submit(org=tworld.org, config=job_config(tworld.org, mt))
    refresh(job)
    assert (job.status, job.instance_id) == (J.ASSIGNED, member.pk)
    assert job.admitted_at is not None and job.assigned_at is not None


@pytest.mark.django_db(transaction=True)
def test_a_submit_never_waits_for_a_grant_another_transaction_holds(tworld: World) -> None:
    mt, grant = setup_type(tworld)
    pool = pool_create(org=tworld.org, name="warm", machine_type=mt, target_size=1, max_size=2)
    idle_machine(tworld.org, mt, pool=pool)
    cfg = job_config(tworld.org, mt)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # a scheduling pass (or a refill) holding the grant
        try:
            with transaction.atomic():
                grant_lock(org_id=grant.org_id, machine_type_id=grant.machine_type_id)
                held.set()
                release.wait(30)
        finally:
            connection.close()

    submitted: list[Job] = []

    def submit() -> None:
        try:
            submitted.append(job_submit(org=tworld.org, config=cfg))
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    submitter = threading.Thread(target=submit)
    submitter.start()
    submitter.join(10)
    try:
        assert not submitter.is_alive(), "the submit waited for the grant's lock"
        job = Job.objects.get(pk=submitted[0].pk)
        assert job.status == J.QUEUED  # left to the scheduling pass it enqueued
    finally:
        release.set()
        holder.join(10)
    assert schedule().assigned == 1  # the pass places it once the grant is free
    assert Job.objects.get(pk=submitted[0].pk).status == J.ASSIGNED


@pytest.mark.django_db(transaction=True)
def test_concurrent_submits_never_pass_the_quota(tworld: World) -> None:
    mt, _ = setup_type(tworld, max_concurrent_jobs=3)
    cfg = job_config(tworld.org, mt)
    at_once(8, lambda: job_submit(org=tworld.org, config=cfg))
    admitted = Job.objects.exclude(status=J.QUEUED).count()
    assert admitted <= 3
    schedule()
    assert Job.objects.exclude(status=J.QUEUED).count() == 3
    assert Job.objects.filter(status=J.QUEUED, pending_reason="max_concurrent_jobs 3/3").count() == 5


@pytest.mark.django_db(transaction=True)
def test_concurrent_retries_with_one_idempotency_key_queue_one_job(tworld: World) -> None:
    """A client whose submit timed out retries it on other connections at once: one job, and
    every retry answers that job."""
    from apps.events.models import Event
    from apps.jobs.submission import job_submit_once

    mt, _ = setup_type(tworld, max_concurrent_jobs=3)
    cfg = job_config(tworld.org, mt)
    answers: list[tuple[str, bool]] = []

    def submit() -> None:
        job, queued = job_submit_once(org=tworld.org, config=cfg, idempotency_key="deploy-42")
        answers.append((str(job.pk), queued))

    at_once(6, submit)
    assert len(answers) == 6
    assert len({job for job, _ in answers}) == 1
    assert sorted(queued for _, queued in answers) == [False] * 5 + [True]
    assert Job.objects.filter(org=tworld.org).count() == 1
    assert Event.objects.filter(kind="job.queued").count() == 1
