from __future__ import annotations

from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from apps.core.actors import Actor
from apps.core.errors import DomainError
from apps.orgs.choices import Role
from apps.orgs.models import Membership, Organization
from apps.orgs.services import api_token_create, membership_set, user_get_or_create


class Command(BaseCommand):
    help = "Print a new API token acting for USER in ORG (only its hash is stored; it is shown once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--org", required=True, help="organization slug")
        parser.add_argument("--user", required=True, help="username (created if missing)")
        parser.add_argument(
            "--role",
            choices=Role.values,
            help="the token's role: it narrows the member's role and never changes the membership "
            "(a user who is not a member yet joins with this role, default 'member')",
        )
        parser.add_argument("--name", default="", help="a label for the token")
        parser.add_argument("--expires-in-days", type=int, default=None)

    def handle(self, *args: object, **options: object) -> None:
        org = Organization.objects.filter(slug=options["org"]).first()
        if org is None:
            raise CommandError(f"no organization {options['org']!r}")
        user = user_get_or_create(username=str(options["user"]))
        role = str(options["role"] or "")
        if not Membership.objects.filter(org=org, user=user).exists():
            membership_set(org=org, user=user, role=role or Role.MEMBER, actor=Actor.MANAGE)
        expires = options["expires_in_days"]
        if expires is not None and expires < 1:  # type: ignore[operator]
            raise CommandError("--expires-in-days must be at least 1")
        try:
            _, secret = api_token_create(
                org=org,
                user=user,
                name=str(options["name"]),
                role=role,
                expires_at=timezone.now() + timedelta(days=expires) if expires else None,  # type: ignore[arg-type]
                actor=Actor.MANAGE,
            )
        except DomainError as exc:
            raise CommandError(exc.detail) from None
        self.stdout.write(secret)
