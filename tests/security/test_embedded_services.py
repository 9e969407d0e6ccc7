"""Boundary: the embedded PostgreSQL and Redis are not open to anyone on the machine.

Shown on main: PostgreSQL ran with trust authentication and Redis without a password, so any
local process (a job on the local provider included) connected as superuser or queued tasks.
"""

from __future__ import annotations

import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from catacloud.embedded import EmbeddedPostgres
from testkit.processes import WATCHED_FOLDERS


def no_password_dsn(port: int, db: str = "postgres") -> str:
    return f"postgresql://postgres@127.0.0.1:{port}/{db}"


@pytest.mark.django_db
def test_the_running_embedded_server_needs_its_password() -> None:
    port = int(connection.settings_dict["PORT"])
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(no_password_dsn(port), connect_timeout=5).close()


@pytest.fixture
def home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="catacloud-pg-test-"))
    path.chmod(0o755)  # the server runs as its own system user when we are root
    WATCHED_FOLDERS.append(path)  # the run's leftover check looks at its servers too
    yield path
    EmbeddedPostgres(path).stop()
    shutil.rmtree(path, ignore_errors=True)


def test_an_old_trust_cluster_gets_a_password_at_its_next_start(home: Path) -> None:
    pg = EmbeddedPostgres(home)
    pg.start()  # initdb --auth=trust, as every home made before passwords existed
    port = pg.state.load()["port"]
    psycopg.connect(no_password_dsn(port)).close()  # the old, open state

    pg.secure()

    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(no_password_dsn(port), connect_timeout=5).close()
    with psycopg.connect(pg.url("postgres")) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
    assert stat.S_IMODE((home / "pg-password").stat().st_mode) == 0o600
    pg.secure()  # idempotent: a restart changes nothing and still connects
    psycopg.connect(pg.url("postgres")).close()


# ---- the embedded Redis (Celery's broker: whoever reaches it can queue tasks) -----------------


@pytest.mark.django_db
def test_the_running_embedded_redis_needs_its_password() -> None:
    import redis
    from django.conf import settings

    url = redis.connection.parse_url(settings.REDIS_URL)
    assert url.get("password"), "REDIS_URL carries the password"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=url["host"], port=url["port"], socket_timeout=5).ping()


def test_an_unprotected_redis_gets_its_password_at_the_next_start(home: Path) -> None:
    import redis

    from catacloud.embedded import EmbeddedRedis

    server = EmbeddedRedis(home)
    server.start()
    try:
        port = server.state.load()["port"]
        redis.Redis.from_url(server.url()).config_set("requirepass", "")  # as before passwords
        redis.Redis(host="127.0.0.1", port=port).ping()

        server.secure()

        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=5).ping()
        assert redis.Redis.from_url(server.url()).ping()
        assert server.password() not in " ".join(__import__("psutil").Process(server._pid()).cmdline())
    finally:
        server.stop()
