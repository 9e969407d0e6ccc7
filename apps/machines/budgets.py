"""Money budgets: no machine is bought that would take an org past its budget.

A budget's spend in a period (calendar month or day, UTC) counts every machine of its scope
(the org, optionally one machine type) whose billing started in the period: the recorded
cost of machines that ended, plus what live machines have committed to the end of their
current paid period (a machine not yet at the provider commits its first period). A buyer
(job placement, pool refill) may buy a machine only while spend + its first paid period
stays within the amount. Machines already paid keep running jobs: the check is only where
machines are bought.

Called under the grant's row lock; the budget rows are locked next (``SELECT … FOR UPDATE``
in primary key order), so buyers of different machine types under one org-wide budget
never both spend its last cents. A budget raised or lowered counts at the next check.
Events ``budget.warning`` (80 %) and ``budget.exhausted`` (100 %: spent, or a purchase
refused) are recorded once per period and threshold.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from django.conf import settings
from django.db.models import Q

from apps.core.actors import Actor
from apps.core.ids import OrgId
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.machines.choices import INSTANCE_LIVE, INSTANCE_TERMINAL
from apps.machines.models import Budget, BudgetPeriod, MachineInstance, MachineType
from catacloud.policy.attribution import first_period_cost
from catacloud.policy.billing import Billing

CENT = Decimal("0.01")
WARNING_PERCENT = 80


def period_start(period: str, now: datetime) -> datetime:
    now = now.astimezone(UTC)
    if period == BudgetPeriod.DAY:
        return now.replace(hour=0, minute=0, second=0, microsecond=0)
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def next_month(month_start: datetime) -> datetime:
    """The first instant of the month after the one ``month_start`` begins."""
    return (month_start.replace(day=1) + timedelta(days=32)).replace(day=1)


def _billing(mt: MachineType) -> Billing:
    return Billing(mt.billing_increment_seconds, mt.min_billed_seconds, mt.price_per_hour)


def budget_spend(budget: Budget, *, now: datetime) -> Decimal:
    """Spent plus committed in the budget's current period (see the module docstring)."""
    return budget_spends([budget], now=now)[budget.pk]


@dataclass(frozen=True)
class MachineSpend:
    """What one machine counts against budgets and cost figures."""

    org_id: Any
    org_slug: str
    machine_type_id: Any
    machine_type_name: str
    started: datetime | None
    amount: Decimal
    own: bool = False  # on the organization's own cloud account (apps/machines/owned.py)


def machine_spends(
    *, since: datetime, now: datetime, org_ids: Iterable[Any] | None = None
) -> list[MachineSpend]:
    """Every machine that counts since ``since``, in one query (of ``org_ids``' orgs, or all):
    machines that ended count what they cost; live ones what they have cost so far, or their
    first paid period when they are not started yet. The one rule budgets and cost figures
    (apps/billing) read."""
    rows = MachineInstance.objects.order_by().filter(
        Q(status__in=INSTANCE_TERMINAL, provisioning_started_at__gte=since)
        | Q(status__in=INSTANCE_LIVE)
        & (Q(provisioning_started_at__gte=since) | Q(provisioning_started_at__isnull=True))
    )
    if org_ids is not None:
        rows = rows.filter(org_id__in=set(org_ids))
    spends = []
    for row in rows.values(
        "org_id",
        "org__slug",
        "machine_type_id",
        "machine_type__name",
        "machine_type__org_id",
        "status",
        "cost",
        "provisioning_started_at",
        "machine_type__billing_increment_seconds",
        "machine_type__min_billed_seconds",
        "machine_type__price_per_hour",
    ):
        started = row["provisioning_started_at"]
        if row["status"] in INSTANCE_TERMINAL:
            amount = row["cost"] or Decimal(0)
        else:
            billing = Billing(
                row["machine_type__billing_increment_seconds"],
                row["machine_type__min_billed_seconds"],
                row["machine_type__price_per_hour"],
            )
            # requested: it will cost its first period; running: what it has cost so far
            amount = (
                first_period_cost(billing)
                if started is None
                else billing.cost((now - started).total_seconds())
            )
        spends.append(
            MachineSpend(
                row["org_id"],
                row["org__slug"],
                row["machine_type_id"],
                row["machine_type__name"],
                started,
                amount,
                own=row["machine_type__org_id"] is not None,
            )
        )
    return spends


def budget_spends(budgets: Sequence[Budget], *, now: datetime) -> dict[Any, Decimal]:
    """Each budget's spend in one query, however many budgets (a list page)."""
    if not budgets:
        return {}
    since = {budget.pk: period_start(budget.period, now) for budget in budgets}
    machines = machine_spends(since=min(since.values()), now=now, org_ids={b.org_id for b in budgets})
    return {
        budget.pk: sum(
            (
                m.amount
                for m in machines
                if m.org_id == budget.org_id
                and (budget.machine_type_id is None or m.machine_type_id == budget.machine_type_id)
                and (m.started is None or m.started >= since[budget.pk])
            ),
            Decimal(0),
        )
        for budget in budgets
    }


@dataclass(frozen=True)
class BudgetCheck:
    """How many more machines of one type the org's budgets allow now (None: no budget)."""

    allowed: int | None
    reason: str  # the binding budget's sentence ("budget 98.20/100.00 USD this month"), or ""
    budget: Budget | None = None  # the binding budget
    spend: Decimal = Decimal(0)  # its spend and commitments now
    price: Decimal = Decimal(0)  # the first paid period of one more machine

    def cap(self, wanted: int) -> int:
        return wanted if self.allowed is None else min(wanted, self.allowed)

    def reason_after(self, bought: int) -> str:
        """The sentence once ``bought`` more machines are committed."""
        if self.budget is None:
            return self.reason
        return budget_sentence(self.budget, self.spend + bought * self.price)


NO_BUDGET = BudgetCheck(None, "")


def budget_sentence(budget: Budget, spend: Decimal) -> str:
    when = "today" if budget.period == BudgetPeriod.DAY else "this month"
    scope = f" for {budget.machine_type.name}" if budget.machine_type is not None else ""
    shown = spend.quantize(CENT, rounding=ROUND_HALF_UP)
    return f"budget {shown}/{budget.amount.quantize(CENT)} {settings.CATACLOUD_CURRENCY} {when}{scope}"


def budget_check(
    *, org_id: OrgId, machine_type: MachineType, now: datetime, actor: Actor = Actor.UNNAMED
) -> BudgetCheck:
    """Lock the org's budgets that cover ``machine_type`` and say how many machines of it may
    be bought now. Call it in the transaction that buys (after the grant's row lock)."""
    budgets = list(
        Budget.objects.select_for_update(of=("self",))
        .select_related("machine_type")
        .filter(org_id=org_id)
        .filter(Q(machine_type__isnull=True) | Q(machine_type=machine_type))
        .order_by("pk")
    )
    if not budgets:
        return NO_BUDGET
    price = first_period_cost(_billing(machine_type))
    best = NO_BUDGET
    for budget in budgets:
        spend = budget_spend(budget, now=now)
        room = budget.amount - spend
        n = int(room // price) if price > 0 else None
        if n is not None:
            n = max(0, n)
        _alert(budget, spend=spend, refused=n == 0, now=now, actor=actor)
        if n is not None and (best.allowed is None or n < best.allowed):
            best = BudgetCheck(n, budget_sentence(budget, spend), budget, spend, price)
    return best


def budget_bought(check: BudgetCheck, bought: int, *, now: datetime, actor: Actor = Actor.UNNAMED) -> None:
    """After buying ``bought`` machines under ``check``: announce a threshold they crossed."""
    if check.budget is not None and bought:
        _alert(check.budget, spend=check.spend + bought * check.price, refused=False, now=now, actor=actor)


def _alert(budget: Budget, *, spend: Decimal, refused: bool, now: datetime, actor: Actor) -> None:
    """``budget.warning`` at 80 %, ``budget.exhausted`` at 100 % (or when it refuses a
    machine), once per period and threshold."""
    current: date = period_start(budget.period, now).date()
    already = budget.alerted_level if budget.alerted_period == current else 0
    level = 0
    if refused or spend >= budget.amount:
        level = 100
    elif budget.amount and spend >= budget.amount * WARNING_PERCENT / 100:
        level = WARNING_PERCENT
    if level <= already:
        return
    Budget.objects.filter(pk=budget.pk).update(alerted_level=level, alerted_period=current)
    budget.alerted_level, budget.alerted_period = level, current
    event_record(
        kind=EventKind.BUDGET_EXHAUSTED if level == 100 else EventKind.BUDGET_WARNING,
        org=budget.org_id,
        actor=actor or Actor.BUDGET,
        reason=budget_sentence(budget, spend),
        budget=str(budget.pk),
        percent=level,
        spend=str(spend.quantize(CENT)),
        amount=str(budget.amount),
        currency=settings.CATACLOUD_CURRENCY,
        period=budget.period,
        machine_type=budget.machine_type.name if budget.machine_type is not None else None,
    )
