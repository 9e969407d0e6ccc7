"""Boundary: a production deployment is configured safely from the environment.

Shown on main: no HSTS, secure cookies or proxy SSL header could be set, so ``manage.py check
--deploy`` always complained; compose published Flower (the admin password's twin) on every
interface.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]

# The production variables README documents (values made up for the check).
PRODUCTION = {
    "DJANGO_DEBUG": "false",
    "DATABASE_URL": "postgresql://catacloud@db.internal:5432/catacloud",
    "REDIS_URL": "redis://redis.internal:6379/0",
    "DJANGO_ALLOWED_HOSTS": "catacloud.example.com",
    "DJANGO_SECRET_KEY": "k" * 10 + "Zq9#x!2@Lm4$Vb7%Nc8^Tr1&Ws5*Yd3(Fg6)Hj0-Pa+Qe=Uo~Ik",
    "CATACLOUD_ENCRYPTION_KEY": "0nQnCZr0mBxgv-xR0jXfdiK0uQd1pP3sCw1gTfnZk0k=",
    "CATACLOUD_BOOTSTRAP_KEYS": "bootstrap-signing-key-for-the-check-only",
    "DJANGO_SECURE_PROXY_SSL_HEADER": "true",
    "DJANGO_SECURE_SSL_REDIRECT": "true",
    "DJANGO_SECURE_HSTS_SECONDS": "31536000",
    "DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS": "true",
    "DJANGO_SECURE_HSTS_PRELOAD": "true",
    "DJANGO_SECURE_COOKIES": "true",
}


def check_deploy(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    clean = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CATACLOUD_HOME": str(tmp_path / "home")}
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_deploy_passes_with_the_documented_production_variables(tmp_path: Path) -> None:
    result = check_deploy(PRODUCTION, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_check_deploy_complains_without_them(tmp_path: Path) -> None:
    bare = {k: v for k, v in PRODUCTION.items() if not k.startswith("DJANGO_SECURE_")}
    result = check_deploy(bare, tmp_path)
    assert result.returncode != 0
    assert "SECURE_HSTS_SECONDS" in result.stderr + result.stdout


def test_compose_publishes_flower_on_localhost_unless_told_otherwise() -> None:
    flower = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["flower"]
    assert flower["ports"] == ["${FLOWER_BIND:-127.0.0.1}:5555:5555"]
