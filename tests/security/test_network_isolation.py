"""Boundary: a job reaches the internet and nothing else (its disk: tests/security/test_disk_bounds.py).

Two local machines of two organizations run on this host as `make dev` runs them (each a
sandbox, its agent enrolled with a fake Agent API of its own). The destinations a job tries are
this host's loopback and a network namespace of the test's own (tests/security/netlab.py): a
public address (the internet, for a job), a private one and a link-local one.

Shown on main before the job network namespace: the demo org's job read another org's job's
secret over 127.0.0.1 and an abstract unix socket; a job reached private and link-local
addresses (on EC2, the metadata service and its instance profile's credentials); /proc/net
listed every socket of the host; a job could fill the disk the control plane lives on.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from catacloud.agent.netns import host_addresses
from catacloud.providers.base import LABEL_INSTALLATION, MachineSpec
from catacloud.providers.local import LocalProvider
from catacloud.providers.machine_sandbox import network_problem
from tests.agent.fake_server import FakeAgentAPI
from tests.security import netlab
from tests.security.netlab import LINK_LOCAL, PRIVATE, PUBLIC, probe_command, tries
from tests.security.test_sandbox_escape import start_machine

pytestmark = pytest.mark.skipif(
    network_problem(Path("/tmp")) is not None, reason=f"no job network here: {network_problem(Path('/tmp'))}"
)


class Machines:
    """Two organizations' machines on this host, and a way to start more."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.provider = LocalProvider(
            config={"state_dir": str(state_dir), "stop_timeout_seconds": 2}, credentials={}
        )
        self.apis: list[FakeAgentAPI] = []
        self.ids: list[str] = []

    def start(self, org: str, env: dict[str, str] | None = None) -> FakeAgentAPI:
        api = FakeAgentAPI(heartbeat_interval=0.2, poll_timeout=0.5).start()
        self.apis.append(api)
        self.ids.append(start_machine(self.provider, api, org, env=env))
        return api

    def stop(self) -> None:
        for instance_id in self.ids:
            self.provider.delete(instance_id)
        for api in self.apis:
            api.stop()


@pytest.fixture(scope="module")
def machines(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[FakeAgentAPI, FakeAgentAPI, Machines]]:
    group = Machines(tmp_path_factory.mktemp("network") / "machines")
    try:
        api_a = group.start("org-a")
        api_b = group.start("org-b")
        yield api_a, api_b, group
    finally:
        group.stop()


def run(api: FakeAgentAPI, command: str, **payload: Any) -> tuple[dict[str, Any], str]:
    job = api.assign(command, timeout_seconds=120, **payload)
    finished = api.wait_done(job, timeout=120)
    return finished, api.output(job, "stdout") + api.output(job, "stderr")


class Service:
    """A TCP service on this host's loopback that answers a secret (the control plane, say)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.secret = f"host-secret-{secrets.token_hex(6)}"
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.sendall(f"{self.secret}\n".encode())
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def service() -> Iterator[Service]:
    svc = Service()
    yield svc
    svc.close()


def refused(result: tuple[str, float]) -> bool:
    """A connection error at once (never a hang, never a timeout)."""
    name, took = result
    return name in ("ConnectionRefusedError", "PermissionError", "OSError") and took < 5


# ---- neighbours ---------------------------------------------------------------------------------

VICTIM = r"""
import os, socket, sys, threading
secret = os.environ["SECRET"]
def serve(sock):
    while True:
        conn, _ = sock.accept()
        conn.sendall((secret + "\n").encode())
        conn.close()
tcp = socket.socket(); tcp.bind(("127.0.0.1", 0)); tcp.listen(8)
unix = socket.socket(socket.AF_UNIX); unix.bind("\0" + os.environ["ABSTRACT"]); unix.listen(8)
for s in (tcp, unix):
    threading.Thread(target=serve, args=(s,), daemon=True).start()
for family, address in ((socket.AF_INET, tcp.getsockname()), (socket.AF_UNIX, "\0" + os.environ["ABSTRACT"])):
    c = socket.socket(family); c.connect(address); print("SELF", c.makefile().readline().strip(), flush=True)
print(f"PORT={tcp.getsockname()[1]}", flush=True)
threading.Event().wait()
"""

ATTACK_ABSTRACT = r"""
import socket, sys
c = socket.socket(socket.AF_UNIX)
try:
    c.connect("\0" + sys.argv[1]); print("ABSTRACT", c.makefile().readline().strip())
except OSError as exc:
    print("ABSTRACT", type(exc).__name__)
"""


def test_a_job_reaches_no_other_jobs_service_on_loopback_nor_abstract_sockets(
    machines: tuple[FakeAgentAPI, FakeAgentAPI, Machines],
) -> None:
    api_a, api_b, _ = machines
    secret = f"victim-secret-{secrets.token_hex(6)}"
    abstract = f"cc-victim-{secrets.token_hex(4)}"
    victim = api_b.assign(
        f"python3 -c {shlex.quote(VICTIM)}", env={"SECRET": secret, "ABSTRACT": abstract}, timeout_seconds=120
    )
    try:
        output = api_b.wait_output(victim, "PORT=", timeout=30)
        assert output.count(f"SELF {secret}") == 2  # its own services answer it
        port = int(output.split("PORT=")[1].split()[0])

        finished, seen = run(
            api_a,
            probe_command(f"127.0.0.1:{port}") + f"; python3 -c {shlex.quote(ATTACK_ABSTRACT)} {abstract}",
        )
    finally:
        api_b.cancel(victim)
    assert finished["outcome"] == "succeeded", seen
    assert secret not in seen
    assert refused(tries(seen)[f"127.0.0.1:{port}"])
    assert "ABSTRACT ConnectionRefusedError" in seen


# ---- the internet, and nothing private ------------------------------------------------------------


def test_a_job_reaches_the_internet_and_not_the_hosts_loopback_lan_or_metadata(
    lab: netlab.Lab, machines: tuple[FakeAgentAPI, FakeAgentAPI, Machines], service: Service
) -> None:
    api_a, _, _ = machines
    host_ip = next(a for a in host_addresses() if ":" not in a and not a.startswith("127."))
    everywhere = Service("0.0.0.0")  # a control plane listening on every address of the host
    try:
        targets = {
            "internet": f"{PUBLIC}:8080",
            "lan": f"{PRIVATE}:8080",
            "metadata range": f"{LINK_LOCAL}:8080",
            "host loopback": f"127.0.0.1:{service.port}",
            "agent API": f"127.0.0.1:{api_a.url.rsplit(':', 1)[1]}",
            "host address": f"{host_ip}:{everywhere.port}",
        }
        finished, seen = run(api_a, probe_command(*targets.values()))
    finally:
        everywhere.close()
    assert finished["outcome"] == "succeeded", seen
    results = tries(seen)
    assert results[targets["internet"]][0] == f"LAB:{PUBLIC}:8080", seen
    for name, target in targets.items():
        if name != "internet":
            assert refused(results[target]), f"{name} {target}: {results[target]}"
    assert service.secret not in seen and everywhere.secret not in seen


def test_the_machine_types_allow_list_opens_only_what_it_names(
    lab: netlab.Lab, machines: tuple[FakeAgentAPI, FakeAgentAPI, Machines], service: Service
) -> None:
    api_a, _, _ = machines
    other = Service()
    try:
        allowed = [f"{PRIVATE}:8080", f"127.0.0.1:{service.port}"]
        targets = [*allowed, f"{PRIVATE}:8081", f"{LINK_LOCAL}:8080", f"127.0.0.1:{other.port}"]
        # Twice: the first job's network is made at its start (the one the idle machine made
        # had the last job's allow list); the machine makes the second's ahead, with this list.
        runs = [run(api_a, probe_command(*targets), network={"allow": allowed}) for _ in range(2)]
    finally:
        other.close()
    assert [finished["network"] for finished, _ in runs] == ["at start", "ahead"]
    for finished, seen in runs:
        assert finished["outcome"] == "succeeded", seen
        results = tries(seen)
        assert results[f"{PRIVATE}:8080"][0] == f"LAB:{PRIVATE}:8080"
        assert results[f"127.0.0.1:{service.port}"][0] == service.secret  # an operator's cache, say
        for target in targets[2:]:
            assert refused(results[target]), f"{target}: {results[target]}"
        assert other.secret not in seen


def test_proc_net_lists_only_the_jobs_own_sockets(
    machines: tuple[FakeAgentAPI, FakeAgentAPI, Machines], service: Service, tmp_path: Path
) -> None:
    api_a, _, _ = machines
    path = tmp_path / f"cc-host-{secrets.token_hex(4)}.sock"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(path))
    unix.listen(1)
    try:
        finished, seen = run(api_a, "cat /proc/net/tcp /proc/net/tcp6 /proc/net/unix")
    finally:
        unix.close()
    assert finished["outcome"] == "succeeded", seen
    assert f":{service.port:04X} " not in seen  # the host's listening port
    assert str(path) not in seen and "catacloud" not in seen  # nor its sockets' paths


def test_without_pasta_a_job_gets_no_network_rather_than_the_hosts(
    lab: netlab.Lab, machines: tuple[FakeAgentAPI, FakeAgentAPI, Machines], service: Service
) -> None:
    _, _, group = machines
    api = group.start("org-c", env={"CATACLOUD_PASTA": "/nonexistent/pasta"})
    report = api.calls("POST", "enroll")[0].body["machine"]["isolation"]
    assert report["network"] == "none" and "pasta" in report["network_detail"]
    finished, seen = run(
        api,
        "ip -o addr | awk '{print \"IF\", $2}'; "
        + probe_command(f"{PUBLIC}:8080", f"127.0.0.1:{service.port}"),
    )
    assert finished["outcome"] == "succeeded", seen
    assert {line.split()[1] for line in seen.splitlines() if line.startswith("IF ")} == {"lo"}
    results = tries(seen)
    assert not results[f"{PUBLIC}:8080"][0].startswith("LAB")
    assert results[f"127.0.0.1:{service.port}"][0] != service.secret


FLOOD = r"""
import socket, sys, time
held, reached = [], set()
targets = [(h, int(p)) for h, p in (t.rsplit(":", 1) for t in sys.argv[1:])]
targets += [(h, port) for h in {h for h, _ in targets} for port in range(1, 1025)]
for host, port in targets:
    for _ in range(1000 if port > 1024 else 1):
        s = socket.socket(); s.settimeout(0.5)
        try:
            s.connect((host, port))
        except OSError:
            s.close()
            break
        held.append(s); reached.add(f"{host}:{port}")
print("FLOOD held", len(held), "reached", sorted(reached), flush=True)
time.sleep(15)
"""


def test_a_job_flooding_every_port_it_can_reach_slows_no_other_organizations_job(
    machines: tuple[FakeAgentAPI, FakeAgentAPI, Machines],
) -> None:
    """1,000 connections to every port the job can reach (the agent APIs, the host's address,
    ports 1-1024): it reaches none of them, and the other organization's job runs as before."""
    api_a, api_b, _ = machines
    host_ip = next(a for a in host_addresses() if ":" not in a and not a.startswith("127."))
    work = "for i in $(seq 300); do echo line-$i; done"
    started = time.monotonic()
    assert run(api_b, work)[0]["outcome"] == "succeeded"
    usual = time.monotonic() - started
    ports = [api.url.rsplit(":", 1)[1] for api in (api_a, api_b)]
    targets = [f"{h}:{p}" for h in ("127.0.0.1", host_ip) for p in ports]
    flood = api_a.assign(f"python3 -c {shlex.quote(FLOOD)} " + " ".join(targets), timeout_seconds=120)
    api_a.wait_output(flood, "FLOOD held", timeout=60)
    started = time.monotonic()
    finished, seen = run(api_b, work)
    took = time.monotonic() - started
    assert finished["outcome"] == "succeeded", seen
    assert [line for line in seen.splitlines() if line.startswith("line-")] == [
        f"line-{i}" for i in range(1, 301)
    ]  # its log complete, in order
    assert took < usual + 10, f"{took:.1f} s under the flood, {usual:.1f} s before"
    assert "FLOOD held 0 reached []" in api_a.output(flood, "stdout")
    api_a.cancel(flood)


# ---- CPU and cgroups ---------------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroup limits need root (or a delegated cgroup)")
def test_machine_cgroups_live_under_their_installations_own_and_never_exceed_the_host(
    tmp_path: Path,
) -> None:
    from catacloud.providers.machine_sandbox import host_cpus

    made: list[tuple[LocalProvider, str]] = []
    limits = {}
    try:
        for installation in ("inst-a", "inst-b"):
            provider = LocalProvider(config={"state_dir": str(tmp_path / installation)}, credentials={})
            spec = MachineSpec(
                instance_id=str(uuid.uuid4()),
                labels={LABEL_INSTALLATION: installation},
                server_type="local",
                image="local",
                cpus=64,
                memory_mb=256,
                command=("sleep", "60"),
            )
            provider.create(spec)
            made.append((provider, spec.instance_id))
            limits[installation] = json.loads(
                (tmp_path / installation / spec.instance_id / "limits.json").read_text()
            )
        for installation, record in limits.items():
            assert record["enforced"] is True, record
            assert f"/catacloud-{installation}/cc-" in record["cgroup"]
            assert record["cpus"] == host_cpus() < 64  # a machine never gets more than the host
        parents = {r["cgroup"].rsplit("/", 1)[0] for r in limits.values()}
        assert len(parents) == 2  # two installations never share a parent
    finally:
        for provider, instance_id in made:
            provider.delete(instance_id)
    for record in limits.values():  # gone with their machines, and so is the installation's own
        assert not any(Path(root + record["cgroup"]).exists() for root in _cgroup_roots())
        installation = record["cgroup"].rsplit("/", 1)[0]
        assert not any(Path(root + installation).exists() for root in _cgroup_roots()), installation


def _cgroup_roots() -> list[str]:
    return ["/sys/fs/cgroup"] + [f"/sys/fs/cgroup/{c}" for c in ("cpu", "memory", "pids")]
