"""The machine life cycle against clouds that are real enough: the fake Hetzner API driven by
the real hcloud client, and moto's EC2 server driven by the real boto3. Services and task
bodies are called directly (crash points are simulated between them)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from apps.events.models import Event
from apps.machines import lifecycle
from apps.machines.choices import INSTANCE_LIVE, InstanceStatus
from apps.machines.models import MachineInstance, MachineType
from apps.machines.reconcile import reconcile_account
from apps.machines.services import INSTANCE_STATES
from catacloud.providers import LABEL_INSTALLATION, LABEL_INSTANCE, ProviderError
from testkit.builders import granted_type, provider_account
from testkit.servers import moto_client, moto_server
from tests.conftest import HETZNER_TOKEN, World
from tests.fakes.hetzner_api import FakeHetzner

pytestmark = pytest.mark.django_db
S = InstanceStatus


def serve_an_agent_wheel(settings: Any, folder: Path) -> None:
    """What the image sets (CATACLOUD_AGENT_WHEEL): a cloud machine installs its agent only from
    the wheel its control plane serves, and none is made without one."""
    (folder / "catacloud_agent-0.1.0-py3-none-any.whl").write_bytes(b"an agent wheel")
    settings.CATACLOUD_AGENT_WHEEL = str(folder)


@pytest.fixture
def hetzner(world: World, fake_hetzner: FakeHetzner, settings: Any, tmp_path: Path) -> MachineType:
    serve_an_agent_wheel(settings, tmp_path)
    fake_hetzner.reset()
    config = {
        "api_endpoint": fake_hetzner.url,
        "location": "fsn1",
        "poll_interval": 0.001,
        "retry_backoff": 0.001,
        "retry_max_delay": 0.01,
        "retry_attempts": 2,
        "timeout": 2,
    }
    account = provider_account("hetzner", "hz", config, credentials={"token": HETZNER_TOKEN})
    return granted_type(
        world.org,
        account,
        "cx23",
        server_type="cx23",
        image="ubuntu-24.04",
        location="fsn1",
        memory_mb=4096,
        price_per_hour=Decimal("0.006"),
        grant={"max_instances": 1000},
    )[0]


def provision(instance_id: Any, attempts: int = 6) -> None:
    """What provision_instance_task does, with Celery's retries played inline."""
    for _ in range(attempts):
        try:
            lifecycle.instance_provision(instance_id=instance_id)
            return
        except ProviderError as exc:
            if not exc.retryable:
                lifecycle.instance_fail(instance_id=instance_id, reason=exc.code)
                return
    lifecycle.instance_fail(instance_id=instance_id, reason="gave up")


def destroy(instance_id: Any, attempts: int = 6) -> None:
    for _ in range(attempts):
        try:
            lifecycle.instance_destroy(instance_id=instance_id)
            return
        except ProviderError:
            continue


def test_provision_creates_a_labelled_server_and_the_instance_warms(
    world: World, hetzner: MachineType, fake_hetzner: FakeHetzner
) -> None:
    instance = lifecycle.instance_request(org=world.org, machine_type=hetzner, actor="test")
    assert instance.status == S.PENDING
    provision(instance.pk)
    instance.refresh_from_db()
    assert instance.status == S.WARMING and instance.provider_id
    (server,) = fake_hetzner.servers.values()
    assert server["name"] == f"cc-{instance.pk}"
    assert server["labels"][LABEL_INSTANCE] == str(instance.pk)
    assert server["labels"][LABEL_INSTALLATION] == lifecycle.owner_labels()[LABEL_INSTALLATION]
    user_data = fake_hetzner.user_data[int(instance.provider_id)]
    assert lifecycle.bootstrap_token_for(instance.pk) in user_data
    assert HETZNER_TOKEN not in user_data
    # Running the task again (redelivery) changes nothing and creates nothing.
    provision(instance.pk)
    assert len(fake_hetzner.servers) == 1


def test_a_worker_builds_machines_from_the_account_config_however_it_was_changed(
    world: World, tmp_path: Any
) -> None:
    """A worker keeps one driver per account; a change to the account's config (a mount added
    to show a runner folder in every machine) reaches the next machine it starts, also when the
    change was saved without touching ``updated_at`` (``update_fields``, a queryset update)."""
    from apps.machines.models import ProviderAccount

    def driver() -> Any:  # what a worker builds machines with: the account as stored now
        return lifecycle.provider_for(ProviderAccount.objects.get(pk=world.account.pk))

    assert driver().mounts == []
    account = ProviderAccount.objects.get(pk=world.account.pk)
    account.config["mounts"] = [{"source": str(tmp_path), "target": "/opt/actions-runner"}]
    account.save(update_fields=["config"])
    assert [m.target for m in driver().mounts] == ["/opt/actions-runner"]
    ProviderAccount.objects.filter(pk=account.pk).update(config={**account.config, "mounts": []})
    assert driver().mounts == []


def test_worker_killed_after_create_before_record_is_adopted(
    world: World, hetzner: MachineType, fake_hetzner: FakeHetzner
) -> None:
    instance = lifecycle.instance_request(org=world.org, machine_type=hetzner)
    INSTANCE_STATES.move(instance.pk, to=S.PROVISIONING)
    instance.refresh_from_db()
    # The worker created the server, then died before recording its id.
    lifecycle.provider_for(instance.provider_account).create(lifecycle.machine_spec(instance))
    report = reconcile_account(account=instance.provider_account, grace_seconds=0)
    assert report.adopted == [str(instance.pk)]
    instance.refresh_from_db()
    assert instance.status == S.WARMING
    assert instance.provider_id == str(next(iter(fake_hetzner.servers)))
    assert Event.objects.filter(kind="reconcile.adopted", instance_id=instance.pk).exists()
    # A second pass finds nothing to do: nothing is unowned.
    assert reconcile_account(account=instance.provider_account, grace_seconds=0).actions == 0


def test_dropped_create_response_retried_by_the_task_leaves_one_server(
    world: World, hetzner: MachineType, fake_hetzner: FakeHetzner
) -> None:
    instance = lifecycle.instance_request(org=world.org, machine_type=hetzner)
    fake_hetzner.fail_next("POST /servers", "drop_after")  # created, then the response is lost
    provision(instance.pk)
    instance.refresh_from_db()
    assert instance.status == S.WARMING
    assert len(fake_hetzner.servers) == 1
    assert fake_hetzner.servers[int(instance.provider_id)]["name"] == f"cc-{instance.pk}"


def test_provisioning_never_created_is_failed_by_the_reconciler(world: World, hetzner: MachineType) -> None:
    instance = lifecycle.instance_request(org=world.org, machine_type=hetzner)
    INSTANCE_STATES.move(instance.pk, to=S.PROVISIONING)
    report = reconcile_account(account=hetzner.provider_account, grace_seconds=0)
    assert report.not_created == [str(instance.pk)]
    instance.refresh_from_db()
    assert instance.status == S.FAILED


def test_orphans_are_deleted_and_vanished_machines_make_rows_lost(
    world: World, hetzner: MachineType, fake_hetzner: FakeHetzner
) -> None:
    keep = lifecycle.instance_request(org=world.org, machine_type=hetzner)
    gone = lifecycle.instance_request(org=world.org, machine_type=hetzner)
    provision(keep.pk)
    provision(gone.pk)
    gone.refresh_from_db()
    # Behind our back: someone deletes one server and a labelled server with no row appears.
    del fake_hetzner.servers[int(gone.provider_id)]
    orphan_labels = {**lifecycle.owner_labels(), LABEL_INSTANCE: "7a3f7c2e-0000-4000-8000-000000000000"}
    fake_hetzner.add_server("cc-orphan", labels=orphan_labels)
    foreign = fake_hetzner.add_server("not-ours", labels={LABEL_INSTALLATION: "someone-else"})

    report = reconcile_account(account=hetzner.provider_account, grace_seconds=0)
    assert report.lost == [str(gone.pk)]
    assert len(report.orphans_deleted) == 1
    gone.refresh_from_db()
    assert gone.status == S.LOST and gone.ended_at is not None
    keep.refresh_from_db()
    assert keep.status == S.WARMING
    assert set(fake_hetzner.servers) == {
        int(keep.provider_id),
        foreign,
    }  # another installation's is untouched


def test_two_accounts_seeing_one_project_never_delete_each_others_machines(
    world: World, hetzner: MachineType, fake_hetzner: FakeHetzner
) -> None:
    """Two accounts with one Hetzner project's token (one per location, say) list the same
    servers: each account's reconciler leaves the other's machines alone, still deletes its own
    orphans, and still finds its own vanished machines."""
    account = hetzner.provider_account
    nbg = provider_account(
        "hetzner", "hz-nbg", {**account.config, "location": "nbg1"}, credentials={"token": HETZNER_TOKEN}
    )
    other = granted_type(
        world.org,
        nbg,
        "cx23-nbg",
        server_type="cx23",
        image="ubuntu-24.04",
        location="nbg1",
        grant={"max_instances": 10},
    )[0]
    mine = lifecycle.instance_request(org=world.org, machine_type=hetzner)
    theirs = lifecycle.instance_request(org=world.org, machine_type=other)
    provision(mine.pk)
    provision(theirs.pk)
    mine.refresh_from_db()
    theirs.refresh_from_db()
    orphan = {**lifecycle.owner_labels(), LABEL_INSTANCE: "7a3f7c2e-0000-4000-8000-000000000001"}
    fake_hetzner.add_server("cc-orphan", labels=orphan)

    for acc in (account, nbg, account):
        report = reconcile_account(account=acc, grace_seconds=0)
        assert report.lost == []
    assert set(fake_hetzner.servers) == {int(mine.provider_id), int(theirs.provider_id)}
    for row in (mine, theirs):
        row.refresh_from_db()
        assert row.status == S.WARMING  # neither was deleted as the other's orphan
    del fake_hetzner.servers[int(theirs.provider_id)]
    assert reconcile_account(account=account, grace_seconds=0).lost == []
    assert reconcile_account(account=nbg, grace_seconds=0).lost == [str(theirs.pk)]


def test_terminate_deletes_the_server_and_records_the_bill(
    world: World, hetzner: MachineType, fake_hetzner: FakeHetzner
) -> None:
    instance = lifecycle.instance_request(org=world.org, machine_type=hetzner)
    provision(instance.pk)
    lifecycle.instance_terminate(instance_id=instance.pk, actor="test")
    destroy(instance.pk)
    destroy(instance.pk)  # twice: idempotent
    instance.refresh_from_db()
    assert instance.status == S.TERMINATED
    assert fake_hetzner.servers == {}
    assert instance.billed_seconds == 3600 and instance.cost == Decimal("0.006")


def test_a_machine_created_for_a_row_that_ended_meanwhile_is_deleted(
    world: World, hetzner: MachineType, fake_hetzner: FakeHetzner, monkeypatch: pytest.MonkeyPatch
) -> None:
    instance = lifecycle.instance_request(org=world.org, machine_type=hetzner)
    provider = lifecycle.provider_for(instance.provider_account)
    real_create = provider.create

    def create_while_terminated(spec):
        machine = real_create(spec)
        lifecycle.instance_terminate(instance_id=instance.pk, actor="impatient user")
        return machine

    monkeypatch.setattr(provider, "create", create_while_terminated)
    provision(instance.pk)
    assert fake_hetzner.servers == {}


def _soak(world: World, mt: MachineType, inject: Any, clear: Any, cloud_ids: Any, seed: int) -> None:
    """250 creates and 250 deletes through the real services under random faults; then one
    reconcile pass leaves exactly the live rows' machines at the provider."""
    rng = random.Random(seed)
    live: list[Any] = []
    for _ in range(500):
        inject(rng)
        if live and (rng.random() < 0.5 or len(live) > 40):
            instance_id = live.pop(rng.randrange(len(live)))
            try:
                lifecycle.instance_terminate(instance_id=instance_id, actor="soak")
            except Exception:
                continue
            if rng.random() < 0.8:  # sometimes the terminate task never runs (worker died)
                destroy(instance_id, attempts=1)
        else:
            instance = lifecycle.instance_request(org=world.org, machine_type=mt, actor="soak")
            provision(instance.pk, attempts=2)
            live.append(instance.pk)
    clear()
    MachineInstance.objects.update(created_at=timezone.now() - timezone.timedelta(hours=1))
    reconcile_account(account=mt.provider_account, grace_seconds=0)
    for row in MachineInstance.objects.filter(status=S.TERMINATING):
        destroy(row.pk)  # the re-enqueued terminations, run
    rows = set(
        MachineInstance.objects.filter(status__in=INSTANCE_LIVE)
        .exclude(provider_id="")
        .values_list("provider_id", flat=True)
    )
    assert not MachineInstance.objects.filter(status__in=INSTANCE_LIVE, provider_id="").exists()
    assert cloud_ids() == rows
    assert MachineInstance.objects.filter(status=S.TERMINATED).count() > 100


HETZNER_FAULTS = [
    ("POST /servers", "rate_limit"),
    ("POST /servers", "bad_gateway"),
    ("POST /servers", "drop_after"),
    ("POST /servers", "drop_before"),
    ("POST /servers", "resource_unavailable"),
    ("GET /actions/{id}", "bad_gateway"),
    ("DELETE /servers/{id}", "bad_gateway"),
    ("DELETE /servers/{id}", "gateway_timeout"),
    ("GET /servers", "rate_limit"),
]


def test_soak_hetzner_500_cycles_with_faults(
    world: World, hetzner: MachineType, fake_hetzner: FakeHetzner
) -> None:
    def inject(rng: random.Random) -> None:
        if rng.random() < 0.3:
            endpoint, kind = rng.choice(HETZNER_FAULTS)
            fake_hetzner.fail_next(endpoint, kind, times=rng.randint(1, 3))

    _soak(
        world, hetzner, inject, fake_hetzner.clear_faults, lambda: {str(i) for i in fake_hetzner.servers}, 4
    )
    assert fake_hetzner.pending_faults() == 0


# ---- AWS (moto) -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    with moto_server() as url:
        yield url


@pytest.fixture
def aws(world: World, moto_url: str, settings: Any, tmp_path: Path) -> MachineType:
    serve_an_agent_wheel(settings, tmp_path)
    ec2 = moto_client("ec2", moto_url, "eu-central-1")
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    account = provider_account(
        "aws",
        "aws",
        {"region": "eu-central-1", "endpoint_url": moto_url},
        credentials={"access_key_id": "test", "secret_access_key": "test"},
    )
    return granted_type(
        world.org,
        account,
        "t3",
        server_type="t3.micro",
        image=ami,
        memory_mb=1024,
        billing_increment_seconds=1,
        min_billed_seconds=60,
        price_per_hour=Decimal("0.0104"),
        grant={"max_instances": 1000},
    )[0]


def test_aws_lifecycle_tags_adopt_and_terminate(world: World, aws: MachineType, moto_url: str) -> None:
    ec2 = moto_client("ec2", moto_url, "eu-central-1")
    instance = lifecycle.instance_request(org=world.org, machine_type=aws)
    provision(instance.pk)
    instance.refresh_from_db()
    assert instance.status == S.WARMING and instance.provider_id.startswith("i-")
    described = ec2.describe_instances(InstanceIds=[instance.provider_id])["Reservations"][0]["Instances"][0]
    tags = {t["Key"]: t["Value"] for t in described["Tags"]}
    assert tags[LABEL_INSTANCE] == str(instance.pk) and tags["Name"] == f"cc-{instance.pk}"
    lifecycle.instance_terminate(instance_id=instance.pk)
    destroy(instance.pk)
    instance.refresh_from_db()
    assert instance.status == S.TERMINATED
    state = ec2.describe_instances(InstanceIds=[instance.provider_id])["Reservations"][0]["Instances"][0][
        "State"
    ]
    assert state["Name"] in ("shutting-down", "terminated")
    assert instance.billed_seconds == 60  # EC2: per second with a 60 s minimum


def test_soak_aws_500_cycles_with_faults(
    world: World, aws: MachineType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faults are injected into boto3 calls at the client (moto never fails by itself)."""
    from botocore.exceptions import ClientError

    provider = lifecycle.provider_for(aws.provider_account)
    pending: list[tuple[str, str]] = []
    for name in ("create", "delete"):
        real = getattr(provider, name)

        def faulty(arg: Any, _real: Any = real, _name: str = name) -> Any:
            if pending and pending[0][0] == _name:
                _, code = pending.pop(0)
                if code == "lost_response" and _name == "create":
                    _real(arg)  # the cloud did it; we never heard back
                from catacloud.providers.aws import map_error

                raise map_error(ClientError({"Error": {"Code": code, "Message": "x"}}, _name))
            return _real(arg)

        monkeypatch.setattr(provider, name, faulty)

    codes = ["RequestLimitExceeded", "InsufficientInstanceCapacity", "InternalError", "lost_response"]

    def inject(rng: random.Random) -> None:
        if rng.random() < 0.3:
            pending.append((rng.choice(["create", "delete"]), rng.choice(codes)))

    def cloud_ids() -> set[str]:
        return {
            m.provider_id for m in lifecycle.provider_for(aws.provider_account).list(lifecycle.owner_labels())
        }

    _soak(world, aws, inject, pending.clear, cloud_ids, 7)
