"""The agent, run as a real process against a fake Agent API (and a fake EC2 metadata service)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from catacloud.agent import __version__
from catacloud.agent.client import AgentAPIError, RedactingFormatter, redact, register_secret
from catacloud.agent.meta import SOCKET_ENV, TOKEN_ENV, job_meta_command
from catacloud.agent.runner import LogStreamer
from catacloud.agent.sandbox import DEFAULT_JOB_UIDS, SANDBOX_SOCKET
from catacloud.protocol import VERSION as PROTOCOL_VERSION
from tests.agent.fake_server import FakeAgentAPI, FakeIMDS
from tests.agent.harness import (
    PY,
    AgentProcess,
    agent_pid,
    alive,
    assert_no_secrets,
    host_pids,
    leftovers,
    outcome,
    values,
    wait_gone,
)

# -- enrollment and heartbeats ------------------------------------------------------------------


def test_enroll_is_followed_at_once_by_a_heartbeat_then_periodic_ones(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent()
    api.wait_for(lambda: len(api.calls("POST", "heartbeat")) >= 4, what="four heartbeats")

    first, second = api.requests[0], api.requests[1]
    assert (first.method, first.path) == ("POST", "enroll")
    machine = first.body.pop("machine")
    assert first.body == {
        "bootstrap_token": api.bootstrap_token,
        "hostname": socket.gethostname(),
        "agent_version": __version__,
        "protocol": PROTOCOL_VERSION,  # the control plane refuses an agent too old for it
    }
    # How this machine isolates its jobs, told at enrollment: a sandbox each, a uid of their own.
    assert machine["isolation"]["jobs"] == "bubblewrap"
    assert machine["isolation"]["job_uids"] == str(DEFAULT_JOB_UIDS)
    assert machine["limits"]["enforced"] is True
    assert "Authorization" not in first.headers
    assert (second.method, second.path) == ("POST", "heartbeat")
    assert second.body == {"running_job": None}
    assert second.headers["Authorization"] == f"Agent {api.agent_token}"
    beats = [r.at for r in api.calls("POST", "heartbeat")]
    assert (
        max(b - a for a, b in zip(beats[1:], beats[2:], strict=False)) < 2.0
    )  # periodic (every ~0.2 s), not just once
    assert api.calls("GET", "work"), "idle agents long-poll for work"

    agent.signal(signal.SIGTERM)
    assert agent.wait() == 0
    assert f"enrolled as instance {api.instance_id}" in agent.log()
    assert_no_secrets(api, agent)


def test_a_used_bootstrap_token_makes_the_agent_exit_with_a_clear_error(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    first = start_agent()
    api.wait_for(lambda: api.calls("POST", "heartbeat"), what="the first agent's heartbeat")

    second = start_agent()

    assert second.wait() != 0
    assert "already used" in second.log()
    assert "single-use" in second.log()
    assert first.proc.poll() is None, "the first machine is unaffected"
    assert_no_secrets(api, second)


def test_an_unknown_bootstrap_token_makes_the_agent_exit_with_a_clear_error(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent(token="not-a-real-token-123")

    assert agent.wait() != 0
    assert "bootstrap token is invalid" in agent.log()
    assert "not-a-real-token-123" not in agent.log()


def test_a_revoked_agent_token_stops_the_agent(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent()
    api.wait_for(lambda: api.calls("POST", "heartbeat"), what="a heartbeat")

    api.revoked = True

    assert agent.wait() == 1
    assert "rejected this agent's credentials" in agent.log()
    assert_no_secrets(api, agent)


# -- running jobs -------------------------------------------------------------------------------


def test_output_reaches_the_server_while_the_job_still_runs(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    start_agent()
    job = api.assign("echo first; echo oops >&2; sleep 3; echo second")

    api.wait_output(job, "first\n", timeout=5)
    assert job not in api.finished, "the first line arrived before the job finished"
    api.wait_for(
        lambda: any(r.body == {"running_job": job} for r in api.calls("POST", "heartbeat")),
        what="a heartbeat naming the running job",
    )

    finished = api.wait_finished(job)
    assert outcome(finished) == {
        "exit_code": 0,
        "outcome": "succeeded",
        "reason": "exit code 0",
        "uploads_pending": 0,
        "code": "",
    }
    assert api.output(job, "stdout") == "first\nsecond\n"
    assert api.output(job, "stderr") == "oops\n"
    assert sorted(api.logs[job]) == list(range(len(api.logs[job]))), "seq counts up from 0"
    first_chunk_at = min(at for chunk, at in api.logs[job].values() if "first" in chunk["data"])
    assert api.finished[job][1] - first_chunk_at > 2.0
    log_posts = [r.at for r in api.calls("POST", f"jobs/{job}/logs")]
    assert max(log_posts) <= api.finished[job][1], "all output is sent before finished"
    assert [r.path for r in api.requests if r.path.startswith(f"jobs/{job}")][0] == f"jobs/{job}/started"


def test_exit_codes_are_reported_and_the_agent_takes_the_next_job(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], work_dir: Path
) -> None:
    agent = start_agent(token_via_env=True)
    failing = api.assign(
        'echo "id=$CATACLOUD_JOB_ID"; echo "attempt=$CATACLOUD_ATTEMPT"; echo "wd=$CATACLOUD_WORK_DIR";'
        ' echo "pwd=$(pwd)"; echo "greeting=$GREETING"; echo "boot=${CATACLOUD_BOOTSTRAP_TOKEN:-none}";'
        " exit 3",
        env={"GREETING": "hello"},
        attempt=2,
    )
    leaving_a_child = api.assign("sleep 1001 & echo bg=$!")

    assert outcome(api.wait_finished(failing)) == {
        "exit_code": 3,
        "outcome": "failed",
        "reason": "exit code 3",
        "uploads_pending": 0,
        "code": "",
    }
    assert api.wait_finished(leaving_a_child, timeout=8)["outcome"] == "succeeded"
    assert wait_gone(leftovers(agent, "sleep 1001")) == [], "no leftovers between jobs"
    output = api.output(failing)
    assert values(output, "id") == [failing]
    assert values(output, "attempt") == ["2"]
    assert values(output, "greeting") == ["hello"]
    assert values(output, "boot") == ["none"], "jobs never see the bootstrap token"
    assert values(output, "wd") == values(output, "pwd")
    assert Path(values(output, "wd")[0]).parent == work_dir
    assert Path(values(output, "wd")[0]).name.endswith("-2")


def pastas(agent: AgentProcess) -> list[int]:
    """The job networks' pasta processes on the agent's machine."""
    found = []
    with contextlib.suppress(psutil.Error):
        for process in psutil.Process(agent.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if process.name().startswith(("pasta", "passt")) and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process.pid)
    return found


PY_IN_JOB = "python3"
LINGER = (
    "import socket\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 47123)); s.listen()\n"
    "c = socket.create_connection(('127.0.0.1', 47123)); a, _ = s.accept()\n"
    "c.close(); a.recv(1); a.close()\n"
    "n = sum(':B813 ' in line and line.split()[3] == '06' for line in open('/proc/net/tcp'))\n"
    "print('left', n)"
)


def test_the_next_jobs_network_is_made_while_the_machine_idles_and_serves_that_job_alone(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent()
    enrolled = api.wait_for(lambda: api.calls("POST", "enroll"), timeout=20, what="the enrollment")
    isolation = enrolled[0].body["machine"]["isolation"]
    if isolation["network"] != "pasta":
        pytest.skip(f"no job network here: {isolation['network_detail']}")
    # Idle after enrolling: the first job's network is made already (its pasta runs).
    api.wait_for(lambda: len(pastas(agent)) == 1, timeout=20, what="the next job's network")
    # Each job counts the connections to port 47123 its namespace holds, then leaves one there:
    # closed first on its side, it stays in TIME_WAIT after the job's processes end, for as long
    # as the namespace lives. A job that found one would share an earlier job's namespace.
    jobs = [
        api.assign(f"grep -c ':B813 ' /proc/net/tcp; {PY_IN_JOB} -c {shlex.quote(LINGER)}") for _ in range(3)
    ]
    reports = [api.wait_finished(job, timeout=30) for job in jobs]

    assert [r["network"] for r in reports] == ["ahead"] * 3, reports
    assert all(0 < r["launch_ms"] < 60_000 for r in reports), reports
    counts = [api.output(job, "stdout").split() for job in jobs]
    errors = [api.output(job, "stderr") for job in jobs]
    assert counts == [["0", "left", "1"]] * 3, (
        f"each job in a network namespace of its own: {counts} {errors}"
    )
    # Each job's pasta ended with it; only the next job's runs while the machine idles.
    api.wait_for(lambda: len(pastas(agent)) == 1, timeout=20, what="one pasta: the next job's")
    time.sleep(0.5)
    assert len(pastas(agent)) == 1, "a job network outlived its job"


def serving_helpers(agent: AgentProcess) -> list[int]:
    """The job network's helper the agent keeps running (``netns_helper.py serve``), not counting
    the children it forks for a network (which run as a job uid)."""
    found = []
    with contextlib.suppress(psutil.Error):
        mine = psutil.Process(agent_pid(agent))
        for process in mine.children():
            with contextlib.suppress(psutil.Error):
                if "netns_helper.py serve" in " ".join(process.cmdline()) and process.status() != "zombie":
                    found.append(process.pid)
    return found


def test_job_networks_are_made_by_one_kept_helper_and_one_that_died_is_replaced(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    """No Python starts per job network: one helper the agent keeps forks each network's child
    (its rules, then pasta). A helper that died is started again for the next network."""
    agent = start_agent()
    enrolled = api.wait_for(lambda: api.calls("POST", "enroll"), timeout=20, what="the enrollment")
    if enrolled[0].body["machine"]["isolation"]["network"] != "pasta":
        pytest.skip("no job network here")
    api.wait_for(lambda: len(pastas(agent)) == 1, timeout=20, what="the first job's network")
    (kept,) = serving_helpers(agent)
    count = f"grep -c ':B813 ' /proc/net/tcp; {PY_IN_JOB} -c {shlex.quote(LINGER)}"
    jobs = [api.assign(count) for _ in range(2)]
    reports = [api.wait_finished(job, timeout=30) for job in jobs]
    api.wait_for(lambda: len(pastas(agent)) == 1, timeout=20, what="the next job's network")
    assert serving_helpers(agent) == [kept], "every network came from the same helper"

    os.kill(kept, signal.SIGKILL)  # the next job's network is made already; the one after it is not
    jobs += [api.assign(count) for _ in range(2)]
    reports += [api.wait_finished(job, timeout=30) for job in jobs[2:]]
    api.wait_for(lambda: len(pastas(agent)) == 1, timeout=20, what="the network after the helper died")

    assert [r["network"] for r in reports] == ["ahead"] * 4, reports
    assert [r["outcome"] for r in reports] == ["succeeded"] * 4, reports
    # each job still in a namespace of its own, the rules loaded (the same job as above)
    assert [api.output(job, "stdout").split() for job in jobs] == [["0", "left", "1"]] * 4
    assert len(again := serving_helpers(agent)) == 1 and again != [kept]


def test_the_next_jobs_network_is_made_while_a_job_runs_so_a_job_right_after_it_waits_for_none(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    """Back-to-back jobs (a CI burst): the next job's network is not made after a job ends, as
    the next job arrives, but while the job runs. Both exist then, each a namespace of its own."""
    agent = start_agent()
    enrolled = api.wait_for(lambda: api.calls("POST", "enroll"), timeout=20, what="the enrollment")
    if enrolled[0].body["machine"]["isolation"]["network"] != "pasta":
        pytest.skip("no job network here")
    api.wait_for(lambda: len(pastas(agent)) == 1, timeout=20, what="the first job's network")
    # The first job runs a while: meanwhile its own pasta and the next job's both run.
    count = f"grep -c ':B813 ' /proc/net/tcp; {PY_IN_JOB} -c {shlex.quote(LINGER)}"
    first = api.assign(f"{count}; sleep 6")
    second = api.assign(count)  # handed out as soon as the first ends
    api.wait_for(lambda: len(pastas(agent)) == 2, timeout=6, what="the next job's network, made meanwhile")
    assert first not in api.finished, "the first job ended before the next network was seen"
    reports = [api.wait_finished(job, timeout=30) for job in (first, second)]
    assert [r["network"] for r in reports] == ["ahead", "ahead"], reports
    # The second job's namespace is not the first's: the connection the first left is not there.
    assert [api.output(job, "stdout").split() for job in (first, second)] == [["0", "left", "1"]] * 2


def test_a_job_with_thousands_of_env_variables_gets_each_exactly(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    """The env reaches the job through a file its own shell reads, never bubblewrap's arguments
    (capped at 9000: a job with 5,000 variables used to fail to start)."""
    start_agent()
    env = {f"V{i}": f"value {i} with 'quotes' and $dollars" for i in range(5000)}
    env["MULTI"] = "line one\nline 'two'"
    job = api.assign('env | grep -c "^V[0-9]*="; printf "%s|" "$V4999" "$MULTI"', env=env)
    assert api.wait_finished(job, timeout=30)["outcome"] == "succeeded", api.output(job)
    count, values_seen = api.output(job, "stdout").split("\n", 1)
    assert count == "5000"
    assert values_seen == "value 4999 with 'quotes' and $dollars|line one\nline 'two'|"


def test_a_job_the_server_took_back_is_not_run(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], work_dir: Path
) -> None:
    start_agent()
    api.started_status["taken"] = 409
    api.assign("touch ran; echo ran", job_id="taken")
    after = api.assign("echo next")

    assert api.wait_finished(after)["outcome"] == "succeeded", api.finished
    assert "taken" not in api.finished
    assert "taken" not in api.logs
    assert not list(work_dir.glob("taken*")), "no working directory, nothing ran"


def test_nothing_of_a_job_runs_before_its_start_is_confirmed(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], work_dir: Path
) -> None:
    """The agent makes the job's folder and sandbox while its start report is on its way; the
    command waits at the sandbox's gate for the answer. Taken back late (409 after a second),
    nothing of it ran; confirmed late, its first instruction comes after the answer."""
    start_agent()
    api.started_delay.update(taken=1.0, late=1.0)
    api.started_status["taken"] = 409
    api.assign("touch ran; echo ran", job_id="taken")
    late = api.assign("date +%s.%N", job_id="late")
    finished = api.wait_finished(late, timeout=30)
    assert finished["outcome"] == "succeeded", api.output(late)
    assert "taken" not in api.finished and "taken" not in api.logs
    assert not list(work_dir.glob("taken*")), "its folder went"
    assert not list(work_dir.rglob("ran")), "its command never ran"
    first_instruction = float(api.output(late, "stdout").split()[0])
    assert first_instruction >= api.started_answered["late"], (first_instruction, api.started_answered)


def test_a_job_held_at_its_gate_never_runs_when_its_agent_dies(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], work_dir: Path
) -> None:
    """The agent crashes (SIGKILL) while a job's sandbox waits for its start's answer: the
    kernel closes the agent's end of the gate unwritten, and the sandbox ends with nothing of its
    command run. (bubblewrap's own hold, ``--block-fd``, went on at end-of-file: the command's
    first instant ran before ``--die-with-parent`` ended it.)"""
    agent = start_agent()
    api.started_delay["held"] = 5.0  # the answer never comes in time
    api.assign("touch ran; echo ran", job_id="held")
    api.wait_for(lambda: api.calls("POST", "jobs/held/started"), what="the start report")

    def held() -> list[int]:
        with contextlib.suppress(psutil.Error):
            return [
                p.pid
                for p in psutil.Process(agent.proc.pid).children(recursive=True)
                if "touch ran" in " ".join(p.cmdline())
            ]
        return []

    api.wait_for(held, what="the job's sandbox, held")
    time.sleep(0.5)  # made whole, waiting at its gate
    sandbox = held()
    agent.signal(signal.SIGKILL)
    assert wait_gone(sandbox, timeout=10) == [], "the held sandbox ended with its agent"
    assert list(work_dir.glob("held*")), "the job's folder is there (nobody removed it)"
    assert not list(work_dir.rglob("ran")), "its command never ran"
    assert "held" not in api.finished and "held" not in api.logs


# A launcher that dies (SIGKILL: no goodbye) while its sandbox waits at the gate, the moment the
# sandbox has its first process; or (argv[3] "open") once the command it let run has ended.
# argv[1] is the job's folder: the command touches a file there.
_DIES_HOLDING = """
import os, signal, sys
from catacloud.agent.netns import Egress
from catacloud.agent.sandbox import BubblewrapLauncher, JobPlace, bwrap_path
uid = int(sys.argv[2])
launcher = BubblewrapLauncher(bwrap=bwrap_path(), hostname="held", egress=Egress("none", detail="test"))
launch = launcher.launch("touch ran", {}, JobPlace(sys.argv[1], "", uid, uid), held=True)
proc = launch.spawn()
assert launch.gate is not None and launch.gate.child() is not None
if sys.argv[3] == "open":
    assert launch.begin(proc) is None
    proc.wait()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox runs as a job uid")
def test_a_sandbox_held_at_its_gate_never_runs_when_its_launcher_dies(work_dir: Path) -> None:
    """Straight at the launcher: with bubblewrap's own ``--block-fd`` as the gate, 19 and 20 of
    20 such launches ran the command.

    A launcher killed while bubblewrap starts may leave bubblewrap's inner process waiting for
    the outer one forever, its command never run (bubblewrap's ``--die-with-parent`` race,
    containers/bubblewrap#633; seen under load). Each launcher runs in a process group of its
    own, as the agent runs under its supervisor, and the group is ended once nothing could run
    any more (the wait here was once for its output pipes, which such a survivor held)."""
    uid = DEFAULT_JOB_UIDS.start + 4243
    groups: list[int] = []

    def dies(name: str, how: str) -> Path:
        folder = work_dir / name
        folder.mkdir(parents=True)
        os.chown(folder, uid, uid)
        errors = folder.parent / f"{name}.err"
        with errors.open("wb") as err:
            died = subprocess.Popen(
                [sys.executable, "-c", _DIES_HOLDING, str(folder), str(uid), how],
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )
        groups.append(died.pid)
        assert died.wait(60) == -signal.SIGKILL, errors.read_text()
        return folder

    try:
        assert (dies("opened", "open") / "ran").exists(), "a command let through runs there"
        held = [dies(f"held-{i}", "held") for i in range(10)]
        time.sleep(1)  # anything that could still run after its launcher's end has run by now
        assert [f.name for f in held if (f / "ran").exists()] == []
    finally:
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


def test_a_held_sandbox_whose_set_up_failed_ends_with_its_error_not_the_agents(tmp_path: Path) -> None:
    """The gate is opened after the sandbox died on its own (its folder is not there): no reader
    is left, and the launch still answers, the sandbox's exit saying why."""
    from catacloud.agent.netns import Egress
    from catacloud.agent.sandbox import BubblewrapLauncher, JobPlace, bwrap_path

    bwrap = bwrap_path()
    assert bwrap is not None
    launcher = BubblewrapLauncher(bwrap=bwrap, hostname="held", egress=Egress("none", detail="test"))
    launch = launcher.launch("true", {}, JobPlace(str(tmp_path / "gone"), "", None, None), held=True)
    proc = launch.spawn(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=30)
    try:
        assert launch.begin(proc) is None  # no BrokenPipeError out of the agent's start
    finally:
        launch.finish()
    assert proc.returncode != 0 and b"gone" in err


def test_timeout_kills_the_whole_process_tree(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent()
    job = api.assign(
        "sleep 1000 & echo bg=$!;"
        " setsid sh -c 'echo esc=$$; exec sleep 1000' &"
        " sleep 0.3; echo fg=$$; exec sleep 1000",
        timeout_seconds=2,
    )

    output = api.wait_output(job, "fg=", timeout=5)
    pids = host_pids(agent, *(int(values(output, key)[0]) for key in ("bg", "fg", "esc")))
    assert all(alive(pid) for pid in pids)
    assert os.getpgid(pids[2]) != os.getpgid(pids[0]), "one process left the job's process group"
    finished = api.wait_finished(job, timeout=10)

    assert finished["outcome"] == "timed_out"
    assert finished["exit_code"] is None
    assert wait_gone(pids) == []
    started_at = api.calls("POST", f"jobs/{job}/started")[0].at
    assert api.finished[job][1] - started_at < 2 + 4


def test_cancel_from_heartbeat_or_logs_answer_stops_the_job_within_seconds(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent()
    by_heartbeat = api.assign("echo pid=$$; exec sleep 1000")
    [pid] = host_pids(agent, int(values(api.wait_output(by_heartbeat, "pid="), "pid")[0]))

    cancelled_at = time.monotonic()
    api.cancel(by_heartbeat)
    finished = api.wait_finished(by_heartbeat, timeout=10)

    assert finished["outcome"] == "cancelled"
    assert api.finished[by_heartbeat][1] - cancelled_at < 4.0
    assert wait_gone([pid]) == []

    by_logs = api.assign("while true; do echo tick; sleep 0.2; done")
    api.wait_output(by_logs, "tick")
    api.cancel(by_logs, via_logs=True)
    assert api.wait_finished(by_logs, timeout=10)["outcome"] == "cancelled"


def test_transient_server_errors_are_retried_without_duplicating_output(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], work_dir: Path
) -> None:
    start_agent()
    api.wait_for(lambda: api.calls("GET", "work"), what="a poll")
    api.fail_next.update({"work": 1, "jobs/flaky/logs": 1, "jobs/flaky/finished": 1})
    # Its first line is shipped while it runs (the post fails once), its last one with its exit
    # report (which fails once too).
    api.assign("echo hello; until [ -e go ]; do sleep 0.05; done; echo bye", job_id="flaky")
    api.wait_output("flaky", "hello")
    (work_dir / "flaky-1" / "go").touch()

    assert api.wait_finished("flaky")["outcome"] == "succeeded"
    assert api.output("flaky") == "hello\nbye\n"
    posts = api.calls("POST", "jobs/flaky/logs")
    assert len(posts) == 2
    assert posts[0].body == posts[1].body, "the retry repeats the same chunk and seq"
    reports = api.calls("POST", "jobs/flaky/finished")
    assert len(reports) == 2 and reports[0].body == reports[1].body
    assert [(c["seq"], c["data"]) for c in reports[1].body["output"]] == [(1, "bye\n")]


# -- job-meta -----------------------------------------------------------------------------------


def test_job_meta_prints_the_resource_metadata_only_for_the_running_job(
    api: FakeAgentAPI,
    start_agent: Callable[..., AgentProcess],
    work_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    start_agent()
    api.meta[("with-db", "db")] = {"host": "db.internal", "port": 5432}
    job = api.assign(
        'echo "socket=$CATACLOUD_AGENT_SOCKET"; echo "token=$CATACLOUD_JOB_TOKEN"; echo "uid=$(id -u)"; env;'
        ' "$PY" -m catacloud.agent job-meta db > db.json; echo "ok=$?";'
        ' "$PY" -m catacloud.agent job-meta cache; echo "missing=$?";'
        ' CATACLOUD_JOB_TOKEN=wrong "$PY" -m catacloud.agent job-meta db; echo "wrong=$?";'
        ' env -u CATACLOUD_JOB_TOKEN "$PY" -m catacloud.agent job-meta db; echo "absent=$?";'
        " echo checked; exec sleep 1000",
        job_id="with-db",
        env={"PY": PY},
    )

    output = api.wait_output(job, "checked", timeout=15)
    assert values(output, "ok") == ["0"]
    assert json.loads((work_dir / "with-db-1" / "db.json").read_text()) == {
        "host": "db.internal",
        "port": 5432,
    }
    assert values(output, "missing") == ["1"]
    assert values(output, "wrong") == ["1"]
    assert values(output, "absent") == ["1"]
    errors = api.output(job, "stderr")
    assert "no resource named 'cache'" in errors
    assert "CATACLOUD_JOB_TOKEN is missing, wrong" in errors
    assert "CATACLOUD_JOB_TOKEN is not set" in errors
    assert api.agent_token not in output, "the job never sees the agent token"
    meta_calls = api.calls("GET", "jobs/with-db/meta/db")
    assert meta_calls and meta_calls[0].headers["Authorization"] == f"Agent {api.agent_token}"

    assert values(output, "socket") == [SANDBOX_SOCKET]
    socket_path = work_dir / ".agent" / "agent.sock"  # where the agent keeps it, outside the sandbox
    assert stat.S_ISSOCK(socket_path.stat().st_mode)
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
    assert socket_path.stat().st_uid == int(values(output, "uid")[0]) in DEFAULT_JOB_UIDS, (
        "the job's uid only"
    )
    environ = {SOCKET_ENV: str(socket_path), TOKEN_ENV: values(output, "token")[0]}
    assert job_meta_command("db", environ=environ) == 0
    assert json.loads(capsys.readouterr().out) == {"host": "db.internal", "port": 5432}

    api.cancel(job)
    api.wait_finished(job)
    assert job_meta_command("db", environ=environ) == 1, "a finished job's token is no longer valid"
    assert "no longer running" in capsys.readouterr().err
    assert socket_path.stat().st_uid == os.geteuid(), "no job uid may connect between jobs"


# -- interruption and stopping ------------------------------------------------------------------


def test_spot_interruption_notice_is_reported_once(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], imds: FakeIMDS
) -> None:
    agent = start_agent("--imds-url", imds.url)
    imds.wait_for(lambda: imds.calls("GET", "/latest/meta-data/spot/instance-action"), what="an IMDS look")
    time.sleep(0.3)
    assert api.interruptions == [], "404 means no notice"

    notice = '{"action": "terminate", "time": "2030-01-01T00:00:00Z"}'
    imds.notice = notice
    api.wait_for(lambda: api.interruptions, timeout=8, what="the interruption report")
    time.sleep(0.5)

    assert api.interruptions == [{"kind": "spot", "detail": notice}]
    token_puts = imds.calls("PUT", "/latest/api/token")
    assert token_puts and token_puts[0].headers["X-aws-ec2-metadata-token-ttl-seconds"]
    assert all(
        "X-aws-ec2-metadata-token" in r.headers
        for r in imds.calls("GET", "/latest/meta-data/spot/instance-action")
    ), "IMDSv2 only"
    assert agent.proc.poll() is None, "the agent keeps running until told to terminate"


def test_sigterm_to_the_agent_kills_the_running_job_and_reports_it(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent()
    job = api.assign("echo pid=$$; exec sleep 1000")
    [pid] = host_pids(agent, int(values(api.wait_output(job, "pid="), "pid")[0]))

    agent.signal(signal.SIGTERM)

    assert agent.wait(10) == 0
    assert outcome(api.finished[job][0]) == {
        "exit_code": None,
        "outcome": "cancelled",
        "reason": "agent stopped",
        "uploads_pending": 0,
        "code": "",
    }
    assert wait_gone([pid]) == []
    assert_no_secrets(api, agent)


def test_stop_signals_coming_all_the_while_still_stop_the_agent_and_its_job(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    """A service manager's SIGTERM and an operator's Ctrl-C close together: a handler that took
    the agent's lock, run again inside itself by the next signal, waited for that lock forever
    (the job ran on, the agent never exited)."""
    agent = start_agent()
    job = api.assign("echo pid=$$; exec sleep 1000")
    [pid] = host_pids(agent, int(values(api.wait_output(job, "pid="), "pid")[0]))

    # from before the first is handled to well after, but not up to the agent's exit (a Python on
    # its way out has put the default handlers back: a late SIGTERM would end it with 143)
    target, sent = agent_pid(agent), 0
    with contextlib.suppress(ProcessLookupError):
        while sent < 400 and not api.finished.get(job):
            os.kill(target, signal.SIGTERM)
            os.kill(target, signal.SIGINT)
            sent += 1

    code = agent.wait(10)
    assert code in (0, 130), agent.log()[-3000:]  # whichever came first: SIGTERM's 0 or Ctrl-C's 130
    assert outcome(api.finished[job][0])["reason"] == "agent stopped"
    assert wait_gone([pid]) == []


def test_terminate_from_heartbeat_stops_the_job_and_the_agent(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent()
    job = api.assign("echo pid=$$; exec sleep 1000")
    [pid] = host_pids(agent, int(values(api.wait_output(job, "pid="), "pid")[0]))

    api.terminate = True

    assert agent.wait(10) == 0
    assert outcome(api.finished[job][0]) == {
        "exit_code": None,
        "outcome": "cancelled",
        "reason": "machine terminating",
        "uploads_pending": 0,
        "code": "",
    }
    assert wait_gone([pid]) == []


def test_an_agent_whose_control_plane_is_gone_for_its_limit_ends_itself_and_its_job(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    """A local machine whose stack went away kept retrying for ever. With an unreachable limit
    the agent stops once nothing has reached the control plane for that long (503s do not
    count: a stack whose database is gone), taking its running job and its sandbox with it."""
    agent = start_agent("--exit-when-unreachable", "2")
    job = api.assign("echo pid=$$; exec sleep 1000")
    [pid] = host_pids(agent, int(values(api.wait_output(job, "pid="), "pid")[0]))
    with api.cond:  # every call from now on fails, then nothing answers at all
        api.fail_next.update({path: 10**6 for path in ("heartbeat", "work", f"jobs/{job}/logs")})
    api.stop()
    went = time.monotonic()

    assert agent.wait(20) == 3
    assert 2 <= time.monotonic() - went < 15
    assert "has not answered for" in agent.log() and "(limit 2 s)" in agent.log()
    assert wait_gone([pid]) == []  # its job
    assert job not in api.finished  # nobody was there to hear it


# -- in-process units ---------------------------------------------------------------------------


def test_secrets_are_redacted_from_log_lines_and_errors() -> None:
    register_secret("tok-0123456789abcdef")
    formatter = RedactingFormatter("%(message)s")
    try:
        raise RuntimeError("boom with tok-0123456789abcdef inside")
    except RuntimeError:
        record = logging.LogRecord(
            "x", logging.ERROR, __file__, 1, "token %s", ("tok-0123456789abcdef",), None
        )
        record.exc_info = sys.exc_info()
    text = formatter.format(record)

    assert "tok-0123456789abcdef" not in text
    assert "[redacted]" in text
    assert "tok-0123456789abcdef" not in str(AgentAPIError("failed for tok-0123456789abcdef"))
    assert redact("nothing secret") == "nothing secret"


def test_log_streamer_keeps_order_decodes_split_utf8_and_retries_with_the_same_seq() -> None:
    posts: list[list[dict[str, Any]]] = []
    failures = [1]

    def send(chunks: list[dict[str, Any]]) -> bool:
        posts.append([dict(c) for c in chunks])
        if failures[0]:
            failures[0] -= 1
            raise ConnectionError("server away")
        return False

    streamer = LogStreamer(send, flush_interval=0.05, retry_base=0.05)
    streamer.start()
    euro = "€".encode()
    streamer.feed("stdout", b"a" + euro[:1])
    streamer.feed("stdout", euro[1:] + b"\n")
    streamer.feed("stderr", b"bad \xff byte\n")
    streamer.feed("stdout", b"z\n")
    for stream in ("stdout", "stderr"):
        streamer.end_stream(stream)

    assert streamer.close(timeout=5.0)
    assert posts[0] == posts[1], "the retry resends the same chunks"
    delivered = [c for post in posts[1:] for c in post]
    assert [c["seq"] for c in delivered] == list(range(len(delivered)))
    assert [(c["stream"], c["data"]) for c in delivered] == [
        ("stdout", "a€\n"),
        ("stderr", "bad \ufffd byte\n"),
        ("stdout", "z\n"),
    ]


def test_log_streamer_hands_over_what_is_left_only_when_nothing_is_in_flight() -> None:
    """The exit report carries what is left (hand_over) unless a post is in flight or being
    retried: then close() ships it, in order, as before."""
    posts: list[list[dict[str, Any]]] = []
    release = threading.Event()

    def send(chunks: list[dict[str, Any]]) -> bool:
        posts.append([dict(c) for c in chunks])
        release.wait(10)  # the first post hangs until the test lets it go
        return False

    quiet = LogStreamer(send, flush_interval=60)
    quiet.start()
    quiet.feed("stdout", b"a\n")
    quiet.feed("stderr", b"b\n")
    assert quiet.hand_over() == [
        {"seq": 0, "stream": "stdout", "data": "a\n"},
        {"seq": 1, "stream": "stderr", "data": "b\n"},
    ]
    quiet.feed("stdout", b"after\n")  # nothing of it is posted: the report carried the rest
    assert posts == [] and quiet.close(timeout=0.2) and posts == []

    busy = LogStreamer(send, flush_interval=0.01)
    busy.start()
    busy.feed("stdout", b"one\n")
    deadline = time.monotonic() + 10
    while not posts and time.monotonic() < deadline:
        time.sleep(0.01)
    busy.feed("stdout", b"two\n")
    assert busy.hand_over() is None, "a post in flight: not handed over"
    release.set()
    assert busy.close(timeout=5.0)
    assert [c["data"] for post in posts for c in post] == ["one\n", "two\n"]


def test_a_restarted_agent_resumes_its_saved_enrollment(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    """systemd restarts a crashed agent; the bootstrap token is single-use, so the agent keeps
    its enrollment in a 0600 state file and resumes with it instead of enrolling again."""
    state = tmp_path / "state" / "agent.json"
    first = start_agent("--state-file", str(state))
    api.wait_for(lambda: api.calls("POST", "heartbeat"), what="the first heartbeat")
    assert oct(state.stat().st_mode & 0o777) == "0o600"
    first.signal(signal.SIGKILL)  # a crash: no goodbye
    first.wait()
    beats = len(api.calls("POST", "heartbeat"))
    second = start_agent("--state-file", str(state))
    api.wait_for(lambda: len(api.calls("POST", "heartbeat")) > beats, what="heartbeats after the restart")
    assert len(api.calls("POST", "enroll")) == 1  # resumed, not enrolled twice
    assert second.proc.poll() is None
    assert f"reusing the saved enrollment of instance {api.instance_id}" in second.log()
    assert_no_secrets(api, second)
