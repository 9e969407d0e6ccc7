from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser

from apps.core.actors import Actor
from apps.core.crypto import hash_token
from apps.machines.reconcile import end_local_leftovers, reconcile_local_machines
from apps.orgs.models import ApiToken, Organization
from apps.orgs.services import api_token_create


def _private_file(path: Path, make: Callable[[], str]) -> str:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(make())
        path.chmod(0o600)
    return path.read_text().strip()


class Command(BaseCommand):
    help = (
        "Development only: ensure the demo admin user and a demo API token (printed as JSON); mark "
        "local machines that did not outlive the previous run lost, and end the processes of this "
        "home's local machines that no live row owns."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--org", default="demo")
        parser.add_argument("--user", default="admin")

    def handle(self, *args: object, **options: object) -> None:
        home = Path(settings.CATACLOUD_HOME)
        password = _private_file(home / "admin_password", lambda: secrets.token_urlsafe(12))
        user, _ = get_user_model().objects.get_or_create(username=options["user"])
        if not (user.is_staff and user.is_superuser and user.check_password(password)):
            user.is_staff = user.is_superuser = True
            user.set_password(password)
            user.save()
        org = Organization.objects.get(slug=options["org"])
        token_file = home / "demo_token"
        token = token_file.read_text().strip() if token_file.exists() else ""
        live = (
            ApiToken.objects.filter(token_hash=hash_token(token), revoked_at__isnull=True).exists()
            if token
            else False
        )
        if not live:
            _, token = api_token_create(org=org, user=user, name="make dev demo token", actor=Actor.MAKE_DEV)
            token_file.write_text(token)
            token_file.chmod(0o600)
        ghosts = sum(len(report.lost) for report in reconcile_local_machines())
        if ghosts:
            self.stderr.write(
                f"catacloud: {ghosts} local machine(s) of the previous run are gone: marked lost"
            )
        ended = end_local_leftovers(home / "machines")
        if ended:
            self.stderr.write(
                f"catacloud: ended {len(ended)} leftover local machine(s) that no live row owns: "
                + ", ".join(ended)
            )
        self.stdout.write(json.dumps({"username": user.get_username(), "password": password, "token": token}))
