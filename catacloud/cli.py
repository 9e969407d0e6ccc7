"""The ``catacloud`` command: embedded services, the dev runner, (on machines) the agent, and
the client of the REST API (``jobs``, ``pools``, ``artifacts``)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

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
    ]


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
        Program(
            "flower", [*celery, "flower", "--address=127.0.0.1", f"--port={flower_port}"], env, str(ROOT)
        ),
    ]


def cmd_dev(args: argparse.Namespace) -> int:
    """`make dev`: services, migrations, demo data, then web + worker + beat + Flower, each
    restarted when it dies (see catacloud.supervisor); Ctrl-C stops everything and exits 0."""
    from catacloud import embedded
    from catacloud.supervisor import Supervisor

    started = time.monotonic()
    port = int(os.environ.get("PORT", "8000"))
    flower_port = int(os.environ.get("FLOWER_PORT", "5555"))
    agent_port = int(os.environ.get("AGENT_PORT", str(port + 1)))
    services = embedded.services_up()
    home = Path(services.env["CATACLOUD_HOME"])
    # prometheus_client multiprocess mode: every gunicorn worker and the Celery worker write
    # their counters here and each scrape sums them; fresh at every start.
    metrics_dir = home / "prometheus"
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(parents=True)
    env = {
        **os.environ,
        **services.env,
        "DJANGO_DEBUG": os.environ.get("DJANGO_DEBUG", "1"),
        "CATACLOUD_PUBLIC_URL": os.environ.get("CATACLOUD_PUBLIC_URL", f"http://127.0.0.1:{port}"),
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        "CATACLOUD_AGENT_URL": os.environ.get("CATACLOUD_AGENT_URL", f"http://127.0.0.1:{agent_port}"),
        "PYTHONUNBUFFERED": "1",
    }
    supervisor: Supervisor | None = None
    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if stopping.is_set():
            return  # already stopping: a second Ctrl-C must not break the clean-up half way
        stopping.set()
        if supervisor is None:
            raise KeyboardInterrupt  # still setting up: unwind to the clean-up below

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print("catacloud: migrating the database…", flush=True)
        _manage("migrate", "--noinput", env=env, capture=True)
        _manage("collectstatic", "--noinput", env=env, capture=True)
        _manage("apply", str(DEMO_CATALOG), env=env)
        github = DevGitHub(home, port) if os.environ.get("CATACLOUD_DEV_GITHUB") == "fake" else None
        if github is not None:
            _manage("apply", str(github.catalog), env=env)
        creds = json.loads(_manage("dev_bootstrap", env=env, capture=True).strip().splitlines()[-1])
        flower_auth = os.environ.get("FLOWER_BASIC_AUTH", f"admin:{creds['password']}")
        env["FLOWER_BASIC_AUTH"] = flower_auth
        programs = dev_programs(env=env, home=home, port=port, flower_port=flower_port, agent_port=agent_port)
        if github is not None:
            programs.append(Program("github", github.command, env, str(ROOT)))
        supervisor = Supervisor(programs)
        base = f"http://127.0.0.1:{port}"
        lines = [
            f"  admin    {base}/admin/   user {creds['username']}  password {creds['password']}",
            f"  API      {base}/api/v1/  (docs {base}/api/docs/)",
            f"  health   {base}/healthz",
            f"  agents   {env['CATACLOUD_AGENT_URL']}/api/agent/v1/  (the agent server)",
            f"  Flower   http://127.0.0.1:{flower_port}/  "
            f"(basic auth {flower_auth.split(':')[0]} / same password)",
            f"  token    {creds['token']}",
            *(
                [f'  GitHub   a fake GitHub at {github.url} (README: "GitHub Actions on Catacloud")']
                if github is not None
                else []
            ),
            f"  try:     curl -H 'Authorization: Bearer {creds['token']}' {base}/api/v1/machine-types/",
            f"  shell:   . .venv/bin/activate; set -a; . {home / '.env'}; set +a"
            "  (manage.py then uses these services)",
        ]
        print("\n".join(["", "Catacloud is starting (Ctrl-C stops everything):", *lines, ""]), flush=True)
        threading.Thread(
            target=_announce_when_healthy,
            args=(supervisor, f"{base}/healthz", lines, started),
            name="announce",
            daemon=True,
        ).start()
        if not stopping.is_set():
            supervisor.run()
        return 0
    except (KeyboardInterrupt, subprocess.CalledProcessError):
        if not stopping.is_set():
            raise
        return 0  # Ctrl-C while setting up (a manage.py step dies of it too): a clean stop
    finally:
        stopping.set()
        print("catacloud: stopping the local machines and the embedded services…", flush=True)
        _stop_local_machines(home)
        services.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class DevGitHub:
    """``CATACLOUD_DEV_GITHUB=fake make dev``: a fake GitHub (testkit/github_fake.py) sending
    signed deliveries to this web, and the demo org connected to it with one runner class whose
    runners are the stand-in runner (testkit/github_runner)."""

    def __init__(self, home: Path, port: int) -> None:
        self.port = int(os.environ.get("GITHUB_FAKE_PORT", "8070"))
        self.url = f"http://127.0.0.1:{self.port}"
        key, secret = home / "github-fake-app.pem", home / "github-fake-webhook-secret"
        if not key.exists():
            from testkit.github_fake import app_keypair

            key.write_text(app_keypair()[0])
            key.chmod(0o600)
        if not secret.exists():
            import secrets

            secret.write_text(secrets.token_urlsafe(24))
            secret.chmod(0o600)
        self.command = [
            sys.executable, "-m", "testkit.github_fake", "--port", str(self.port), "--app-id", "1",
            "--public-key-file", str(key), "--webhook-secret-file", str(secret),
            "--webhook-url", f"http://127.0.0.1:{port}/api/integrations/github/webhook",
            "--installation", "1", "--account", "demo-org", "--repository", "demo-org/app",
        ]  # fmt: skip
        self.catalog = home / "github-dev.yaml"
        self.catalog.write_text(
            "organizations:\n"
            "  - slug: demo\n"
            "    github:\n"
            "      app_id: 1\n"
            f"      api_url: {self.url}\n"
            f"      private_key: {{file: {key}}}\n"
            f"      webhook_secret: {{file: {secret}}}\n"
            "      installations: [{id: 1, account: demo-org}]\n"
            "      runner_classes:\n"
            "        - name: linux-2cpu\n"
            "          labels: [self-hosted, catacloud-linux-2cpu]\n"
            "          machine_type: local-small\n"
            f"          runner_dir: {ROOT / 'testkit' / 'github_runner'}\n"
        )


def _announce_when_healthy(supervisor: object, url: str, lines: list[str], started: float) -> None:
    """Print the banner again once /healthz says every part is up: the first one has scrolled
    away under the Celery banners by then."""
    while not supervisor._stopping.is_set():  # type: ignore[attr-defined]
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if json.loads(response.read()).get("status") == "ok":
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
    """Ctrl-C stops everything: also the local machines (agent processes) of this home. Their
    rows become lost at the next start and the pools replace them."""
    from catacloud.providers.local import LocalProvider

    root = home / "machines"
    if not root.is_dir():
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=16) as pool:  # each may wait its stop timeout: at once
        for state_dir in sorted(p for p in root.iterdir() if p.is_dir()):
            provider = LocalProvider(
                config={"state_dir": str(state_dir), "stop_timeout_seconds": 2}, credentials={}
            )
            for machine in provider.list({}):
                pool.submit(provider.delete, machine.provider_id)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="catacloud", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    services = sub.add_parser("services", help="embedded PostgreSQL and Redis under $CATACLOUD_HOME")
    services.add_argument("action", choices=["up", "down", "run"])
    services.add_argument("--keep", action="store_true", help="with run: leave the services running")
    services.add_argument("command", nargs=argparse.REMAINDER)
    services.set_defaults(func=cmd_services)

    dev = sub.add_parser("dev", help="run the whole system on the embedded services (make dev)")
    dev.set_defaults(func=cmd_dev)

    from catacloud.agent.main import add_agent_commands

    add_agent_commands(sub)  # `catacloud agent` (on machines) and `catacloud job-meta` (inside jobs)
    from catacloud.simulate import add_simulate_command

    add_simulate_command(sub)
    from catacloud.client.commands import add_client_commands

    add_client_commands(sub)  # `catacloud jobs|pools|artifacts …`: the client of the REST API
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
