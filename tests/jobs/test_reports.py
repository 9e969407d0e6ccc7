"""What the agent reports and what follows a job's end: the machine kept or destroyed, the job
requeued when its machine went away.
Services are called directly; the fake provider stands in for the cloud."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.core.errors import Conflict
from apps.events.models import Event
from apps.jobs.choices import JobStatus
from apps.jobs.convergence import jobs_time_out
from apps.jobs.reports import job_finished, job_started, jobs_requeue_for_instance
from apps.jobs.scheduler import schedule
from apps.jobs.submission import job_submit
from apps.machines.choices import InstanceStatus
from apps.machines.lifecycle import instance_mark_lost
from apps.machines.models import MachineInstance
from testkit.builders import idle_machine, job_config
from tests.conftest import World
from tests.jobs.common import job_on_machine, refresh, setup_type

J = JobStatus
S = InstanceStatus


@pytest.mark.django_db
def test_finished_reuse_job_keeps_the_machine_and_ephemeral_destroys_it(world: World) -> None:
    mt, _ = setup_type(world)
    for reuse, expected in (("reuse", S.READY), ("ephemeral", S.TERMINATING)):
        machine = idle_machine(world.org, mt)
        job = job_submit(org=world.org, config=job_config(world.org, mt, reuse, reuse=reuse))
        schedule()
        refresh(job)
        assert job.instance_id == machine.pk
        job_started(instance=machine, job_id=job.pk)
        job_finished(instance=machine, job_id=job.pk, outcome="succeeded", exit_code=0)
        refresh(job, machine)
        assert job.status == J.SUCCEEDED and job.exit_code == 0
        assert machine.status == expected
        if expected == S.READY:
            assert machine.pool_id is None and machine.last_config_id == job.config_id
            MachineInstance.objects.filter(pk=machine.pk).update(status=S.TERMINATED)


@pytest.mark.django_db(transaction=True)
def test_a_warm_jobs_end_moves_the_rows_it_holds_without_reading_them_back(
    tworld: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every warm job ends with this report: the job and its machine, both held locked, are each
    moved by an UPDATE and an event, with no savepoint of the move's own and no read back; what
    the report answers is what the database has."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    monkeypatch.setattr("apps.core.broker.enqueue", lambda *a, **k: True)
    job, machine = job_on_machine(tworld, started=True, reuse="reuse")
    with CaptureQueriesContext(connection) as seen:
        ended = job_finished(instance=machine, job_id=job.pk, outcome="succeeded", exit_code=0)
    statements = [q["sql"] for q in seen.captured_queries]
    assert len(statements) <= 14, [s[:60] for s in statements]
    assert sum(s.startswith("SAVEPOINT") for s in statements) <= 1  # instance_release's own only
    refresh(job, machine)
    assert (ended.status, ended.finished_at, ended.exit_code) == (J.SUCCEEDED, job.finished_at, 0)
    assert machine.status == S.READY and machine.last_config_id == job.config_id


@pytest.mark.django_db
def test_lost_machine_requeues_with_attempt_plus_one_then_fails(world: World) -> None:
    mt, _ = setup_type(world)
    job = job_submit(org=world.org, config=job_config(world.org, mt, max_attempts=2))
    for attempt, expected in ((1, J.QUEUED), (2, J.FAILED)):
        machine = idle_machine(world.org, mt)
        schedule()
        refresh(job)
        assert job.attempt == attempt and job.instance_id == machine.pk
        job_started(instance=machine, job_id=job.pk)
        instance_mark_lost(instance_id=machine.pk, actor="test", reason="agent silent")
        refresh(job)
        assert job.status == expected
    assert job.attempt == 2
    assert "attempt 2 of 2" in job.failure_reason
    assert Event.objects.filter(kind="job.requeued", job_id=job.pk).count() == 1


@pytest.mark.django_db
def test_a_lost_agent_that_comes_back_cannot_run_or_finish_the_job(world: World) -> None:
    job, first = job_on_machine(world, started=True)
    jobs_requeue_for_instance(instance_id=first.pk, cause="machine_lost", detail="agent silent")
    second = idle_machine(world.org, first.machine_type)
    schedule()
    refresh(job)
    assert job.instance_id == second.pk
    with pytest.raises(Conflict):
        job_started(instance=first, job_id=job.pk)
    with pytest.raises(Conflict):
        job_finished(instance=first, job_id=job.pk, outcome="succeeded", exit_code=0)
    job_started(instance=second, job_id=job.pk)
    refresh(job)
    assert job.status == J.RUNNING and job.instance_id == second.pk


@pytest.mark.django_db
def test_the_reaper_times_out_jobs_whose_agent_never_reported(world: World) -> None:
    job, machine = job_on_machine(world, started=True, timeout_seconds=60)
    jobs_time_out(now=timezone.now() + timedelta(minutes=10))
    refresh(job, machine)
    assert job.status == J.TIMED_OUT
    assert machine.status == S.TERMINATING


@pytest.mark.django_db(transaction=True)
def test_a_burst_of_job_ends_sends_one_scheduling_pass_until_one_starts(
    tworld: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each job's end asks for a scheduling pass (its own and its machine's); a burst of them
    sends one, which sees them all, until that pass starts: what commits later sends another."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from apps.jobs.dispatch import SCHEDULE_TASK
    from apps.jobs.tasks import schedule_task

    mt, _ = setup_type(tworld)
    machines = [idle_machine(tworld.org, mt) for _ in range(4)]
    cfg = job_config(tworld.org, mt, reuse="reuse")
    jobs = [job_submit(org=tworld.org, config=cfg) for _ in range(4)]
    schedule()
    sent: list[tuple] = []
    monkeypatch.setattr("apps.core.broker.enqueue", lambda *a, **k: sent.append(a) or True)
    refresh(*jobs)
    on = {job.pk: MachineInstance.objects.get(pk=job.instance_id) for job in jobs}
    for job in jobs:
        job_started(instance=on[job.pk], job_id=job.pk)
    for job in jobs[:3]:
        with CaptureQueriesContext(connection) as seen:
            job_finished(instance=on[job.pk], job_id=job.pk, outcome="succeeded", exit_code=0)
        # Nothing of the grant waits: the machine's release locks no grant after its commit.
        assert not [
            q for q in seen.captured_queries if "orgmachinetype" in q["sql"] and "FOR UPDATE" in q["sql"]
        ]
    assert sent == [(SCHEDULE_TASK,)], "three job ends, one pass"
    schedule_task()  # the pass starts (a worker runs it)
    job_finished(instance=on[jobs[3].pk], job_id=jobs[3].pk, outcome="succeeded", exit_code=0)
    assert sent == [(SCHEDULE_TASK,)] * 2, "a job end after the pass started sends another"
    assert {m.status for m in MachineInstance.objects.filter(pk__in=[m.pk for m in machines])} == {S.READY}


@pytest.mark.django_db(transaction=True)
def test_a_failure_after_a_job_ends_commit_neither_fails_the_report_nor_stops_its_pass(
    tworld: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What runs after a job's end commits (its grant's scheduling, its pass) never fails the
    agent's report, which is committed already: a database error there is logged, and the
    scheduling pass is still sent."""
    from django.db import DatabaseError

    from apps.jobs.dispatch import SCHEDULE_TASK

    mt, _ = setup_type(tworld)
    machine = idle_machine(tworld.org, mt)
    job = job_submit(org=tworld.org, config=job_config(tworld.org, mt, reuse="reuse"))
    schedule()
    job_started(instance=machine, job_id=job.pk)
    sent: list[tuple] = []
    monkeypatch.setattr("apps.core.broker.enqueue", lambda *a, **k: sent.append(a) or True)

    def down(*args: object) -> bool:
        raise DatabaseError("the connection went away")

    monkeypatch.setattr("apps.jobs.scheduler._grant_waits", down)
    job_finished(instance=machine, job_id=job.pk, outcome="succeeded", exit_code=0)
    refresh(job, machine)
    assert (job.status, machine.status) == (J.SUCCEEDED, S.READY)
    assert sent == [(SCHEDULE_TASK,)]
