"""The environment docker compose gives one service of docker-compose.yml, without Docker.

    python deploy/compose_env.py SERVICE --env-file .env [--mount /run/secrets=DIR ...] [-- CMD ...]

prints ``KEY=value`` lines, or runs CMD with exactly that environment (plus the host's ``PATH``
and ``HOME``, which a command needs to start). What it emulates, as Docker documents it:

- the image's ``ENV`` lines (the Dockerfile) come first; then the service's ``env_file``
  (read as written: no interpolation in it); then its ``environment``, which wins, interpolated
  from the ``.env`` file (docs.docker.com, "Environment variables precedence", "Set environment
  variables within your container's environment", "Interpolation");
- ``.env`` only interpolates the compose file: a variable there reaches a container only through
  ``env_file`` or an ``environment`` entry that names it;
- interpolation: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
  ``${VAR:?error}``, ``${VAR?error}``; anchors and ``<<`` merge keys as YAML defines them.

``--mount CONTAINER=HOST`` rewrites paths inside values (``/run/secrets``, the volume) so that a
command run on this host finds the files the container would. ``.ci/run`` runs
``manage.py check --deploy`` this way; tests/deploy/test_compose.py checks every documented
setting reaches every service that reads it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
_BRACED = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")
_BARE = re.compile(r"\$(?P<name>[A-Za-z_][A-Za-z0-9_]*)")


class ComposeError(Exception):
    """What docker compose itself would refuse (a required variable unset, an unknown service)."""


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=value`` lines; ``#`` comments and blank lines skipped; one pair of quotes removed."""
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", key.strip()):
            raise ComposeError(f"{path}:{number}: not a KEY=value line")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:
            value = value.split(" #", 1)[0].rstrip()
        values[key.strip()] = value
    return values


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    """Compose's interpolation of one string."""

    def braced(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "\0"  # a literal "$", restored after the bare-variable pass
        name, op, arg = m.group("name"), m.group("op"), m.group("arg") or ""
        value = variables.get(name)
        unset = value is None or (op is not None and op.startswith(":") and value == "")
        if op in (":-", "-") and unset:
            return arg
        if op in (":?", "?") and unset:
            raise ComposeError(f"required variable {name} is missing a value: {arg}")
        return value or ""

    text = _BRACED.sub(braced, text)
    text = _BARE.sub(lambda m: variables.get(m.group("name"), ""), text)
    return text.replace("\0", "$")


def image_env(dockerfile: Path) -> dict[str, str]:
    """The ``ENV`` lines of a Dockerfile (``ENV A=1 B=2`` and ``ENV A 1``)."""
    values: dict[str, str] = {}
    for line in dockerfile.read_text().splitlines():
        if not line.startswith("ENV "):
            continue
        words = shlex.split(line[4:])
        if words and "=" not in words[0]:
            values[words[0]] = " ".join(words[1:])
            continue
        for word in words:
            key, _, value = word.partition("=")
            values[key] = value
    return values


def _entries(environment: Any) -> dict[str, str | None]:
    """A service's ``environment``, mapping or list (``KEY``: passed from the shell)."""
    if isinstance(environment, dict):
        return {str(k): None if v is None else str(v) for k, v in environment.items()}
    return {
        str(e).partition("=")[0]: (str(e).partition("=")[2] if "=" in str(e) else None) for e in environment
    }


def service_env(
    service: str,
    dotenv: Mapping[str, str],
    *,
    compose: Path = ROOT / "docker-compose.yml",
    shell: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of ``service``'s container: image ``ENV``, ``env_file``, ``environment``.

    ``dotenv`` is the project's ``.env`` (what ``env_file: .env`` reads, and what interpolation
    reads after ``shell``, the environment compose runs in)."""
    document = yaml.safe_load(compose.read_text())
    spec = document.get("services", {}).get(service)
    if spec is None:
        raise ComposeError(f"no service {service!r} in {compose}")
    variables = {**dotenv, **(shell or {})}
    env: dict[str, str] = image_env(compose.parent / "Dockerfile") if "build" in spec else {}
    files = spec.get("env_file") or []
    for entry in [files] if isinstance(files, str | dict) else files:
        path = entry if isinstance(entry, str) else entry["path"]
        if path in (".env", "./.env"):
            env.update(dotenv)
        elif (compose.parent / path).is_file():
            env.update(read_env_file(compose.parent / path))
        elif isinstance(entry, str) or entry.get("required", True):
            raise ComposeError(f"env file {path} not found")
    for key, value in _entries(spec.get("environment") or {}).items():
        if value is None:
            if key in variables:
                env[key] = variables[key]
        else:
            env[key] = interpolate(value, variables)
    return env


def published_ports(service: str, dotenv: Mapping[str, str], *, compose: Path) -> list[tuple[str, str]]:
    """``(host address, container port)`` of each port a service publishes; ``0.0.0.0`` when
    the short syntax names no address (Docker then publishes on every address)."""
    spec = yaml.safe_load(compose.read_text())["services"][service]
    ports = []
    for entry in spec.get("ports") or []:
        if isinstance(entry, dict):
            ports.append((str(entry.get("host_ip") or "0.0.0.0"), str(entry["target"])))
            continue
        parts = interpolate(str(entry), dotenv).rsplit(":", 2)
        address = parts[0] if len(parts) == 3 else "0.0.0.0"
        ports.append((address.strip("[]"), parts[-1].split("/")[0]))
    return ports


def _mounted(value: str, mounts: Sequence[tuple[str, str]]) -> str:
    for inside, outside in mounts:
        if value == inside or value.startswith(inside.rstrip("/") + "/"):
            return outside.rstrip("/") + value[len(inside.rstrip("/")) :]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("service")
    parser.add_argument("--env-file", type=Path, required=True, help="the project's .env")
    parser.add_argument("--compose", type=Path, default=ROOT / "docker-compose.yml")
    parser.add_argument("--mount", action="append", default=[], help="CONTAINER_PATH=HOST_PATH")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]  # after "--": run it in that environment
    mounts = [tuple(m.split("=", 1)) for m in args.mount]
    try:
        env = service_env(args.service, read_env_file(args.env_file), compose=args.compose)
    except ComposeError as exc:
        print(f"compose_env: {exc}", file=sys.stderr)
        return 2
    env = {key: _mounted(value, mounts) for key, value in env.items()}  # type: ignore[arg-type]
    if not command:
        for key, value in sorted(env.items()):
            print(f"{key}={value}")
        return 0
    host = {key: os.environ[key] for key in ("PATH", "HOME") if key in os.environ}
    os.execvpe(command[0], command, {**env, **host})
    return 127  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
