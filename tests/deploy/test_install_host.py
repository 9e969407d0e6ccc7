"""One command installs an enrolled host: the Agent API serves ``install-host.sh`` with its agent
URL and its wheel pinned by sha256 (503 ``install_script_unavailable`` without a wheel), the
script parses (sh, dash, bash) and shellcheck finds nothing in it, and it runs, here in a folder
standing for the host's root with apt-get, systemctl and id stubbed (each records what it was
asked): the token from the environment, standard input or nowhere, the unit, an upgrade, the
refusals. The token is never on any process's command line, nor in the environment of anything
the script starts, nor in the unit. The last test installs the real wheel from a running
control plane into a real venv and lets the unit's ExecStart enroll the host."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from django.test import Client

from apps.machines.hosts import enrolment_token_create
from apps.machines.install_host import render_install_script
from testkit.builders import provider_account
from testkit.processes import TESTS
from tests.deploy.test_agent_wheel import wheels  # noqa: F401  (the module's fixture)
from tests.machines.test_lifecycle import serve_an_agent_wheel

ROOT = Path(__file__).resolve().parents[2]
SCRIPT_URL = "/api/agent/v1/dist/install-host.sh"
AGENT_URL = "https://cc.example.com"
TOKEN = "ce_" + "Tk3n-_x" * 6  # the shape of one (apps.core.crypto.new_token)
UNIT = "etc/systemd/system/catacloud-host.service"
STATE = "var/lib/catacloud/host/host.json"
TOKEN_FILE = "etc/catacloud/enrolment-token"


@pytest.fixture
def script(settings: Any, tmp_path: Path) -> str:
    serve_an_agent_wheel(settings, tmp_path)
    settings.CATACLOUD_AGENT_URL = AGENT_URL
    response = Client().get(SCRIPT_URL)
    assert response.status_code == 200, response.content
    return response.content.decode()


def test_the_script_is_served_with_the_agent_url_and_the_wheel_pinned_by_its_sha256(
    script: str, tmp_path: Path
) -> None:
    digest = hashlib.sha256(b"an agent wheel").hexdigest()
    wheel = f"{AGENT_URL}/api/agent/v1/dist/catacloud_agent-0.1.0-py3-none-any.whl#sha256={digest}"
    assert f"\nAGENT_WHEEL='{wheel}'\n" in script and f"\nAGENT_URL='{AGENT_URL}'\n" in script
    assert f"curl -fsSL {AGENT_URL}/api/agent/v1/dist/install-host.sh | sudo sh" in script
    served = Client().get(SCRIPT_URL)
    assert served["Content-Type"].startswith("text/x-shellscript")
    # the wheel of that name is still served beside it
    assert Client().get("/api/agent/v1/dist/catacloud_agent-0.1.0-py3-none-any.whl").status_code == 200


@pytest.mark.parametrize("case", ["no wheel", "a quote in the agent URL"])
def test_without_a_wheel_to_pin_or_a_url_a_script_may_hold_the_answer_is_503_with_a_code(
    case: str, settings: Any, tmp_path: Path
) -> None:
    serve_an_agent_wheel(settings, tmp_path)
    settings.CATACLOUD_AGENT_URL = AGENT_URL
    if case == "no wheel":
        settings.CATACLOUD_AGENT_WHEEL = ""
    else:
        settings.CATACLOUD_AGENT_URL = "https://cc.example.com/'; rm -rf / #"
    response = Client().get(SCRIPT_URL)
    assert response.status_code == 503
    body = response.json()
    assert body["code"] == "install_script_unavailable"
    assert ("CATACLOUD_AGENT_WHEEL" if case == "no wheel" else "not an http(s) URL") in body["detail"]


def test_render_refuses_what_could_break_out_of_the_script() -> None:
    pinned = f"{AGENT_URL}/api/agent/v1/dist/catacloud_agent-0.1.0-py3-none-any.whl#sha256={'a' * 64}"
    for url in ("https://cc.example.com/$(id)", "https://a b", "ftp://cc.example.com", "https://x`id`"):
        with pytest.raises(ValueError):
            render_install_script(agent_url=url, wheel_url=pinned)
    with pytest.raises(ValueError):
        render_install_script(agent_url=AGENT_URL, wheel_url="catacloud-agent==0.1.0")
    # "%" is a systemd specifier: doubled in the unit, kept in the script's own messages
    text = render_install_script(agent_url="https://cc.example.com/a%20b", wheel_url=pinned)
    assert "UNIT_AGENT_URL='https://cc.example.com/a%%20b'" in text


def test_the_script_parses_and_shellcheck_finds_nothing(script: str, tmp_path: Path) -> None:
    path = tmp_path / "install-host.sh"
    path.write_text(script)
    for shell in ("sh", "dash", "bash"):
        if shutil.which(shell):
            checked = subprocess.run([shell, "-n", str(path)], capture_output=True, text=True, timeout=30)
            assert checked.returncode == 0, (shell, checked.stderr)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; .ci/run installs it)")
    checked = subprocess.run(
        ["shellcheck", "--shell=sh", "--severity=style", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout


# ---- the script run in a folder standing for the host's root ---------------------------------

# (absolute paths: these commands are wrapped too)
LOG = 'printf "%s\\n" "${0##*/} $*" >> "$FAKE_DIR/calls"; /usr/bin/env > "$FAKE_DIR/env.$$.${0##*/}"\n'
STUBS = {
    "id": '[ "$1" = -u ] && { echo "${FAKE_UID:-0}"; exit 0; }\nexec /usr/bin/id "$@"\n',
    "apt-get": "exit 0\n",
    # systemctl: is-active answers yes; restart looks at the token file as the agent would read
    # it and, standing for the agent, enrolls (writes the host's state file)
    "systemctl": """case "$1" in
restart)
    t="$CATACLOUD_INSTALL_ROOT/etc/catacloud/enrolment-token"
    if [ -f "$t" ]; then stat -c %a "$t" > "$FAKE_DIR/token-mode"; cp "$t" "$FAKE_DIR/token-seen"; fi
    if [ -n "${FAKE_ENROLL:-}" ]; then
        mkdir -p "$CATACLOUD_INSTALL_ROOT/var/lib/catacloud/host"
        printf '{"host_id": "h-1", "host_token": "ch_x"}' \
            > "$CATACLOUD_INSTALL_ROOT/var/lib/catacloud/host/host.json"
    fi ;;
esac
exit 0
""",
}
# python3 -m venv DIR makes a venv whose pip records and whose python is this test's (with the
# project on its path: the script's checks import catacloud.agent and catacloud.providers)
VENV_STUB = """if [ "$1" = -m ] && [ "$2" = venv ]; then
    mkdir -p "$3/bin"
    printf '#!/bin/sh\\n%s' '@LOG@' > "$3/bin/pip"
    printf '#!/bin/sh\\nPYTHONPATH=@ROOT@ exec @PYTHON@ "$@"\\n' > "$3/bin/python"
    chmod +x "$3/bin/pip" "$3/bin/python"
    exit 0
fi
exec @PYTHON@ "$@"
"""


# The other commands the script runs (a token passed to one would show in its record).
WRAPPED = ("mkdir", "chmod", "mktemp", "mv", "cat", "rm", "sleep", "stty", "env", "printf", "tr", "sed")


@dataclass
class Host:
    """A folder standing for a host's root, stubs on PATH, and what they recorded."""

    root: Path
    fake: Path
    bin: Path
    env: dict[str, str] = field(default_factory=dict)
    token: str = TOKEN  # the one no process may show

    def calls(self) -> list[str]:
        path = self.fake / "calls"
        return path.read_text().splitlines() if path.exists() else []

    def run(
        self, script: str, *, stdin: str = "", from_file: bool = False, piped: bool = False, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """``sh install-host.sh`` with ``stdin`` on its standard input (a pipe, or a file), or
        the script piped into ``sh``; with no terminal."""
        path = self.fake / "install-host.sh"
        path.write_text(script)
        argv = ["sh"] if piped else ["sh", str(path)]
        given = self.fake / "stdin"
        given.write_text(stdin)
        shell_env = {**self.env, **env}
        with Watch(self.token, shell_env) as watch, given.open() as handle:
            proc = subprocess.Popen(
                argv,
                stdin=handle if from_file else subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=shell_env,
                text=True,
                start_new_session=True,  # no controlling terminal: /dev/tty cannot be opened
            )
            try:
                out, err = proc.communicate(None if from_file else (script if piped else stdin), timeout=300)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind
        done = subprocess.CompletedProcess(argv, proc.returncode, out, err)
        given.unlink()
        assert not watch.seen, f"the token was visible: {watch.seen}"
        return done

    def assert_token_never_passed_on(self) -> None:
        """No stub's arguments and no environment of a command the script started held it."""
        assert self.token not in "\n".join(self.calls())
        for dump in self.fake.glob("env.*"):
            assert self.token not in dump.read_text(), dump.name


class Watch:
    """Looks at every process's command line (what ``ps`` shows anyone) while the script runs,
    and at the environment of every process but the installer's own shell and its forks (the
    environment it was started with, which a variable given to it holds while it runs)."""

    def __init__(self, token: str, shell_env: dict[str, str]) -> None:
        self.token = token.encode()
        self.shell_env = b"".join(f"{k}={v}\0".encode() for k, v in shell_env.items())
        self.seen: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _loop(self) -> None:
        while not self.stop.is_set():
            for pid in (p for p in os.listdir("/proc") if p.isdigit()):
                with contextlib.suppress(OSError):
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                    if self.token in cmdline:
                        self.seen.append(f"{pid} argv: {cmdline!r}")
                    environ = Path(f"/proc/{pid}/environ").read_bytes()
                    if self.token in environ and environ != self.shell_env:
                        self.seen.append(f"{pid} environ: {cmdline!r}")
            time.sleep(0.005)


def make_host(tmp_path: Path, *, os_id: str = "debian", systemd: bool = True, venv: str = "stub") -> Host:
    root, fake, bin_dir = tmp_path / "root", tmp_path / "fake", tmp_path / "bin"
    for folder in (root / "etc", fake, bin_dir):
        folder.mkdir(parents=True)
    (root / "etc" / "os-release").write_text(f'PRETTY_NAME="a host"\nID={os_id}\nVERSION_ID="12"\n')
    if systemd:
        (root / "run" / "systemd" / "system").mkdir(parents=True)
    stubs = dict(STUBS)
    if venv == "stub":
        stubs["python3"] = (
            VENV_STUB.replace("@LOG@", LOG).replace("@ROOT@", str(ROOT)).replace("@PYTHON@", sys.executable)
        )
    for name in WRAPPED:  # the real command, its arguments and environment recorded
        real = shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
        stubs.setdefault(name, f'exec {real} "$@"\n')
    for name, body in stubs.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + LOG + body)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin",
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        "CATACLOUD_INSTALL_ROOT": str(root),
        "FAKE_DIR": str(fake),
    }
    for name in ("PIP_FIND_LINKS", "PIP_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_INDEX_URL", "PIP_CONFIG_FILE"):
        if name in os.environ:  # the real venv's pip finds the agent's dependencies as this one does
            env[name] = os.environ[name]
    return Host(root=root, fake=fake, bin=bin_dir, env=env)


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return make_host(tmp_path)


def exec_start(host: Host) -> str:
    (line,) = [line for line in (host.root / UNIT).read_text().splitlines() if line.startswith("ExecStart=")]
    return line


def test_the_token_from_the_environment_goes_to_a_0600_file_and_the_unit_starts_the_host(
    script: str, host: Host
) -> None:
    done = host.run(script, CATACLOUD_ENROLMENT_TOKEN=TOKEN, FAKE_ENROLL="1")
    assert done.returncode == 0, done.stderr
    assert "enrolled as host h-1 of https://cc.example.com" in done.stderr
    calls = host.calls()
    assert "apt-get update -q" in calls
    (install,) = [c for c in calls if c.startswith("apt-get install")]
    assert {"python3-venv", "passt", "nftables", "skopeo", "umoci"} <= set(install.split())
    (pip,) = [c for c in calls if c.startswith("pip ")]
    assert re.search(
        r"install .*--upgrade https://cc\.example\.com/api/agent/v1/dist/catacloud_agent-0\.1\.0-py3-none-any\.whl#sha256=[0-9a-f]{64}$",
        pip,
    )
    assert [c for c in calls if c.startswith("systemctl")] == [
        "systemctl daemon-reload",
        "systemctl enable --quiet catacloud-host.service",
        "systemctl restart catacloud-host.service",
        "systemctl is-active --quiet catacloud-host.service",
    ]
    # the agent found the token in a root-only file; once enrolled, the file is gone
    assert (host.fake / "token-seen").read_text() == TOKEN + "\n"
    assert (host.fake / "token-mode").read_text().strip() == "600"
    assert oct((host.root / "etc" / "catacloud").stat().st_mode & 0o777) == "0o700"
    assert not (host.root / TOKEN_FILE).exists()
    unit = (host.root / UNIT).read_text()
    assert exec_start(host) == (
        "ExecStart=/opt/catacloud/bin/catacloud host --url https://cc.example.com "
        "--enrolment-token-file /etc/catacloud/enrolment-token "
        "--state-file /var/lib/catacloud/host/host.json --slots-dir /var/lib/catacloud/slots"
    )
    for line in ("Restart=always", "KillMode=process", "Delegate=yes", "WantedBy=multi-user.target"):
        assert f"\n{line}\n" in unit
    assert TOKEN not in unit
    host.assert_token_never_passed_on()


@pytest.mark.parametrize("how", ["a file", "a pipe"])
def test_the_token_on_standard_input_works_the_same(script: str, host: Host, how: str) -> None:
    if how == "a file":  # sudo sh install-host.sh < token-file (with a DOS line end and spaces)
        done = host.run(script, stdin=f"  {TOKEN}\r\n", from_file=True, FAKE_ENROLL="1")
    else:  # … | sudo sh install-host.sh
        done = host.run(script, stdin=f"{TOKEN}\n", FAKE_ENROLL="1")
    assert done.returncode == 0, done.stderr
    assert (host.fake / "token-seen").read_text() == TOKEN + "\n"
    host.assert_token_never_passed_on()


def test_piped_into_sh_the_script_reads_no_token_from_its_own_text(script: str, host: Host) -> None:
    """``curl … | sudo sh``: standard input is the script; what follows it is nothing, so with
    no terminal and no variable it stops, before it installs anything."""
    done = host.run(script, piped=True)
    assert done.returncode == 1 and "no enrolment token" in done.stderr, done.stderr
    assert not [c for c in host.calls() if c.startswith(("apt-get", "pip", "systemctl"))]
    done = host.run(script, piped=True, CATACLOUD_ENROLMENT_TOKEN=TOKEN, FAKE_ENROLL="1")
    assert done.returncode == 0, done.stderr
    host.assert_token_never_passed_on()


def test_run_again_it_upgrades_the_agent_without_a_token_and_keeps_the_enrolment(
    script: str, host: Host
) -> None:
    assert host.run(script, CATACLOUD_ENROLMENT_TOKEN=TOKEN, FAKE_ENROLL="1").returncode == 0
    state = (host.root / STATE).read_text()
    (host.fake / "calls").unlink()
    done = host.run(script)
    assert done.returncode == 0, done.stderr
    assert "already enrolled" in done.stderr and (host.root / STATE).read_text() == state
    assert [
        c for c in host.calls() if c.startswith("pip ")
    ] and "systemctl restart catacloud-host.service" in host.calls()
    assert not (host.root / TOKEN_FILE).exists()


def test_offering_less_than_the_host_has_and_what_is_refused(script: str, host: Host) -> None:
    done = host.run(
        script,
        CATACLOUD_ENROLMENT_TOKEN=TOKEN,
        FAKE_ENROLL="1",
        CATACLOUD_HOST_CPUS="4",
        CATACLOUD_HOST_GPUS="0",
    )
    assert done.returncode == 0, done.stderr
    assert exec_start(host).endswith("--slots-dir /var/lib/catacloud/slots --cpus 4 --gpus 0")
    (host.root / STATE).unlink()
    done = host.run(script, CATACLOUD_ENROLMENT_TOKEN=TOKEN, CATACLOUD_HOST_CPUS="4 --url http://evil")
    assert done.returncode == 1 and "a whole number" in done.stderr
    for bad in ("cc_" + TOKEN[3:], TOKEN + "$(id)", "ce_"):
        done = host.run(script, CATACLOUD_ENROLMENT_TOKEN=bad)
        assert done.returncode == 1 and "not an enrolment token" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("setup", "said"),
    [
        ({"os_id": "fedora"}, "installs on Debian or Ubuntu"),
        ({"systemd": False}, "systemd is not running"),
        ({"uid": "1000"}, "run it as root"),
    ],
)
def test_it_refuses_a_machine_it_cannot_install_on_before_it_changes_anything(
    script: str, tmp_path: Path, setup: dict[str, Any], said: str
) -> None:
    uid = setup.pop("uid", "0")
    host = make_host(tmp_path, **setup)
    done = host.run(script, CATACLOUD_ENROLMENT_TOKEN=TOKEN, FAKE_UID=uid)
    assert done.returncode == 1 and said in done.stderr, done.stderr
    assert not [c for c in host.calls() if not c.startswith("id ")]
    assert not (host.root / "etc" / "catacloud").exists()


# ---- the real thing: the served wheel in a real venv, the unit's ExecStart enrolls ----------

RUN_UNIT = """case "$1" in
restart)
    line=$(sed -n 's/^ExecStart=//p' "$CATACLOUD_INSTALL_ROOT/etc/systemd/system/catacloud-host.service")
    # the unit's paths, in the folder standing for the root
    cmd=$(printf '%s' "$line" | sed -e "s# /# $CATACLOUD_INSTALL_ROOT/#g" -e "s#^/#$CATACLOUD_INSTALL_ROOT/#")
    # shellcheck disable=SC2086
    setsid $cmd > "$FAKE_DIR/host.log" 2>&1 < /dev/null &
    echo $! > "$FAKE_DIR/host.pid" ;;
esac
exit 0
"""


@pytest.fixture
def control_plane(wheels: Path, tmp_path: Path) -> Iterator[str]:  # noqa: F811
    with TESTS.gunicorn(tmp_path, workers=1, threads=8, CATACLOUD_AGENT_WHEEL=str(wheels)) as (url, _):
        yield url


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_the_script_installs_the_served_agent_and_the_unit_enrolls_the_host(
    control_plane: str, tmp_path: Path
) -> None:
    account = provider_account("hosts", "rack", {})
    _, token = enrolment_token_create(provider_account=account, labels={"site": "lab"})
    script = requests.get(control_plane + SCRIPT_URL, timeout=30)
    assert script.status_code == 200, script.text
    host = make_host(tmp_path / "h", venv="real")
    (host.bin / "systemctl").write_text("#!/bin/sh\n" + LOG + RUN_UNIT)
    host.token = token
    try:
        done = host.run(script.text, stdin=token + "\n", from_file=True)
    finally:
        pid = host.fake / "host.pid"
        if pid.exists():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid.read_text()), signal.SIGTERM)
    log = (host.fake / "host.log").read_text() if (host.fake / "host.log").exists() else ""
    assert done.returncode == 0, done.stderr[-3000:] + log
    from apps.machines.models import Host as HostRow

    (row,) = HostRow.objects.all()
    assert f"enrolled as host {row.pk} of {control_plane}" in done.stderr
    assert row.labels["site"] == "lab" and row.agent_version
    saved_state = json.loads((host.root / STATE).read_text())
    assert saved_state["host_id"] == str(row.pk)
    assert oct((host.root / STATE).stat().st_mode & 0o777) == "0o600"
    assert not (host.root / TOKEN_FILE).exists() and token not in (host.root / UNIT).read_text()
    assert (host.root / "opt" / "catacloud" / "bin" / "catacloud").exists()
