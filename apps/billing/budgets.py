"""Budget administration (create, change) and the spend figures the console shows. The budget
*gate*, which every buyer of machines (job placement, pool refill) consults under its grant's
lock, is :mod:`apps.machines.budgets`: it sits below the buyers."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from django.conf import settings
from django.db.models import Q, Sum

from apps.core.actors import Actor
from apps.core.errors import ValidationFailed
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.machines.budgets import CENT
from apps.machines.choices import INSTANCE_LIVE, INSTANCE_TERMINAL
from apps.machines.models import Budget, BudgetPeriod, MachineInstance, MachineType
from apps.orgs.models import Organization
from catacloud.policy.attribution import first_period_cost
from catacloud.policy.billing import Billing


def spend_grouped(*, since: datetime, now: datetime) -> dict[tuple[str, str], Decimal]:
    """Spent plus committed since ``since`` for every (org slug, machine type name), by the
    rule of :func:`apps.machines.budgets.budget_spend`, in two queries (the dashboard's cost figures)."""
    scope = MachineInstance.objects.order_by()
    out: dict[tuple[str, str], Decimal] = {}
    for org, mt, total in (
        scope.filter(status__in=INSTANCE_TERMINAL, provisioning_started_at__gte=since)
        .values_list("org__slug", "machine_type__name")
        .annotate(total=Sum("cost"))
    ):
        out[(org, mt)] = total or Decimal(0)
    live = (
        scope.filter(status__in=INSTANCE_LIVE)
        .filter(Q(provisioning_started_at__gte=since) | Q(provisioning_started_at__isnull=True))
        .values_list(
            "org__slug",
            "machine_type__name",
            "provisioning_started_at",
            "machine_type__billing_increment_seconds",
            "machine_type__min_billed_seconds",
            "machine_type__price_per_hour",
        )
    )
    for org, mt, started, increment, minimum, price in live:
        billing = Billing(increment, minimum, price)
        if started is None:
            committed = first_period_cost(billing)
        else:
            committed = billing.cost((now - started).total_seconds())
        out[(org, mt)] = out.get((org, mt), Decimal(0)) + committed
    return out


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
