"""Containers in jobs, end to end over REST: the operator's machine type allows containers, a
member's job calls ``docker`` on a local machine (its agent, its sandbox, its rootless Podman),
pulling from a real registry on loopback that the type's network allows."""

from __future__ import annotations

import secrets
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from apps.jobs.choices import JOB_LIVE
from apps.jobs.models import Job, JobLogChunk
from apps.machines.services import machine_type_update
from catacloud.agent.containers import engine_path
from testkit.gitlab_kit import RUNNER_PATH
from testkit.registry import INSTALL, Registry, build_image, missing_tools, push
from tests.e2e.conftest import Stack
from tests.e2e.test_github_actions import LABELS, GitHubStack, github  # noqa: F401  (the fixture)
from tests.e2e.test_gitlab_ci import GitLabStack, gitlab  # noqa: F401  (the fixture)
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

    def tools(root: Path) -> None:  # what the services' and CI jobs' scripts below use
        for applet in ("httpd", "wget", "seq", "sleep", "grep", "mkdir", "tail"):
            if not (root / "bin" / applet).exists():
                (root / "bin" / applet).symlink_to("busybox")

    page = {"www/index.html": b"hello-from-a-service-image\n"}
    httpd = ("httpd", "-f", "-p", "80", "-h", "/www")  # a service image's own command, as nginx's
    with Registry(work / "registry") as running:
        push(build_image(work / "img", "1", prepare=tools), f"{running.host}/team/busybox:1")
        push(
            build_image(work / "web", "1", prepare=tools, files=page, cmd=httpd), f"{running.host}/team/web:1"
        )
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


def test_a_jobs_docker_pulls_the_organizations_private_image_with_its_registry_credentials(
    stack: Stack, registry: Registry, tmp_path: Path
) -> None:
    """The admin sets the organization's credentials for its private registry (as for a job's
    image); a member's job on a containers type runs ``docker run`` of a private image there:
    its engine pulls through the agent, which adds them (the job never gets them)."""
    import subprocess

    password = "private-registry-" + secrets.token_hex(6)
    with Registry(tmp_path / "private", users={"robot": password}) as private:
        subprocess.run(
            ["skopeo", "copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false"]
            + ["--dest-creds", f"robot:{password}"]
            + [f"docker://{registry.host}/team/busybox:1", f"docker://{private.host}/team/app:1"],
            check=True,
        )
        mt = stack.world.machine_type
        allow = {"allow": [registry.host, private.host]}
        machine_type_update(machine_type=mt, actor="test", containers=True, network=allow)
        body = {"registry": private.host, "username": "robot", "password": password}
        created = stack.api("admin").post("/api/v1/registry-credentials/", body, format="json")
        assert created.status_code == 201, created.content
        command = f"docker run --rm {private.host}/team/app:1 echo from-the-private-image; env"
        done = ended(stack, submit(stack, job_config(stack, "private-docker", command)), timeout=120)
        text = logs(stack, done["id"])
        assert done["status"] == "succeeded", (done, text)
        assert "from-the-private-image" in text and password not in text and "***" not in text, text


DOCKER_TAGS = ["catacloud", "docker"]


def test_gitlabs_docker_executor_runs_each_ci_job_in_its_image(
    gitlab: GitLabStack,  # noqa: F811
    registry: Registry,
) -> None:
    """A GitLab runner class with ``executor: docker`` on a machine type that allows containers:
    the stand-in gitlab-runner (testkit/gitlab_runner) pulls each CI job's ``image:`` through the
    job's own Docker API, runs the job's script in a container of it (its /etc/os-release is the
    image's) with its ``services:`` beside it (reached on localhost: the runner's network mode is
    the job's own network), reports the script's exit status, and removes the containers."""
    from apps.gitlab.models import GitLabRunner
    from apps.gitlab.services import runner_class_save

    fake, stack = gitlab.fake, gitlab.stack
    mt = stack.world.machine_type
    allow = [*(mt.network or {}).get("allow", []), registry.host]  # the fake GitLab's, the registry
    machine_type_update(machine_type=mt, actor="test", containers=True, network={"allow": allow})
    mt.refresh_from_db()
    runner_class_save(
        org=stack.world.org,
        name="docker",
        tags=DOCKER_TAGS,
        machine_type=mt,
        pool=gitlab.pool,
        executor="docker",
        runner_path=RUNNER_PATH,
    )
    image = f"{registry.host}/team/busybox:1"
    web = "mkdir -p /www && echo hello-from-a-service > /www/index.html && "
    web += "exec httpd -f -p 127.0.0.1:18080 -h /www"
    ask = "for i in $(seq 40); do wget -q -O - http://127.0.0.1:18080/ && break; sleep 0.25; done"
    passing = fake.queue_job(
        "acme/app",
        DOCKER_TAGS,
        ["grep ^ID= /etc/os-release", ask],
        image=image,
        services=[{"name": image, "command": ["sh", "-c", web]}],
    )
    failing = fake.queue_job("acme/app", DOCKER_TAGS, ["echo before", "exit 3", "echo never"], image=image)
    stack.wait(lambda: not fake.unfinished([passing, failing]), 240, "the docker executor's CI jobs")

    def runner_log(ci_job: int) -> str:
        ours = GitLabRunner.objects.get(gitlab_runner_id=fake.job(ci_job).runner_id)
        stack.wait(
            lambda: not Job.objects.filter(pk=ours.job_id, status__in=JOB_LIVE).exists(), 60, "its end"
        )
        return "".join(JobLogChunk.objects.filter(job_id=ours.job_id).values_list("data", flat=True))

    text = runner_log(passing)
    assert fake.job(passing).status == "success", text
    assert f"Pulling docker image {image}" in text and "ID=catacloud-test" in text, text
    assert f"Starting service {image}" in text and "hello-from-a-service" in text, text  # on localhost
    text = runner_log(failing)
    assert fake.job(failing).status == "failed", text
    assert "before" in text and "ERROR: Job failed: exit code 3" in text and "\nnever" not in text, text


def test_github_container_and_services_jobs_run_in_their_images_on_a_network_of_their_own(
    github: GitHubStack,  # noqa: F811
    registry: Registry,
) -> None:
    """A workflow job with ``container:`` and ``services:`` on a runner class whose machine type
    allows containers: the stand-in runner does what actions/runner does with the job's Docker
    (testkit/github_runner): a network of the job's own, the service on it under its name, the job
    container on it, every step run in that container with ``docker exec``, all removed after."""
    from apps.github.models import Runner

    fake, stack = github.fake, github.stack
    mt = stack.world.machine_type
    allow = [*(mt.network or {}).get("allow", []), registry.host]  # the fake GitHub's, the registry
    machine_type_update(machine_type=mt, actor="test", containers=True, network={"allow": allow})
    image = f"{registry.host}/team/busybox:1"
    steps = [
        "grep ^ID= /etc/os-release",
        "for i in $(seq 40); do wget -q -O - http://web/ && break; sleep 0.25; done",  # by its name
    ]
    service = f"{registry.host}/team/web:1"
    job = fake.queue_job("acme/app", LABELS, steps, container=image, services={"web": service}, name="in-one")
    stack.wait(lambda: github.all_completed([job]), 240, "the container workflow job")
    runner = Runner.objects.get(name=fake.job(job).runner_name)
    stack.wait(lambda: not Job.objects.filter(pk=runner.job_id, status__in=JOB_LIVE).exists(), 60, "its end")
    text = "".join(JobLogChunk.objects.filter(job_id=runner.job_id).values_list("data", flat=True))
    assert fake.job(job).conclusion == "success", text
    assert "ID=catacloud-test" in text and "hello-from-a-service-image" in text, text
