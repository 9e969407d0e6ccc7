from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.control.catalog import CatalogError, apply_file


class Command(BaseCommand):
    help = "Apply a declarative catalog (provider accounts, machine types, orgs, grants) idempotently."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", nargs="+", help="YAML catalog file(s), applied in order, each atomically")
        parser.add_argument("--dry-run", action="store_true", help="validate and report, change nothing")
        parser.add_argument(
            "--no-check",
            action="store_true",
            help="do not ask Hetzner, AWS or Azure whether each machine type's server type, image and "
            "location exist (offline; their API down)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        for path in options["file"]:
            try:
                report = apply_file(path, dry_run=bool(options["dry_run"]), check=not options["no_check"])
            except CatalogError as exc:
                raise CommandError(str(exc)) from None
            except OSError as exc:
                raise CommandError(f"{path}: {exc.strerror}") from None
            verb = "would apply" if options["dry_run"] else "applied"
            self.stdout.write(f"{path}: {verb}: {report.summary()}")
            for item in report.created:
                self.stdout.write(f"  + {item}")
            for item in report.updated:
                self.stdout.write(f"  ~ {item}")
            for warning in report.warnings:
                self.stderr.write(f"  ! {warning}")
