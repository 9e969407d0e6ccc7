"""``postgres_database``: a scratch database and a login role on a configured PostgreSQL
server; the job gets the DSN; both are dropped afterwards.

Config: ``admin_dsn_env`` (name of an environment variable holding an admin DSN on the
workers) or ``admin_dsn_file``; ``use_catacloud_database: true`` uses Catacloud's own server
(handy with the embedded PostgreSQL). The admin DSN is never stored in the database.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import psycopg
from django.conf import settings
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from apps.resources.wells import Created, Well, WellPermanent, WellTransient


class PostgresDatabaseWell(Well):
    kind = "postgres_database"

    def _admin_dsn(self) -> str:
        if self.config.get("admin_dsn_env"):
            dsn = os.environ.get(str(self.config["admin_dsn_env"]), "")
        elif self.config.get("admin_dsn_file"):
            dsn = Path(str(self.config["admin_dsn_file"])).read_text().strip()
        elif self.config.get("use_catacloud_database"):
            db = settings.DATABASES["default"]
            dsn = make_conninfo(
                host=db["HOST"],
                port=db["PORT"] or 5432,
                user=db["USER"],
                password=db.get("PASSWORD") or None,
                dbname="postgres",
            )
        else:
            raise WellPermanent(
                "postgres_database needs admin_dsn_env, admin_dsn_file or use_catacloud_database"
            )
        if not dsn:
            raise WellPermanent("the admin DSN for postgres_database is empty")
        return dsn

    @staticmethod
    def _names(resource_id: str) -> tuple[str, str]:
        short = resource_id.replace("-", "")[:20]
        return f"cc_db_{short}", f"cc_user_{short}"

    def _admin(self) -> psycopg.Connection:
        try:
            return psycopg.connect(self._admin_dsn(), autocommit=True, connect_timeout=10)
        except psycopg.OperationalError as exc:
            raise WellTransient(f"cannot reach the PostgreSQL server: {type(exc).__name__}") from None

    def create(self, *, resource_id: str, job: Any) -> Created:
        dbname, user = self._names(resource_id)
        password = secrets.token_urlsafe(24)
        with self._admin() as conn:
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [user]).fetchone()
            if exists:  # a retried create: reset the password we are about to hand out
                conn.execute(
                    sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(user), sql.Literal(password))
                )
            else:
                conn.execute(
                    sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                        sql.Identifier(user), sql.Literal(password)
                    )
                )
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [dbname]).fetchone():
                conn.execute(
                    sql.SQL("CREATE DATABASE {} OWNER {}").format(
                        sql.Identifier(dbname), sql.Identifier(user)
                    )
                )
            # Only its owner (and superusers) may connect: not the other jobs' scratch roles.
            conn.execute(sql.SQL("REVOKE CONNECT ON DATABASE {} FROM PUBLIC").format(sql.Identifier(dbname)))
            info = conninfo_to_dict(conn.info.dsn)
        host = str(self.config.get("public_host") or info.get("host") or "127.0.0.1")
        port = int(info.get("port") or 5432)
        dsn = make_conninfo(host=host, port=port, dbname=dbname, user=user, password=password)
        return Created(
            external_id=dbname,
            metadata={"host": host, "port": port, "dbname": dbname, "user": user},
            secret={"password": password, "dsn": dsn},
        )

    def destroy(self, *, resource_id: str, external_id: str, job_id: str | None) -> None:
        dbname, user = self._names(resource_id)
        with self._admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(user)))
