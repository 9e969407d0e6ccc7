"""docker-compose.yml is for users (no Docker engine runs here): parse it and check it."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_runs_the_whole_system() -> None:
    services = _compose()["services"]
    assert services["postgres"]["image"] == "postgres:16"
    assert services["redis"]["image"] == "redis:7"
    commands = {name: " ".join(svc.get("command", [])) for name, svc in services.items()}
    assert "gunicorn config.wsgi" in commands["web"]
    assert commands["agent-api"].startswith("uvicorn config.agent_asgi:application")
    assert commands["worker"].startswith("celery -A config worker")
    assert commands["beat"].startswith("celery -A config beat")
    assert commands["flower"].startswith("celery -A config flower")
    assert "manage.py migrate" in commands["migrate"]


def test_every_app_service_shares_one_configuration() -> None:
    services = _compose()["services"]
    names = ("web", "agent-api", "worker", "beat", "flower", "migrate")
    envs = [services[name].get("environment", services["worker"]["environment"]) for name in names]
    for env in envs:
        assert env["DATABASE_URL"].startswith("postgresql://")
        assert env["REDIS_URL"].startswith("redis://")
        # Secrets arrive as files, never inline.
        assert "DJANGO_SECRET_KEY" not in env and env["DJANGO_SECRET_KEY_FILE"].startswith("/run/secrets/")
        assert env["CATACLOUD_ENCRYPTION_KEY_FILE"].startswith("/run/secrets/")
    assert "FLOWER_BASIC_AUTH" in services["flower"]["environment"]
    for name in ("web", "agent-api", "worker", "beat"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    # Every other setting comes from .env (tests/deploy/test_compose.py renders what each gets).
    assert all(services[name]["env_file"] == ".env" for name in names)


def test_the_image_installs_the_package() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    # the agent distribution, then the server with the tracing extra (on with OTEL_* alone)
    assert "pip install ./agent '.[tracing]'" in dockerfile
    # the agent wheel the Agent API serves to cloud machines (tests/deploy/test_agent_wheel.py)
    assert "pip wheel --no-deps -w /app/dist ./agent" in dockerfile
    assert "CATACLOUD_AGENT_WHEEL=/app/dist" in dockerfile
    assert "USER catacloud" in dockerfile


def test_web_and_worker_share_one_metrics_directory_made_fresh_before_they_start() -> None:
    """/metrics under several gunicorn workers sums every process's counters (multiprocess
    mode); the worker's (claim latency on job placement) land in the same directory."""
    services = _compose()["services"]
    dirs = {name: services[name]["environment"].get("PROMETHEUS_MULTIPROC_DIR") for name in ("web", "worker")}
    assert dirs["web"] and dirs["web"] == dirs["worker"], dirs
    mounts = {name: services[name]["volumes"] for name in ("web", "worker")}
    assert any(dirs["web"].startswith(m.split(":")[1]) for m in mounts["web"]), mounts
    assert mounts["web"] == mounts["worker"]
    migrate = " ".join(services["migrate"]["command"])
    assert 'mkdir -p "$$PROMETHEUS_MULTIPROC_DIR"' in migrate and "*.db" in migrate


def test_tls_in_front_routes_machines_to_the_agent_server_and_the_rest_to_the_web() -> None:
    """The guide's proxy (compose profile ``tls``, deploy/Caddyfile): machines reach the agent
    server (and the agent wheel) through it, people and scrapers the web."""
    proxy = _compose()["services"]["proxy"]
    assert proxy["profiles"] == ["tls"] and "443:443" in proxy["ports"]
    assert "./deploy/Caddyfile:/etc/caddy/Caddyfile:ro" in proxy["volumes"]
    caddy = (ROOT / "deploy" / "Caddyfile").read_text()
    agent = caddy.index("handle /api/agent/*")
    assert caddy.index("reverse_proxy agent-api:8001", agent) < caddy.index("reverse_proxy web:8000")
    assert "flower" not in caddy.lower()  # Flower stays on the host
