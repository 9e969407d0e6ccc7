"""A PostgreSQL restore never leaks a paid machine. A backup is older than the cloud: after a
restore, machines exist at the provider that the restored rows do not know (bought after the
backup), or know in an earlier state (still ``pending``, mid-provisioning, alive though deleted
since). Convergence (the reconciler, the re-drive of provisioning) must adopt each labelled
machine into exactly one live row or destroy it; none may stay without an owner.

The clouds are the fake Hetzner API (real hcloud client) and moto's EC2 server (real boto3).
The restore is what ``pg_restore`` does to the machines table: every row back to its state at
the backup, rows created since gone."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import requests
from django.utils import timezone

from apps.core.repairs import InlineRepairs
from apps.machines import convergence, lifecycle, reconcile
from apps.machines.choices import INSTANCE_LIVE, InstanceStatus
from apps.machines.models import MachineInstance, MachineType
from apps.machines.services import INSTANCE_STATES
from catacloud.providers import LABEL_INSTANCE
from testkit.servers import moto_client
from tests.conftest import World
from tests.fakes.hetzner_api import FakeHetzner
from tests.machines.test_lifecycle import aws, destroy, hetzner, moto_url, provision  # noqa: F401

pytestmark = pytest.mark.django_db
S = InstanceStatus


def _backup() -> list[dict[str, Any]]:
    return list(MachineInstance.objects.values())


def _restore(backup: list[dict[str, Any]]) -> None:
    """The machines table as the backup has it: rows made since are gone, the others go back."""
    MachineInstance.objects.all().delete()
    MachineInstance.objects.bulk_create([MachineInstance(**row) for row in backup])


def _converge(machine_type: MachineType, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the reaper does over a few ticks, with the tasks the reconciler sends run inline:
    the reconciler, then the re-drive of provisioning and termination (their deadlines passed),
    which the tick runs itself."""

    def run_inline(task: Any, *args: Any) -> bool:
        name = task if isinstance(task, str) else task.name
        if name == lifecycle.PROVISION_TASK:
            provision(args[0])
        elif name == lifecycle.TERMINATE_TASK:
            destroy(args[0])
        return True

    monkeypatch.setattr(reconcile, "enqueue", run_inline)
    later = timezone.now() + timedelta(hours=1)
    for _ in range(2):
        reconcile.reconcile_account(account=machine_type.provider_account, grace_seconds=0)
        convergence.redrive_provisioning(now=later, repairs=InlineRepairs())
        convergence.redrive_terminating(now=later, repairs=InlineRepairs())


def _scenario(
    world: World,
    machine_type: MachineType,
    monkeypatch: pytest.MonkeyPatch,
    machines: Callable[[], dict[str, str]],
    buy_again: Callable[[MachineInstance], None],
) -> dict[str, MachineInstance]:
    """``machines()``: the cloud's labelled machines, provider id → instance label;
    ``buy_again(row)``: a second machine carrying ``row``'s labels, as a create re-driven after
    the cloud forgot the first one's idempotency key (the name on Hetzner, EC2's client token
    after its window) would make."""
    rows = {name: lifecycle.instance_request(org=world.org, machine_type=machine_type) for name in "abcd"}
    provision(rows["a"].pk)  # a: running at the backup, running after it
    provision(rows["d"].pk)  # d: running at the backup, destroyed after it
    INSTANCE_STATES.move(rows["c"].pk, to=S.PROVISIONING, from_=[S.PENDING], actor="test")
    # b: still pending at the backup; c: its create under way
    backup = _backup()

    provision(rows["b"].pk)
    provision(rows["c"].pk)
    rows["e"] = lifecycle.instance_request(org=world.org, machine_type=machine_type)
    provision(rows["e"].pk)  # e: bought after the backup
    lifecycle.instance_terminate(instance_id=rows["d"].pk)
    destroy(rows["d"].pk)
    at_the_cloud = machines()
    assert len(at_the_cloud) == 4  # a, b, c, e

    _restore(backup)
    assert not MachineInstance.objects.filter(pk=rows["e"].pk).exists()
    # a: restored with its machine, which a second create for its row joins
    buy_again(rows["a"])
    _converge(machine_type, monkeypatch)

    after = machines()
    live = {
        row.provider_id: str(row.pk)
        for row in MachineInstance.objects.filter(provider_account=machine_type.provider_account)
        if row.status in INSTANCE_LIVE
    }
    # Every machine the cloud still runs belongs to the live row its label names: none leaked.
    leaked = {pid: label for pid, label in after.items() if live.get(pid) != label}
    assert not leaked, f"machines nobody owns after the restore: {leaked} (live rows: {live})"
    # One machine a row: no row was given a second machine.
    assert len(set(after.values())) == len(after)
    for row in rows.values():
        if MachineInstance.objects.filter(pk=row.pk).exists():
            row.refresh_from_db()
    return rows


def test_after_a_restore_hetzner_servers_are_adopted_or_destroyed_never_leaked(
    world: World,
    hetzner: MachineType,  # noqa: F811
    fake_hetzner: FakeHetzner,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def machines() -> dict[str, str]:
        return {str(sid): s["labels"].get(LABEL_INSTANCE, "") for sid, s in fake_hetzner.servers.items()}

    def buy_again(row: MachineInstance) -> None:
        fake_hetzner.add_server(f"cc-{row.pk}-again", labels=lifecycle.machine_spec(row).labels)

    rows = _scenario(world, hetzner, monkeypatch, machines, buy_again)
    kept = {label for label in machines().values()}
    # a: its row owns it; b (pending) and c (mid-create): adopted; e (bought after): destroyed
    assert kept == {str(rows[n].pk) for n in "abc"}
    assert {rows[n].status for n in "abc"} == {S.WARMING}
    assert rows["d"].status == S.LOST  # its machine went after the backup: the row ends


def test_after_a_restore_ec2_instances_are_adopted_or_destroyed_never_leaked(
    world: World,
    aws: MachineType,  # noqa: F811
    moto_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    requests.post(f"{moto_url}/moto-api/reset", timeout=10)  # other tests' machines are not ours
    ec2 = moto_client("ec2", moto_url, "eu-central-1")

    def machines() -> dict[str, str]:
        found = {}
        pages = ec2.get_paginator("describe_instances").paginate(  # moto keeps other tests' machines
            Filters=[{"Name": "tag-key", "Values": [LABEL_INSTANCE]}]
        )
        for reservation in (r for page in pages for r in page["Reservations"]):
            for inst in reservation["Instances"]:
                if inst["State"]["Name"] in ("terminated", "shutting-down"):
                    continue
                tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
                if LABEL_INSTANCE in tags:
                    found[inst["InstanceId"]] = tags[LABEL_INSTANCE]
        return found

    def buy_again(row: MachineInstance) -> None:
        tags = [{"Key": k, "Value": v} for k, v in lifecycle.machine_spec(row).labels.items()]
        ec2.run_instances(
            ImageId=aws.image,
            InstanceType=aws.server_type,
            MinCount=1,
            MaxCount=1,
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
        )

    rows = _scenario(world, aws, monkeypatch, machines, buy_again)
    assert set(machines().values()) == {str(rows[n].pk) for n in "abc"}
    assert rows["d"].status == S.LOST
