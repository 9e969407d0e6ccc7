"""Containers in jobs, end to end over REST: the operator's machine type allows containers, a
member's job calls ``docker`` on a local machine (its agent, its sandbox, its rootless Podman),
pulling from a real registry on loopback that the type's network allows."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from apps.machines.services import machine_type_update
from catacloud.agent.containers import engine_path
from testkit.registry import INSTALL, Registry, build_image, missing_tools, push
from tests.e2e.conftest import Stack
from tests.e2e.test_images import ended, job_config, logs, submit

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(engine_path() is None, reason="no podman here (apt-get install podman crun)"),
]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    if missing_tools():
        pytest.fail(f"images need {', '.join(missing_tools())}: {INSTALL}")
    work = tmp_path_factory.mktemp("registry")
    with Registry(work / "registry") as running:
        push(build_image(work / "img", "1"), f"{running.host}/team/busybox:1")
        yield running


def test_a_job_on_a_type_that_allows_containers_builds_and_runs_them(
    stack: Stack, registry: Registry, tmp_path: Path
) -> None:
    mt = stack.world.machine_type
    machine_type_update(machine_type=mt, actor="test", containers=True, network={"allow": [registry.host]})
    shown = stack.api("viewer").get(f"/api/v1/machine-types/{mt.pk}/").json()
    assert shown["containers"] is True
    image = f"{registry.host}/team/busybox:1"
    dockerfile = f"FROM {image}\nRUN echo made-by-docker-build > /made\n"
    command = (
        f"printf %s {shlex.quote(dockerfile)} > Dockerfile && docker build -q -t app . "
        ">/dev/null && docker run --rm app cat /made && docker images --format '{{.Repository}}'"
    )
    done = ended(stack, submit(stack, job_config(stack, "docker", command)), timeout=120)
    text = logs(stack, done["id"])
    assert done["status"] == "succeeded", (done, text)
    assert "made-by-docker-build" in text and "localhost/app" in text, text

    # A type without the setting: the same command finds no engine of the job's.
    machine_type_update(machine_type=mt, actor="test", containers=False)
    done = ended(stack, submit(stack, job_config(stack, "no-docker", "docker info")), timeout=120)
    assert done["status"] == "failed", (done, logs(stack, done["id"]))
