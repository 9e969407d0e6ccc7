"""Boundary: a token acts with at most its user's role, and ``--role`` only narrows it.

Shown on main: ``create_api_token --role viewer`` rewrote the membership (demoting the user)
and gave the token no role of its own.
"""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from apps.orgs.models import ApiToken, Membership
from testkit.builders import warming_instance
from tests.conftest import World

pytestmark = pytest.mark.django_db


def create_token(*args: str) -> str:
    out = io.StringIO()
    call_command("create_api_token", *args, stdout=out)
    return out.getvalue().strip()


def test_role_narrows_the_token_and_leaves_the_membership_alone(world: World) -> None:
    secret = create_token("--org", "acme", "--user", "admin", "--role", "viewer")

    assert Membership.objects.get(org=world.org, user=world.users["admin"]).role == "admin"
    assert ApiToken.objects.latest("created_at").role == "viewer"
    narrow = APIClient()
    narrow.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    body = {"name": "p", "machine_type": str(world.machine_type.pk), "command": "x"}
    assert narrow.get("/api/v1/job-configs/").status_code == 200
    assert narrow.post("/api/v1/job-configs/", body, format="json").status_code == 403
    # The user's own other token still has the admin role.
    assert world.client("admin").post("/api/v1/job-configs/", body, format="json").status_code == 201


def test_role_can_never_widen_a_token(world: World) -> None:
    with pytest.raises(CommandError, match="more rights"):
        create_token("--org", "acme", "--user", "viewer", "--role", "admin")
    assert Membership.objects.get(org=world.org, user=world.users["viewer"]).role == "viewer"


def test_a_new_user_joins_with_the_role_given(world: World) -> None:
    create_token("--org", "acme", "--user", "newcomer", "--role", "viewer")
    assert Membership.objects.get(org=world.org, user__username="newcomer").role == "viewer"


# ---- bootstrap tokens (a machine's single-use enrollment) ------------------------------------


def new_instance(world: World) -> object:
    return warming_instance(world.org, world.machine_type)


def enroll(token: str) -> int:
    return APIClient().post("/api/agent/v1/enroll", {"bootstrap_token": token}, format="json").status_code


def test_a_bootstrap_token_expires(world: World) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from apps.machines.lifecycle import bootstrap_token_for
    from apps.machines.models import MachineInstance

    old = new_instance(world)
    MachineInstance.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=2))
    assert enroll(bootstrap_token_for(old.pk)) == 401
    assert enroll(bootstrap_token_for(new_instance(world).pk)) == 200


def test_bootstrap_keys_rotate_first_signs_all_verify(world: World, settings: object) -> None:
    from apps.machines.lifecycle import bootstrap_token_for

    settings.CATACLOUD_BOOTSTRAP_KEYS = ["old-key"]
    signed_with_old = bootstrap_token_for(new_instance(world).pk)
    late_with_old = bootstrap_token_for(new_instance(world).pk)
    settings.CATACLOUD_BOOTSTRAP_KEYS = ["new-key", "old-key"]  # rotation under way
    assert enroll(signed_with_old) == 200
    signed_with_new = bootstrap_token_for(new_instance(world).pk)
    settings.CATACLOUD_BOOTSTRAP_KEYS = ["new-key"]  # the old key retired
    assert enroll(signed_with_new) == 200
    assert enroll(late_with_old) == 401  # a retired key verifies nothing
    assert enroll(bootstrap_token_for(new_instance(world).pk).rsplit(".", 1)[0] + ".0" * 1) == 401


def test_bootstrap_tokens_do_not_hang_on_the_secret_key(world: World, settings: object) -> None:
    from apps.machines.lifecycle import bootstrap_token_for

    token = bootstrap_token_for(new_instance(world).pk)
    settings.SECRET_KEY = "a-rotated-django-secret-key-that-changes-nothing-for-machines"
    assert enroll(token) == 200


def test_revoke_api_token_reads_the_token_from_standard_input(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--token -`` (what the help advises, to keep the token out of shell history) looked
    for a token spelled "-" and found none."""
    import sys

    token = world.tokens["member"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(token + "\n"))
    out = io.StringIO()
    call_command("revoke_api_token", "--token", "-", stdout=out)
    assert "revoked 1 token(s)" in out.getvalue()
    assert world.client("member").get("/api/v1/pools/").status_code == 401
    assert world.client("admin").get("/api/v1/pools/").status_code == 200  # only that one
