"""Candidates and capacity: which machine types may run a job, the cheapest first, and the
cool-down a provider's capacity error starts.

A job configuration names one machine type; that type may list ``alternatives`` (other types:
another location, server type, provider account, spot or on-demand), or the configuration
states ``requirements`` (cpus, memory_mb, gpus) and any granted type with at least that is a
candidate. A provider's capacity error (Hetzner ``resource_unavailable``, EC2
``InsufficientInstanceCapacity``) marks that type cooling down for
``CATACLOUD_CAPACITY_COOLDOWN`` seconds (Karpenter keeps its unavailable-offerings cache three
minutes): nothing of it is bought meanwhile, and its waiting jobs move to their next candidate
at once (apps.jobs.placement)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from apps.core.actors import Actor
from apps.core.errors import ErrorCode, ValidationFailed
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.machines.models import MachineType, OrgMachineType
from apps.orgs.models import Organization
from catacloud.providers.base import InsufficientCapacity

SIZES = ("cpus", "memory_mb", "gpus")  # at least this much
REQUIREMENTS = (*SIZES, "arch", "labels")


def clean_requirements(value: Any) -> dict[str, Any]:
    """``{"cpus": 4, "memory_mb": 8192, "gpus": 0, "arch": "arm64", "labels": {"disk": "nvme"}}``,
    each optional: sizes are whole numbers (at least that much), ``arch`` one of the machine
    types' (``x86_64``, ``arm64``), ``labels`` what the type's labels must hold. 400 otherwise."""
    from apps.machines.hosts import clean_labels
    from apps.machines.services import ARCHES

    value = value or {}
    if not isinstance(value, dict):
        raise ValidationFailed.field("requirements", f"must be an object with {', '.join(REQUIREMENTS)}")
    unknown = sorted(set(value) - set(REQUIREMENTS))
    if unknown:
        raise ValidationFailed.field(
            "requirements", f"unknown requirement {unknown[0]!r}: known are {', '.join(REQUIREMENTS)}"
        )
    for name in SIZES:
        amount = value.get(name, 0)
        if not isinstance(amount, int) or isinstance(amount, bool) or amount < 0 or amount > 1_000_000_000:
            raise ValidationFailed.field("requirements", f"{name} must be a whole number of at least 0")
    if "arch" in value and value["arch"] not in ARCHES:
        raise ValidationFailed.field("requirements", f"arch must be one of {', '.join(ARCHES)}")
    out = {name: value[name] for name in REQUIREMENTS if name in value}
    if "labels" in out:
        out["labels"] = clean_labels(out["labels"], "requirements")
        if not out["labels"]:
            del out["labels"]
    return out


def fits(mt: MachineType, requirements: dict[str, Any]) -> bool:
    """At least the sizes asked, the arch asked, and every label asked (an enrolled host type's
    ``host_labels`` are labels of its machines too)."""
    if any(getattr(mt, name) < requirements[name] for name in SIZES if name in requirements):
        return False
    if "arch" in requirements and mt.arch != requirements["arch"]:
        return False
    labels = {**(mt.host_labels or {}), **(mt.labels or {})}
    return all(labels.get(key) == item for key, item in (requirements.get("labels") or {}).items())


def _wanted(requirements: dict[str, Any]) -> str:
    """``cpus 6, arch arm64, labels gpu=a4000``: what requirements ask, for a message."""
    parts = [f"{name} {amount}" for name, amount in requirements.items() if name != "labels"]
    labels = requirements.get("labels") or {}
    if labels:
        parts.append("labels " + ", ".join(f"{k}={v}" for k, v in labels.items()))
    return ", ".join(parts)


def is_cooling(mt: MachineType, now: datetime | None = None) -> bool:
    return mt.capacity_cooling_until is not None and mt.capacity_cooling_until > (now or timezone.now())


def _granted(org_id: Any, extra: Q | None = None) -> list[MachineType]:
    """The machine types the organization is granted (and privileged for)."""
    org = Organization.objects.get(pk=org_id)
    rows = MachineType.objects.filter(
        pk__in=OrgMachineType.objects.filter(org_id=org_id).values("machine_type_id")
    ).select_related("required_privilege")
    if extra is not None:
        rows = rows.filter(extra)
    return [mt for mt in rows if org.has_privilege(mt.required_privilege)]


def _cheapest_first(types: Iterable[MachineType], primary_id: Any) -> list[MachineType]:
    return sorted(types, key=lambda mt: (mt.price_per_hour, mt.pk != primary_id, mt.name))


def candidates(*, org_id: Any, config: Any) -> list[MachineType]:
    """The machine types a job of ``config`` may run on, the cheapest first (its own type first
    among equals): every granted type meeting its ``requirements``, or its machine type and the
    granted ones of that type's ``alternatives``."""
    if config.requirements:
        return _cheapest_first(
            (mt for mt in _granted(org_id) if fits(mt, config.requirements)), config.machine_type_id
        )
    primary = config.machine_type
    if not primary.alternatives:
        return [primary]
    # An operator's type falls over to the operator's types only (an organization's own type of
    # the same name is another thing); its own types may name any type it may use.
    named = Q(name__in=primary.alternatives) & (Q(org__isnull=True) if primary.org_id is None else Q())
    return _cheapest_first(_granted(org_id, named | Q(pk=primary.pk)), primary.pk)


def choose(candidate_types: list[MachineType], now: datetime | None = None) -> MachineType | None:
    """The cheapest candidate not cooling down; None when every one is."""
    return next((mt for mt in candidate_types if not is_cooling(mt, now)), None)


def cheapest_fitting(*, org_id: Any, requirements: dict[str, Any]) -> MachineType:
    """The cheapest granted type meeting ``requirements``: what a configuration stating them
    names as its machine type. None fits: 400 ``no_machine_type_fits``, naming the largest."""
    granted = _granted(org_id)
    fitting = _cheapest_first((mt for mt in granted if fits(mt, requirements)), None)
    if fitting:
        return fitting[0]
    wanted = _wanted(requirements)
    if not granted:
        message = f"no machine type is granted to this organization; the job asks for {wanted}"
    else:
        largest = max(granted, key=lambda mt: (mt.cpus, mt.memory_mb, mt.gpus))
        message = (
            f"no machine type this organization may use has {wanted}: the largest is {largest.name} "
            f"({largest.cpus} cpus, {largest.memory_mb} MB memory, {largest.gpus} gpus, {largest.arch})"
        )
    raise ValidationFailed(message, fields={"requirements": [message]}, code=ErrorCode.NO_MACHINE_TYPE_FITS)


def cooling_reason(types: Iterable[MachineType]) -> str:
    """``every candidate is cooling down after a capacity error: cx23 until 12:03:00 UTC
    (resource_unavailable: ...)``: the pending reason of a job that none can serve now."""
    cooling = [mt for mt in types if mt.capacity_cooling_until is not None]
    parts = [
        f"{mt.name} until {mt.capacity_cooling_until:%H:%M:%S} UTC ({mt.capacity_error})" for mt in cooling
    ]
    capacity = all(mt.capacity_error.startswith(InsufficientCapacity.code) for mt in cooling)
    after = "a capacity error" if capacity else "the provider's refusal"
    return (f"every candidate is cooling down after {after}: " + "; ".join(parts))[:300]


def cool_down(*, machine_type_id: Any, reason: str, actor: Actor = Actor.PROVISIONER) -> datetime:
    """The provider has no capacity for this type now, or refuses every machine of it (``reason``
    says which, by its code): buy none of it for the cool-down (its version is not touched: no
    machine of it is outdated by this). Returns when it ends."""
    until = timezone.now() + timedelta(seconds=settings.CATACLOUD_CAPACITY_COOLDOWN)
    MachineType.objects.filter(pk=machine_type_id).update(
        capacity_cooling_until=until, capacity_error=reason[:300]
    )
    name = MachineType.objects.filter(pk=machine_type_id).values_list("name", flat=True).first()
    capacity = reason.startswith(InsufficientCapacity.code)
    event_record(
        kind=EventKind.MACHINE_TYPE_CAPACITY_ERROR if capacity else EventKind.MACHINE_TYPE_REFUSED,
        actor=actor,
        machine_type=name,
        reason=reason[:300],
        cooling_until=until.isoformat(),
    )
    return until
