"""The agent protocol: the server's answers and the agent's parsers agree on every field, a
field added on one side only fails here, and an agent one version behind still works."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from rest_framework.test import APIClient

from apps.jobs.models import Job
from apps.jobs.selectors import job_payload
from apps.machines.models import MachineInstance
from apps.machines.services import machine_type_update
from catacloud.agent.netns import Egress
from catacloud.agent.sandbox import BubblewrapLauncher, UidLauncher
from catacloud.protocol import (
    OLDEST_AGENT,
    VERSION,
    AgentError,
    Enroll,
    Finished,
    Isolation,
    JobPayload,
    Limits,
    MachineReport,
    Outcome,
)
from tests.conftest import World

pytestmark = pytest.mark.django_db

ENROLL = "/api/agent/v1/enroll"


def names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def assigned_job(world: World) -> Job:
    from testkit.builders import instance_row, job_config

    machine_type_update(
        machine_type=world.machine_type,
        actor="test",
        disk_gb=7,
        network={"allow": ["10.0.0.5:3128", "127.0.0.1:8765"]},
    )
    world.machine_type.refresh_from_db()
    config = job_config(world.org, world.machine_type, name="p", env={"A": "1"})
    instance = instance_row(world.org, world.machine_type, status="claimed")
    return Job.objects.create(
        org=world.org,
        config=config,
        machine_type=world.machine_type,
        command="echo hi",
        env={"B": "2"},
        status="assigned",
        instance=instance,
        timeout_seconds=30,
    )


def test_the_servers_job_payload_and_the_agents_parser_agree_on_every_field(world: World) -> None:
    payload = job_payload(assigned_job(world))
    parsed = JobPayload.from_json(payload)
    assert set(payload) == names(JobPayload)  # nothing the agent would drop, nothing it lacks
    assert parsed.to_json() == payload  # and every value survives the trip
    assert parsed.network.allow == ("10.0.0.5:3128", "127.0.0.1:8765")
    assert parsed.disk_limit_bytes == 7 * 10**9


def test_an_older_servers_payload_still_parses_with_defaults() -> None:
    """What a version-1 control plane sent: no network, no disk limit, no checkpoint."""
    job = JobPayload.from_json(
        {"id": "j", "command": "true", "env": {}, "timeout_seconds": 5, "attempt": 1, "resources": []}
    )
    assert job.network.allow == () and job.disk_limit_bytes is None and not job.checkpoint.available
    with pytest.raises(ValueError, match="command is missing"):
        JobPayload.from_json({"id": "j"})
    with pytest.raises(ValueError, match="timeout_seconds"):
        JobPayload.from_json({"id": "j", "command": "true", "timeout_seconds": "soon"})


def test_what_an_agent_reports_of_its_machine_is_kept_whole(world: World) -> None:
    """Every field of the machine report, set, reaches the instance: a field the agent sends
    and the server would drop fails here (the job network's fields once were)."""
    from apps.machines.bootstrap import token_for
    from testkit.builders import instance_row

    instance = instance_row(world.org, world.machine_type, status="provisioning")
    full = {
        f.name: ("x" if f.type in ("str", str) else 3 if "int" in str(f.type) else True)
        for cls in (Isolation, Limits)
        for f in dataclasses.fields(cls)
    }
    report = MachineReport(
        isolation=Isolation.from_json({k: v for k, v in full.items() if k in names(Isolation)}),
        limits=Limits.from_json({k: v for k, v in full.items() if k in names(Limits)}),
    )
    body = Enroll(bootstrap_token=token_for(instance.pk), protocol=VERSION, machine=report).to_json()
    answer = APIClient().post(ENROLL, body, format="json")
    assert answer.status_code == 200, answer.content
    kept = MachineInstance.objects.get(pk=instance.pk).isolation
    assert {k: v for k, v in kept.items() if k != "limits"} == report.isolation.to_json()
    assert kept["limits"] == report.limits.to_json()


def test_an_agent_one_version_behind_enrolls_and_one_too_old_is_told_to_upgrade(world: World) -> None:
    from apps.machines.bootstrap import token_for
    from testkit.builders import instance_row

    old = instance_row(world.org, world.machine_type, status="provisioning")
    body: dict[str, Any] = {"bootstrap_token": token_for(old.pk), "hostname": "h"}  # no version
    assert APIClient().post(ENROLL, body, format="json").status_code == 200
    ancient = instance_row(world.org, world.machine_type, status="provisioning")
    body = {"bootstrap_token": token_for(ancient.pk), "protocol": OLDEST_AGENT - 1}
    answer = APIClient().post(ENROLL, body, format="json")
    assert answer.status_code == 426
    assert answer.json()["code"] == AgentError.UPGRADE_REQUIRED
    assert "upgrade catacloud-agent" in answer.json()["detail"]
    assert MachineInstance.objects.get(pk=ancient.pk).agent_token_hash == ""  # nothing written


def test_what_each_launcher_and_cgroup_reports_is_a_field_of_the_protocol() -> None:
    from catacloud.providers.machine_sandbox import Cgroup

    reported = set(UidLauncher().describe())
    reported |= set(BubblewrapLauncher(bwrap="bwrap", hostname="h", egress=Egress("none")).describe())
    assert reported | {"job_uids"} <= names(Isolation)
    group, limits = Cgroup.create("cc-protocol-test", installation="t", cpus=1, memory_mb=64, pids=8)
    if group is not None:
        group.remove()
    assert set(limits) <= names(Limits)


def test_outcomes_are_one_enum_on_both_sides() -> None:
    from apps.control.agent.endpoints import FinishedIn
    from apps.jobs.reports import OUTCOMES
    from catacloud.agent import runner

    assert set(FinishedIn().fields["outcome"].choices) == set(Outcome)
    assert set(OUTCOMES) == set(Outcome)
    assert runner.Outcome is Outcome
    assert Finished.from_json({"outcome": "timed_out"}).outcome is Outcome.TIMED_OUT
