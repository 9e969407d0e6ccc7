"""The ``catacloud`` command: embedded services, the dev runner, (on machines) the agent, and
the client of the REST API (``jobs``, ``run``, ``configs``, ``pools``, ``costs``, ``auth``, …)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from catacloud.agent.signals import STOP_SIGNALS
from catacloud.supervisor import Program

ROOT = Path(__file__).resolve().parent.parent
DEMO_CATALOG = Path(__file__).resolve().parent / "data" / "demo.yaml"


def _manage(*args: str, env: dict[str, str], capture: bool = False) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        env=env,
        check=True,
        text=True,
        stdout=subprocess.PIPE if capture else None,
    )
    return result.stdout or ""


def cmd_services(args: argparse.Namespace) -> int:
    from catacloud import embedded

    if args.action == "down":
        embedded.services_down()
        return 0
    services = embedded.services_up()
    if args.action == "up":
        for key, value in services.env.items():
            print(f"export {key}={value}")
        return 0
    # run: start what is missing, run the command with the env, stop what we started.
    command = list(args.command)
    while command and command[0] == "--keep":  # argparse.REMAINDER keeps options after "run"
        args.keep = True
        command.pop(0)
    if command[:1] == ["--"]:
        command.pop(0)
    if not command:
        print("catacloud services run -- COMMAND...", file=sys.stderr)
        return 2
    env = {**os.environ, **services.env}
    try:
        return subprocess.call(command, env=env)
    except KeyboardInterrupt:
        return 130
    finally:
        if not args.keep:
            services.stop()


AGENT_HTTP_PROTOCOL = "apps.control.agent.protocol:AgentHttpProtocol"


def agent_server_command(*, host: str, port: int, workers: int = 1) -> list[str]:
    """The agent server (the Agent API on ASGI, ``config/agent_asgi.py``) under uvicorn: one
    event loop per worker holds every idle long poll. Connections are kept alive longer than a
    long poll, so an agent's heartbeats and polls reuse theirs."""
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "config.agent_asgi:application",
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--lifespan",
        "off",
        "--timeout-keep-alive",
        "75",
        "--backlog",
        "4096",
        # waiting polls are safe to cut (agents poll again): a stop does not wait for them
        "--timeout-graceful-shutdown",
        "3",
        "--no-access-log",
        # a header timeout and connection budgets (CATACLOUD_AGENT_HEADER_TIMEOUT, ...)
        "--http",
        AGENT_HTTP_PROTOCOL,
    ]


def flower_command(*, host: str, port: int) -> list[str]:
    """Flower with its configuration file, which puts ``/metrics`` behind its basic auth."""
    celery = [sys.executable, "-m", "celery", "-A", "config"]
    conf = ROOT / "config" / "flowerconfig.py"
    return [*celery, "flower", f"--address={host}", f"--port={port}", f"--conf={conf}"]


def dev_programs(
    *, env: dict[str, str], home: Path, port: int, flower_port: int, agent_port: int | None = None
) -> list[Program]:
    """What `make dev` runs: web (gunicorn: the user API and the admin), the agent server
    (uvicorn: the Agent API), one Celery worker, beat and Flower."""
    celery = [sys.executable, "-m", "celery", "-A", "config"]
    gunicorn = [sys.executable, "-m", "gunicorn", "config.wsgi", "--bind", f"127.0.0.1:{port}"]
    # agents long-poll the agent server (its own process); Ctrl-C must not wait for anything
    # the web still holds (catacloud/gunicorn_dev.py)
    gunicorn += ["--workers", "2", "--threads", "8", "--access-logfile", "-"]
    gunicorn += ["--config", "python:catacloud.gunicorn_dev"]
    # its control socket would be ~/.gunicorn/gunicorn.ctl, one for every make dev on the host
    gunicorn += ["--control-socket", str(home / "gunicorn.ctl")]
    agent_port = agent_port if agent_port is not None else port + 1
    return [
        # SIGINT is gunicorn's quick shutdown (and gunicorn_dev's workers leave at once).
        Program("web", gunicorn, env=env, cwd=str(ROOT), stop_signal=signal.SIGINT),
        Program("agent-api", agent_server_command(host="127.0.0.1", port=agent_port), env, str(ROOT)),
        Program(
            "worker", [*celery, "worker", "--loglevel", "INFO", "--concurrency", "4", "-E"], env, str(ROOT)
        ),
        Program(
            "beat",
            [*celery, "beat", "--loglevel", "INFO", "--schedule", str(home / "celerybeat-schedule")],
            env,
            str(ROOT),
        ),
        Program("flower", flower_command(host="127.0.0.1", port=flower_port), env, str(ROOT)),
    ]


def dev_env(base: Mapping[str, str], *, port: int, agent_port: int, metrics_dir: Path) -> dict[str, str]:
    """The environment of `make dev`'s programs: ``base`` (the user's environment and the
    embedded services') with development defaults the user may override. ``/metrics`` is open
    (CATACLOUD_METRICS_PUBLIC): on this loopback-only server, what the docs show works."""
    return {
        **base,
        "DJANGO_DEBUG": base.get("DJANGO_DEBUG", "1"),
        "CATACLOUD_PUBLIC_URL": base.get("CATACLOUD_PUBLIC_URL", f"http://127.0.0.1:{port}"),
        "CATACLOUD_METRICS_PUBLIC": base.get("CATACLOUD_METRICS_PUBLIC", "true"),
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        "CATACLOUD_AGENT_URL": base.get("CATACLOUD_AGENT_URL", f"http://127.0.0.1:{agent_port}"),
        # OTEL_TRACES_EXPORTER=file make dev: every process's spans here (apps/core/tracing.py)
        "CATACLOUD_TRACES_FILE": base.get("CATACLOUD_TRACES_FILE", str(metrics_dir.parent / "traces.jsonl")),
        "PYTHONUNBUFFERED": "1",
    }


def cmd_dev(args: argparse.Namespace) -> int:
    """`make dev`: services, migrations, demo data, then web + worker + beat + Flower, each
    restarted when it dies (see catacloud.supervisor); Ctrl-C stops everything and exits 0, and
    so does SIGTERM or SIGHUP (a closed terminal). Every stop ends the local machines of the
    home, whether or not PostgreSQL and Redis still run."""
    from catacloud import embedded
    from catacloud.supervisor import Supervisor

    started = dev_started_at(os.environ)
    problem = _local_sandbox_problem()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    port = int(os.environ.get("PORT", "8000"))
    flower_port = int(os.environ.get("FLOWER_PORT", "5555"))
    agent_port = int(os.environ.get("AGENT_PORT", str(port + 1)))
    home = embedded.catacloud_home()
    home.mkdir(parents=True, exist_ok=True)
    _tool_notes(home)
    lock = _dev_lock(home)  # held until this process ends, however it ends
    if lock is None:
        return 1
    services = embedded.services_up(home)
    metrics_dir = _fresh_metrics_dir(home)
    env = dev_env({**os.environ, **services.env}, port=port, agent_port=agent_port, metrics_dir=metrics_dir)
    supervisor: Supervisor | None = None
    stopping = threading.Event()  # set by the main thread's own code, never by a handler
    asked: list[int] = []  # the stop signal received outside the supervisor's run

    def on_signal(signum: int, frame: object) -> None:  # takes no lock: catacloud/agent/signals.py
        if asked or stopping.is_set():
            return  # already stopping: a second Ctrl-C must not break the clean-up half way
        asked.append(signum)
        if supervisor is None:
            raise KeyboardInterrupt  # still setting up: unwind to the clean-up below
        supervisor.stop()  # before its run took the signals (its main thread is not in its Event)

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    give_back_terminal = _own_terminal()
    _watch_hangup(stopping)
    try:
        fakes, creds = _dev_data(env, home, port)
        flower_auth = os.environ.get("FLOWER_BASIC_AUTH", f"admin:{creds['password']}")
        env["FLOWER_BASIC_AUTH"] = flower_auth
        cleanup = _cleanup_command(home, services.started)
        programs = dev_programs(env=env, home=home, port=port, flower_port=flower_port, agent_port=agent_port)
        for fake in fakes:
            programs.append(Program(fake.forge, fake.command, env, str(ROOT)))
        supervisor = Supervisor(
            programs,
            on_orphan=cleanup,  # if this process is SIGKILLed: what its watchdog stops
            # the machines end beside the programs' stop (a worker may take its stop timeout)
            on_stop=lambda: _stop_local_machines(home),
            state_file=home / DEV_STATE,
        )
        base = f"http://127.0.0.1:{port}"
        lines = _banner(base, env, creds, flower_port, flower_auth, fakes, home)
        print("\n".join(["", "Catacloud is starting (Ctrl-C stops everything):", *lines, ""]), flush=True)
        threading.Thread(
            target=_announce_when_healthy,
            args=(supervisor, f"{base}/readyz", lines, started),
            name="announce",
            daemon=True,
        ).start()
        supervisor.run()  # returns at once if a signal came since it was made
        return 0
    except (KeyboardInterrupt, subprocess.CalledProcessError):
        if not asked:
            raise
        return 0  # Ctrl-C while setting up (a manage.py step dies of it too): a clean stop
    finally:
        stopping.set()
        _say("catacloud: stopping the local machines and the embedded services…")
        _stop_local_machines(home)  # again (see on_stop): what a worker's last seconds started
        services.stop()
        give_back_terminal()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        lock.close()


def _fresh_metrics_dir(home: Path) -> Path:
    """prometheus_client multiprocess mode: every gunicorn worker and the Celery worker write
    their counters here and each scrape sums them; fresh at every start."""
    metrics_dir = home / "prometheus"
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(parents=True)
    return metrics_dir


def _cleanup_command(home: Path, started: Sequence[object]) -> list[str]:
    """What the supervisor's watchdog runs if `make dev` itself is SIGKILLed: stop the machines
    and the services this run started."""
    command = [sys.executable, "-m", "catacloud.cli", "dev-cleanup", "--home", str(home)]
    return command + [
        f"--stop-{type(service).__name__.removeprefix('Embedded').lower()}" for service in started
    ]


def _dev_data(env: dict[str, str], home: Path, port: int) -> tuple[list[DevForge], dict[str, str]]:
    """Migrations, static files, the demo catalog (and the fake GitHub's and GitLab's), the admin
    and the demo token: what `make dev` sets up before it starts anything."""
    print("catacloud: migrating the database…", flush=True)
    _manage("migrate", "--noinput", env=env, capture=True)
    _manage("collectstatic", "--noinput", env=env, capture=True)
    _manage("apply", str(DEMO_CATALOG), env=env)
    fakes: list[DevForge] = []
    if os.environ.get("CATACLOUD_DEV_GITHUB") == "fake":
        fakes.append(DevGitHub.prepare(home, port))
    if os.environ.get("CATACLOUD_DEV_GITLAB") == "fake":
        fakes.append(DevGitLab.prepare(home, port))  # after GitHub's: its catalog keeps GitHub's mount
    if os.environ.get("CATACLOUD_DEV_CLOUD") == "fake":
        fakes.append(DevCloud.prepare(home, port))
    for fake in fakes:
        if fake.catalog is not None:
            _manage("apply", str(fake.catalog), env=env)
        env.update(fake.env)  # the web's, the worker's and the beat's
    creds: dict[str, str] = json.loads(
        _manage("dev_bootstrap", env=env, capture=True).strip().splitlines()[-1]
    )
    return fakes, creds


def _banner(
    base: str,
    env: Mapping[str, str],
    creds: Mapping[str, str],
    flower_port: int,
    flower_auth: str,
    fakes: list[DevForge],
    home: Path,
) -> list[str]:
    """Where each part of `make dev` listens, the admin's password and the demo token."""
    return [
        f"  admin    {base}/admin/   user {creds['username']}  password {creds['password']}",
        f"  API      {base}/api/v1/  (docs {base}/api/docs/)",
        f"  health   {base}/readyz  (200 once every part is up; {base}/healthz: details for staff)",
        f"  agents   {env['CATACLOUD_AGENT_URL']}/api/agent/v1/  (the agent server)",
        f"  Flower   http://127.0.0.1:{flower_port}/  "
        f"(basic auth {flower_auth.split(':')[0]} / same password)",
        f"  token    {creds['token']}",
        *(f"  {fake.title:<8} a fake {fake.title} at {fake.url} ({fake.walkthrough})" for fake in fakes),
        f"  try:     curl -H 'Authorization: Bearer {creds['token']}' {base}/api/v1/machine-types/",
        f"  shell:   . .venv/bin/activate; set -a; . {home / '.env'}; set +a"
        "  (manage.py then uses these services)",
    ]


DEV_LOCK, DEV_STATE = "dev.lock", "dev.programs.json"


def _dev_lock(home: Path) -> IO[str] | None:
    """One `make dev` per $CATACLOUD_HOME: hold ``dev.lock`` (flock, released by the kernel
    when this process ends, even by SIGKILL), and refuse when another holds it or when
    programs of a previous run whose supervisor died still run (they hold its ports, and a
    second beat would run beside theirs). Prints why and returns None when refused."""
    import fcntl

    from catacloud.supervisor import leftovers

    fh = open(home / DEV_LOCK, "a+")  # noqa: SIM115  (held open for the life of the process)
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        fh.close()
        print(
            f"catacloud: another `make dev` runs on {home} (pid {holder}); stop it first (Ctrl-C in "
            f"its terminal, or kill {holder}), or give this one its own CATACLOUD_HOME",
            file=sys.stderr,
        )
        return None
    left = leftovers(home / DEV_STATE)
    if left:
        fh.close()
        pids = " ".join(item.split("pid ", 1)[1].split(":", 1)[0] for item in left)
        print(
            f"catacloud: programs of a previous `make dev` on {home} still run (its supervisor died): "
            f"{'; '.join(left)}. Stop them first (kill {pids}).",
            file=sys.stderr,
        )
        return None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def _say(text: str) -> None:
    """Print a line; a closed terminal (EIO) or pipe must not stop a stop half way."""
    with contextlib.suppress(OSError, ValueError):
        print(text, flush=True)


# Left in the process group the dev runner leaves (`make`'s, the one a shell, a script or a
# service manager signals): hands SIGINT, SIGTERM and SIGHUP on to the dev runner, and ends with
# it (its stdin is a pipe only the dev runner holds).
RELAY = """
import os, signal, sys
runner = int(sys.argv[1])
def relay(signum, frame):
    try:
        os.kill(runner, signum)
    finally:
        os._exit(0)
for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, relay)
while os.read(0, 512):
    pass
"""


_relays: list[subprocess.Popen[bytes]] = []


def _own_terminal() -> Callable[[], None]:
    """Make this process the terminal's foreground process group, so that Ctrl-C reaches it
    alone: `make` (which started it) would otherwise get SIGINT too, die of it and exit 130
    whatever we do. Signals sent to the group it leaves (``kill -TERM -- -PGID``, the SIGHUP a
    shell sends its jobs when its terminal closes) still reach it, through a small relay
    process left in that group. Returns what gives the terminal back. Does nothing without a
    terminal or in the background."""
    try:
        fd = sys.stdin.fileno()
        if not os.isatty(fd) or os.tcgetpgrp(fd) != os.getpgrp():
            return lambda: None
        before = os.getpgrp()
        relay = subprocess.Popen(
            [sys.executable, "-c", RELAY, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _relays.append(relay)  # held: its stdin pipe closes (and the relay ends) with this process
        os.setpgid(0, 0)
        quiet = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a background group may set it
        try:
            os.tcsetpgrp(fd, os.getpgrp())
        finally:
            signal.signal(signal.SIGTTOU, quiet)
    except (OSError, ValueError):
        return lambda: None

    def give_back() -> None:
        quiet = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        try:
            with contextlib.suppress(OSError):
                os.tcsetpgrp(fd, before)
        finally:
            signal.signal(signal.SIGTTOU, quiet)

    return give_back


def _watch_hangup(stopping: threading.Event) -> None:
    """When the terminal on stdin hangs up (its window closed, its ssh connection lost), send
    ourselves SIGHUP: the shell's SIGHUP goes to its jobs' process groups and to the session
    leader, which this process may not be in (it left `make`'s group for the terminal's
    foreground, see :func:`_own_terminal`; `make` itself may lead the session)."""
    import select

    try:
        fd = sys.stdin.fileno()
        if not os.isatty(fd):
            return
    except (OSError, ValueError):
        return

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, 0)  # no event asked: poll still says POLLHUP, POLLERR, POLLNVAL
        while True:
            try:
                if poller.poll():
                    break
            except InterruptedError:
                continue
        if not stopping.is_set():  # (once stopped, the default SIGHUP would end us with 129)
            os.kill(os.getpid(), signal.SIGHUP)

    threading.Thread(target=watch, name="hangup", daemon=True).start()


def cmd_dev_cleanup(args: argparse.Namespace) -> int:
    """What a `make dev` watchdog runs when its supervisor died: stop the local machines of
    ``--home`` and the embedded services that run had started."""
    from catacloud import embedded

    home = Path(args.home)
    _stop_local_machines(home)
    if args.stop_redis:
        embedded.EmbeddedRedis(home).stop()
    if args.stop_postgres:
        embedded.EmbeddedPostgres(home).stop()
    with contextlib.suppress(FileNotFoundError):
        (home / DEV_STATE).unlink()
    _say("catacloud: stopped what the dead `make dev` left (machines, services)")
    return 0


def _local_sandbox_problem() -> str | None:
    """Local machines run in a bubblewrap sandbox: a host that refuses one stops `make dev` at
    once with the fix, unless the user opted out (CATACLOUD_LOCAL_SANDBOX=off)."""
    from catacloud.providers.local import sandbox_default
    from catacloud.providers.machine_sandbox import HOST_FIX, host_problem

    if not sandbox_default():
        print(
            "catacloud: CATACLOUD_LOCAL_SANDBOX=off: local machines run unsandboxed "
            "(jobs still run as their own uid, never root)",
            flush=True,
        )
        return None
    why = host_problem()
    if why is None:
        return None
    return (
        f"catacloud: local machines run in a bubblewrap sandbox, and this host refused one: {why}\n"
        f"Fix: {HOST_FIX}"
    )


def _local_network_note(home: Path) -> None:
    """Jobs on local machines reach the internet through pasta and nothing else; where this host
    cannot, they get no network at all (never the host's): say so, and how to fix it."""
    from catacloud.providers.local import sandbox_default
    from catacloud.providers.machine_sandbox import network_problem

    if not sandbox_default():
        return
    (home / "machines").mkdir(exist_ok=True)
    why = network_problem(home / "machines")
    if why is not None:
        print(f"catacloud: jobs on local machines get no network (a loopback only): {why}", flush=True)


def _images_note() -> None:
    """Jobs with an ``image`` need skopeo and umoci on this host (local machines use its tools):
    where they are missing, say the one line that installs them."""
    from catacloud.agent.images import find_tools

    why = find_tools()
    if isinstance(why, str):
        print(f"catacloud: jobs with an image will fail here: {why}", flush=True)


def _tool_notes(home: Path) -> None:
    """What this host lacks for local machines' jobs (their network, images, containers): each
    said with the line that installs it."""
    _local_network_note(home)
    _images_note()
    if (note := containers_note()) is not None:
        print(note, flush=True)


def containers_note() -> str | None:
    """Jobs of machine types with ``containers: true`` need Podman on this host (local machines
    use its tools), and the networks they make slirp4netns and iptables: what is missing, in the
    one line that installs it (None: nothing is)."""
    from catacloud.agent import containers

    missing = [
        tool for tool in containers.HOST_TOOLS if shutil.which(tool, path=containers.SYSTEM_PATH) is None
    ]
    if not missing:
        return None
    return (
        f"catacloud: jobs of machine types with containers: true will fail here (no {', '.join(missing)}): "
        f"apt-get install {' '.join(containers.HOST_PACKAGES)}"
    )


def dev_started_at(environ: Mapping[str, str]) -> float:
    """When the user started waiting, on the monotonic clock: `make dev` passes the time it
    started (``CATACLOUD_DEV_STARTED``, before its bootstrap: the venv, pip), else this
    process's own start. The ready banner counts from there: the wait the user had."""
    try:
        since = float(environ["CATACLOUD_DEV_STARTED"])
    except (KeyError, ValueError):
        import psutil

        since = psutil.Process().create_time()
    return time.monotonic() - max(0.0, time.time() - since)


@dataclass(frozen=True)
class DevForge:
    """A fake forge (or cloud) ``make dev`` runs beside the stack, and the demo org connected to
    it. The test kit prepares it (``python -m testkit.dev_<forge>``, by name: product code
    imports nothing of the test kit) and answers where it listens, the catalog to apply (if
    any), the command that runs it and the settings the stack's programs get (if any)."""

    forge: str
    title: str
    walkthrough: str
    url: str
    catalog: Path | None
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def _prepare(
        cls, forge: str, title: str, walkthrough: str, home: Path, port: int, fake_port: str
    ) -> DevForge:
        answer = subprocess.run(
            [sys.executable, "-m", f"testkit.dev_{forge}", str(home), str(port), fake_port],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        data = json.loads(answer)
        return cls(
            forge=forge,
            title=title,
            walkthrough=walkthrough,
            url=data["url"],
            catalog=Path(data["catalog"]) if data.get("catalog") else None,
            command=data["command"],
            env=dict(data.get("env") or {}),
        )


class DevGitHub(DevForge):
    """``CATACLOUD_DEV_GITHUB=fake make dev``: a fake GitHub sending signed deliveries to this web."""

    @classmethod
    def prepare(cls, home: Path, port: int) -> DevForge:
        fake_port = os.environ.get("GITHUB_FAKE_PORT", "8070")
        return cls._prepare("github", "GitHub", "docs/walkthroughs/github-actions.md", home, port, fake_port)


class DevCloud(DevForge):
    """``CATACLOUD_DEV_CLOUD=fake make dev``: a fake Hetzner Cloud API that organizations' own
    Hetzner accounts call (the operator's ``CATACLOUD_ORG_PROVIDER_SETTINGS`` says so)."""

    @classmethod
    def prepare(cls, home: Path, port: int) -> DevForge:
        fake_port = os.environ.get("HETZNER_FAKE_PORT", "8072")
        return cls._prepare("cloud", "Hetzner", "docs/walkthroughs/own-cloud.md", home, port, fake_port)


class DevGitLab(DevForge):
    """``CATACLOUD_DEV_GITLAB=fake make dev``: a fake GitLab sending Job events to this web."""

    @classmethod
    def prepare(cls, home: Path, port: int) -> DevForge:
        fake_port = os.environ.get("GITLAB_FAKE_PORT", "8071")
        return cls._prepare("gitlab", "GitLab", "docs/walkthroughs/gitlab-ci.md", home, port, fake_port)


def _announce_when_healthy(supervisor: object, url: str, lines: list[str], started: float) -> None:
    """Print the banner again once /readyz says every part is up (200; 503 until then): the
    first one has scrolled away under the Celery banners by then."""
    while not supervisor._stopping.is_set():  # type: ignore[attr-defined]
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if json.loads(response.read()).get("status") == "ready":
                    break
        except (OSError, ValueError):
            pass
        time.sleep(1)
    else:
        return
    took = time.monotonic() - started
    supervisor.announce(  # type: ignore[attr-defined]
        "\n".join(["", f"Catacloud is ready ({took:.0f} s; Ctrl-C stops everything):", *lines, ""])
    )


def _stop_local_machines(home: Path) -> None:
    """Every stop ends the local machines of this home (their rows become lost at the next
    start and the pools replace them). First each recorded machine is asked to stop (its agent
    gets SIGTERM, then after 2 s everything left SIGKILL), then every process still carrying the
    mark of a machine of this home is SIGKILLed: found by the mark, not by the records, which
    may be gone meanwhile (`make clean` deleting $CATACLOUD_HOME). Needs neither PostgreSQL
    nor Redis."""
    from concurrent.futures import ThreadPoolExecutor

    from catacloud.providers.local import LocalProvider, end_processes, machine_processes, release_areas

    root = home / "machines"
    with contextlib.suppress(OSError), ThreadPoolExecutor(max_workers=16) as pool:
        # each may wait its stop timeout: all at once
        for state_dir in sorted(p for p in root.iterdir() if p.is_dir()):
            provider = LocalProvider(
                config={"state_dir": str(state_dir), "stop_timeout_seconds": 2}, credentials={}
            )
            for machine in provider.list({}):
                pool.submit(provider.delete, machine.provider_id)
    left = end_processes([p for procs in machine_processes(root).values() for p in procs])
    if left:
        _say(f"catacloud: could not end {len(left)} local machine process(es): pids {[p.pid for p in left]}")
    if root.is_dir():
        release_areas(root)  # the jobs' file systems of machines that had died before


DESCRIPTION = (
    "Catacloud: the client of the REST API (jobs, run, configs, pools, instances, artifacts, events, "
    "costs, budgets, registry-credentials, github, gitlab, auth), "
    "then the server's commands: the dev runner and embedded services (dev, services), the "
    "simulator (simulate) and, on machines, the agent (agent, job-meta, checkpoint). Global "
    "flags (--url, --profile, --json) go before or after the command."
)


def build_parser() -> argparse.ArgumentParser:
    from catacloud.client.api import client_version
    from catacloud.client.usage import Parser, add_global_flags

    parser = Parser(prog="catacloud", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"catacloud {client_version()}")
    add_global_flags(parser, top=True)
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    from catacloud.client.commands import add_client_commands

    # The client first (what most users run), then the server's commands.
    add_client_commands(sub)  # `catacloud jobs|run|configs|pools|instances|…|auth …`

    services = sub.add_parser("services", help="embedded PostgreSQL and Redis under $CATACLOUD_HOME")
    services.add_argument("action", choices=["up", "down", "run"])
    services.add_argument("--keep", action="store_true", help="with run: leave the services running")
    services.add_argument("command", nargs=argparse.REMAINDER)
    services.set_defaults(func=cmd_services)

    dev = sub.add_parser("dev", help="run the whole system on the embedded services (make dev)")
    dev.set_defaults(func=cmd_dev)
    cleanup = sub.add_parser("dev-cleanup")  # no help: not listed (a dev watchdog runs it)
    cleanup.add_argument("--home", required=True)
    cleanup.add_argument("--stop-postgres", action="store_true")
    cleanup.add_argument("--stop-redis", action="store_true")
    cleanup.set_defaults(func=cmd_dev_cleanup)

    from catacloud.agent.command import add_agent_commands

    add_agent_commands(sub)  # `catacloud agent` (on machines) and `catacloud job-meta` (inside jobs)
    from catacloud.simulate import add_simulate_command

    add_simulate_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
