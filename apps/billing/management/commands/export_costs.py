"""`python manage.py export_costs --org SLUG [--from DATE] [--to DATE] [--output FILE]`: every
attributed part of the org's machines in the window as CSV, one row per part (a job's share,
warm, idle or tail time of one machine), so a spreadsheet can regroup them any way. The
amounts of one machine's parts sum exactly to its billed cost."""

from __future__ import annotations

import csv
from datetime import UTC, datetime, time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from apps.billing.costs import part_rows
from apps.machines.budgets import next_month, period_start
from apps.orgs.models import Organization

COLUMNS = (
    "start",
    "end",
    "seconds",
    "kind",
    "amount",
    "currency",
    "machine",
    "machine_type",
    "pool",
    "job",
    "config",
    "repository",
    "workflow",
    "live",
    "payer",
)


def _when(raw: str | None, default: datetime) -> datetime:
    if not raw:
        return default
    value = parse_datetime(raw)
    if value is None:
        day = parse_date(raw)
        if day is None:
            raise CommandError(f"not a date or ISO time: {raw!r}")
        value = datetime.combine(day, time.min)
    return value if timezone.is_aware(value) else value.replace(tzinfo=UTC)


class Command(BaseCommand):
    help = "Export an organization's machine costs, attributed to jobs, warm, idle and tail time, as CSV."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--org", required=True, help="organization slug")
        parser.add_argument(
            "--from", dest="start", help="start (date or ISO time, UTC); default: month start"
        )
        parser.add_argument("--to", dest="end", help="end, exclusive; default: the next month's start")
        parser.add_argument("--output", default="-", help="file to write (default: stdout)")

    def handle(self, *args: Any, **options: Any) -> None:
        org = Organization.objects.filter(slug=options["org"]).first()
        if org is None:
            raise CommandError(f"no organization {options['org']!r}")
        now = timezone.now()
        month = period_start("month", now)
        start = _when(options["start"], month)
        end = _when(options["end"], next_month(month))  # as GET /costs/: the whole month
        if end <= start:
            raise CommandError("--to must be after --from")
        rows = part_rows(org=org, start=start, end=end, now=now)
        out: Any = self.stdout if options["output"] == "-" else open(options["output"], "w", newline="")  # noqa: SIM115
        try:
            writer = csv.writer(out)
            writer.writerow(COLUMNS)
            for r in rows:
                writer.writerow(
                    [
                        r.start.isoformat(),
                        r.end.isoformat(),
                        f"{(r.end - r.start).total_seconds():.3f}",
                        r.kind,
                        str(r.amount),
                        settings.CATACLOUD_CURRENCY,
                        str(r.instance_id),
                        r.machine_type,
                        r.pool or "",
                        r.job_id or "",
                        r.config or "",
                        r.repository or "",
                        r.workflow or "",
                        "yes" if r.live else "no",
                        r.payer,
                    ]
                )
        finally:
            if out is not self.stdout:
                out.close()
        if options["output"] != "-":
            self.stderr.write(f"wrote {len(rows)} parts to {options['output']}")
