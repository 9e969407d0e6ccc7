"""Pools: creation with the validation users expect, sizes, and the pool state machine."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from apps.core import hooks
from apps.core.actors import Actor
from apps.core.causes import Cause
from apps.core.errors import ErrorCode, InvalidTransition, NotFound, PoolEmpty, ValidationFailed
from apps.core.ids import JobConfigId, JobId, OrgId, PoolId
from apps.core.locks import POOL_REFILL, machine_releases_lock
from apps.core.transitions import StateMachine
from apps.events.kinds import EventKind
from apps.events.services import event_record, events_record
from apps.machines import capacity, claims
from apps.machines.budgets import budget_bought, budget_check
from apps.machines.choices import INSTANCE_LIVE, InstanceStatus
from apps.machines.hosts import NoHostRoom
from apps.machines.lifecycle import instance_request, instance_terminate
from apps.machines.models import MachineInstance, MachineType
from apps.machines.selectors import BOOTING, paid_capacity
from apps.machines.services import grant_check_privilege, grant_for, grant_lock
from apps.orgs.models import Organization
from apps.orgs.registries import check_image_reference
from apps.pools.choices import POOL_ACTIVE, POOL_TRANSITIONS, PoolStatus
from apps.pools.metrics import CLAIM_LATENCY
from apps.pools.models import InstancePool
from apps.pools.refill import clear_mark, request_refill
from catacloud.policy.pools import refill_plan


def pool_validate_sizes(*, target_size: int, min_size: int, max_size: int, max_pool_size: int) -> None:
    """``min_size <= target_size <= max_size <= max_pool_size`` (the org's quota)."""
    errors: dict[str, list[str]] = {}
    for name, value in (("target_size", target_size), ("min_size", min_size), ("max_size", max_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            errors[name] = ["must be a whole number of at least 0"]
    if errors:
        raise ValidationFailed("pool sizes must be whole numbers of at least 0", fields=errors)
    if not min_size <= target_size <= max_size:
        raise ValidationFailed(
            "sizes must satisfy min_size <= target_size <= max_size "
            f"(got {min_size}, {target_size}, {max_size})",
            fields={"target_size": ["must lie between min_size and max_size"]},
            code=ErrorCode.INVALID_SIZES,
        )
    if max_size > max_pool_size:
        raise ValidationFailed(
            f"max_size {max_size} exceeds the organization's max_pool_size {max_pool_size} "
            "for this machine type",
            fields={"max_size": [f"must be at most {max_pool_size}"]},
            code=ErrorCode.QUOTA_EXCEEDED,
        )


@transaction.atomic
def pool_create(
    *,
    org: Organization,
    name: str,
    machine_type: MachineType,
    target_size: int,
    min_size: int = 0,
    max_size: int | None = None,
    warmup_grace_seconds: int = 600,
    description: str = "",
    images: list[str] | None = None,
    actor: Actor = Actor.UNNAMED,
) -> InstancePool:
    images = pool_check_images(images or [])
    grant = grant_for(org=org, machine_type=machine_type)
    grant_check_privilege(org=org, machine_type=machine_type)
    max_size = target_size if max_size is None else max_size
    pool_validate_sizes(
        target_size=target_size, min_size=min_size, max_size=max_size, max_pool_size=grant.max_pool_size
    )
    if InstancePool.objects.filter(org=org, name=name).exists():
        raise ValidationFailed(
            f"a pool named {name!r} already exists",
            fields={"name": ["already exists"]},
            code=ErrorCode.DUPLICATE_NAME,
        )
    pool = InstancePool.objects.create(
        org=org,
        name=name,
        description=description,
        machine_type=machine_type,
        target_size=target_size,
        min_size=min_size,
        max_size=max_size,
        warmup_grace_seconds=warmup_grace_seconds,
        images=images,
    )
    event_record(
        kind=EventKind.POOL_CREATED,
        org=org,
        pool=pool,
        actor=actor,
        target_size=target_size,
        machine_type=machine_type.name,
        images=images or None,
    )
    request_refill(pool.pk)  # warm it now (after commit), not at the next reaper tick
    return pool


# The event a refill records when a limit starts holding it back (``limit``'s first word).
LIMIT_EVENTS = {
    "pool_at_max_size": EventKind.POOL_AT_MAX_SIZE,
    "quota_exceeded": EventKind.POOL_QUOTA_EXCEEDED,
    "budget_exceeded": EventKind.POOL_BUDGET_EXCEEDED,
    "no_host_room": EventKind.POOL_NO_HOST_ROOM,
    "capacity_cooling": EventKind.POOL_CAPACITY_COOLING,
}

# Every pool status change: POOL_STATES.move(pool_id, to=..., ...).
POOL_STATES = StateMachine(
    InstancePool,
    POOL_TRANSITIONS,
    "pool",
    kinds=EventKind,
    record=event_record,
    record_many=events_record,
    stamps={PoolStatus.DRAINED: "drained_at"},
)


# ---- claim (the hot path) -------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    claim_id: uuid.UUID
    instance: MachineInstance


def pool_claim(
    *,
    pool_id: PoolId,
    acquired_by: str = "",
    acquired_for: str = "",
    actor: Actor = Actor.UNNAMED,
    job_id: JobId | None = None,
    org_id: OrgId | None = None,
    lease_seconds: float | None = None,
    image: str | None = None,
    config_id: JobConfigId | None = None,
) -> Claim:
    """Atomically claim one ready member of a pool. Never waits on a lock, never hands one
    instance to two callers; answers :class:`PoolEmpty` at once when none is ready.

    The claim is one statement, so outside a transaction it runs (and commits) in a single
    round trip. ``org_id`` scopes the pool to an organization (another org's pool: NotFound).
    Inside a transaction (job placement) a member holding ``image`` is taken first.
    ``config_id``: the configuration of the job it is taken for, which the machine remembers
    (placement prefers it for that configuration's next job, its caches warm).
    """
    started = time.perf_counter()
    in_transaction = connection.in_atomic_block
    claim_id, instance = claims.claim(
        claims.pool_sql(POOL_ACTIVE, in_transaction=in_transaction),
        actor=actor,
        by=acquired_by,
        for_=acquired_for,
        job_id=job_id,
        lease_seconds=lease_seconds,
        pool=str(pool_id),
        org=str(org_id) if org_id else None,
        **({"image": image} if in_transaction else {}),
        last_config=str(config_id) if config_id else None,
    )
    if instance is None:
        pools = InstancePool.objects.filter(pk=pool_id)
        if org_id:
            pools = pools.filter(org_id=org_id)
        status = pools.values_list("status", flat=True).first()
        if status is None:
            raise NotFound("pool not found")
        if status not in POOL_ACTIVE:
            raise InvalidTransition("Pool", pool_id, status, "claimed from")
        raise PoolEmpty("no ready member in this pool; try again shortly or raise target_size")
    if in_transaction:
        request_refill(pool_id)  # after that transaction commits
    # else the claim statement itself marked the pool for a refill and notified the listener.
    CLAIM_LATENCY.observe(time.perf_counter() - started)
    return Claim(claim_id=claim_id, instance=instance)


# ---- sizes, drain, delete -------------------------------------------------------------------


# How many images a pool may keep hot on every member.
MAX_POOL_IMAGES = 20


def pool_check_images(images: object) -> list[str]:
    """A pool's ``images``: a list of image references (each normalised, no repeats), or a 400
    naming the one that is wrong."""
    if not isinstance(images, list | tuple) or len(images) > MAX_POOL_IMAGES:
        raise ValidationFailed.field("images", f"a list of at most {MAX_POOL_IMAGES} image references")
    normalised: list[str] = []
    for i, image in enumerate(images):
        ref = check_image_reference(image, field=f"images[{i}]")
        if ref not in normalised:
            normalised.append(ref)
    return normalised


def pool_member_enrolled(*, instance_id: Any) -> list[str]:
    """A member's agent enrolled: the images it pulls before it is ready (its pool's list, whose
    version it is recorded as having); none for a machine outside pools."""
    row = (
        MachineInstance.objects.filter(pk=instance_id, pool__isnull=False)
        .values("pool__images", "pool__images_version")
        .first()
    )
    if row is None:
        return []
    MachineInstance.objects.filter(pk=instance_id).update(pool_images_version=row["pool__images_version"])
    return list(row["pool__images"] or [])


@transaction.atomic
def pool_update(*, pool: InstancePool, actor: Actor = Actor.UNNAMED, **sizes: Any) -> InstancePool:
    """Change sizes (and description, and the images members hold); the reaper and the refill
    converge to them. New ``images`` make every member told the old list outdated: the refill
    replaces them as it replaces members of an older machine type version."""
    pool = InstancePool.objects.select_for_update().get(pk=pool.pk)
    if pool.status not in POOL_ACTIVE:
        raise InvalidTransition("Pool", pool.pk, pool.status, "resized")
    if "images" in sizes:
        images = pool_check_images(sizes.pop("images"))
        if images != list(pool.images):
            InstancePool.objects.filter(pk=pool.pk).update(
                images=images, images_version=F("images_version") + 1
            )
            event_record(kind=EventKind.POOL_UPDATED, org=pool.org_id, pool=pool, actor=actor, images=images)
            request_refill(pool.pk)
            pool.refresh_from_db()
    wanted = {k: sizes.get(k, getattr(pool, k)) for k in ("target_size", "min_size", "max_size")}
    grant = grant_for(org=pool.org, machine_type=pool.machine_type)
    pool_validate_sizes(**wanted, max_pool_size=grant.max_pool_size)
    changed = {k: v for k, v in sizes.items() if getattr(pool, k) != v}
    for key, value in changed.items():
        setattr(pool, key, value)
    if changed:
        pool.save()
        event_record(kind=EventKind.POOL_UPDATED, org=pool.org_id, pool=pool, actor=actor, **changed)
        request_refill(pool.pk)
    return pool


def pool_drain(*, pool: InstancePool, terminate_members: bool, actor: Actor = Actor.UNNAMED) -> int:
    """Stop keeping machines: no new members, acquires refused. With ``terminate_members``
    every live member is terminated; without, unclaimed members are released as idle
    machines that the reaper destroys at the end of their paid period. Returns the number
    of members terminated."""
    with transaction.atomic():
        # Lock order as in a refill (grant, then the pool's refill lock), then as in a claim
        # (member, then pool row). The refill lock makes a refill in flight finish first (its
        # members are drained with the others) or find the pool draining: a drained pool never
        # gets a member again.
        grant_lock(org_id=pool.org_id, machine_type_id=pool.machine_type_id)
        _refill_lock(pool.pk)
        list(MachineInstance.objects.select_for_update().filter(pool=pool, status__in=INSTANCE_LIVE))
        POOL_STATES.move(
            pool.pk,
            to=PoolStatus.DRAINING,
            actor=actor,
            reason="terminate members" if terminate_members else "release members",
        )
        members = list(
            MachineInstance.objects.filter(pool=pool, status__in=INSTANCE_LIVE)
            .exclude(status=InstanceStatus.TERMINATING)
            .values_list("pk", "status")
        )
        terminated = 0
        for instance_id, status in members:
            if terminate_members:
                try:
                    instance_terminate(
                        instance_id=instance_id, actor=actor, reason="pool drained", cause=Cause.POOL_DRAINED
                    )
                    terminated += 1
                except InvalidTransition:
                    pass
            elif status != InstanceStatus.CLAIMED:
                MachineInstance.objects.filter(pk=instance_id).update(pool=None)
                event_record(
                    kind=EventKind.POOL_MEMBER_RELEASED,
                    org=pool.org_id,
                    pool=pool,
                    instance=instance_id,
                    actor=actor,
                    reason="pool drained without terminating members",
                )
        POOL_STATES.move(
            pool.pk, to=PoolStatus.DRAINED, actor=actor, event_data={"terminated_count": terminated}
        )
    return terminated


def pool_delete(*, pool: InstancePool, actor: Actor = Actor.UNNAMED) -> None:
    status = InstancePool.objects.filter(pk=pool.pk).values_list("status", flat=True).first()
    if status != PoolStatus.DRAINED:
        raise InvalidTransition("Pool", pool.pk, status, "deleted (drain it first)")
    # Its (ending) members leave it first, in a statement of their own: deleting the pool row
    # would otherwise set their pool to NULL while holding the pool row's lock, and a member's
    # termination finishing at that moment (member row locked, then the pool's) deadlocked
    # with it: a 500 on DELETE that README's walkthrough hit. A drained pool gets no members.
    MachineInstance.objects.filter(pool_id=pool.pk).update(pool=None)
    with transaction.atomic():
        locked = InstancePool.objects.select_for_update().get(pk=pool.pk)
        if locked.status != PoolStatus.DRAINED:
            raise InvalidTransition("Pool", pool.pk, locked.status, "deleted (drain it first)")
        event_record(kind=EventKind.POOL_DELETED, org=pool.org_id, pool=pool, actor=actor, name=pool.name)
        locked.delete()


# ---- refill: converge members to target_size ------------------------------------------------


def pool_refill(*, pool_id: PoolId, actor: Actor = Actor.REFILL) -> int:
    """Provision what the pool lacks (up to target_size, never past max_size or the org's
    max_instances), replace outdated members, trim a surplus, and update the pool's status.
    Serialised per pool by a row lock; returns the number of members requested."""
    keys = InstancePool.objects.filter(pk=pool_id).values("org_id", "machine_type_id").first()
    if keys is None:
        return 0
    clear_mark(pool_id)  # a claim committed from now on asks for the next refill
    with transaction.atomic():
        # Lock order: the grant (serialises every path that buys machines of this org and
        # machine type: other pools' refills, job placement), then the pool's refill lock (an
        # advisory lock, not the pool row, which claims update to signal refills).
        grant = grant_lock(org_id=keys["org_id"], machine_type_id=keys["machine_type_id"])
        _refill_lock(pool_id)
        # The grant's releases being committed finish first: a machine a job's end keeps for
        # the next job is counted idle below (and taken in), never bought again beside it.
        machine_releases_lock(org_id=keys["org_id"], machine_type_id=keys["machine_type_id"], shared=False)
        # Read after the lock: a drain (which takes it too) has either not started or committed.
        pool = InstancePool.objects.select_related("machine_type").filter(pk=pool_id).first()
        if pool is None or pool.status not in POOL_ACTIVE:
            return 0
        mt = pool.machine_type
        if settings.CATACLOUD_REPLACE_OUTDATED:
            MachineInstance.objects.filter(
                pool=pool, status__in=INSTANCE_LIVE, machine_type_version__lt=mt.version, outdated=False
            ).update(outdated=True)
        # Members told an older image list than the pool's: drift, as an older machine type.
        MachineInstance.objects.filter(
            pool=pool, status__in=INSTANCE_LIVE, pool_images_version__lt=pool.images_version, outdated=False
        ).update(outdated=True)
        members = list(
            MachineInstance.objects.filter(pool=pool, status__in=INSTANCE_LIVE)
            .exclude(status=InstanceStatus.TERMINATING)
            .values("pk", "status", "outdated", "ready_at", "provisioning_started_at")
        )
        unclaimed = [m for m in members if m["status"] != InstanceStatus.CLAIMED]
        fresh = [m for m in unclaimed if not m["outdated"]]
        fresh_ready = [m for m in fresh if m["status"] == InstanceStatus.READY]
        outdated = [m for m in unclaimed if m["outdated"]]
        # What the org already pays for counts first: idle machines of this type outside
        # every pool, then machines booting for no job, are taken in before anything is bought.
        paid = paid_capacity(org_id=pool.org_id, machine_type=mt)
        # A pool that keeps images hot takes in no outside machine: it would not hold them.
        idle, booting = (0, 0) if pool.images else (paid.idle, paid.booting)
        outside = idle + booting
        plan = refill_plan(
            target=pool.target_size,
            max_size=pool.max_size,
            members=len(members),
            fresh=len(fresh),
            idle=idle,
            booting=booting,
            waiting=hooks.jobs_waiting(org_id=pool.org_id, machine_type_id=mt.pk) if outside else 0,
            counted=paid.counted,
            max_instances=grant.max_instances if grant else 0,
        )
        wanted, limit = plan.wanted, plan.limit
        adopted_ready, adopted_booting = _adopt(
            pool, mt, ready=plan.adopt_ready, booting=plan.adopt_booting, actor=actor
        )
        count, budget_limit = _buy(pool, mt, plan.buy, actor=actor)
        limit = budget_limit or limit
        room = count == 0 and wanted > adopted_ready + adopted_booting
        _retire(pool, fresh, fresh_ready, outdated, room=room, actor=actor)
        _record_limit(pool, limit, wanted=wanted, requested=count, actor=actor)
        _sync_status(pool, ready=len(fresh_ready) + adopted_ready)
    return count


Member = Mapping[str, Any]  # a pool member's row: pk, status, outdated, ready_at, provisioning_started_at


def _buy(pool: InstancePool, mt: MachineType, count: int, *, actor: Actor) -> tuple[int, str]:
    """Request ``count`` members, as many as the org's budgets allow (lock order: grant, pool,
    budget); how many, and the budget's limit when it held some back."""
    limit = ""
    if count and capacity.is_cooling(mt):  # the provider said it has none: wait out the cool-down
        return 0, f"capacity_cooling: {capacity.cooling_reason([mt])}"[:200]
    if count:
        now = timezone.now()
        check = budget_check(org_id=pool.org_id, machine_type=mt, now=now, actor=actor)
        if check.cap(count) < count:
            count = check.cap(count)
            limit = f"budget_exceeded: {check.reason_after(count)}"
        budget_bought(check, count, now=now, actor=actor)
    for done in range(count):
        try:
            instance_request(org=pool.org_id, machine_type=mt, pool=pool.pk, actor=actor, reason="refill")
        except NoHostRoom as exc:  # an enrolled host type: its hosts are full (slots, not machines)
            return done, limit or f"no_host_room: {exc}"
    return count, limit


def _retire(
    pool: InstancePool,
    fresh: Sequence[Member],
    fresh_ready: Sequence[Member],
    outdated: Sequence[Member],
    *,
    room: bool,
    actor: Actor,
) -> None:
    """Outdated members once their replacements are ready (or one at a time to make ``room``
    when none can be bought), and ready members above target_size."""
    to_terminate: list[Any] = []
    if outdated:
        if len(fresh_ready) >= pool.target_size:
            to_terminate += [m["pk"] for m in outdated]  # replacements are ready: retire the old
        elif room:
            to_terminate.append(outdated[0]["pk"])  # no room to surge: make room, one at a time
    surplus = len(fresh) - pool.target_size
    if surplus > 0:
        ready_first = sorted(
            fresh, key=lambda m: (m["status"] != InstanceStatus.READY, m["ready_at"] is None)
        )
        to_terminate += [m["pk"] for m in ready_first[:surplus] if m["status"] == InstanceStatus.READY]
    old = {m["pk"] for m in outdated}
    for instance_id in to_terminate:
        with contextlib.suppress(InvalidTransition):
            instance_terminate(
                instance_id=instance_id,
                actor=actor,
                reason="outdated machine type version" if instance_id in old else "above target_size",
            )


def _record_limit(pool: InstancePool, limit: str, *, wanted: int, requested: int, actor: Actor) -> None:
    """Keep what holds the pool back on its row, and an event when that changes (not on every
    refill while it holds)."""
    if limit != pool.limit_reason:
        InstancePool.objects.filter(pk=pool.pk).update(limit_reason=limit, updated_at=timezone.now())
    if limit and limit.split(":")[0] != pool.limit_reason.split(":")[0]:
        event_record(
            kind=LIMIT_EVENTS[limit.split(":")[0]],
            org=pool.org_id,
            pool=pool,
            actor=actor,
            reason=limit,
            wanted=wanted,
            requested=requested,
        )


def _refill_lock(pool_id: PoolId) -> None:
    """The pool's refill lock until the transaction ends: one refill or drain of it at a time."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [POOL_REFILL, str(pool_id)])


def _adopt(pool: InstancePool, mt: MachineType, *, ready: int, booting: int, actor: Actor) -> tuple[int, int]:
    """Take ``ready`` idle machines and ``booting`` machines booting for no job, of the pool's
    org and machine type, outside every pool, into the pool (they cost nothing more). The
    caller holds the grant's lock, so placement does not claim them meanwhile; rows another
    transaction holds are skipped. Machines that never ran a job first, then the oldest.
    Returns how many ready and booting machines it took in."""
    taken = [0, 0]
    for i, (statuses, n) in enumerate((([InstanceStatus.READY], ready), (list(BOOTING), booting))):
        if n <= 0:
            continue
        ids = list(
            MachineInstance.objects.filter(
                org_id=pool.org_id,
                machine_type=mt,
                machine_type_version=mt.version,
                pool__isnull=True,
                status__in=statuses,
            )
            .order_by(F("last_config").asc(nulls_first=True), "created_at")
            .select_for_update(skip_locked=True)
            .values_list("pk", flat=True)[:n]
        )
        for instance_id in ids:
            if MachineInstance.objects.filter(pk=instance_id, pool__isnull=True, status__in=statuses).update(
                pool=pool
            ):
                event_record(
                    kind=EventKind.POOL_MEMBER_ADOPTED,
                    org=pool.org_id,
                    pool=pool,
                    instance=instance_id,
                    actor=actor,
                    reason="idle machine of the pool's type taken in"
                    if statuses == [InstanceStatus.READY]
                    else "machine booting for no job taken in",
                )
                taken[i] += 1
    return taken[0], taken[1]


def _sync_status(pool: InstancePool, *, ready: int) -> None:
    """warming → ready when target_size members are ready; ready ⇄ replenishing."""
    if ready >= pool.target_size and pool.status != PoolStatus.READY:
        POOL_STATES.move(pool.pk, to=PoolStatus.READY, actor=Actor.REFILL, event_data={"ready": ready})
    elif ready < pool.target_size and pool.status == PoolStatus.READY:
        POOL_STATES.move(
            pool.pk,
            to=PoolStatus.REPLENISHING,
            actor=Actor.REFILL,
            event_data={"ready": ready, "target_size": pool.target_size},
        )
