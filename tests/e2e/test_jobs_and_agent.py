"""Jobs end to end: the scheduler (real worker and beat), real agents started by the local
driver, the live API."""

from __future__ import annotations

from typing import Any

import psutil
import pytest

from apps.events.models import Event
from apps.machines.models import MachineInstance, OrgMachineType
from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def job_config(stack: Stack, name: str, command: str, **fields: Any) -> str:
    body = {"name": name, "machine_type": str(stack.world.machine_type.pk), "command": command, **fields}
    response = stack.api("admin").post("/api/v1/job-configs/", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def submit(stack: Stack, config_id: str) -> str:
    response = stack.api("member").post("/api/v1/jobs/", {"config": config_id}, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["status"] == "queued"
    return response.json()["id"]


def job(stack: Stack, job_id: str) -> dict:
    return stack.api("viewer").get(f"/api/v1/jobs/{job_id}/").json()


def logs(stack: Stack, job_id: str) -> str:
    return stack.api("viewer").get(f"/api/v1/jobs/{job_id}/logs/").json()["text"]


def test_output_streams_while_running_and_the_exit_code_is_recorded(stack: Stack) -> None:
    # Its first line holds a NUL (binary output), which the server once refused (the agent
    # retried that output until the report's deadline); its last one comes with its exit report.
    command = "printf 'started-%s\\0bin\\n' $CATACLOUD_ATTEMPT; sleep 4; echo done >&2; exit 3"
    cfg = job_config(stack, "stream", command, reuse="ephemeral")
    job_id = submit(stack, cfg)
    stack.wait(lambda: "started-1\ufffdbin\n" in logs(stack, job_id), 60, "the first line of output")
    assert job(stack, job_id)["status"] == "running"  # output arrived while it still runs
    body = stack.wait(lambda: (j := job(stack, job_id))["status"] == "failed" and j, 30, "the job to end")
    assert body["exit_code"] == 3
    assert "done" in logs(stack, job_id)
    # Ephemeral: the machine is destroyed after the job.
    stack.wait(
        lambda: MachineInstance.objects.get(pk=body["instance"]).status == "terminated", 30, "teardown"
    )


def test_timeout_kills_the_process_tree(stack: Stack) -> None:
    cfg = job_config(stack, "slow", "sleep 301 & echo started; sleep 302", timeout_seconds=2)
    job_id = submit(stack, cfg)
    stack.wait(lambda: "started" in logs(stack, job_id), 60, "the job to run")
    instance = job(stack, job_id)["instance"]
    assert sleepers(stack, instance) == ["sleep 301", "sleep 302"]
    body = stack.wait(lambda: (j := job(stack, job_id))["status"] == "timed_out" and j, 60, "the timeout")
    assert body["exit_code"] is None
    stack.wait(lambda: sleepers(stack, instance) == [], 10, "the background grandchild to be killed")


def test_cancel_kills_a_running_job(stack: Stack) -> None:
    cfg = job_config(stack, "long", "echo running; sleep 303")
    job_id = submit(stack, cfg)
    stack.wait(lambda: "running" in logs(stack, job_id), 60, "the job to run")
    instance = job(stack, job_id)["instance"]
    assert sleepers(stack, instance) == ["sleep 303"]
    assert stack.api("viewer").post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 403
    response = stack.api("member").post(f"/api/v1/jobs/{job_id}/cancel/")
    assert response.status_code == 202 and response.json()["cancel_requested"] is True
    stack.wait(lambda: job(stack, job_id)["status"] == "cancelled", 20, "the cancellation")
    assert sleepers(stack, instance) == []


def sleepers(stack: Stack, instance_id: str) -> list[str]:
    """The job's ``sleep`` processes still running on its machine."""
    found = []
    for process in stack.machine_processes(instance_id):
        try:
            if process.name() == "sleep" and process.status() != psutil.STATUS_ZOMBIE:
                found.append(" ".join(process.cmdline()))
        except psutil.Error:
            continue
    return sorted(found)


def test_a_killed_agent_makes_its_machine_lost_and_the_job_finishes_elsewhere(stack: Stack) -> None:
    cfg = job_config(
        stack,
        "resilient",
        'echo attempt-$CATACLOUD_ATTEMPT; if [ "$CATACLOUD_ATTEMPT" = 1 ]; then sleep 300; fi; echo finished',
    )
    job_id = submit(stack, cfg)
    stack.wait(lambda: "attempt-1" in logs(stack, job_id), 60, "the first attempt to run")
    first = job(stack, job_id)["instance"]
    stack.agent_process(first).kill()  # the machine dies: no goodbye (and everything in it)
    body = stack.wait(
        lambda: (j := job(stack, job_id))["status"] == "succeeded" and j,
        120,
        "the job to be requeued and finish on another machine",
    )
    assert body["attempt"] == 2 and body["instance"] != first
    assert MachineInstance.objects.get(pk=first).status == "lost"
    assert Event.objects.filter(kind="job.requeued", job_id=job_id).exists()
    assert "attempt-2" in stack.api("viewer").get(f"/api/v1/jobs/{job_id}/logs/?attempt=2").json()["text"]


def test_kueue_example_two_of_three_run_until_one_finishes(stack: Stack) -> None:
    mt = stack.world.machine_type
    mt.cpus = 32
    mt.save()
    OrgMachineType.objects.filter(org=stack.world.org, machine_type=mt).update(cpu_quota=64)
    gate = stack.shared / "gate"  # /shared/gate inside the machines
    cfg = job_config(
        stack, "train", "while [ ! -e /shared/gate-$CATACLOUD_JOB_ID ]; do sleep 0.2; done; echo ok"
    )
    jobs = [submit(stack, cfg) for _ in range(3)]
    stack.wait(
        lambda: sorted(job(stack, j)["status"] for j in jobs) == ["queued", "running", "running"],
        90,
        "two running and one queued",
    )
    queued = next(j for j in jobs if job(stack, j)["status"] == "queued")
    assert job(stack, queued)["pending_reason"] == "cpu quota 64/64 in use"
    first_running = next(j for j in jobs if j != queued)
    (gate.parent / f"{gate.name}-{first_running}").touch()
    stack.wait(lambda: job(stack, first_running)["status"] == "succeeded", 30, "the first job to finish")
    stack.wait(lambda: job(stack, queued)["status"] == "running", 60, "the third job to be admitted and run")
    for j in jobs:
        (gate.parent / f"{gate.name}-{j}").touch()
    stack.wait(lambda: all(job(stack, j)["status"] == "succeeded" for j in jobs), 60, "all to finish")
    # Reuse: three jobs needed at most two machines.
    assert len({job(stack, j)["instance"] for j in jobs}) <= 2
