"""Pools: creation with the validation users expect, sizes, and the pool state machine."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import transaction

from apps.core.errors import ValidationFailed
from apps.core.transitions import change_state
from apps.events.services import event_record
from apps.machines.models import MachineType
from apps.machines.services import grant_check_privilege, grant_for
from apps.orgs.models import Organization
from apps.pools.choices import POOL_TRANSITIONS, PoolStatus
from apps.pools.models import InstancePool


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
            code="invalid_sizes",
        )
    if max_size > max_pool_size:
        raise ValidationFailed(
            f"max_size {max_size} exceeds the organization's max_pool_size {max_pool_size} "
            "for this machine type",
            fields={"max_size": [f"must be at most {max_pool_size}"]},
            code="quota_exceeded",
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
    actor: str = "",
) -> InstancePool:
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
            code="duplicate_name",
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
    )
    event_record(
        kind="pool.created",
        org=org,
        pool=pool,
        actor=actor,
        target_size=target_size,
        machine_type=machine_type.name,
    )
    return pool


def pool_transition(
    *,
    pool_id: Any,
    to: str,
    from_: Iterable[str] | None = None,
    actor: str = "",
    reason: str = "",
    **changes: Any,
) -> InstancePool:
    """Compare-and-set a pool's status (``pool.<status>`` event)."""
    stamps = {PoolStatus.DRAINED: "drained_at"}
    return change_state(
        InstancePool,
        pool_id,
        graph=POOL_TRANSITIONS,
        to=to,
        event_prefix="pool",
        from_=from_,
        stamps=stamps,
        actor=actor,
        reason=reason,
        **changes,
    )
