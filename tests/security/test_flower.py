"""Boundary: Flower (every task, its arguments, the workers) answers only with its basic auth.

Shown on main: ``/metrics`` answered anyone; every other Flower page asked for the password.
"""

from __future__ import annotations

import base64
import http.client
from pathlib import Path

import pytest

from catacloud.cli import flower_command
from testkit.processes import TESTS, Proc, free_port, wait_for

pytestmark = pytest.mark.e2e


def get(port: int, path: str, auth: str | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        conn.request("GET", path, headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


def test_flower_metrics_need_the_basic_auth_like_its_pages(tmp_path: Path, settings: object) -> None:
    port = free_port()
    env = TESTS.env(FLOWER_BASIC_AUTH="ops:s3cret-flower")
    proc = Proc("flower", flower_command(host="127.0.0.1", port=port), env, tmp_path / "flower.log")
    try:

        def up() -> bool:
            proc.check()
            try:
                return get(port, "/healthcheck") == 200
            except OSError:
                return False

        wait_for(up, 60, "flower to answer")
        assert get(port, "/metrics") == 401
        assert get(port, "/metrics", "ops:wrong") == 401
        assert get(port, "/metrics", "ops:s3cret-flower") == 200
        assert get(port, "/workers") == 401  # its pages, as before
        assert get(port, "/healthcheck") == 200  # says "OK" and nothing else
    finally:
        proc.stop()
