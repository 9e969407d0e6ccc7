"""Boundary: job code reaches only its own env, work folder and ``catacloud`` over the agent's
socket; it never outlives its agent.

Shown on main: local jobs inherited the control plane's environment (``DATABASE_URL``,
``REDIS_URL``, ``FLOWER_BASIC_AUTH``), ran as root and read the agent's state file and
``/proc/<agent>/environ``; a job whose agent was SIGKILLed lived on (it ran in its own session)
while attempt 2 ran elsewhere.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from catacloud.agent.sandbox import DEFAULT_JOB_UIDS
from catacloud.providers.base import MachineSpec
from catacloud.providers.local import TOKEN_FILE, LocalProvider
from testkit.processes import wait_for
from tests.agent.fake_server import FakeAgentAPI
from tests.agent.harness import AgentProcess, agent_pid, alive, host_pids, values, wait_gone

CONTROL_PLANE_ENV = {
    "DATABASE_URL": "postgresql://postgres:s3cret-db@127.0.0.1:5432/catacloud",
    "REDIS_URL": "redis://:s3cret-redis@127.0.0.1:6379/0",
    "FLOWER_BASIC_AUTH": "admin:s3cret-admin",
    "DJANGO_SECRET_KEY": "s3cret-django-key",
    "CATACLOUD_ENCRYPTION_KEY": "s3cret-fernet-key",
}
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


def test_a_job_dies_with_its_agent_even_when_the_agent_is_sigkilled(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent()
    job = api.assign(
        "sleep 1000 & echo bg=$!;"
        " setsid sh -c 'echo esc=$$; exec sleep 1000' &"  # left the job's process group
        " (setsid sh -c 'echo dmn=$$; exec sleep 1000' &);"  # double fork: a daemon
        " sleep 0.3; echo fg=$$; exec sleep 1000",
        timeout_seconds=600,
    )
    output = api.wait_output(job, "fg=", timeout=10)
    pids = host_pids(agent, *(int(values(output, key)[0]) for key in ("bg", "esc", "dmn", "fg")))
    assert all(alive(pid) for pid in pids)

    agent.signal(signal.SIGKILL)
    agent.proc.wait(5)

    assert wait_gone(pids, timeout=5) == [], "the job's processes outlived their agent"


def test_a_job_gets_its_own_env_and_nothing_of_the_agents(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], work_dir: Path
) -> None:
    start_agent(env_extra=CONTROL_PLANE_ENV)
    job = api.assign("env; echo path=$PATH; command -v catacloud", env={"GREETING": "hello"})
    assert api.wait_finished(job)["outcome"] == "succeeded"
    output = api.output(job)

    for name, value in CONTROL_PLANE_ENV.items():
        assert name not in output and value not in output
    assert api.bootstrap_token not in output
    assert "GREETING=hello" in output
    assert f"CATACLOUD_JOB_ID={job}" in output
    # PATH: the agent's own `catacloud` wrapper first (job-meta, checkpoint), then its Python's folder
    job_bin, python_bin = values(output, "path")[0].split(":")[:2]
    assert python_bin == os.path.dirname(sys.executable)
    wrapper = output.strip().splitlines()[-1]
    assert wrapper == os.path.join(job_bin, "catacloud")
    assert f"exec {sys.executable} -m catacloud.agent" in Path(wrapper).read_text()


@root_only
def test_each_job_runs_as_a_uid_of_its_own_and_cannot_read_the_agents_secrets(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    agent = start_agent("--state-file", str(state_dir / "agent.json"))
    probe = (
        'echo "uid=$(id -u)"; echo "groups=$(id -G)";'
        ' cat "$STATE" >/dev/null 2>&1; echo "state=$?";'
        ' cat "/proc/$AGENT/environ" >/dev/null 2>&1; echo "environ=$?";'
        ' echo mine > "$CATACLOUD_OUTPUT_DIR/x"; echo "out=$?";'
        ' echo "home=$(cd && pwd)"'
    )
    env = {"STATE": str(state_dir / "agent.json"), "AGENT": str(agent_pid(agent))}
    first, second = api.assign(probe, env=env), api.assign(probe, env=env)
    assert api.wait_finished(first)["outcome"] == api.wait_finished(second)["outcome"] == "succeeded"

    uids = []
    for job in (first, second):
        output = api.output(job)
        uids += [int(uid) for uid in values(output, "uid")]
        assert values(output, "groups") == values(output, "uid"), "no supplementary groups"
        assert values(output, "state") != ["0"], "the job read the agent's state file (its token)"
        assert values(output, "environ") != ["0"], "the job read the agent's environment"
        assert values(output, "out") == ["0"], "the job can write its own outputs"
    assert len(set(uids)) == 2, "a new uid for each job"
    assert all(uid in DEFAULT_JOB_UIDS for uid in uids), "never root, never an account of the host"
    assert json.loads((state_dir / "agent.json").read_text())["agent_token"] == api.agent_token
    assert not (tmp_path / "bootstrap-token-0").exists(), "the used bootstrap token file is removed"


def test_a_local_machine_gets_neither_the_control_planes_env_nor_its_token_in_environ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in CONTROL_PLANE_ENV.items():
        monkeypatch.setenv(name, value)
    provider = LocalProvider(config={"state_dir": str(tmp_path)}, credentials={})
    token = "cb.instance.abcdefghijklmnopqrstuvwxyz"
    spec = MachineSpec(
        instance_id="m1",
        labels={},
        server_type="local",
        image="",
        location="",
        cpus=1,
        memory_mb=256,  # (1 MB: the cgroup's OOM killer took its outer bubblewrap, and now the machine)
        gpus=0,
        spot=False,
        user_data="",
        command=("sh", "-c", "sleep 30"),
        env={"CATACLOUD_BOOTSTRAP_TOKEN": token},
    )
    record = provider.create(spec)
    try:
        root = psutil.Process(json.loads((tmp_path / "m1.json").read_text())["pid"])
        wait_for(lambda: any(p.name() == "sleep" for p in root.children(recursive=True)), 10, "the command")
        cmdlines = []
        for process in [root, *root.children(recursive=True)]:
            environ = process.environ()
            cmdlines.append(" ".join(process.cmdline()))
            assert not set(CONTROL_PLANE_ENV) & set(environ)
            assert token not in json.dumps(environ) and token not in cmdlines[-1]
        assert f"--bootstrap-token-file {TOKEN_FILE}" in cmdlines[0]  # in the machine's own folder
        token_file = tmp_path / "m1" / "bootstrap-token"
        assert token_file.read_text() == token and token_file.stat().st_mode & 0o777 == 0o600
    finally:
        provider.delete(record.provider_id)
    assert not (tmp_path / "m1").exists(), "the machine's folder (and the token) go with it"


def test_cloud_machines_run_the_agent_as_root_and_every_job_as_a_uid_of_its_own() -> None:
    import yaml

    from catacloud.providers.userdata import VENV, render_user_data

    document = yaml.safe_load(
        render_user_data(agent_url="https://cc.example", bootstrap_token="cb.x.abcdefghijklmnopqrstuvwxyz")
    )
    assert "users" not in document, "no shared job account: each job gets a uid of its own"
    unit = next(f["content"] for f in document["write_files"] if f["path"].endswith(".service"))
    assert "--job-user" not in unit and "--no-sandbox" not in unit
    assert "User=" not in unit  # the agent itself stays root, to give each job its own uid
    # The agent's Python sits where every job uid can run it (catacloud job-meta, checkpoint).
    assert VENV.startswith("/opt/")


def test_the_agent_reads_a_jobs_folder_without_following_links(tmp_path: Path) -> None:
    import tarfile

    from catacloud.agent.files import archive_dir, open_beneath

    secret = tmp_path / "agent.json"
    secret.write_text("agent token")
    job = tmp_path / "checkpoint"
    (job / "real").mkdir(parents=True)
    (job / "real" / "weights.bin").write_text("weights")
    (job / "linked-dir").symlink_to(tmp_path)  # a folder swapped for a link
    (job / "linked-file").symlink_to(secret)

    os.close(open_beneath(str(job), "real/weights.bin"))
    for rel in ("linked-dir/agent.json", "linked-file", "../agent.json"):
        with pytest.raises(OSError):
            os.close(open_beneath(str(job), rel))

    archive = tmp_path / "c.tar.gz"
    archive_dir(str(job), str(archive))
    with tarfile.open(archive) as tar:
        contents = b"".join(
            tar.extractfile(m).read()
            for m in tar.getmembers()
            if m.isreg()  # type: ignore[union-attr]
        )
    assert b"agent token" not in contents and b"weights" in contents


def test_a_bootstrap_token_given_in_the_environment_leaves_it(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent(token_via_env=True, sandboxed=False)  # the agent alone, as on a cloud machine
    api.wait_for(lambda: api.calls("POST", "heartbeat"), what="a heartbeat")
    assert api.calls("POST", "enroll")[0].body["bootstrap_token"] == api.bootstrap_token
    environ = psutil.Process(agent.proc.pid).environ()
    assert api.bootstrap_token not in json.dumps(environ)
    assert api.bootstrap_token not in " ".join(psutil.Process(agent.proc.pid).cmdline())


@root_only
def test_an_unreachable_work_folder_stops_the_agent_with_a_clear_error(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], work_dir: Path
) -> None:
    private = work_dir.parent / "private"
    private.mkdir(mode=0o700)
    agent = start_agent("--work-dir", str(private / "work"))
    assert agent.wait() == 2
    assert f"cannot pass {private}" in agent.log()


def test_on_cloud_machines_the_state_folder_is_not_on_the_work_folders_path() -> None:
    from catacloud.providers.userdata import STATE_FILE, WORK_DIR

    state_folder = os.path.dirname(STATE_FILE)
    assert not (WORK_DIR + "/").startswith(state_folder + "/")
