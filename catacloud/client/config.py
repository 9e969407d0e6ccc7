"""Where the client finds its API URL and token.

Precedence, highest first (README, "The command line client"):

1. ``--url`` on the command line (the URL only: a token is never a command-line argument,
   where ``ps`` and shell history would show it);
2. ``--profile NAME`` on the command line: that profile of the config file, and the
   ``CATACLOUD_URL`` / ``CATACLOUD_TOKEN`` environment is ignored (so an exported dev token
   is never sent to the server another profile names);
3. the environment: ``CATACLOUD_URL``, ``CATACLOUD_TOKEN`` (or ``CATACLOUD_TOKEN_FILE``);
4. the profile ``CATACLOUD_PROFILE`` names, else ``default``, of the config file
   (``$CATACLOUD_CONFIG``, else ``$XDG_CONFIG_HOME/catacloud/config.toml``, else
   ``~/.config/catacloud/config.toml``): ``url`` and ``token`` or ``token_file``;
5. the URL ``http://127.0.0.1:8000`` (what ``make dev`` serves); no token is an error.
"""

from __future__ import annotations

import os
import stat
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8000"


class ConfigError(Exception):
    """The settings cannot be used (a missing token, an unknown profile, a bad file)."""


@dataclass(frozen=True)
class ClientConfig:
    url: str
    token: str = field(repr=False)  # never in a repr, a log line or an error message
    profile: str | None = None
    source: str = ""  # where the URL and token came from, for messages

    @property
    def api(self) -> str:
        return f"{self.url}/api/v1"


def config_path(env: Mapping[str, str]) -> Path:
    if env.get("CATACLOUD_CONFIG"):
        return Path(env["CATACLOUD_CONFIG"]).expanduser()
    base = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else Path.home() / ".config"
    return base / "catacloud" / "config.toml"


def normalize_url(url: str) -> str:
    """``http://host:8000``, ``http://host:8000/`` and ``http://host:8000/api/v1/`` all name the
    same server."""
    url = url.strip().rstrip("/")
    if url.endswith("/api/v1"):
        url = url[: -len("/api/v1")]
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"the API URL must start with http:// or https:// (got {url!r})")
    return url


def _read_token_file(path: str, what: str) -> str:
    try:
        token = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {what} names ({path}): {exc.strerror}") from None
    if not token:
        raise ConfigError(f"the token file {what} names ({path}) is empty")
    return token


def _load_profiles(path: Path, warn: list[str]) -> dict[str, dict]:
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if any(isinstance(p, dict) and "token" in p for p in data.values()):
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            warn.append(f"warning: {path} holds a token and others may read it (chmod 600 {path})")
    return {name: p for name, p in data.items() if isinstance(p, dict)}


def resolve(
    *,
    env: Mapping[str, str] | None = None,
    url: str | None = None,
    profile: str | None = None,
    warn: list[str] | None = None,
) -> ClientConfig:
    """The client's URL and token from the flags (``url``, ``profile``), the environment and
    the config file, in the precedence above. ``warn`` collects warnings to show."""
    env = os.environ if env is None else env
    warn = [] if warn is None else warn
    path = config_path(env)
    profiles = _load_profiles(path, warn)
    explicit_profile = profile is not None
    name = profile or env.get("CATACLOUD_PROFILE") or "default"
    chosen = profiles.get(name)
    if chosen is None and (explicit_profile or env.get("CATACLOUD_PROFILE")):
        known = ", ".join(sorted(profiles)) or "none"
        raise ConfigError(f"no profile {name!r} in {path} (profiles: {known})")
    chosen = chosen or {}

    found_url, found_token, source = None, None, ""
    if not explicit_profile:
        found_url = env.get("CATACLOUD_URL") or None
        if env.get("CATACLOUD_TOKEN"):
            found_token, source = env["CATACLOUD_TOKEN"].strip(), "CATACLOUD_TOKEN"
        elif env.get("CATACLOUD_TOKEN_FILE"):
            found_token = _read_token_file(env["CATACLOUD_TOKEN_FILE"], "CATACLOUD_TOKEN_FILE")
            source = "CATACLOUD_TOKEN_FILE"
    if found_url is None:
        found_url = chosen.get("url")
    if found_token is None:
        if chosen.get("token"):
            found_token, source = str(chosen["token"]).strip(), f"profile {name!r} in {path}"
        elif chosen.get("token_file"):
            found_token = _read_token_file(str(chosen["token_file"]), f"profile {name!r}")
            source = f"profile {name!r} in {path}"
    final_url = normalize_url(url or found_url or DEFAULT_URL)
    if not found_token:
        raise ConfigError(
            'no API token: set CATACLOUD_TOKEN (or CATACLOUD_TOKEN_FILE), or put `token = "cc_…"` '
            f"in a profile of {path}; `python manage.py create_api_token` makes one"
        )
    return ClientConfig(url=final_url, token=found_token, profile=name if chosen else None, source=source)


def print_warnings(warn: list[str]) -> None:
    for line in warn:
        print(line, file=sys.stderr)
