"""Outputs and checkpoints end to end: real worker, real agents (local driver), live API."""

from __future__ import annotations

import contextlib
import hashlib
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from apps.jobs.models import Job
from tests.e2e.conftest import Stack
from tests.e2e.test_jobs_and_agent import job, job_config, logs, submit

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
PY = sys.executable


def test_outputs_are_listed_and_downloaded_byte_for_byte(stack: Stack) -> None:
    cfg = job_config(
        stack,
        "build",
        "mkdir -p $CATACLOUD_OUTPUT_DIR/reports; "
        "echo '<testsuite tests=\"3\"/>' > $CATACLOUD_OUTPUT_DIR/reports/junit.xml;"
        f" {PY} -c \"import os; open(os.environ['CATACLOUD_OUTPUT_DIR'] + '/blob.bin', 'wb')"
        '.write(bytes(range(256)) * 8192)"; exit 1',
    )
    job_id = submit(stack, cfg)
    stack.wait(lambda: job(stack, job_id)["status"] == "failed", 60, "the job to fail")
    viewer = stack.api("viewer")
    listed = stack.wait(
        lambda: (a := viewer.get(f"/api/v1/jobs/{job_id}/artifacts/").json()) and len(a) == 2 and a,
        30,
        "both outputs to be uploaded (a failed job keeps its outputs too)",
    )
    blob = bytes(range(256)) * 8192
    by_name = {a["name"]: a for a in listed}
    assert by_name["blob.bin"]["size"] == len(blob)
    assert by_name["blob.bin"]["sha256"] == hashlib.sha256(blob).hexdigest()
    response = viewer.get(f"/api/v1/jobs/{job_id}/artifacts/blob.bin")
    assert b"".join(response.streaming_content) == blob
    response = viewer.get(f"/api/v1/jobs/{job_id}/artifacts/reports/junit.xml")
    assert b"".join(response.streaming_content) == b'<testsuite tests="3"/>\n'
    assert stack.api("outsider").get(f"/api/v1/jobs/{job_id}/artifacts/blob.bin").status_code == 404


def test_a_requeued_job_resumes_from_its_last_checkpoint(stack: Stack) -> None:
    command = (
        "S=$CATACLOUD_CHECKPOINT_DIR/step; step=$(cat $S 2>/dev/null || echo 0); "
        'echo "attempt $CATACLOUD_ATTEMPT starts at $step"; '
        "while [ $step -lt 6 ]; do step=$((step + 1)); echo $step > $S; "
        f'{PY} -m catacloud.agent checkpoint || exit 9; echo "step $step"; '
        'if [ "$CATACLOUD_ATTEMPT" = 1 ] && [ $step = 3 ]; then sleep 300; fi; done; '
        'echo "done at $step" > $CATACLOUD_OUTPUT_DIR/result.txt'
    )
    job_id = submit(stack, job_config(stack, "resumable", command))
    stack.wait(lambda: "step 3" in logs(stack, job_id), 60, "three steps of attempt 1")
    first = job(stack, job_id)["instance"]
    stack.agent_process(first).kill()  # the machine dies, and everything in it
    stack.wait(lambda: job(stack, job_id)["status"] == "succeeded", 120, "the second attempt to finish")
    second = stack.api("viewer").get(f"/api/v1/jobs/{job_id}/logs/?attempt=2").json()["text"]
    assert "attempt 2 starts at 3" in second  # resumed, did not start over
    assert "step 1\n" not in second and "step 4" in second
    # Outputs follow the exit report (which they never block): wait for the upload.
    viewer = stack.api("viewer")
    stack.wait(
        lambda: any(
            a["name"] == "result.txt" for a in viewer.get(f"/api/v1/jobs/{job_id}/artifacts/").json()
        ),
        30,
        "the output to be uploaded",
    )
    result = viewer.get(f"/api/v1/jobs/{job_id}/artifacts/result.txt")
    assert b"".join(result.streaming_content) == b"done at 6\n"
    assert Job.objects.get(pk=job_id).attempt == 2


@contextlib.contextmanager
def ec2_notices() -> Iterator[tuple[str, str, Callable[[str], None]]]:
    """EC2's metadata service (the fake IMDSv2): its URL, kind, and how a machine gets its notice."""
    from tests.agent.fake_server import FakeIMDS

    with FakeIMDS() as imds:

        def notify(instance_id: str) -> None:
            imds.notices[instance_id] = '{"action": "terminate", "time": "2030-01-01T00:02:00Z"}'

        yield imds.url, "ec2", notify


@contextlib.contextmanager
def azure_notices() -> Iterator[tuple[str, str, Callable[[str], None]]]:
    """Azure's Scheduled Events (the fake Azure's metadata service): a Spot VM of the machine's
    name, evicted with Azure's 30 s notice (a ``Preempt`` event)."""
    from tests.fakes.azure_arm import FakeAzure

    with FakeAzure() as azure:

        def notify(instance_id: str) -> None:
            # The machine's agent watches from its start; its VM (the name its metadata service
            # answers) exists from now, and its events reach it once it has asked (the first
            # request enables Scheduled Events), as on Azure.
            azure.add_vm(instance_id, priority="Spot")
            deadline = time.monotonic() + 30
            while not any(
                vm == instance_id and p == "/metadata/scheduledevents" for _, vm, p, _ in azure.imds_requests
            ):
                assert time.monotonic() < deadline, "the agent never asked for its scheduled events"
                time.sleep(0.1)
            azure.evict(instance_id, notice=30)

        yield azure.imds_url, "azure", notify


@pytest.mark.parametrize("notices", [ec2_notices, azure_notices], ids=["ec2", "azure"])
def test_a_spot_interruption_hands_the_job_on_with_its_checkpoint(
    stack: Stack,
    notices: Callable[[], contextlib.AbstractContextManager[tuple[str, str, Callable[[str], None]]]],
) -> None:
    """A job checkpointing every second on a spot machine gets its machine's interruption notice
    at second 5 (EC2's two-minute notice from the fake IMDSv2, or Azure's 30 s Preempt event from
    the fake Scheduled Events): it is told (SIGTERM: its trap saves its step), its last
    checkpoint is uploaded, the attempt is recorded as interrupted (free: a job of max_attempts 1
    runs again), and it finishes on another machine, resumed from that step (its output says
    so), well within the notice window; both machines' cost is its."""
    from apps.machines.models import MachineType

    with notices() as (imds_url, kind, notify):
        stack.world.account.config.update(imds_url=imds_url, imds_kind=kind)
        stack.world.account.save(update_fields=["config"])
        MachineType.objects.filter(pk=stack.world.machine_type.pk).update(spot=True)
        command = (
            "S=$CATACLOUD_CHECKPOINT_DIR/step; step=$(cat $S 2>/dev/null || echo 0); "
            'echo "attempt $CATACLOUD_ATTEMPT starts at $step"; '
            "trap 'echo $step > $S; echo \"told at step $step\"; exit 0' TERM; "
            "while [ $step -lt 8 ]; do step=$((step + 1)); echo $step > $S; "
            f'{PY} -m catacloud.agent checkpoint || exit 9; echo "step $step"; sleep 1; done; '
            'echo "done at $step"'
        )
        job_id = submit(stack, job_config(stack, "spotty", command, max_attempts=1, reuse="ephemeral"))
        stack.wait(lambda: "step 5" in logs(stack, job_id), 60, "five steps of attempt 1")
        first = job(stack, job_id)["instance"]
        notify(first)
        noticed = time.monotonic()
        stack.wait(lambda: job(stack, job_id)["attempt"] == 2, 60, "the job requeued by the interruption")
        requeued_in = time.monotonic() - noticed
        done = stack.wait(
            lambda: (j := job(stack, job_id))["status"] == "succeeded" and j,
            120,
            "the second attempt to finish",
        )

    first_log = stack.api("viewer").get(f"/api/v1/jobs/{job_id}/logs/?attempt=1").json()["text"]
    second_log = stack.api("viewer").get(f"/api/v1/jobs/{job_id}/logs/?attempt=2").json()["text"]
    told = int(first_log.split("told at step ")[1].split()[0])
    assert told >= 5
    assert f"attempt 2 starts at {told}\n" in second_log  # resumed from the step saved on SIGTERM
    assert "step 1\n" not in second_log and "done at 8" in second_log
    window = 120 if kind == "ec2" else 30  # EC2's two minutes; Azure's Preempt: at least 30 s
    assert requeued_in < window, f"requeued {requeued_in:.1f} s after the notice: past {kind}'s {window} s"
    assert (done["requeue_reason"], done["free_requeues"], done["instance"] != first) == (
        "spot_interruption", 1, True,
    )  # fmt: skip
    assert {m["instance"] for m in done["cost"]["machines"]} >= {first, done["instance"]}
