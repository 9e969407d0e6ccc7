from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.core.actors import Actor
from apps.core.errors import DomainError
from apps.machines.hosts import enrolment_token_create
from apps.machines.models import ProviderAccount
from apps.orgs.models import Organization
from catacloud.client.hosts import parse_duration, parse_labels


class Command(BaseCommand):
    help = (
        "Print a new enrolment token for hosts of a provider account of kind hosts (shown once; only "
        "its hash is stored): scoped to --org (only its jobs run on its hosts), else shared (every "
        "organization granted a machine type on the account runs jobs there)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--account", required=True, help="the provider account (kind hosts)")
        parser.add_argument("--org", help="organization slug (default: shared by the operator)")
        parser.add_argument(
            "--label", action="append", default=[], metavar="K=V", help="a label its hosts get (repeatable)"
        )
        parser.add_argument(
            "--uses", type=int, default=1, help="how many hosts may enroll with it (default 1)"
        )
        parser.add_argument(
            "--ttl", default="24h", help="it expires after this: 3600, 30m, 24h, 7d (default 24h)"
        )
        parser.add_argument("--description", default="", help="what it is for")

    def handle(self, *args: object, **options: object) -> None:
        account = ProviderAccount.objects.filter(name=options["account"], org__isnull=True).first()
        if account is None:
            raise CommandError(f"no provider account {options['account']!r}")
        org = None
        if options["org"]:
            org = Organization.objects.filter(slug=options["org"]).first()
            if org is None:
                raise CommandError(f"no organization {options['org']!r}")
        try:
            labels = parse_labels(options["label"])  # type: ignore[arg-type]
            ttl = parse_duration(str(options["ttl"]), "--ttl")
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        try:
            _, secret = enrolment_token_create(
                provider_account=account,
                org=org,
                labels=labels,
                max_uses=options["uses"],  # type: ignore[arg-type]
                ttl_seconds=ttl,
                description=str(options["description"]),
                actor=Actor.MANAGE,
            )
        except DomainError as exc:
            raise CommandError(exc.detail) from None
        self.stdout.write(secret)
