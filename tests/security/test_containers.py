"""Containers inside jobs (a machine type's ``containers``), and what they may not reach.

Local machines run on this host as `make dev` runs them (each a sandbox, its agent enrolled with
a fake Agent API of its own); a job there gets rootless Podman of its own
(catacloud/agent/containers.py) with Docker's API and a ``docker`` command. The image comes from
a real registry (Debian's ``docker-registry``) on this host's loopback, which the job's machine
type allows (``network.allow``: one loopback port, as an operator's mirror would be).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from catacloud.agent.containers import engine_path
from catacloud.providers.local import LocalProvider
from catacloud.providers.machine_sandbox import network_problem
from testkit.registry import FaultyProxy, Registry, build_image, missing_tools, push
from tests.security import netlab
from tests.security.netlab import LINK_LOCAL, PRIVATE, PUBLIC
from tests.security.test_disk_bounds import Machine, needs_root_and_loop
from tests.security.test_network_isolation import Service

pytestmark = [
    pytest.mark.skipif(
        network_problem(Path("/tmp")) is not None,
        reason=f"no job network here: {network_problem(Path('/tmp'))}",
    ),
    pytest.mark.skipif(engine_path() is None, reason="no podman here (apt-get install podman crun)"),
    pytest.mark.skipif(bool(missing_tools()), reason=f"no registry tools: {missing_tools()}"),
]


class Lab:
    def __init__(self, registry: Registry, machine: Machine, plain: Machine, provider: LocalProvider) -> None:
        self.registry, self.machine, self.plain, self.provider = registry, machine, plain, provider

    @property
    def image(self) -> str:
        return f"{self.registry.host}/busybox:1"

    def run(self, command: str, machine: Machine | None = None, **payload: Any) -> tuple[dict[str, Any], str]:
        payload.setdefault("network", {"allow": [self.registry.host]})
        finished, output, _took = (machine or self.machine).run(command, **payload)
        return finished, output


@pytest.fixture(scope="module")
def ct(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    why = needs_root_and_loop()
    if why is not None:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("containers")
    provider = LocalProvider(
        config={"state_dir": str(tmp / "machines"), "stop_timeout_seconds": 2}, credentials={}
    )

    def tools(root: Path) -> None:  # wget and nc in the image: what the probes below use
        for applet in ("wget", "nc", "dd", "httpd", "rm", "timeout", "grep", "seq"):
            (root / "bin" / applet).symlink_to("busybox")

    image = build_image(tmp / "image", "1", prepare=tools)
    with Registry(tmp / "registry") as registry:
        push(image, f"{registry.host}/busybox:1")
        machine = Machine(provider, disk_gb=1, containers=True)
        plain = Machine(provider, disk_gb=None)
        try:
            yield Lab(registry, machine, plain, provider)
        finally:
            machine.stop()
            plain.stop()


def test_image_names_read_as_dockers(ct: Lab) -> None:
    """A short name is Docker Hub's, and a registry on loopback is reached over plain HTTP (every
    other test here pulls from one): Podman alone refused both (Debian's settings name no registry
    to search; TLS everywhere). This machine has no internet: the pull fails, after its try."""
    finished, output = ct.run(
        "docker pull catacloud-example/nothing 2>&1; echo pull-exit=$?", containers=True
    )
    assert "Trying to pull docker.io/catacloud-example/nothing:latest" in output, output
    assert "no unqualified-search registries" not in output and "pull-exit=0" not in output, output


def test_a_job_builds_an_image_and_runs_it_with_docker(ct: Lab) -> None:
    dockerfile = f'FROM {ct.image}\nRUN echo built-in-a-container > /built\nCMD ["cat", "/built"]\n'
    command = (
        f"printf %s {shlex.quote(dockerfile)} > Dockerfile && "
        "docker build -q -t mine . >/dev/null && "
        "docker run --rm mine && docker run --rm mine id -u"
    )
    finished, output = ct.run(command, containers=True)
    assert finished["outcome"] == "succeeded", output
    assert "built-in-a-container" in output
    assert "\n0\n" in f"\n{output}"  # root in its container (the job's own uid outside)


# From inside a container: one line per target, "TRY host:port open <what answered>" or "closed".
# Each is asked an HTTP/1.0 request (the registry answers it; the lab's servers and the host's
# service answer anything with their address or secret, and close).
CONTAINER_PROBE = (
    'for t in "$@"; do a=$(printf "GET /v2/ HTTP/1.0\\r\\n\\r\\n" | timeout 5 nc "${t%:*}" "${t##*:}" 2>&1); '
    'if [ -n "$a" ] && ! echo "$a" | grep -q -i -e refused -e unreachable -e "timed out"; '
    'then echo "TRY $t open $(echo "$a" | head -1)"; else echo "TRY $t closed"; fi; done'
)


def container_tries(output: str) -> dict[str, str]:
    return {line.split()[1]: line.split()[2] for line in output.splitlines() if line.startswith("TRY ")}


def test_a_container_reaches_the_internet_and_nothing_the_job_may_not(
    ct: Lab, lab: netlab.Lab, service: Service
) -> None:
    """Containers use the job's own network namespace: every rule of the job network holds for
    them (tests/security/test_network_isolation.py holds them for the job itself)."""
    targets = {
        "internet": f"{PUBLIC}:8080",
        "lan": f"{PRIVATE}:8080",
        "metadata range": f"{LINK_LOCAL}:8080",
        "host loopback": f"127.0.0.1:{service.port}",
        "the registry (allowed)": ct.registry.host,
    }
    command = f"docker run --rm {ct.image} sh -c {shlex.quote(CONTAINER_PROBE)} sh " + " ".join(
        targets.values()
    )
    finished, output = ct.run(command, containers=True)
    assert finished["outcome"] == "succeeded", output
    seen = container_tries(output)
    assert seen[targets["internet"]] == "open", output
    assert seen[targets["the registry (allowed)"]] == "open", output  # HTTP answers a bare connect
    for name in ("lan", "metadata range", "host loopback"):
        assert seen[targets[name]] == "closed", f"{name}: {output}"
    assert service.secret not in output


def test_a_container_on_a_network_of_the_jobs_reaches_the_internet_and_nothing_else(
    ct: Lab, lab: netlab.Lab, service: Service
) -> None:
    """A network the job makes (``docker network create``, a compose file's, the GitHub runner's):
    its containers sit in Podman's rootless network namespace, whose only way out is slirp4netns,
    a process of the job's in the job's own namespace (its --disable-host-loopback set): every
    rule of the job network holds for what they send. The job's loopback (the allowed registry is
    there) is not theirs: slirp4netns's gateway (10.0.2.2) would lead to it, and is refused."""
    registry_port = ct.registry.host.rsplit(":", 1)[1]
    targets = {
        "internet": f"{PUBLIC}:8080",
        "lan": f"{PRIVATE}:8080",
        "metadata range": f"{LINK_LOCAL}:8080",
        "host loopback": f"127.0.0.1:{service.port}",
        "the job's loopback through slirp4netns's gateway": f"10.0.2.2:{registry_port}",
        "the host's loopback service through that gateway": f"10.0.2.2:{service.port}",
    }
    command = (
        f"docker network create mine >/dev/null && docker run --rm --network mine {ct.image} "
        f"sh -c {shlex.quote(CONTAINER_PROBE)} sh " + " ".join(targets.values())
    )
    finished, output = ct.run(command, containers=True)
    assert finished["outcome"] == "succeeded", output
    seen = container_tries(output)
    assert seen[targets["internet"]] == "open", output
    for name in [n for n in targets if n != "internet"]:
        assert seen[targets[name]] == "closed", f"{name}: {output}"
    assert service.secret not in output


def test_a_service_container_answers_the_job(ct: Lab) -> None:
    """What CI's ``services:`` are: a container started in the background that the job's steps
    talk to (on the job's own loopback: containers share its namespace)."""
    command = (
        "mkdir -p site && echo hello-from-a-service > site/index.html && "
        f'docker run -d --name web -v "$PWD/site:/srv" {ct.image} '
        "httpd -f -p 8089 -h /srv >/dev/null && for i in $(seq 50); do "
        "busybox wget -q -O - http://127.0.0.1:8089/ 2>/dev/null && break; sleep 0.1; done"
    )
    finished, output = ct.run(command, containers=True)
    assert finished["outcome"] == "succeeded", output
    assert "hello-from-a-service" in output


def test_docker_rm_force_kills_at_once_as_dockers_does(ct: Lab) -> None:
    """``docker rm --force`` sends SIGKILL and nothing else (Docker's reference for ``rm``);
    Podman's sent SIGTERM first and waited 10 s for a container that ignores it. A plain
    ``docker rm`` of a stopped container is untouched."""
    trap = "trap 'echo got-term >> /shared/signals' TERM; touch /shared/ready; while true; do sleep 0.1; done"
    command = (
        f'mkdir -p shared && docker run -d --name c -v "$PWD/shared:/shared" {ct.image} sh -c '
        f"{shlex.quote(trap)} >/dev/null && for i in $(seq 100); do [ -e shared/ready ] && break; "
        "sleep 0.1; done && docker rm --force c >/dev/null && "
        "docker container ls -a --format '{{.Names}}' | grep -c . ; cat shared/signals 2>/dev/null; echo end"
    )
    finished, output = ct.run(command, containers=True)
    assert finished["outcome"] == "succeeded", output
    assert "got-term" not in output and output.strip().splitlines()[-2:] == ["0", "end"], output
    command = (
        f"docker run --name s {ct.image} true && docker rm s && docker container rm -f nothing-here; echo end"
    )
    finished, output = ct.run(command, containers=True)
    assert output.strip().splitlines()[-1] == "end" and "\ns\n" in f"\n{output}", output
    assert "--force option must be specified" not in output, output


def test_the_docker_api_answers_at_docker_host_and_the_usual_socket(ct: Lab) -> None:
    command = (
        "echo host=$DOCKER_HOST; "
        'curl -s --unix-socket "${DOCKER_HOST#unix://}" http://docker/_ping; echo; '
        "curl -s --unix-socket /var/run/docker.sock http://docker/version"
    )
    finished, output = ct.run(command, containers=True)
    assert finished["outcome"] == "succeeded", output
    assert "host=unix:///run/user/" in output and "\nOK\n" in output
    assert '"ApiVersion"' in output  # Docker's API, as the GitHub runner and docker-compose call it


def test_only_a_containers_job_may_make_user_namespaces(ct: Lab) -> None:
    finished, output = ct.run("unshare -U true && echo made-one", containers=True)
    assert finished["outcome"] == "succeeded" and "made-one" in output, output
    finished, output = ct.run("unshare -U true && echo made-one", machine=ct.plain)
    assert finished["outcome"] == "failed" and "made-one" not in output, output
    # The same machine's job without the setting (as a type without it is, on any machine).
    finished, output = ct.run("unshare -U true && echo made-one")
    assert finished["outcome"] == "failed" and "made-one" not in output, output


def test_a_container_writing_past_the_jobs_disk_gets_enospc_and_nothing_is_left(ct: Lab) -> None:
    """Images and containers live in the job's work folder: the machine type's disk_gb bounds
    them (the kernel's file system, catacloud/agent/disk.py); the job's end leaves nothing.

    What the user sees is one of two, by a race: the agent finds the job's disk full (it looks
    every 0.25 s) and ends the job with ``disk_limit_exceeded``, or the container has already
    ended on its ENOSPC and removed its layer (``--rm``), freeing the disk. The container tells
    its ENOSPC through its exit status (28, the error's number, when dd's message says so), not
    its output: Podman's conmon writes each piece of a container's output to the container's log
    file, on that same full disk, and passes on only what it could write there
    (containers/conmon src/ctr_stdio.c, read_stdio)."""
    command = (
        f"docker run --rm {ct.image} sh -c "
        "'dd if=/dev/zero of=/big bs=1M count=1500 2>/dev/shm/err; "
        'grep -q "No space left on device" /dev/shm/err && exit 28; cat /dev/shm/err; exit 1\'; '
        "echo docker-exit=$?"
    )
    finished, output = ct.run(command, containers=True)
    ended_full = finished["outcome"] == "failed" and finished["reason"].startswith(
        "disk_limit_exceeded: the job filled its disk"
    )
    assert ended_full or "docker-exit=28" in output, (finished, output)
    machine = ct.machine
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the job's folder goes once its report is in
        work = machine.folder / "work"
        left = [p.name for p in work.iterdir() if p.name.startswith("job-")] if work.exists() else []
        engines = [
            p.info["name"]
            for p in psutil.process_iter(["name", "cmdline"])
            if p.info["name"] in ("podman", "conmon", "catatonit", "crun")
            or "system service" in " ".join(p.info["cmdline"] or [])
        ]
        if not left and not engines:
            break
        time.sleep(0.2)
    assert left == [] and engines == [], (left, engines)


def test_the_machine_of_a_containers_type_holds_no_cap_sys_admin(ct: Lab) -> None:
    """A local machine of such a type mounts a /proc of its own first (catacloud/providers/
    machine_sandbox.py, FRESH_PROC); nothing of it, its agent least, keeps CAP_SYS_ADMIN
    (nor CAP_SETPCAP, held to drop it from the bounding set), in any set."""
    record = json.loads((ct.machine.provider.state_dir / f"{ct.machine.id}.json").read_text())
    processes = psutil.Process(record["pid"]).children(recursive=True)
    agents = [p for p in processes if "catacloud.agent" in " ".join(p.cmdline()) and p.name() != "bwrap"]
    assert agents, [p.cmdline() for p in processes]
    sys_admin = 1 << 21 | 1 << 8  # CAP_SYS_ADMIN, CAP_SETPCAP (linux/capability.h)
    machine_userns = os.readlink(f"/proc/{agents[0].pid}/ns/user")
    for process in processes:
        if process.name() == "bwrap" or os.readlink(f"/proc/{process.pid}/ns/user") != machine_userns:
            continue  # bubblewrap itself; a job network's pasta (its caps hold in the job's namespace)
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{process.pid}/status").read_text().splitlines()
        )
        for field in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb"):
            assert not int(status[field], 16) & sys_admin, (process.cmdline(), field, status[field])


COMPOSE = """\
services:
  web:
    image: {image}
    command: ["httpd", "-f", "-p", "8080", "-h", "/srv"]
    volumes: ["./site:/srv"]
  client:
    image: {image}
    depends_on: [web]
    command:
      - sh
      - -c
      - for i in $$(seq 20); do wget -q -O - http://web:8080/ && exit 0; sleep 0.5; done; exit 1
"""


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="no docker-compose here")
def test_docker_compose_runs_a_service_the_job_s_other_container_reaches(ct: Lab) -> None:
    """``docker compose`` (Debian's docker-compose against the job's engine): a service and a
    client of it on the compose file's own network, the client reaching the service by its name
    (the network's DNS, aardvark-dns)."""
    command = (
        "mkdir -p site && echo hello-from-a-compose-service > site/index.html && "
        f"printf %s {shlex.quote(COMPOSE.format(image=ct.image))} > docker-compose.yml && "
        "docker compose up --abort-on-container-exit --exit-code-from client 2>&1; echo compose-exit=$?"
    )
    finished, output = ct.run(command, containers=True)
    assert "hello-from-a-compose-service" in output and "compose-exit=0" in output, output


def test_a_containers_machine_sees_no_cgroup_of_the_host(ct: Lab) -> None:
    """The host's /sys is there (Podman reads it), its cgroup tree is not: other machines'
    cgroups (their names are their instance ids) and the installation's limits stay hidden."""
    finished, output = ct.run("ls -A /sys/fs/cgroup | wc -l; ls /sys/class | head -3", containers=True)
    assert finished["outcome"] == "succeeded", output
    assert output.splitlines()[0].strip() == "0", output
    assert "catacloud-" not in output


# What the job tries with the organization's registry: pull through its mirror (the engine's
# registries.conf names it), pull without it, push through it, push around it; and where the
# credentials could be: its environment, its engine's settings, the auth files a client keeps.
CREDENTIAL_PROBE = """\
conf=$CONTAINERS_REGISTRIES_CONF
mirror=$(grep -A1 'registry.mirror' "$conf" | sed -n 's/^location = "\\(.*\\)"$/\\1/p')
echo "MIRROR $mirror"
docker pull {image} >/dev/null 2>&1; echo "mirror-pull=$?"
docker run --rm {image} echo ran-the-organizations-image
printf '[[registry]]\\nlocation = "127.0.0.1"\\ninsecure = true\\n' > direct.conf
CONTAINERS_REGISTRIES_CONF=direct.conf docker pull {host}/tool:2 2>&1 | tail -1; echo "direct-pull"
docker tag {image} "$mirror/tool:evil"
docker push "$mirror/tool:evil" 2>&1 | tail -1; echo "mirror-push=$?"
docker tag {image} {host}/tool:evil
CONTAINERS_REGISTRIES_CONF=direct.conf docker push {host}/tool:evil 2>&1 | tail -1
env; cat "$conf"
cat "$XDG_RUNTIME_DIR/containers/auth.json" "$HOME/.docker/config.json" 2>&1
"""


def test_the_engine_pulls_with_the_organizations_credentials_the_job_never_holds(
    ct: Lab, tmp_path: Path
) -> None:
    """The job's `docker pull` of the organization's private registry works (the agent's mirror
    adds the credentials, catacloud/agent/registry_proxy.py); without the mirror the registry
    refuses it, a push is refused both ways, nothing of the credentials reaches the job (its
    output would show the password, or the Basic token an auth file holds), and the
    mirror's grant ends with the job."""
    import base64
    import subprocess
    import urllib.error
    import urllib.request

    password = "org-registry-" + os.urandom(8).hex()
    with Registry(tmp_path / "private", users={"puller": password}) as private:
        subprocess.run(
            ["skopeo", "copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false"]
            + [
                "--dest-creds",
                f"puller:{password}",
                f"docker://{ct.image}",
                f"docker://{private.host}/tool:1",
            ],
            check=True,
        )
        image = f"{private.host}/tool:1"
        login = {"registry": private.host, "username": "puller", "password": password}
        finished, output = ct.run(
            CREDENTIAL_PROBE.format(image=image, host=private.host),
            containers=True,
            network={"allow": [ct.registry.host, private.host]},
            registries=[login],
        )
        assert "mirror-pull=0" in output and "ran-the-organizations-image" in output, output
        lines = output.splitlines()
        direct = lines[lines.index("direct-pull") - 1]
        assert "authentication required" in direct or "unauthorized" in direct, output
        assert "this mirror only pulls" in output, output  # the push's manifest was refused
        assert password not in output, output  # (not masked: it would show as it is)
        assert base64.b64encode(f"puller:{password}".encode()).decode() not in output, output
        tags = subprocess.run(
            ["skopeo", "list-tags", "--tls-verify=false", "--creds", f"puller:{password}"]
            + [f"docker://{private.host}/tool"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(tags.stdout)["Tags"] == ["1"], tags.stdout  # no push reached it
        mirror = next(line.split(" ", 1)[1] for line in lines if line.startswith("MIRROR "))
        assert mirror.startswith("127.0.0.1:"), output
        with pytest.raises(urllib.error.HTTPError) as ended:  # from the host: the grant is gone
            urllib.request.urlopen(
                f"http://{mirror.split('/', 1)[0]}/v2/{mirror.split('/', 1)[1]}/tool/manifests/1"
            )
        assert ended.value.code == 404


def test_the_engine_takes_the_layers_the_machines_image_store_holds(ct: Lab) -> None:
    """A job ran inside an image (the machine's store pulled it); a later containers job's
    `docker pull` of that image asks the registry for its manifest alone: every blob comes from
    the store, through the agent's mirror (no second download of what the machine holds)."""
    counting = FaultyProxy(ct.registry.host).start()  # counts what reaches the registry
    machine = Machine(ct.provider, disk_gb=1, containers=True)
    try:
        image = f"{counting.host}/busybox:1"
        allow = {"allow": [counting.host]}
        finished, output, _ = machine.run("cat /etc/os-release", network=allow, image=image)
        assert finished["outcome"] == "succeeded", output
        blobs, manifests = counting.blob_gets(), counting.manifest_requests()
        assert blobs >= 2  # the store's own pull: its config and layer
        command = f"docker pull -q {image} && docker run --rm {image} echo seeded-from-the-store"
        finished, output, _ = machine.run(command, network=allow, containers=True)
        assert finished["outcome"] == "succeeded" and "seeded-from-the-store" in output, output
        assert counting.blob_gets() == blobs, counting.requests  # no blob fetched again
        assert counting.manifest_requests() > manifests  # the tag was still asked of the registry
    finally:
        machine.stop()
        counting.stop()
