"""``catacloud costs`` (``GET /costs/``: what the organization's machines cost in a window,
split into job, warm, idle and tail) and ``catacloud budgets`` (``/budgets/``: money budgets
with their spend; admins set them)."""

from __future__ import annotations

import argparse
import sys
from decimal import Decimal, InvalidOperation
from typing import Any

from catacloud.client.api import Api
from catacloud.client.base import Commands, UsageError, show_list
from catacloud.client.output import print_json, table

KINDS = ("job", "warm", "idle", "tail")  # the API's parts of a machine's cost (policy.attribution)
GROUPS = ("day", "config", "pool", "machine_type", "kind", "machine", "repository", "workflow", "owner")


def register(at: Commands) -> None:
    p = at.command(
        at.subparsers,
        "costs",
        cmd_costs,
        "what the machines cost: job, warm, idle and tail parts, by day, configuration, pool, …",
    )
    p.add_argument(
        "--by",
        choices=GROUPS,
        default="day",
        metavar="GROUP",
        help=f"group by: {', '.join(GROUPS)} (default day)",
    )
    p.add_argument(
        "--from", dest="start", metavar="DATE", help="start (a date or ISO time, UTC; default: this month)"
    )
    p.add_argument(
        "--to", dest="end", metavar="DATE", help="end, exclusive (default: the next month's start)"
    )

    budgets = at.group("budgets", "money budgets per month or day, with their spend")
    at.command(budgets, "ls", cmd_budgets_ls, "list budgets with what they spent this period")
    p = at.command(
        budgets,
        "set",
        cmd_budgets_set,
        "set a budget (admin): the org's, or one machine type's; again to change it",
    )
    p.add_argument("amount", metavar="AMOUNT", help="money per period, e.g. 100 or 12.50")
    p.add_argument("--period", choices=("month", "day"), default="month", help="calendar month or day, UTC")
    p.add_argument("--machine-type", metavar="TYPE", help="only this machine type's machines (name or id)")


def _money(value: Any) -> str:
    """An amount as people read it: cents, or more digits where cents would show 0.00."""
    amount = Decimal(str(value))
    if amount == 0 or abs(amount) >= Decimal("0.01"):
        return f"{amount:.2f}"
    return f"{amount.normalize():f}"


def cmd_costs(api: Api, args: argparse.Namespace) -> int:
    report = api.get("costs/", group_by=args.by, **{"from": args.start, "to": args.end})
    if args.json:
        print_json(report)
        return 0
    currency = report["currency"]
    print(f"{report['from'][:10]} to {report['to'][:10]} (exclusive), by {report['group_by']}, {currency}")
    if report["results"]:
        table(
            [args.by.upper().replace("_", " "), "TOTAL", *(k.upper() for k in KINDS)],
            [[r["key"] if r["key"] is not None else "(none)", _money(r["total"]),
              *(_money(r[k]) for k in KINDS)] for r in report["results"]],
        )  # fmt: skip
    shares = ", ".join(f"{k} {100 * report['shares'][k]:.1f}%" for k in KINDS)
    print(f"total {_money(report['total'])} {currency}: {shares}")
    if Decimal(report["committed_not_yet_used"]):
        print(f"of which live machines' paid time still to come: {_money(report['committed_not_yet_used'])}")
    return 0


def cmd_budgets_ls(api: Api, args: argparse.Namespace) -> int:
    def cells(b: dict) -> list[Any]:
        amount, spend = Decimal(b["amount"]), Decimal(b["spend"])
        used = f"{100 * spend / amount:.0f}%" if amount else "-"
        return [b["period"], b["machine_type"] or "(all)", _money(amount), _money(spend), used,
                b["currency"], b.get("alerted_level") or None]  # fmt: skip

    rows = api.pages("budgets/", limit=1000)
    headers = ["PERIOD", "MACHINE TYPE", "AMOUNT", "SPEND", "USED", "CURRENCY", "ALERTED"]
    return show_list(args, rows, headers, cells, empty="no budgets (catacloud budgets set AMOUNT)")


def cmd_budgets_set(api: Api, args: argparse.Namespace) -> int:
    try:
        amount = Decimal(args.amount)
    except InvalidOperation:
        raise UsageError(f"AMOUNT is a sum of money like 100 or 12.50, got {args.amount!r}") from None
    body: dict[str, Any] = {"amount": str(amount), "period": args.period}
    if args.machine_type:
        body["machine_type"] = args.machine_type
    budget = api.post("budgets/", body)
    if args.json:
        print_json(budget)
        return 0
    scope = f"machine type {budget['machine_type']}" if budget["machine_type"] else "the organization"
    print(
        f"budget for {scope}: {_money(budget['amount'])} {budget['currency']} a {budget['period']} "
        f"(spent {_money(budget['spend'])} this {budget['period']})"
    )
    print("it counts from the next scheduler tick or refill", file=sys.stderr)
    return 0
