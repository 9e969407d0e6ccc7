"""`python manage.py export_job_trace --org SLUG [--since DAYS] [--output FILE]`: an org's
finished jobs as a trace for `catacloud simulate` (CSV: submit_time_seconds,
duration_seconds,config; submit time relative to the first job, duration started → finished)."""

from __future__ import annotations

import csv
import sys
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from apps.jobs.choices import JOB_TERMINAL
from apps.jobs.models import Job
from apps.orgs.models import Organization


class Command(BaseCommand):
    help = "Export an organization's finished jobs as a job trace CSV for `catacloud simulate`."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--org", required=True, help="organization slug")
        parser.add_argument(
            "--since", type=float, default=None, help="only jobs queued in the last DAYS days"
        )
        parser.add_argument("--output", default="-", help="file to write (default: stdout)")

    def handle(self, *args: Any, **options: Any) -> None:
        org = Organization.objects.filter(slug=options["org"]).first()
        if org is None:
            raise CommandError(f"no organization {options['org']!r}")
        jobs = Job.objects.filter(
            org=org, status__in=JOB_TERMINAL, started_at__isnull=False, finished_at__isnull=False
        )
        if options["since"] is not None:
            jobs = jobs.filter(queued_at__gte=timezone.now() - timedelta(days=options["since"]))
        rows = list(
            jobs.order_by("queued_at").values_list("queued_at", "started_at", "finished_at", "config__name")
        )
        out = sys.stdout if options["output"] == "-" else open(options["output"], "w", newline="")  # noqa: SIM115
        try:
            writer = csv.writer(out)
            writer.writerow(["submit_time_seconds", "duration_seconds", "config"])
            first = rows[0][0] if rows else None
            for queued, started, finished, config in rows:
                if first is None or started is None or finished is None:
                    continue  # the query keeps finished jobs only; the types cannot tell
                writer.writerow(
                    [
                        f"{(queued - first).total_seconds():.1f}",
                        f"{(finished - started).total_seconds():.1f}",
                        config,
                    ]
                )
        finally:
            if out is not sys.stdout:
                out.close()
        if options["output"] != "-":
            self.stderr.write(f"wrote {len(rows)} jobs to {options['output']}")
