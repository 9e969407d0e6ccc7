"""Convergence under faults (issue 13): every live row has an owner and a deadline.

One test per case observed on the old code. A lost Celery message is simulated the way it
happens: the row is committed and its message never runs (in these tests on_commit hooks do
not fire), then the reaper's tick, run with a clock past the state's deadline, must move it.
Messages the reaper sends land in the real Redis queue, where the tests read them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from apps.control.reaper import reaper_tick
from apps.core.broker import redis_client
from apps.core.errors import PoolEmpty
from apps.core.repairs import InlineRepairs
from apps.events.models import Event
from apps.jobs.acquisition import job_acquire_resources, resources_safety_net
from apps.jobs.choices import JobStatus
from apps.jobs.models import Job
from apps.jobs.reports import job_finished, job_started
from apps.jobs.scheduler import schedule
from apps.jobs.submission import job_cancel, job_submit
from apps.machines import lifecycle
from apps.machines.choices import INSTANCE_COUNTED, InstanceStatus
from apps.machines.models import MachineInstance, OrgMachineType
from apps.machines.services import INSTANCE_STATES
from apps.orgs.models import ApiToken
from apps.pools.models import InstancePool
from apps.pools.services import pool_create, pool_drain, pool_refill
from apps.resources.lifecycle import resource_destroy
from apps.resources.models import ResourceInstance, ResourceType
from apps.resources.wells import build_well
from testkit.builders import idle_machine, job_config, ready_members
from tests.concurrency import released_together
from tests.conftest import World
from tests.jobs.common import job_on_machine, refresh, setup_type

J = JobStatus
S = InstanceStatus


@pytest.fixture
def queue() -> Iterator[Any]:
    """The real Celery queue in Redis (the test database's): what the reaper sent."""
    client = redis_client()
    client.delete("celery")

    class Sent:
        def __call__(self, task_suffix: str) -> list[str]:
            out = []
            for raw in client.lrange("celery", 0, -1):
                headers = json.loads(raw)["headers"]
                if headers["task"].endswith(task_suffix):
                    out.append(headers["argsrepr"])
            return out

        def clear(self) -> None:
            client.delete("celery")

    yield Sent()
    client.delete("celery")


def later(seconds: float) -> Any:
    return timezone.now() + timedelta(seconds=seconds)


def at_once(work: list[Any]) -> list[BaseException]:
    """Run each callable in its own thread (its own database connection), all released
    together; returns what they raised."""
    errors: list[BaseException] = []

    def reporting(fn: Any) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported to the caller
                errors.append(exc)

        return run

    released_together(*map(reporting, work), timeout=None)
    return errors


# ---- 1. a provision message lost: the instance stays pending -----------------------------


@pytest.mark.django_db
def test_a_pending_instance_whose_provision_message_was_lost_is_provisioned_by_the_tick(
    world: World, queue: Any
) -> None:
    """Re-driving through the broker lost the second message as it lost the first (a storm):
    the tick provisions the row itself, and sends nothing."""
    mt, _ = setup_type(world)
    instance = lifecycle.instance_request(org=world.org, machine_type=mt, actor="test")
    queue.clear()
    reaper_tick(now=later(settings.CATACLOUD_REDRIVE_AFTER / 2), reconcile=False)
    refresh(instance)
    assert instance.status == S.PENDING  # not yet: the message may still be on its way
    reaper_tick(now=later(settings.CATACLOUD_REDRIVE_AFTER + 1), reconcile=False)
    refresh(instance)
    assert instance.status == S.WARMING and instance.provider_id
    assert queue("provision_instance_task") == []
    # The lost message turns up after all (a redelivery): one machine, still warming.
    lifecycle.instance_provision(instance_id=instance.pk)
    refresh(instance)
    assert instance.status == S.WARMING


@pytest.mark.django_db
def test_a_second_provision_run_never_deletes_the_machine_the_first_recorded(world: World) -> None:
    from catacloud.providers.fake import FakeProvider

    mt, _ = setup_type(world)
    instance = lifecycle.instance_request(org=world.org, machine_type=mt)
    create = FakeProvider.create
    nested = []

    def interleaved(self: FakeProvider, spec: Any) -> Any:
        machine = create(self, spec)
        if not nested:  # run B (the re-driven copy) runs to the end while A is creating
            nested.append(True)
            lifecycle.instance_provision(instance_id=instance.pk)
        return machine

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FakeProvider, "create", interleaved)
        lifecycle.instance_provision(instance_id=instance.pk)  # run A
    refresh(instance)
    assert instance.status == S.WARMING
    assert [m.provider_id for m in FakeProvider.machines_of("jobs")] == [instance.provider_id]
    assert FakeProvider.calls_for("jobs", "delete") == []


@pytest.mark.django_db
def test_machines_outside_pools_that_never_become_ready_are_terminated(world: World) -> None:
    mt, _ = setup_type(world)
    instance = lifecycle.instance_request(org=world.org, machine_type=mt)
    lifecycle.instance_provision(instance_id=instance.pk)  # warming, agent never enrolls
    reaper_tick(now=later(settings.CATACLOUD_BOOT_TIMEOUT - 30), reconcile=False)
    refresh(instance)
    assert instance.status == S.WARMING
    reaper_tick(now=later(settings.CATACLOUD_BOOT_TIMEOUT + 1), reconcile=False)
    refresh(instance)
    assert (instance.status, instance.end_cause) == (S.TERMINATING, "boot_timeout")
    assert Event.objects.filter(kind="instance.stuck", instance_id=instance.pk).exists()


@pytest.mark.django_db
def test_a_terminate_message_lost_is_redriven_by_the_tick_itself(world: World, queue: Any) -> None:
    mt, _ = setup_type(world)
    machine = idle_machine(world.org, mt)
    lifecycle.instance_terminate(instance_id=machine.pk, actor="test")
    queue.clear()
    reaper_tick(now=later(settings.CATACLOUD_REDRIVE_AFTER + 1), reconcile=False)
    refresh(machine)
    assert machine.status == S.TERMINATED
    assert queue("terminate_instance_task") == []


# ---- 2 and 7. a machine terminated or drained under its job -------------------------------


@pytest.mark.django_db
def test_terminating_a_machine_under_an_assigned_job_requeues_it_without_using_an_attempt(
    world: World,
) -> None:
    job, machine = job_on_machine(world, max_attempts=1)
    refresh(job)
    assert (job.status, job.instance_id) == (J.ASSIGNED, machine.pk)
    lifecycle.instance_terminate(instance_id=machine.pk, actor="admin:ops")
    refresh(job)
    assert job.status == J.ASSIGNED  # the machine may still run it until it is gone
    lifecycle.instance_destroy(instance_id=machine.pk)
    refresh(job)
    assert (job.status, job.requeue_reason, job.attempt, job.free_requeues) == (
        J.QUEUED,
        "machine_terminated",
        2,
        1,
    )
    assert job.instance_id is None
    # max_attempts 1 and yet it runs again: the operator's terminate did not use it up.
    second = idle_machine(world.org, machine.machine_type)
    schedule()
    job_started(instance=second, job_id=job.pk)
    refresh(job)
    assert (job.status, job.instance_id) == (J.RUNNING, second.pk)


@pytest.mark.django_db
def test_the_reaper_requeues_a_job_whose_machine_ended_behind_its_back(world: World) -> None:
    job, machine = job_on_machine(world, started=True)
    # The terminate task recorded `terminated` and died before requeueing.
    INSTANCE_STATES.move(machine.pk, to=S.TERMINATING, end_cause="machine_terminated")
    INSTANCE_STATES.move(machine.pk, to=S.TERMINATED)
    refresh(job)
    assert job.status == J.RUNNING
    reaper_tick(reconcile=False)
    refresh(job)
    # Requeued (and, the same tick, admitted again: the safety net schedules too).
    assert (job.requeue_reason, job.attempt, job.instance_id) == ("machine_terminated", 2, None)
    assert job.status in (J.QUEUED, J.WAITING_FOR_MACHINE)


@pytest.mark.django_db
def test_cancel_of_a_job_whose_machine_is_gone_ends_it(world: World) -> None:
    mt, grant = setup_type(world, max_concurrent_jobs=1)
    job = job_submit(org=world.org, config=job_config(world.org, mt))
    machine = idle_machine(world.org, mt)
    schedule()
    INSTANCE_STATES.move(machine.pk, to=S.TERMINATING)
    INSTANCE_STATES.move(machine.pk, to=S.TERMINATED)
    assert job_cancel(job=job).status == J.CANCELLED
    # Its max_concurrent_jobs slot is free again.
    other = job_submit(org=world.org, config=job_config(world.org, mt, name="next"))
    schedule()
    refresh(other)
    assert other.status != J.QUEUED


@pytest.mark.django_db
def test_an_agent_stopped_by_a_drain_reports_and_the_job_is_requeued_not_cancelled(world: World) -> None:
    mt, _ = setup_type(world)
    pool = pool_create(org=world.org, name="p", machine_type=mt, target_size=0, max_size=2)
    member = idle_machine(world.org, mt, pool=pool)
    job = job_submit(org=world.org, config=job_config(world.org, mt, max_attempts=3))
    schedule()
    refresh(job)
    assert job.instance_id == member.pk
    job_started(instance=member, job_id=job.pk)
    pool_drain(pool=InstancePool.objects.get(pk=pool.pk), terminate_members=True, actor="admin:ops")
    # The agent is told to stop, kills the job and reports before the machine is deleted.
    job_finished(instance=member, job_id=job.pk, outcome="cancelled", exit_code=-15, reason="agent stopped")
    refresh(job)
    assert (job.status, job.requeue_reason, job.attempt, job.free_requeues) == (
        J.QUEUED,
        "pool_drained",
        2,
        1,
    )


@pytest.mark.django_db
def test_a_job_that_succeeds_just_before_its_machine_goes_keeps_its_success(world: World) -> None:
    job, machine = job_on_machine(world, started=True)
    lifecycle.instance_terminate(instance_id=machine.pk, actor="admin:ops")
    job_finished(instance=machine, job_id=job.pk, outcome="succeeded", exit_code=0)
    refresh(job)
    assert job.status == J.SUCCEEDED


@pytest.mark.django_db
def test_a_job_assigned_but_never_started_is_requeued_and_its_machine_retired(world: World) -> None:
    job, machine = job_on_machine(world)
    deadline = later(settings.CATACLOUD_ASSIGN_TIMEOUT + 1)
    MachineInstance.objects.filter(pk=machine.pk).update(last_heartbeat_at=deadline)  # alive, yet idle
    reaper_tick(now=deadline, reconcile=False)
    refresh(job, machine)
    assert (job.requeue_reason, job.attempt, job.instance_id) == ("not_started", 2, None)
    assert machine.status == S.TERMINATING
    with pytest.raises(Exception, match="not .or no longer. assigned"):
        job_started(instance=machine, job_id=job.pk)


# ---- 3. a worker killed during a well's create ---------------------------------------------


@pytest.mark.django_db
def test_a_resource_left_creating_by_a_dead_worker_is_created_again(world: World) -> None:
    from tests.resources.test_resources import admitted_job, config_with

    ResourceType.objects.create(id="scoped-token", well="api_token")
    job = admitted_job(world, config_with(world, "scoped-token"))
    # The worker reserved the resource, moved it to creating, and died.
    with pytest.MonkeyPatch.context() as patch:

        def die(*args: Any, **kwargs: Any) -> None:
            raise SystemExit("worker killed")

        patch.setattr("apps.resources.wells.api_token.ApiTokenWell.create", die)
        with pytest.raises(SystemExit):
            job_acquire_resources(job_id=job.pk)
    resource = ResourceInstance.objects.get(job=job)
    assert resource.status == "creating"
    assert job_acquire_resources(job_id=job.pk) == "waiting"  # the redelivered task leaves it
    resources_safety_net(now=later(settings.CATACLOUD_RESOURCE_CREATE_TIMEOUT / 2), repairs=InlineRepairs())
    refresh(job, resource)
    assert (job.status, resource.status) == (J.ACQUIRING_RESOURCES, "creating")  # not yet
    # Past the create timeout: back to requested, and the tick itself acquires (no message).
    repairs = InlineRepairs()
    resources_safety_net(now=later(settings.CATACLOUD_RESOURCE_CREATE_TIMEOUT + 1), repairs=repairs)
    assert repairs.done == [f"job-acquire:{job.pk}"]
    refresh(job, resource)
    assert (job.status, resource.status) == (J.WAITING_FOR_MACHINE, "held")


@pytest.mark.django_db
def test_a_token_created_but_never_recorded_is_revoked_when_the_resource_is_released(world: World) -> None:
    from tests.resources.test_resources import admitted_job, config_with

    rtype = ResourceType.objects.create(id="scoped-token", well="api_token")
    job = admitted_job(world, config_with(world, "scoped-token"))
    resource = ResourceInstance.objects.create(resource_type=rtype, org=world.org, job=job, status="creating")
    # The well created the token; the worker died before recording its id.
    build_well("api_token", {}).create(resource_id=str(resource.pk), job=job)
    token = ApiToken.objects.get(name__endswith=f"({resource.pk})")
    assert token.revoked_at is None
    job_cancel(job=job)  # releases the resource with an empty external id
    resource_destroy(resource_id=resource.pk)
    token.refresh_from_db()
    assert token.revoked_at is not None


# ---- 4. quotas under the grant lock --------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_pools_created_at_once_never_pass_max_instances(tworld: World) -> None:
    mt, grant = setup_type(tworld, max_instances=6, max_pool_size=10)
    pools = [
        pool_create(org=tworld.org, name=f"p{i}", machine_type=mt, target_size=4, max_size=4)
        for i in range(3)
    ]
    errors = at_once([lambda p=p: pool_refill(pool_id=p.pk) for p in pools])
    assert errors == []
    live = MachineInstance.objects.filter(
        org=tworld.org, machine_type=mt, status__in=INSTANCE_COUNTED
    ).count()
    assert live == 6
    limited = InstancePool.objects.filter(limit_reason__startswith="quota_exceeded").count()
    assert limited >= 1


@pytest.mark.django_db(transaction=True)
def test_refills_and_placement_at_once_never_pass_max_instances(tworld: World) -> None:
    mt, grant = setup_type(tworld, max_instances=5, max_pool_size=10, max_concurrent_jobs=50)
    cfg = job_config(tworld.org, mt)
    pools = [
        pool_create(org=tworld.org, name=f"p{i}", machine_type=mt, target_size=3, max_size=3)
        for i in range(2)
    ]
    for _ in range(6):
        job_submit(org=tworld.org, config=cfg)
    work = [
        lambda: pool_refill(pool_id=pools[0].pk),
        lambda: pool_refill(pool_id=pools[1].pk),
        schedule,
        schedule,
    ]
    assert at_once(work) == []
    live = MachineInstance.objects.filter(
        org=tworld.org, machine_type=mt, status__in=INSTANCE_COUNTED
    ).count()
    assert live == 5


@pytest.mark.django_db
def test_terminating_machines_still_count_against_max_instances(world: World) -> None:
    mt, _ = setup_type(world, max_instances=2)
    pool = pool_create(org=world.org, name="p", machine_type=mt, target_size=2, max_size=2)
    pool_refill(pool_id=pool.pk)
    members = list(MachineInstance.objects.filter(pool=pool))
    assert len(members) == 2
    lifecycle.instance_terminate(instance_id=members[0].pk, actor="test")
    assert pool_refill(pool_id=pool.pk) == 0  # the terminating one still bills
    lifecycle.instance_destroy(instance_id=members[0].pk)
    assert pool_refill(pool_id=pool.pk) == 1


# ---- 5. agent reports act only on their own claim -------------------------------------------


@pytest.mark.django_db
def test_a_repeated_uploads_done_for_an_old_job_does_not_release_the_next_jobs_machine(world: World) -> None:
    mt, _ = setup_type(world)
    cfg = job_config(world.org, mt)
    machine = idle_machine(world.org, mt)
    first = job_submit(org=world.org, config=cfg)
    schedule()
    job_started(instance=machine, job_id=first.pk)
    job_finished(instance=machine, job_id=first.pk, outcome="succeeded", exit_code=0, uploads_pending=1)
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Agent {_agent_token(machine)}")
    url = f"/api/agent/v1/jobs/{first.pk}/uploads-done"
    assert agent.post(url, {}, format="json").status_code == 200  # released for reuse
    second = job_submit(org=world.org, config=cfg)
    schedule()
    refresh(second, machine)
    assert (second.instance_id, machine.status) == (machine.pk, S.CLAIMED)
    # The old job's report arrives again: a no-op that answers 200.
    assert agent.post(url, {}, format="json").status_code == 200
    refresh(machine)
    assert (machine.status, machine.claimed_for) == (S.CLAIMED, f"job:{second.pk}")
    third = job_submit(org=world.org, config=cfg)
    schedule()
    refresh(third)
    assert third.instance_id is None
    # A repeated finish answers 200 and changes nothing.
    again = agent.post(
        f"/api/agent/v1/jobs/{first.pk}/finished", {"outcome": "failed", "exit_code": 1}, format="json"
    )
    assert again.status_code == 200 and again.json()["status"] == J.SUCCEEDED


def _agent_token(machine: MachineInstance) -> str:
    from apps.core.crypto import hash_token, new_token
    from apps.machines.agents import AGENT_TOKEN_PREFIX

    secret = new_token(AGENT_TOKEN_PREFIX)
    MachineInstance.objects.filter(pk=machine.pk).update(agent_token_hash=hash_token(secret))
    return secret


@pytest.mark.django_db
def test_a_machine_held_for_uploads_that_never_finish_is_released(world: World) -> None:
    job, machine = job_on_machine(world, started=True)
    job_finished(instance=machine, job_id=job.pk, outcome="succeeded", exit_code=0, uploads_pending=3)
    reaper_tick(reconcile=False)
    refresh(machine)
    assert machine.status == S.CLAIMED  # still uploading
    deadline = later(settings.CATACLOUD_UPLOAD_TIMEOUT + 1)
    MachineInstance.objects.filter(pk=machine.pk).update(last_heartbeat_at=deadline)
    reaper_tick(now=deadline, reconcile=False)
    refresh(machine)
    assert machine.status == S.READY  # released for reuse


# ---- 9. the console cannot delete live rows --------------------------------------------------


@pytest.mark.django_db
def test_the_console_cannot_delete_a_running_job_or_a_live_machine(world: World) -> None:
    from django.contrib.admin.sites import site

    job, machine = job_on_machine(world, started=True)
    operator = world.users["admin"]
    operator.is_staff = operator.is_superuser = True
    operator.save()
    client = APIClient()
    client.force_login(operator)
    for model, obj in ((Job, job), (MachineInstance, machine)):
        url = f"/admin/{model._meta.app_label}/{model._meta.model_name}/{obj.pk}/delete/"
        assert client.post(url, {"post": "yes"}).status_code == 403
        assert model.objects.filter(pk=obj.pk).exists()
        changelist = f"/admin/{model._meta.app_label}/{model._meta.model_name}/"
        client.post(changelist, {"action": "delete_selected", "_selected_action": [obj.pk], "post": "yes"})
        assert model.objects.filter(pk=obj.pk).exists()
        assert "delete_selected" not in site._registry[model].get_actions(_request(operator))


def _request(user: Any) -> Any:
    from django.test import RequestFactory

    request = RequestFactory().get("/admin/")
    request.user = user
    return request


@pytest.mark.django_db
def test_a_machine_claimed_for_a_deleted_job_is_terminated(world: World) -> None:
    job, machine = job_on_machine(world)
    Job.objects.filter(pk=job.pk).delete()  # e.g. the org deleted in the console
    reaper_tick(reconcile=False)
    refresh(machine)
    assert (machine.status, machine.end_cause) == (S.TERMINATING, "claim_released")


# ---- claims that end ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_acquire_with_a_lease_expires_and_release_hands_the_machine_back(world: World) -> None:
    mt, _ = setup_type(world)
    OrgMachineType.objects.filter(org=world.org, machine_type=mt).update(max_instances=10)
    pool = pool_create(org=world.org, name="p", machine_type=mt, target_size=2, max_size=2)
    pool_refill(pool_id=pool.pk)
    for member in MachineInstance.objects.filter(pool=pool):
        lifecycle.instance_provision(instance_id=member.pk)
        INSTANCE_STATES.move(member.pk, to=S.READY, last_heartbeat_at=timezone.now())
    api = world.client("member")
    leased = api.post(f"/api/v1/pools/{pool.pk}/acquire/", {"lease_seconds": 60}, format="json")
    assert leased.status_code == 201, leased.json()
    leased_id = leased.json()["instance"]["id"]
    assert leased.json()["instance"]["lease_expires_at"]
    held = api.post(f"/api/v1/pools/{pool.pk}/acquire/", {}, format="json").json()["instance"]["id"]
    expiry = later(61)
    MachineInstance.objects.filter(pool=pool).update(last_heartbeat_at=expiry)
    reaper_tick(now=expiry, reconcile=False)
    assert MachineInstance.objects.get(pk=leased_id).status == S.TERMINATING
    assert Event.objects.filter(kind="instance.lease_expired", instance_id=leased_id).exists()
    assert MachineInstance.objects.get(pk=held).status == S.CLAIMED  # no lease: held
    # Release: the machine is terminated (never back to ready) and the pool refills.
    released = api.post(f"/api/v1/instances/{held}/release/", {}, format="json")
    assert released.status_code == 202 and released.json()["status"] == S.TERMINATING
    assert api.post(f"/api/v1/instances/{held}/release/", {}, format="json").status_code == 202
    assert world.client("viewer").post(f"/api/v1/instances/{held}/release/").status_code == 403
    assert world.client("outsider").post(f"/api/v1/instances/{held}/release/").status_code == 404
    assert MachineInstance.objects.filter(pool=pool, status=S.PENDING).count() >= 1
    bad = api.post(f"/api/v1/pools/{pool.pk}/acquire/", {"lease_seconds": 0}, format="json")
    assert bad.status_code == 400 and bad.json()["code"]


@pytest.mark.django_db
def test_release_refuses_a_machine_that_runs_a_job(world: World) -> None:
    mt, _ = setup_type(world)
    machine = idle_machine(world.org, mt)
    job_submit(org=world.org, config=job_config(world.org, mt))
    schedule()
    answer = world.client("member").post(f"/api/v1/instances/{machine.pk}/release/")
    assert answer.status_code == 409 and answer.json()["code"] == "held_by_job"


# ---- 10. Redis down: the API degrades, never fails -----------------------------------------


@pytest.mark.django_db(transaction=True)
def test_with_the_broker_down_the_api_answers_and_a_committed_claim_is_201(tworld: World) -> None:
    from apps.core import broker

    world = tworld
    mt, _ = setup_type(world)
    pool = pool_create(org=world.org, name="p", machine_type=mt, target_size=1, max_size=1)
    pool_refill(pool_id=pool.pk)
    member = MachineInstance.objects.get(pool=pool)
    lifecycle.instance_provision(instance_id=member.pk)
    INSTANCE_STATES.move(member.pk, to=S.READY, last_heartbeat_at=timezone.now())
    dead = "redis://127.0.0.1:1/0"  # nothing listens there
    caches = {"default": {**settings.CACHES["default"], "LOCATION": dead}}
    broker.redis_client.cache_clear()
    try:
        with override_settings(CELERY_BROKER_URL=dead, CACHES=caches):
            from config.celery import app

            app.conf.broker_url = dead
            _reset_broker_pools(app)
            api = world.client("member")
            assert api.get("/api/v1/jobs/").status_code == 200  # the throttle fails open
            claimed = api.post(f"/api/v1/pools/{pool.pk}/acquire/", {}, format="json")
            assert claimed.status_code == 201
            refresh(member)
            assert member.status == S.CLAIMED
            submitted = api.post(
                "/api/v1/jobs/", {"config": str(job_config(world.org, mt).pk)}, format="json"
            )
            assert submitted.status_code == 201
            status, body = _health()
            assert status == 503 and body["checks"]["broker"]["ok"] is False
            assert body["checks"]["database"]["ok"] is True
    finally:
        from config.celery import app

        app.conf.broker_url = settings.CELERY_BROKER_URL
        _reset_broker_pools(app)
        broker.redis_client.cache_clear()
        broker._down_until = 0.0


def _reset_broker_pools(app: Any) -> None:
    """The Celery app caches broker connections: drop them so the next publish uses the
    broker URL now configured."""
    from kombu import pools

    pools.reset()  # closes and forgets every cached connection and producer pool
    app._pool = None
    app.amqp._producer_pool = None


def _health() -> tuple[int, dict]:
    from apps.core.health import health

    return health()


# ---- the reaper's deadlines hold for every live state -----------------------------------------


@pytest.mark.django_db(transaction=True)
def test_every_status_change_records_when_it_happened(tworld: World) -> None:
    world = tworld
    mt, _ = setup_type(world)
    machine = idle_machine(world.org, mt)
    before = timezone.now()
    job = job_submit(org=world.org, config=job_config(world.org, mt))
    schedule()
    refresh(job, machine)
    assert job.status_changed_at >= before and machine.status_changed_at >= before


@pytest.mark.django_db(transaction=True)
def test_claims_refills_and_placement_at_once_never_deadlock(tworld: World) -> None:
    """Lock order (grant, pool, instance, job; only the grant row, never the organization it
    belongs to): claims that mark their pool, refills, placements and submits running at
    once all finish without an error."""
    from apps.pools.services import pool_claim

    mt, _ = setup_type(tworld, max_instances=60, max_pool_size=40, max_concurrent_jobs=100)
    cfg = job_config(tworld.org, mt)
    pool = pool_create(org=tworld.org, name="hot", machine_type=mt, target_size=20, max_size=40)
    ready_members(pool, 30)

    def ten_times(fn: Any) -> Any:
        def run() -> None:
            for _ in range(10):
                with contextlib.suppress(PoolEmpty):
                    fn()

        return run

    work = [
        lambda: pool_claim(pool_id=pool.pk),
        lambda: pool_claim(pool_id=pool.pk),
        lambda: pool_refill(pool_id=pool.pk),
        lambda: job_submit(org=tworld.org, config=cfg),
        schedule,
        schedule,
    ]
    errors = at_once([ten_times(fn) for fn in work])
    assert errors == []
    live = MachineInstance.objects.filter(
        org=tworld.org, machine_type=mt, status__in=INSTANCE_COUNTED
    ).count()
    assert live <= 60
