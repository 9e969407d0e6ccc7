from __future__ import annotations

import sys

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.core.actors import Actor
from apps.core.crypto import hash_token
from apps.orgs.models import ApiToken
from apps.orgs.services import api_token_revoke


class Command(BaseCommand):
    help = "Revoke API tokens: by the token itself, by its prefix, or every token of a user."

    def add_arguments(self, parser: CommandParser) -> None:
        group = parser.add_mutually_exclusive_group(required=True)
        group.add_argument(
            "--token",
            help="the token, or - to read it from standard input (keeps it out of shell history)",
        )
        group.add_argument("--prefix", help="the prefix shown in the admin, e.g. cc_AbCdEfG")
        group.add_argument("--user", help="revoke every token of this username")

    def handle(self, *args: object, **options: object) -> None:
        tokens = ApiToken.objects.filter(revoked_at__isnull=True)
        if options["token"]:
            secret = str(options["token"])
            if secret == "-":
                secret = sys.stdin.readline()
            if not secret.strip():
                raise CommandError("no token given")
            tokens = tokens.filter(token_hash=hash_token(secret.strip()))
        elif options["prefix"]:
            tokens = tokens.filter(prefix=options["prefix"])
        else:
            tokens = tokens.filter(user__username=options["user"])
        found = list(tokens)
        if not found:
            raise CommandError("no live token matches")
        for token in found:
            api_token_revoke(token=token, actor=Actor.MANAGE)
        self.stdout.write(f"revoked {len(found)} token(s)")
