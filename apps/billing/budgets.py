"""Budget administration (create, change) and the spend figures the console shows. The budget
*gate*, which every buyer of machines (job placement, pool refill) consults under its grant's
lock, is :mod:`apps.machines.budgets`: it sits below the buyers."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from django.conf import settings

from apps.core.actors import Actor
from apps.core.errors import ValidationFailed
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.machines.budgets import CENT, machine_spends
from apps.machines.models import Budget, BudgetPeriod, MachineType
from apps.orgs.models import Organization


def spend_grouped(*, since: datetime, now: datetime) -> dict[tuple[str, str], Decimal]:
    """Spent plus committed since ``since`` for every (org slug, machine type name), by the
    rule of :func:`apps.machines.budgets.machine_spends` (the dashboard's cost figures)."""
    return spend_grouped_and_own(since=since, now=now)[0]


def spend_grouped_and_own(
    *, since: datetime, now: datetime
) -> tuple[dict[tuple[str, str], Decimal], dict[str, Decimal]]:
    """:func:`spend_grouped`, and per org slug what of it its own cloud accounts paid (one query)."""
    out: dict[tuple[str, str], Decimal] = {}
    own: dict[str, Decimal] = {}
    for m in machine_spends(since=since, now=now):
        key = (m.org_slug, m.machine_type_name)
        out[key] = out.get(key, Decimal(0)) + m.amount
        if m.own:
            own[m.org_slug] = own.get(m.org_slug, Decimal(0)) + m.amount
    return out, own


def budget_set(
    *,
    org: Organization,
    amount: object,  # what the caller was given: checked here
    period: str = BudgetPeriod.MONTH,
    machine_type: MachineType | None = None,
    actor: Actor = Actor.UNNAMED,
) -> Budget:
    """Create or change a budget; it counts from the next check (the next scheduler tick or
    refill). Thresholds are announced again against the new amount."""
    try:
        value = Decimal(str(amount))
    except (ArithmeticError, ValueError, TypeError):
        value = Decimal("NaN")
    if not value.is_finite() or value < 0:
        raise ValidationFailed(
            "amount must be a number of at least 0", fields={"amount": ["must be a number >= 0"]}
        )
    if period not in BudgetPeriod.values:
        raise ValidationFailed(
            f"period must be one of {', '.join(BudgetPeriod.values)}",
            fields={"period": [f"must be one of {', '.join(BudgetPeriod.values)}"]},
        )
    budget, created = Budget.objects.update_or_create(
        org_id=getattr(org, "pk", org),
        machine_type=machine_type,
        period=period,
        defaults={"amount": value.quantize(CENT), "alerted_level": 0, "alerted_period": None},
    )
    event_record(
        kind=EventKind.BUDGET_CREATED if created else EventKind.BUDGET_UPDATED,
        org=budget.org_id,
        actor=actor,
        amount=str(budget.amount),
        period=period,
        currency=settings.CATACLOUD_CURRENCY,
        machine_type=machine_type.name if machine_type else None,
    )
    return budget
