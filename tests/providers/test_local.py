"""The local driver: machines are detached processes recorded in a state directory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from catacloud.providers import (
    LABEL_INSTALLATION,
    LABEL_POOL,
    InsufficientCapacity,
    MachineSpec,
    MachineState,
    NotFound,
    Permanent,
)
from catacloud.providers.base import Bootstrap
from catacloud.providers.local import LocalProvider

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = (sys.executable, "-c", "import time; time.sleep(300)")


def make_spec(command: tuple[str, ...] = SLEEPER, **labels: str) -> MachineSpec:
    return MachineSpec(
        instance_id=str(uuid.uuid4()),
        labels={LABEL_INSTALLATION: "test", **labels},
        server_type="local",
        image="local",
        command=command,
    )


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def is_dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture()
def state_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "machines"
    yield path
    # Never leak processes: delete whatever the test left behind.
    cleaner = LocalProvider(config={"state_dir": str(path), "stop_timeout_seconds": 0.5}, credentials={})
    for record in path.glob("*.json"):
        cleaner.delete(record.stem)


@pytest.fixture()
def provider(state_dir: Path) -> LocalProvider:
    return LocalProvider(config={"state_dir": str(state_dir)}, credentials={})


def record_of(state_dir: Path, instance_id: str) -> dict:
    return json.loads((state_dir / f"{instance_id}.json").read_text())


def test_create_starts_a_detached_process_with_the_spec_env(provider: LocalProvider, state_dir: Path) -> None:
    script = (
        "import os, sys, time; print('agent for', os.environ['CC_TEST_VAR'], flush=True); time.sleep(300)"
    )
    spec = MachineSpec(
        instance_id=str(uuid.uuid4()),
        labels={LABEL_INSTALLATION: "test"},
        server_type="local",
        image="local",
        command=(sys.executable, "-c", script),
        env={"CC_TEST_VAR": "hello-42"},
    )
    machine = provider.create(spec)

    assert machine.provider_id == spec.instance_id
    assert machine.name == f"cc-{spec.instance_id}"
    assert machine.state is MachineState.RUNNING
    pid = record_of(state_dir, spec.instance_id)["pid"]
    assert psutil.Process(pid).is_running()
    assert os.getsid(pid) == pid != os.getsid(0)  # own session: survives a worker restart
    log = state_dir / f"{spec.instance_id}.log"
    assert wait_for(lambda: "agent for hello-42" in log.read_text())


def test_an_account_full_to_max_machines_answers_no_capacity_until_one_ends(state_dir: Path) -> None:
    room = LocalProvider(config={"state_dir": str(state_dir), "max_machines": 2}, credentials={})
    first, second, third = make_spec(), make_spec(), make_spec()
    room.create(first)
    room.create(second)
    room.create(first)  # adopting a machine it holds is no new machine
    with pytest.raises(InsufficientCapacity, match="at most 2 machines"):
        room.create(third)
    assert not (state_dir / f"{third.instance_id}.json").exists()
    room.delete(second.instance_id)
    room.create(third)


def test_create_twice_starts_one_process(provider: LocalProvider, state_dir: Path) -> None:
    spec = make_spec()
    first = provider.create(spec)
    pid = record_of(state_dir, spec.instance_id)["pid"]
    again = LocalProvider(config={"state_dir": str(state_dir)}, credentials={}).create(spec)
    assert again.provider_id == first.provider_id
    assert record_of(state_dir, spec.instance_id)["pid"] == pid
    assert len(list(state_dir.glob("*.json"))) == 1


def test_machines_survive_the_worker_and_a_new_provider_lists_them(state_dir: Path) -> None:
    instance_id = str(uuid.uuid4())
    worker = f"""
import sys
from catacloud.providers import MachineSpec
from catacloud.providers.local import LocalProvider
provider = LocalProvider(config={{"state_dir": {str(state_dir)!r}}}, credentials={{}})
provider.create(MachineSpec(instance_id={instance_id!r}, labels={{"catacloud/installation": "test"}},
    server_type="local", image="local", command=(sys.executable, "-c", "import time; time.sleep(300)")))
"""
    subprocess.run([sys.executable, "-c", worker], cwd=ROOT, check=True, timeout=30)  # the worker exits

    restarted = LocalProvider(config={"state_dir": str(state_dir)}, credentials={})
    found = restarted.list({LABEL_INSTALLATION: "test"})
    assert [m.provider_id for m in found] == [instance_id]
    assert found[0].state is MachineState.RUNNING
    pid = record_of(state_dir, instance_id)["pid"]
    restarted.delete(instance_id)
    assert wait_for(lambda: is_dead(pid))
    assert restarted.list({LABEL_INSTALLATION: "test"}) == []


def test_list_filters_by_owner_labels(provider: LocalProvider) -> None:
    mine = provider.create(make_spec(**{LABEL_POOL: "p1"}))
    provider.create(make_spec(**{LABEL_POOL: "p2"}))
    assert [m.provider_id for m in provider.list({LABEL_POOL: "p1"})] == [mine.provider_id]
    assert len(provider.list({LABEL_INSTALLATION: "test"})) == 2
    assert provider.list({LABEL_INSTALLATION: "other"}) == []


def test_delete_kills_the_whole_process_group(provider: LocalProvider, state_dir: Path) -> None:
    spec = make_spec(command=("sh", "-c", "sleep 300 & wait"))
    provider.create(spec)
    leader = record_of(state_dir, spec.instance_id)["pid"]

    def sleeper() -> int | None:
        found = [p.pid for p in psutil.Process(leader).children(recursive=True) if p.name() == "sleep"]
        return found[0] if found else None

    assert wait_for(lambda: sleeper() is not None)
    child = sleeper()
    assert child is not None and psutil.Process(child).is_running()

    provider.delete(spec.instance_id)

    assert wait_for(lambda: is_dead(leader) and is_dead(child))
    assert not (state_dir / f"{spec.instance_id}.json").exists()
    with pytest.raises(NotFound):
        provider.get(spec.instance_id)


def test_a_machine_ignoring_sigterm_is_killed_after_the_grace_period(state_dir: Path) -> None:
    provider = LocalProvider(
        config={"state_dir": str(state_dir), "stop_timeout_seconds": 0.3}, credentials={}
    )
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(300)"
    )
    spec = make_spec(command=(sys.executable, "-c", stubborn))
    provider.create(spec)
    log = state_dir / f"{spec.instance_id}.log"
    assert wait_for(lambda: "ready" in log.read_text())
    pid = record_of(state_dir, spec.instance_id)["pid"]

    started = time.monotonic()
    provider.delete(spec.instance_id)

    assert is_dead(pid)
    assert time.monotonic() - started >= 0.25  # not before its boot delay


def test_delete_of_unknown_or_deleted_machine_is_success(provider: LocalProvider) -> None:
    spec = make_spec()
    provider.create(spec)
    provider.delete(spec.instance_id)
    provider.delete(spec.instance_id)
    provider.delete(str(uuid.uuid4()))
    provider.delete("../../etc/passwd")
    with pytest.raises(NotFound):
        provider.get("../../etc/passwd")


def test_a_dead_process_shows_as_gone(provider: LocalProvider, state_dir: Path) -> None:
    spec = make_spec(command=(sys.executable, "-c", "pass"))
    provider.create(spec)
    assert wait_for(lambda: provider.get(spec.instance_id).state is MachineState.GONE)
    gone = provider.get(spec.instance_id)
    assert gone.raw_state == "exited"
    assert not gone.alive
    assert provider.list({LABEL_INSTALLATION: "test"}) == []  # list shows live-or-dying machines only
    assert provider.find_by_instance(spec.instance_id, {}) is None
    provider.delete(spec.instance_id)
    with pytest.raises(NotFound):
        provider.get(spec.instance_id)


def test_create_replaces_a_machine_whose_process_died(provider: LocalProvider, state_dir: Path) -> None:
    spec = make_spec()
    provider.create(spec)
    old_pid = record_of(state_dir, spec.instance_id)["pid"]
    os.killpg(old_pid, signal.SIGKILL)
    assert wait_for(lambda: provider.get(spec.instance_id).state is MachineState.GONE)
    assert provider.create(spec).state is MachineState.RUNNING
    assert record_of(state_dir, spec.instance_id)["pid"] != old_pid


def test_boot_delay_is_respected(state_dir: Path) -> None:
    provider = LocalProvider(config={"state_dir": str(state_dir), "boot_delay_seconds": 0.6}, credentials={})
    script = "import pathlib, time; pathlib.Path('booted').write_text(repr(time.time())); time.sleep(300)"
    spec = make_spec(command=(sys.executable, "-c", script))
    marker = state_dir / spec.instance_id / "booted"  # the machine's own folder, its working directory
    before = time.time()
    machine = provider.create(spec)

    assert machine.state is MachineState.PROVISIONING
    assert machine.raw_state == "booting"
    assert not marker.exists()
    assert wait_for(lambda: marker.exists() and marker.read_text() != "", timeout=5)
    assert float(marker.read_text()) - before >= 0.6
    assert wait_for(lambda: provider.get(spec.instance_id).state is MachineState.RUNNING, timeout=2)
    # exec kept the pid, so the record still points at the agent
    assert psutil.Process(record_of(state_dir, spec.instance_id)["pid"]).cmdline()[-1] == script


def test_a_reused_pid_is_neither_trusted_nor_signalled(provider: LocalProvider, state_dir: Path) -> None:
    decoy = subprocess.Popen(SLEEPER, start_new_session=True)
    time.sleep(0.2)  # a reused pid belongs to a process started at another time
    spec = make_spec()
    provider.create(spec)
    path = state_dir / f"{spec.instance_id}.json"
    record = json.loads(path.read_text())
    real_pid = record["pid"]
    try:
        record["pid"] = decoy.pid  # as if the agent died and its pid went to another process
        path.write_text(json.dumps(record))

        assert provider.get(spec.instance_id).state is MachineState.GONE
        provider.delete(spec.instance_id)
        assert decoy.poll() is None  # the unrelated process was not killed
        assert wait_for(lambda: is_dead(real_pid))  # the machine was: found by its mark
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(real_pid, signal.SIGKILL)
        decoy.kill()
        decoy.wait()


def test_bad_configuration_and_specs_are_permanent(state_dir: Path, provider: LocalProvider) -> None:
    with pytest.raises(Permanent, match="state_dir"):
        LocalProvider(config={}, credentials={})
    with pytest.raises(Permanent, match="command"):
        provider.create(make_spec(command=()))
    with pytest.raises(Permanent, match="cannot start"):
        provider.create(make_spec(command=("/nonexistent/catacloud-agent",)))
    assert list(state_dir.glob("*.json")) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroup limits need root (or a delegated cgroup)")
def test_a_machine_gets_its_machine_types_memory_and_process_limits(state_dir: Path) -> None:
    """A local machine of a 64 MB machine type cannot take 256 MB of the host, nor fork without
    end; the machine's folder says the limits hold (the agent reports it at enrollment)."""
    provider = LocalProvider(config={"state_dir": str(state_dir), "pids_max": 40}, credentials={})
    hog = "b = bytearray(256 * 2**20); print('allocated', flush=True)"
    forks = textwrap.dedent(
        """
        import os, time
        kids = []
        try:
            while len(kids) < 200:
                pid = os.fork()
                if pid == 0:
                    time.sleep(30)
                    os._exit(0)
                kids.append(pid)
        except OSError:
            pass
        print("forks=%d" % len(kids), flush=True)
        for pid in kids:
            os.kill(pid, 9)
        """
    )
    py = sys.executable
    spec = MachineSpec(
        instance_id=str(uuid.uuid4()),
        labels={LABEL_INSTALLATION: "test"},
        server_type="local",
        image="local",
        memory_mb=64,
        cpus=1,
        command=("sh", "-c", f'{py} -c "{hog}"; echo "hog=$?"; exec {py} -c "$0"', forks),
    )
    provider.create(spec)
    log = state_dir / f"{spec.instance_id}.log"
    try:
        assert wait_for(lambda: "forks=" in log.read_text(), timeout=30), log.read_text()
        text = log.read_text()
        assert "allocated" not in text and "hog=137" in text  # killed by the kernel, out of memory
        assert int(text.split("forks=")[1].split()[0]) < 40
        limits = json.loads((state_dir / spec.instance_id / "limits.json").read_text())
        assert limits["enforced"] is True and limits["memory_mb"] == 64 and limits["pids"] == 40
    finally:
        provider.delete(spec.instance_id)


# -- a machine lives and dies as one ------------------------------------------------------------


def closed_port() -> int:
    """A loopback port nothing listens on: a control plane that is gone."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agent_spec() -> MachineSpec:
    """A real agent whose control plane does not answer (it retries enrolling meanwhile)."""
    return MachineSpec(
        instance_id=str(uuid.uuid4()),
        labels={LABEL_INSTALLATION: "test"},
        server_type="local",
        image="local",
        bootstrap=Bootstrap(agent_url=f"http://127.0.0.1:{closed_port()}", token="bootstrap-test-token"),
    )


def machine_tree(state_dir: Path, instance_id: str) -> list[psutil.Process]:
    top = psutil.Process(record_of(state_dir, instance_id)["pid"])
    return [top, *top.children(recursive=True)]


def the_agent(tree: list[psutil.Process]) -> psutil.Process | None:
    for proc in tree:
        if proc.name() not in ("bwrap", "sh") and "catacloud.agent" in " ".join(proc.cmdline()):
            return proc
    return None


@pytest.mark.parametrize("victim", ["the outer sandbox", "the recorded process"])
def test_killing_the_top_of_a_machine_ends_its_agent(
    provider: LocalProvider, state_dir: Path, victim: str
) -> None:
    """Killing a machine's outer bwrap left the inner bwrap and the agent running, re-parented
    to init, out of every record's reach. Each process of the chain now dies with the one above
    it, so killing the sandbox, or the one process the provider records, ends the machine."""
    spec = agent_spec()
    provider.create(spec)
    assert wait_for(lambda: the_agent(machine_tree(state_dir, spec.instance_id)) is not None, 15)
    tree = machine_tree(state_dir, spec.instance_id)
    agent = the_agent(tree)
    assert agent is not None
    if victim == "the outer sandbox":
        target = next(p for p in tree if p.name() == "bwrap")
    else:
        target = psutil.Process(record_of(state_dir, spec.instance_id)["pid"])

    target.kill()

    assert wait_for(lambda: is_dead(agent.pid), 5), f"the agent outlived {victim}"
    assert wait_for(lambda: all(is_dead(p.pid) for p in tree), 5)
    assert provider.get(spec.instance_id).state is MachineState.GONE


def test_a_local_agent_whose_control_plane_never_answers_ends_its_machine(state_dir: Path) -> None:
    """A local machine has no purpose without its stack: past the account's unreachable limit
    its agent ends itself, and the machine (keeper, sandbox, agent) is gone."""
    provider = LocalProvider(
        config={"state_dir": str(state_dir), "unreachable_limit_seconds": 2}, credentials={}
    )
    spec = agent_spec()
    provider.create(spec)
    tree = machine_tree(state_dir, spec.instance_id)

    assert wait_for(lambda: provider.get(spec.instance_id).state is MachineState.GONE, 20)
    assert wait_for(lambda: all(is_dead(p.pid) for p in tree), 5)
    log = (state_dir / f"{spec.instance_id}.log").read_text()
    assert "did not answer within 2 s (the unreachable limit)" in log, log


def test_a_host_without_pasta_is_told_its_jobs_get_no_network_and_how_to_fix_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make dev` says at start when local machines' jobs would get no network (never the
    host's), naming the one install line."""
    from catacloud.cli import _local_network_note
    from catacloud.providers.machine_sandbox import network_problem

    monkeypatch.setenv("CATACLOUD_PASTA", "/nonexistent/pasta")
    assert "apt install passt nftables" in (network_problem(tmp_path) or "")
    _local_network_note(tmp_path)
    said = capsys.readouterr().out
    assert "jobs on local machines get no network" in said and "apt install passt nftables" in said


def test_a_gpu_machine_type_sees_the_hosts_gpu_devices_and_no_other_does(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An enrolled host's GPU slot (its machine type's ``gpus``) gets the host's GPU device nodes;
    a machine that asked for none sees no such node. (No GPU here: ``/dev/loop-control``, which a
    machine never has, plays one.)"""
    from catacloud.providers import local

    monkeypatch.setattr(local, "gpu_devices", lambda: ["/dev/loop-control"])
    provider = LocalProvider(config={"state_dir": str(state_dir)}, credentials={})
    seen = {}
    for gpus in (1, 0):
        spec = MachineSpec(
            instance_id=str(uuid.uuid4()),
            labels={LABEL_INSTALLATION: "test"},
            server_type="local",
            image="local",
            gpus=gpus,
            command=("sh", "-c", "test -c /dev/loop-control && echo GPU-NODE || echo NO-NODE; sleep 30"),
        )
        provider.create(spec)
        log = state_dir / f"{spec.instance_id}.log"
        assert wait_for(lambda log=log: "NODE" in log.read_text(), 10), log.read_text()
        seen[gpus] = log.read_text()
        provider.delete(spec.instance_id)
    assert "GPU-NODE" in seen[1] and "NO-NODE" in seen[0], seen
