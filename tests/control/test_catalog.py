"""`manage.py apply`: the operator's catalog, idempotent and atomic."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from apps.control.catalog import CatalogError, Report, apply_catalog
from apps.machines.models import MachineType, OrgMachineType, ProviderAccount
from apps.orgs.models import Membership, Organization
from catacloud.cli import DEMO_CATALOG
from tests.conftest import HETZNER_TOKEN, World
from tests.fakes.hetzner_api import FakeHetzner

pytestmark = pytest.mark.django_db


def test_demo_catalog_seeds_the_documented_demo_and_reapplying_is_a_noop() -> None:
    out = StringIO()
    call_command("apply", str(DEMO_CATALOG), stdout=out)
    assert "5 created" in out.getvalue()
    grant = OrgMachineType.objects.get(org__slug="demo", machine_type__name="local-small")
    assert (grant.max_pool_size, grant.max_instances, grant.max_concurrent_jobs) == (10, 20, 10)
    mt = grant.machine_type
    assert (mt.cpus, mt.memory_mb, mt.billing_increment_seconds) == (2, 4096, 3600)
    assert mt.provider_account.kind == "local"
    assert Membership.objects.get(org__slug="demo", user__username="admin").role == "admin"

    again = StringIO()
    call_command("apply", str(DEMO_CATALOG), stdout=again)
    assert "0 created, 0 updated, 5 unchanged" in again.getvalue()
    assert MachineType.objects.get(name="local-small").version == 1


def apply_offline(text: str) -> Report:
    """The catalog's own rules, without asking Hetzner (that check: the tests at the end)."""
    return apply_catalog(text, check=False)


GOOD = """\
provider_accounts:
  - name: hz
    kind: hetzner
    config: {location: fsn1}
    credentials:
      token: {env: TEST_HCLOUD_TOKEN}
machine_types:
  - name: cx23
    provider_account: hz
    server_type: cx23
    image: ubuntu-24.04
    cpus: 2
    memory_mb: 4096
    price_per_hour: 0.006
organizations:
  - slug: lab
    members:
      - {username: alice, role: admin}
    grants:
      - {machine_type: cx23, max_instances: 3}
"""


def test_credentials_come_from_env_and_are_encrypted_at_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_HCLOUD_TOKEN", "s3cr3t-hetzner-token")
    apply_offline(GOOD)
    account = ProviderAccount.objects.get(name="hz")
    assert account.credentials == {"token": "s3cr3t-hetzner-token"}
    assert "s3cr3t" not in account.credentials_encrypted
    raw = ProviderAccount.objects.filter(pk=account.pk).values_list("credentials_encrypted", flat=True).get()
    assert "s3cr3t" not in raw


def test_credentials_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("from-a-file\n")
    apply_offline(GOOD.replace("{env: TEST_HCLOUD_TOKEN}", f"{{file: {secret}}}"))
    assert ProviderAccount.objects.get(name="hz").credentials == {"token": "from-a-file"}


def test_inline_credentials_are_refused_with_their_line() -> None:
    with pytest.raises(CatalogError) as exc:
        apply_offline(GOOD.replace("{env: TEST_HCLOUD_TOKEN}", "plain-text-token"))
    assert exc.value.line == 6
    assert "never written inline" in str(exc.value)
    assert not ProviderAccount.objects.exists()


def test_a_bad_entry_changes_nothing_and_names_its_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_HCLOUD_TOKEN", "t")
    bad = GOOD.replace("    price_per_hour: 0.006", "    price_per_hour: -1")
    with pytest.raises(CatalogError) as exc:
        apply_offline(bad)
    assert exc.value.line == 14
    assert "price_per_hour" in str(exc.value)
    # The provider account before it was valid, and still nothing was written.
    assert not ProviderAccount.objects.exists()
    assert not Organization.objects.filter(slug="lab").exists()


@pytest.mark.parametrize(
    ("old", "new", "line", "words"),
    [
        ("    kind: hetzner", "    kind: vmware", 3, "unknown provider kind"),
        ("    cpus: 2", "    cpus: 2\n    colour: blue", 13, "unknown field 'colour'"),
        (
            "      - {machine_type: cx23, max_instances: 3}",
            "      - {machine_type: cx99}",
            20,
            "unknown machine type",
        ),
        (
            "      - {username: alice, role: admin}",
            "      - {username: alice, role: boss}",
            18,
            "unknown role",
        ),
        ("organizations:", "organisations:", 15, "unknown section"),
        ("    cpus: 2", "    cpus: [2", 13, "started at line 12"),
    ],
)
def test_errors_point_at_the_line(
    monkeypatch: pytest.MonkeyPatch, old: str, new: str, line: int, words: str
) -> None:
    monkeypatch.setenv("TEST_HCLOUD_TOKEN", "t")
    assert old in GOOD
    with pytest.raises(CatalogError) as exc:
        apply_offline(GOOD.replace(old, new))
    assert words in str(exc.value)
    assert exc.value.line == line, str(exc.value)
    assert not MachineType.objects.exists()


def test_changing_how_machines_are_built_bumps_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_HCLOUD_TOKEN", "t")
    apply_offline(GOOD)
    apply_offline(GOOD.replace("price_per_hour: 0.006", "price_per_hour: 0.007"))
    assert MachineType.objects.get(name="cx23").version == 1  # price is not a build field
    report = apply_offline(GOOD.replace("image: ubuntu-24.04", "image: debian-12"))
    assert report.updated == ["machine type cx23"]
    assert MachineType.objects.get(name="cx23").version == 2


def test_command_reports_errors_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("machine_types:\n  - name: x\n")
    with pytest.raises(CommandError, match=r"bad.yaml:2: machine type is missing"):
        call_command("apply", str(path))


def test_budgets_in_the_catalog_are_idempotent_and_bad_ones_name_their_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from apps.events.models import Event
    from apps.machines.models import Budget

    monkeypatch.setenv("TEST_HCLOUD_TOKEN", "t")
    doc = (
        GOOD + "    budgets:\n      - {amount: 100}\n      - {amount: 20, period: day, machine_type: cx23}\n"
    )
    apply_offline(doc)
    assert sorted((str(b.amount), b.period, b.machine_type_id is not None) for b in Budget.objects.all()) == [
        ("100.00", "month", False),
        ("20.00", "day", True),
    ]
    events = Event.objects.filter(kind__startswith="budget.").count()
    apply_offline(doc)  # re-applying changes nothing: no event, thresholds not announced again
    assert Event.objects.filter(kind__startswith="budget.").count() == events
    with pytest.raises(CatalogError) as bad:
        apply_offline(GOOD + "    budgets:\n      - {amount: -5}\n")
    assert bad.value.line == 22
    assert Budget.objects.get(period="month").amount == 100  # a bad file changes nothing


def test_a_restart_marks_the_local_machines_that_died_with_the_last_run_lost_at_once(
    world: World, settings: Any, tmp_path: Path
) -> None:
    """After Ctrl-C and `make dev` again, ready rows whose agent processes are gone became lost
    only at a heartbeat deadline: the first job went to one and waited for it."""
    from testkit.builders import ready_instance

    settings.CATACLOUD_HOME = str(tmp_path)
    call_command("apply", str(DEMO_CATALOG), stdout=StringIO())
    ghost = ready_instance(world.machine_type, org=world.org, provider_id="gone")
    ghost.save()
    err = StringIO()

    call_command("dev_bootstrap", stdout=StringIO(), stderr=err)

    ghost.refresh_from_db()
    assert ghost.status == "lost"
    assert "1 local machine(s) of the previous run are gone" in err.getvalue()


# ---- the machine types against what the provider sells ------------------------------------------


@pytest.fixture
def at_fake(fake_hetzner: FakeHetzner, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], str]:
    """GOOD-like catalogs whose account talks to the fake Hetzner API (the real hcloud client)."""
    fake_hetzner.reset()
    monkeypatch.setenv("TEST_HCLOUD_TOKEN", HETZNER_TOKEN)
    endpoint = (
        f"config: {{location: fsn1, api_endpoint: '{fake_hetzner.url}', retry_attempts: 0, timeout: 5}}"
    )
    return lambda text: text.replace("config: {location: fsn1}", endpoint)


def test_a_catalog_naming_what_hetzner_does_not_sell_is_refused_naming_each_and_changes_nothing(
    at_fake: Callable[[str], str], fake_hetzner: FakeHetzner
) -> None:
    """Given cx22 (gone at the end of 2025) and cx23 at ash (it is sold in the EU only), when the
    catalog is applied, then it is refused naming both with their lines, and nothing is written;
    Hetzner was asked once for each list."""
    second = (
        "  - name: us\n    provider_account: hz\n    server_type: cx23\n    location: ash\n"
        "    image: ubuntu-24.04\n    cpus: 2\n    memory_mb: 4096\n"
    )
    text = at_fake(GOOD.replace("server_type: cx23", "server_type: cx22")).replace(
        "organizations:", second + "organizations:"
    )
    with pytest.raises(CatalogError) as refused:
        apply_catalog(text)
    message = str(refused.value)
    assert "line 8, machine type cx23 (account hz): hetzner: no server type 'cx22' is sold" in message
    assert "line 15, machine type us (account hz): hetzner: server type cx23 is not sold at ash" in message
    assert refused.value.line == 8 and "nothing applied" in message
    assert not ProviderAccount.objects.exists() and not MachineType.objects.exists()
    assert [fake_hetzner.count("GET", p) for p in ("/server_types", "/images", "/locations")] == [1, 1, 1]


def test_a_catalog_of_what_hetzner_sells_applies_and_a_deprecated_type_is_a_warning(
    at_fake: Callable[[str], str], fake_hetzner: FakeHetzner, tmp_path: Path, settings: Any
) -> None:
    (tmp_path / "catacloud_agent-0.1.0-py3-none-any.whl").write_bytes(b"a wheel")
    settings.CATACLOUD_AGENT_WHEEL = ""
    assert (
        "serves no agent wheel (CATACLOUD_AGENT_WHEEL)"
        in apply_catalog(at_fake(GOOD), dry_run=True).warnings[0]
    )
    settings.CATACLOUD_AGENT_WHEEL = str(tmp_path)  # what the image sets
    report = apply_catalog(at_fake(GOOD))
    assert report.created and report.warnings == [] and MachineType.objects.get(name="cx23").version == 1

    fake_hetzner.deprecate("cx23", location="fsn1", unavailable_after=datetime.now(UTC) + timedelta(days=30))
    out, err = StringIO(), StringIO()
    path = tmp_path / "catalog.yaml"
    path.write_text(at_fake(GOOD))
    call_command("apply", str(path), stdout=out, stderr=err)
    assert "0 created, 0 updated, 3 unchanged" in out.getvalue()
    assert "! line 8, machine type cx23 (account hz): hetzner: server type cx23 is deprecated at fsn1" in (
        err.getvalue()
    )


def test_a_provider_that_cannot_be_asked_refuses_the_catalog_unless_told_not_to_check(
    at_fake: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TEST_HCLOUD_TOKEN", "a-revoked-token")
    path = tmp_path / "catalog.yaml"
    path.write_text(at_fake(GOOD))
    refused = r"could not check .* \(account hz: hetzner: unable to authenticate"
    with pytest.raises(CommandError, match=refused):
        call_command("apply", str(path), stdout=StringIO())
    assert not ProviderAccount.objects.exists()
    call_command("apply", str(path), "--no-check", stdout=StringIO())
    assert MachineType.objects.filter(name="cx23").exists()
