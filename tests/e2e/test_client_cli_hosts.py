"""``catacloud hosts …`` (issue 50, steps 1 and 5): enrolment tokens made, listed and revoked from
the command line (the token printed once, alone on stdout), and enrolled hosts listed, shown,
cordoned, drained, uncordoned, priced and revoked. The installed ``catacloud`` script in its own
process against the live API; the hosts enroll as ``catacloud host`` does (the service it calls)."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from apps.core.crypto import hash_token
from apps.core.errors import Unauthenticated
from apps.events.models import Event
from apps.machines.hosts import host_enroll
from apps.machines.models import EnrolmentToken, Host, MachineType
from catacloud.protocol import HostCapacity
from testkit.builders import instance_row
from tests.api.endpoints import make_hosts
from tests.conftest import World
from tests.e2e.test_client_cli import Cli, ok

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

CAPACITY = HostCapacity(cpus=4, memory_mb=8192, disk_gb=50, arch="aarch64")


@pytest.fixture
def cli(live_server: Any, tmp_path: Path) -> Cli:
    return Cli(live_server.url, tmp_path)


def rows(text: str) -> dict[str, list[str]]:
    """A table's lines by their first column."""
    return {line.split()[0]: line.split() for line in text.splitlines()[1:]}


def test_hosts_tokens_create_ls_and_revoke(tworld: World, cli: Cli) -> None:
    make_hosts(tworld)
    admin = tworld.tokens["admin"]
    made = ok(
        cli(admin, "hosts", "tokens", "create", "--label", "gpu=a4000", "--label", "site=fsn1",
            "--uses", "2", "--ttl", "2h", "--description", "GPU rack")
    )  # fmt: skip
    secret = made.stdout.strip()
    assert made.stdout == f"{secret}\n" and secret.startswith("ce_")  # alone: TOKEN=$(catacloud …)
    assert "shown this once" in made.stderr and "CATACLOUD_ENROLMENT_TOKEN" in made.stderr
    token = EnrolmentToken.objects.get(token_hash=hash_token(secret))
    assert (token.org, token.labels, token.max_uses) == (tworld.org, {"gpu": "a4000", "site": "fsn1"}, 2)
    assert timedelta(minutes=119) < token.expires_at - timezone.now() <= timedelta(hours=2)

    listed = ok(cli(tworld.tokens["viewer"], "hosts", "tokens", "ls")).stdout
    assert secret not in listed
    row = rows(listed)[f"{token.prefix}…"]
    assert row[1:5] == [str(token.pk)[:8], "active", "0/2", token.expires_at.strftime("%Y-%m-%d")]
    assert "gpu=a4000,site=fsn1" in row and listed.splitlines()[0].split()[:3] == ["PREFIX", "ID", "STATE"]
    host, _ = host_enroll(enrolment_token=secret, hostname="gpu-1", capacity=CAPACITY)
    assert host.org == tworld.org and host.labels["gpu"] == "a4000"

    revoked = ok(cli(admin, "hosts", "tokens", "revoke", token.prefix))
    assert (
        revoked.stdout.strip()
        == f"enrolment token {token.prefix}… revoked: no host enrolls with it (enrolled hosts stay)"
    )
    with pytest.raises(Unauthenticated):
        host_enroll(enrolment_token=secret, hostname="gpu-2", capacity=CAPACITY)
    assert f"{token.prefix}…" not in rows(ok(cli(admin, "hosts", "tokens", "list")).stdout)
    every = rows(ok(cli(admin, "hosts", "tokens", "ls", "--all")).stdout)
    assert every[f"{token.prefix}…"][2:4] == ["revoked", "1/2"]
    as_json = json.loads(ok(cli(admin, "hosts", "tokens", "ls", "--all", "--json")).stdout)
    assert all("token" not in t for t in as_json) and len(as_json) == 2

    # A viewer makes none; bad flags are usage errors; nothing is written by either.
    count = EnrolmentToken.objects.count()
    refused = cli(tworld.tokens["viewer"], "hosts", "tokens", "create")
    assert refused.returncode == 1 and "(permission_denied, HTTP 403)" in refused.stderr
    for flags, says in [
        (["--ttl", "soon"], "--ttl takes seconds or 90s, 10m, 24h, 7d; got 'soon'"),
        (["--label", "gpu"], "--label takes KEY=VALUE"),
    ]:
        bad = cli(admin, "hosts", "tokens", "create", *flags)
        assert bad.returncode == 2 and says in bad.stderr
    bad = cli(admin, "hosts", "tokens", "create", "--account", "local")
    assert bad.returncode == 1 and "provider account local is not for enrolled hosts" in bad.stderr
    assert EnrolmentToken.objects.count() == count


def test_hosts_ls_show_cordon_drain_uncordon_update_and_revoke(tworld: World, cli: Cli) -> None:
    _, host, shared = make_hosts(tworld)
    instance_row(tworld.org, MachineType.objects.get(name="acme-hosts"), status="claimed", host=host)
    admin, viewer = tworld.tokens["admin"], tworld.tokens["viewer"]

    listed = ok(cli(viewer, "hosts", "ls")).stdout
    assert listed.splitlines()[0].split() == [
        "NAME", "ID", "STATUS", "ORG", "CPUS", "MEMORY", "SLOTS", "SCHEDULING", "LABELS", "SEEN",
    ]  # fmt: skip
    table = rows(listed)
    assert table["rack-1"][:9] == [
        "rack-1", str(host.pk)[:8], "active", "acme", "1/8", "1/16", "GiB", "1", "schedulable",
    ]  # fmt: skip
    assert table["rack-1-shared"][2:5] == ["active", "shared", "0/8"]
    shown = ok(cli(viewer, "hosts", "show", "rack-1")).stdout
    assert f"host     rack-1 {host.pk}\n" in shown and "used     1/8 cpus, 1/16 GiB, 0/100 GB disk\n" in shown
    assert "labels   arch=x86_64,site=fsn1\n" in shown
    by_id = ok(cli(viewer, "hosts", "view", str(host.pk)[:8])).stdout  # by its short id too
    assert by_id.splitlines()[:8] == shown.splitlines()[:8]

    cordoned = ok(cli(admin, "hosts", "cordon", "rack-1")).stdout
    said = "cordoned: no new job; running jobs finish (uncordon takes it back)"
    assert cordoned.strip() == f"host rack-1 {str(host.pk)[:8]} {said}"
    assert rows(ok(cli(viewer, "hosts", "ls")).stdout)["rack-1"][8] == "cordoned"
    drained = ok(cli(admin, "hosts", "cordon", "rack-1", "--drain", "10m")).stdout
    deadline = Host.objects.get(pk=host.pk).drain_deadline
    assert deadline is not None and timedelta(minutes=9) < deadline - timezone.now() <= timedelta(minutes=10)
    assert (
        f"draining: no new job; jobs still running at {deadline.strftime('%Y-%m-%d %H:%M:%S')} UTC" in drained
    )
    assert rows(ok(cli(viewer, "hosts", "ls")).stdout)["rack-1"][8:10] == ["draining", "(until"]
    assert "uncordoned" in ok(cli(admin, "hosts", "uncordon", "rack-1")).stdout
    assert Host.objects.get(pk=host.pk).cordoned_at is None

    updated = ok(cli(admin, "hosts", "update", "rack-1", "--monthly-price", "99.50", "--label", "rack=2",
                     "--unset-label", "site"))  # fmt: skip
    assert "updated: labels, monthly_price" in updated.stdout
    host.refresh_from_db()
    assert (host.monthly_price, host.labels) == (Decimal("99.50"), {"arch": "x86_64", "rack": "2"})
    assert "price    99.50 a month\n" in ok(cli(viewer, "hosts", "show", "rack-1")).stdout
    nothing = cli(admin, "hosts", "update", "rack-1")
    assert nothing.returncode == 2 and "nothing to change" in nothing.stderr

    # Shared hosts are the operator's; members read; unknown names say so. Nothing changes.
    before = Event.objects.count()
    theirs = cli(admin, "hosts", "cordon", "rack-1-shared")
    assert (
        theirs.returncode == 1
        and "is shared by the operator" in theirs.stderr
        and "(shared_host, HTTP 403)" in theirs.stderr
    )
    member = cli(tworld.tokens["member"], "hosts", "revoke", "rack-1")
    assert member.returncode == 1 and "this needs the admin role" in member.stderr
    unknown = cli(admin, "hosts", "show", "rack-9")
    assert unknown.returncode == 1 and "no host named 'rack-9'" in unknown.stderr
    outsider = cli(tworld.tokens["outsider"], "hosts", "cordon", str(host.pk))
    assert outsider.returncode == 1 and "not_found" in outsider.stderr
    assert Event.objects.count() == before and Host.objects.get(pk=shared.pk).cordoned_at is None

    revoked = ok(cli(admin, "hosts", "revoke", "rack-1")).stdout
    assert "revoked: its agent is refused and its jobs are requeued" in revoked
    assert "rack-1" not in rows(ok(cli(viewer, "hosts", "ls")).stdout)  # revoked: only with --all
    assert rows(ok(cli(viewer, "hosts", "list", "--all")).stdout)["rack-1"][2] == "revoked"
    as_json = json.loads(ok(cli(viewer, "hosts", "ls", "--status", "revoked", "--json")).stdout)
    assert [h["id"] for h in as_json] == [str(host.pk)]
