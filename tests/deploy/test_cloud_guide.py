"""The deployment guide's cloud steps, against the fake Hetzner API (the real hcloud client):
its catalog applies as shipped (checked against Hetzner's lists), a machine it buys is a
labelled server whose user data installs the agent from the control plane, and each refusal the
guide's table lists ends the machine with the ``failure_reason`` it names. The AWS catalog is
checked against moto's EC2: as shipped its placeholder AMI is refused, with a real one it applies."""

from __future__ import annotations

import re
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from apps.machines import lifecycle
from apps.machines.models import MachineType, ProviderAccount
from apps.machines.tasks import provision_instance_task
from apps.orgs.models import Membership
from catacloud.providers import LABEL_INSTALLATION, LABEL_INSTANCE, LABEL_POOL
from testkit.servers import moto_client, moto_server
from tests.conftest import HETZNER_TOKEN
from tests.fakes.hetzner_api import FakeHetzner
from tests.machines.test_lifecycle import serve_an_agent_wheel

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]
CATALOGS = ROOT / "deploy" / "catalog"
GUIDE = ROOT / "docs" / "operator" / "deployment.md"


def _pointed(catalog: str, at: str, tmp_path: Path) -> Path:
    """The shipped catalog with its one account's config pointed at a fake (one line added)."""
    text = (CATALOGS / catalog).read_text()
    assert text.count("    config:\n") == 1
    copy = tmp_path / catalog
    copy.write_text(text.replace("    config:\n", f"    config:\n{at}\n"))
    return copy


@pytest.fixture
def hetzner(
    fake_hetzner: FakeHetzner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, settings: Any
) -> MachineType:
    """deploy/catalog/hetzner.yaml as an operator applies it (and apply checks it), its account
    pointed at the fake; the control plane serves an agent wheel, as the image's does."""
    serve_an_agent_wheel(settings, tmp_path)
    fake_hetzner.reset()
    monkeypatch.setenv("HCLOUD_TOKEN", HETZNER_TOKEN)
    at = f"      api_endpoint: '{fake_hetzner.url}'"
    call_command("apply", str(_pointed("hetzner.yaml", at, tmp_path)), verbosity=0, stderr=StringIO())
    assert fake_hetzner.count("GET", "/server_types") == 1  # apply asked Hetzner
    account = ProviderAccount.objects.get(name="hetzner")
    account.config = {**account.config, "poll_interval": 0.001, "timeout": 2}
    account.config |= {"retry_backoff": 0.001, "retry_max_delay": 0.01, "retry_attempts": 1}
    account.save()
    return MachineType.objects.get(name="hz-cx23")


def test_the_aws_catalog_is_checked_against_ec2_its_placeholder_ami_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As shipped the catalog names a placeholder AMI: apply refuses it, naming it, until the
    operator puts in one of the region's (here, one of moto's)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    with moto_server() as url:
        catalog = _pointed("aws.yaml", f"      endpoint_url: '{url}'", tmp_path)
        with pytest.raises(CommandError) as refused:
            call_command("apply", str(catalog), verbosity=0)
        assert "machine type aws-m7i-large (account aws): aws: no image 'ami-0123456789abcdef0'" in str(
            refused.value
        )
        assert not MachineType.objects.exists()
        ami = moto_client("ec2", url, "eu-central-1").describe_images(Owners=["amazon"])["Images"][0]
        assert ami["Architecture"] == "x86_64"
        catalog.write_text(catalog.read_text().replace("ami-0123456789abcdef0", ami["ImageId"]))
        call_command("apply", str(catalog), verbosity=0, stderr=StringIO())
    spot = MachineType.objects.get(name="aws-m7i-large-spot")
    assert spot.spot and spot.billing_increment_seconds == 1 and spot.min_billed_seconds == 60
    assert ProviderAccount.objects.get(name="aws").credentials["access_key_id"] == "AKIAEXAMPLE"


def test_a_machine_of_the_catalog_is_a_labelled_server_that_installs_the_agent_from_the_control_plane(
    hetzner: MachineType,
    fake_hetzner: FakeHetzner,
    settings: object,
    tmp_path: Path,
) -> None:
    wheel = tmp_path / "catacloud_agent-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"a wheel")
    settings.CATACLOUD_AGENT_WHEEL = str(tmp_path)  # type: ignore[attr-defined]  # what the image sets
    settings.CATACLOUD_AGENT_URL = "https://catacloud.example.com"  # type: ignore[attr-defined]
    member = lifecycle.instance_request(org=hetzner.grants.get().org, machine_type=hetzner)
    provision_instance_task(str(member.pk))

    member.refresh_from_db()
    assert member.status == "warming" and member.provider_id
    server = fake_hetzner.servers[int(member.provider_id)]
    assert server["name"] == f"cc-{member.pk}" and server["server_type"]["name"] == "cx23"
    assert server["labels"][LABEL_INSTANCE] == str(member.pk) and server["labels"][LABEL_POOL] == "none"
    assert server["labels"][LABEL_INSTALLATION] == lifecycle.owner_labels()[LABEL_INSTALLATION]
    user_data = fake_hetzner.user_data[int(member.provider_id)]
    assert re.search(
        r"https://catacloud\.example\.com/api/agent/v1/dist/catacloud_agent-0\.1\.0-py3-none-any\.whl#sha256=[0-9a-f]{64}",
        user_data,
    ), user_data


def test_without_a_served_agent_wheel_the_machine_fails_saying_so_and_nothing_is_bought(
    hetzner: MachineType, fake_hetzner: FakeHetzner, settings: Any
) -> None:
    settings.CATACLOUD_AGENT_WHEEL = ""
    instance = lifecycle.instance_request(org=hetzner.grants.get().org, machine_type=hetzner)
    provision_instance_task(str(instance.pk))
    instance.refresh_from_db()
    assert instance.status == "failed" and instance.failure_reason.startswith("permanent:")
    assert "CATACLOUD_AGENT_WHEEL" in instance.failure_reason, instance.failure_reason
    assert fake_hetzner.servers == {} and fake_hetzner.count("POST", "/servers") == 0


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("resource_limit_exceeded", "quota_exceeded:"), ("unauthorized", "permanent:")],
)
def test_a_refusing_cloud_fails_the_machine_with_the_reason_the_guide_names(
    hetzner: MachineType, fake_hetzner: FakeHetzner, fault: str, reason: str
) -> None:
    assert f"`{reason}" in GUIDE.read_text()
    instance = lifecycle.instance_request(org=hetzner.grants.get().org, machine_type=hetzner)
    fake_hetzner.fail_next("POST /servers", fault, times=5)
    provision_instance_task(str(instance.pk))
    instance.refresh_from_db()
    hetzner.refresh_from_db()
    assert instance.status == "failed" and instance.failure_reason.startswith(reason), instance.failure_reason
    assert fake_hetzner.servers == {}  # nothing bought, nothing to leak
    # every machine of the type would be refused: it cools down, not bought again every tick
    assert hetzner.capacity_cooling_until is not None and hetzner.capacity_error.startswith(reason)
    assert fake_hetzner.pending_faults() == 4  # asked once, not again


def test_no_capacity_fails_the_machine_and_cools_its_type_down(
    hetzner: MachineType, fake_hetzner: FakeHetzner
) -> None:
    """What the guide's table says of ``insufficient_capacity:``: no retry of the same create."""
    assert "`insufficient_capacity:` | Hetzner `resource_unavailable`" in GUIDE.read_text()
    instance = lifecycle.instance_request(org=hetzner.grants.get().org, machine_type=hetzner)
    fake_hetzner.fail_next("POST /servers", "resource_unavailable", times=5)
    provision_instance_task.apply(args=[str(instance.pk)], throw=True)
    instance.refresh_from_db()
    hetzner.refresh_from_db()
    assert instance.status == "failed" and instance.failure_reason.startswith("insufficient_capacity:")
    assert hetzner.capacity_cooling_until is not None
    assert fake_hetzner.pending_faults() == 4  # asked once, not again


# ---- the first admin, the machines' egress and prerequisites, backups ---------------------------


def test_the_first_admin_is_ops_the_consoles_superuser_and_the_catalogs_org_admin(
    fake_hetzner: FakeHetzner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The guide's one path: createsuperuser --username ops, then the catalog (whose platform
    org names ops as admin) finds that user, then create_api_token for ops acts as the admin."""
    guide = GUIDE.read_text()
    assert "manage.py createsuperuser --username ops" in guide
    assert "manage.py create_api_token --org platform --user ops" in guide
    for catalog in ("hetzner.yaml", "aws.yaml"):
        assert "- slug: platform" in (CATALOGS / catalog).read_text()
        assert "{username: ops, role: admin}" in (CATALOGS / catalog).read_text()

    monkeypatch.setenv("DJANGO_SUPERUSER_PASSWORD", "a-long-enough-password-42")
    call_command("createsuperuser", "--username", "ops", "--email", "ops@example.com", "--noinput")
    fake_hetzner.reset()
    monkeypatch.setenv("HCLOUD_TOKEN", HETZNER_TOKEN)
    at = f"      api_endpoint: '{fake_hetzner.url}'"
    call_command("apply", str(_pointed("hetzner.yaml", at, tmp_path)), verbosity=0, stderr=StringIO())

    ops = get_user_model().objects.get(username="ops")
    assert ops.is_superuser and ops.is_staff and get_user_model().objects.count() == 1
    assert Membership.objects.get(org__slug="platform", user=ops).role == "admin"
    out = StringIO()
    call_command("create_api_token", "--org", "platform", "--user", "ops", "--name", "first-pool", stdout=out)
    answer = Client().get("/api/v1/machine-types/", HTTP_AUTHORIZATION=f"Bearer {out.getvalue().strip()}")
    assert answer.status_code == 200 and [t["name"] for t in answer.json()["results"]] == ["hz-cx23"]


def test_the_guide_lists_what_user_data_installs_and_the_egress_that_needs() -> None:
    """Every package user data installs is an image prerequisite in the guide, and the egress
    table has apt's port 80 (Ubuntu's EC2 mirrors are plain HTTP) besides 443."""
    from catacloud.providers.userdata import render_user_data

    document = yaml.safe_load(render_user_data(agent_url="https://cc.example", bootstrap_token="t" * 20))
    guide = GUIDE.read_text()
    prerequisites = guide[guide.index("**Image prerequisites**") :].split("\n\n")[0]
    assert document["packages"] and all(f"`{p}`" in prerequisites for p in document["packages"])
    egress = guide[guide.index("**What machines reach (egress).**") :].split("## 2.")[0]
    assert "| TCP 80 |" in egress and "| TCP 443 |" in egress and "ec2.archive.ubuntu.com" in egress
    assert "80" in (CATALOGS / "aws.yaml").read_text().split("security_group_ids")[1].splitlines()[0]


def test_backups_keep_the_three_secrets_and_say_what_prunes_events_and_heartbeats() -> None:
    operations = (ROOT / "docs" / "operator" / "operations.md").read_text()
    backups = operations[operations.index("## Backups and restore") :].split("\n## ")[0]
    for secret in ("encryption_key", "bootstrap_keys", "django_secret_key"):
        assert f"`secrets/{secret}`" in backups
    assert "Nothing prunes the events table (`events_event`)" in backups and "`core_heartbeat`" in backups
    # ... and it stays true: no product code deletes events.
    sources = "\n".join(path.read_text() for path in (ROOT / "apps").rglob("*.py"))
    assert not re.search(r"Event\.objects[^\n]*\.delete\(", sources)
