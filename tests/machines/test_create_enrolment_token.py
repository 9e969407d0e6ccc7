"""``manage.py create_enrolment_token``: the operator's enrolment tokens (issue 50), scoped to an
organization or shared, printed once and stored hashed, as ``create_api_token`` does for API
tokens."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from apps.core.crypto import hash_token
from apps.machines.hosts import host_enroll
from apps.machines.models import EnrolmentToken
from catacloud.protocol import HostCapacity
from tests.api.endpoints import make_hosts
from tests.conftest import World

pytestmark = pytest.mark.django_db

CAPACITY = HostCapacity(cpus=4, memory_mb=8192, disk_gb=50, arch="aarch64")


def test_the_operators_command_prints_a_token_once_for_an_org_or_shared(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    make_hosts(world)
    call_command(
        "create_enrolment_token", "--account", "hosts", "--org", "acme", "--label", "gpu=a4000",
        "--label", "site=fsn1", "--uses", "3", "--ttl", "2h",
    )  # fmt: skip
    secret = capsys.readouterr().out.strip()
    token = EnrolmentToken.objects.get(token_hash=hash_token(secret))
    assert secret.startswith("ce_") and secret not in {token.prefix, token.token_hash}
    assert (token.org, token.labels, token.max_uses) == (world.org, {"gpu": "a4000", "site": "fsn1"}, 3)
    assert timedelta(minutes=119) < token.expires_at - timezone.now() <= timedelta(hours=2)
    assert token.created_by == "manage.py"
    call_command("create_enrolment_token", "--account", "hosts")
    shared = EnrolmentToken.objects.get(token_hash=hash_token(capsys.readouterr().out.strip()))
    assert shared.org is None and shared.max_uses == 1
    host, _ = host_enroll(enrolment_token=secret, hostname="from-manage", capacity=CAPACITY)
    assert host.org == world.org
    count = EnrolmentToken.objects.count()
    for args, says in [
        (("--account", "nope"), "no provider account 'nope'"),
        (("--account", "local"), "is not for enrolled hosts"),
        (("--account", "hosts", "--org", "nope"), "no organization 'nope'"),
        (("--account", "hosts", "--ttl", "soon"), "--ttl takes seconds or 90s, 10m, 24h, 7d"),
        (("--account", "hosts", "--ttl", "10s"), "ttl_seconds: from 60 seconds to a year"),
        (("--account", "hosts", "--label", "gpu"), "--label takes KEY=VALUE"),
        (("--account", "hosts", "--uses", "0"), "max_uses"),
    ]:
        with pytest.raises(CommandError, match=says):
            call_command("create_enrolment_token", *args)
    assert EnrolmentToken.objects.count() == count
