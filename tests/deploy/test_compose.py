"""docker-compose.yml gives every service the settings the guide documents, and publishes
nothing that should stay on the host. No Docker engine runs here: deploy/compose_env.py renders
what compose would give a container (image ENV, env_file, environment with interpolation), and
these tests read it.

Shown on main before the fix: the services passed fixed keys only, so `DJANGO_SECURE_*` and
`DJANGO_CSRF_TRUSTED_ORIGINS` written to .env never reached Django (`check --deploy` failed in the
container, the admin login behind the proxy answered "Origin checking failed"), and web and
agent-api were published on every address, past the host's firewall.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.compose_env import interpolate, published_ports, read_env_file, service_env

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
EXAMPLE = ROOT / "deploy" / "env.example"
DOCUMENTED_IN = (ROOT / "docs" / "operator" / "configuration.md", ROOT / "docs" / "security.md")

# Compose decides these itself (the compose network's addresses, the volume's paths): .env cannot
# change them, by design.
COMPOSE_DECIDES = {"DATABASE_URL", "REDIS_URL", "CATACLOUD_HOME", "PROMETHEUS_MULTIPROC_DIR"}
# Secrets arrive as files (docker secrets), never as values: NAME_FILE under /run/secrets.
SECRETS = {
    "DATABASE_PASSWORD",
    "DJANGO_SECRET_KEY",
    "CATACLOUD_ENCRYPTION_KEY",
    "CATACLOUD_BOOTSTRAP_KEYS",
    "CATACLOUD_METRICS_TOKEN",
}
# Documented, but read by no process of the compose services: `make dev` only, compose's own
# interpolation, or the agent on the machines.
NOT_READ_BY_THE_SERVICES = {
    "PORT": "make dev",
    "AGENT_PORT": "make dev",
    "FLOWER_PORT": "make dev",
    "CATACLOUD_DEV_GITHUB": "make dev",
    "GITHUB_FAKE_PORT": "make dev",
    "CATACLOUD_DEV_GITLAB": "make dev",
    "GITLAB_FAKE_PORT": "make dev",
    "FLOWER_BIND": "compose interpolation (the port Flower is published on)",
    "CATACLOUD_JOB_UIDS": "the agent on a machine (catacloud agent --job-uids)",
    "CATACLOUD_PASTA": "the agent on a machine",
}
# Read by the settings module and rightly not in the tables.
UNDOCUMENTED = {
    "DATABASE_TEST_NAME": "the test suite's database",
    "CATACLOUD_EMBEDDED": "set by `make dev` for its own processes",
    "CATACLOUD_AGENT_SERVER": "set by config/agent_asgi.py itself",
    "CATACLOUD_AGENT_PACKAGE": "refused at start: gone",
    "CATACLOUD_AGENT_MAX_CONNECTIONS_PER_CLIENT": "refused at start: gone",
}
APP_SERVICES = ("web", "agent-api", "worker", "beat", "flower", "migrate")
# What must be public: the proxy (Caddy) takes 443, and 80 for ACME's HTTP challenge and redirects.
PUBLIC = {("proxy", "80"), ("proxy", "443")}
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def documented() -> set[str]:
    """Every variable named in the first column of the configuration and security tables."""
    names: set[str] = set()
    for page in DOCUMENTED_IN:
        for line in page.read_text().splitlines():
            if line.startswith("| `"):
                cell = line.split("|")[1]
                names |= {n for n in re.findall(r"`([^`]+)`", cell) if re.fullmatch(r"[A-Z][A-Z0-9_]+", n)}
    return names


def settings_reads() -> set[str]:
    source = (ROOT / "config" / "settings.py").read_text()
    patterns = (
        r'env\.\w+\(\s*"([A-Z][A-Z0-9_]+)"',
        r'_required_secret\(\s*"([A-Z][A-Z0-9_]+)"',
        r'os\.environ(?:\.get)?[(\[]\s*"([A-Z][A-Z0-9_]+)"',
        r'"([A-Z][A-Z0-9_]+)" in os\.environ',
    )
    return {name for pattern in patterns for name in re.findall(pattern, source)}


def example() -> dict[str, str]:
    return {**read_env_file(EXAMPLE), "FLOWER_BASIC_AUTH": "ops:made-up"}  # the guide appends it


def test_every_variable_the_settings_read_is_documented() -> None:
    missing = settings_reads() - documented() - set(UNDOCUMENTED)
    assert not missing, (
        f"read by config/settings.py, in no table of {[p.name for p in DOCUMENTED_IN]}: {missing}"
    )


def test_every_documented_setting_reaches_every_service_that_reads_it() -> None:
    """Given each documented variable written to .env, when compose builds each Catacloud
    service's environment, then the service has it with that value (or, for what compose
    decides or a secret, compose's own value); every service reads the whole settings module."""
    wrong: list[str] = []
    for name in sorted(documented() - set(NOT_READ_BY_THE_SERVICES)):
        dotenv = {**example(), name: f"value-of-{name}"}
        for service in APP_SERVICES:
            env = service_env(service, dotenv, compose=COMPOSE)
            if name in SECRETS:  # never written to .env: compose hands it over as a file
                if not env.get(f"{name}_FILE", "").startswith("/run/secrets/"):
                    wrong.append(f"{service}: {name} (as {name}_FILE under /run/secrets)")
            elif name in COMPOSE_DECIDES:
                if not env.get(name) or env[name] == dotenv[name]:
                    wrong.append(f"{service}: {name} (compose's own)")
            elif env.get(name) != dotenv[name]:
                wrong.append(f"{service}: {name}={env.get(name)!r}")
    assert not wrong, "settings written to .env that a service would not receive:\n" + "\n".join(wrong)


def test_the_example_env_holds_only_settings_compose_and_its_services_read() -> None:
    text = EXAMPLE.read_text()
    assert "$" not in text  # an env_file is not interpolated: a ${...} would reach Django as is
    interpolated = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", COMPOSE.read_text()))
    unknown = set(read_env_file(EXAMPLE)) - documented() - interpolated
    assert not unknown, unknown
    assert not set(read_env_file(EXAMPLE)) & (SECRETS | COMPOSE_DECIDES)


def test_check_deploy_is_clean_in_the_environment_compose_gives_the_web_service(tmp_path: Path) -> None:
    """What .ci/run does: the web service's environment, rendered from docker-compose.yml and
    deploy/env.example, with the secrets written as the guide writes them."""
    (tmp_path / "secrets").mkdir()
    for name in ("postgres_password", "django_secret_key", "bootstrap_keys", "metrics_token"):
        (tmp_path / "secrets" / name).write_text(secrets.token_urlsafe(48))
    from cryptography.fernet import Fernet

    (tmp_path / "secrets" / "encryption_key").write_text(Fernet.generate_key().decode())
    (tmp_path / "home" / "prometheus").mkdir(parents=True)  # the volume, as migrate leaves it
    result = subprocess.run(
        [
            sys.executable,
            "deploy/compose_env.py",
            "web",
            "--env-file",
            str(EXAMPLE),
            "--mount",
            f"/run/secrets={tmp_path / 'secrets'}",
            "--mount",
            f"/var/lib/catacloud={tmp_path / 'home'}",
            "--mount",
            f"/app={ROOT}",
            "--",
            sys.executable,
            "manage.py",
            "check",
            "--deploy",
            "--fail-level",
            "WARNING",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_only_the_proxy_is_published_on_every_address() -> None:
    """Docker's published ports bypass the host's firewall (ufw): anything published on all
    addresses is on the internet. Only the proxy's 80 and 443 must be."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    exposed = {
        (name, port)
        for name in services
        for address, port in published_ports(name, example(), compose=COMPOSE)
        if address not in LOOPBACK
    }
    assert exposed == PUBLIC, f"published on every address: {sorted(exposed - PUBLIC)}"
    assert published_ports("web", example(), compose=COMPOSE) == [("127.0.0.1", "8000")]
    assert published_ports("agent-api", example(), compose=COMPOSE) == [("127.0.0.1", "8001")]


def test_machines_reach_the_agent_server_through_the_proxy() -> None:
    """agent-api needs no public port: the guide's agent URL is the proxy's, whose /api/agent/
    goes to agent-api:8001 on the compose network."""
    env = service_env("worker", example(), compose=COMPOSE)  # the worker renders user data
    assert env["CATACLOUD_AGENT_URL"] == "https://catacloud.example.com"
    caddy = (ROOT / "deploy" / "Caddyfile").read_text()
    assert "handle /api/agent/*" in caddy and "reverse_proxy agent-api:8001" in caddy


def test_health_checks_ask_with_a_host_django_allows() -> None:
    """With DJANGO_ALLOWED_HOSTS set (as it must be), a request with Host 127.0.0.1 gets 400: the
    health checks send the first allowed host instead."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, port in (("web", 8000), ("agent-api", 8001)):
        code = services[name]["healthcheck"]["test"][-1]
        assert f"http://127.0.0.1:{port}/healthz" in code and "DJANGO_ALLOWED_HOSTS" in code
        assert "'Host'" in code


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("${A}", "1"),
        ("${UNSET:-d}", "d"),
        ("${EMPTY:-d}", "d"),
        ("${EMPTY-d}", ""),
        ("$$HOME and $A", "$HOME and 1"),
        ("${A:?must}", "1"),
    ],
)
def test_the_renderer_interpolates_as_compose_does(text: str, expected: str) -> None:
    assert interpolate(text, {"A": "1", "EMPTY": ""}) == expected
