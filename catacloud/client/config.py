"""Where the client finds its API URL and token.

Precedence, highest first (docs/walkthroughs/cli.md):

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

A token only goes to the server it belongs to (see :func:`resolve`).
"""

from __future__ import annotations

import json
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
    """The config file: ``$CATACLOUD_CONFIG``, else under ``$XDG_CONFIG_HOME``, else under
    ``~/.config`` (the XDG Base Directory rules: an unset, empty or relative XDG_CONFIG_HOME
    counts as not set). Reading and ``auth login``'s writing use this one path."""
    if env.get("CATACLOUD_CONFIG"):
        return Path(env["CATACLOUD_CONFIG"]).expanduser()
    xdg = env.get("XDG_CONFIG_HOME") or ""
    base = Path(xdg) if Path(xdg).is_absolute() else Path.home() / ".config"
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


def _others_may_read(path: Path) -> bool:
    try:
        return bool(path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO))
    except OSError:
        return False


def _read_token_file(path: str, what: str, warn: list[str]) -> str:
    file = Path(path).expanduser()
    try:
        token = file.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {what} names ({path}): {exc.strerror}") from None
    if not token:
        raise ConfigError(f"the token file {what} names ({path}) is empty")
    if _others_may_read(file):
        warn.append(f"warning: the token file {file} may be read by others (chmod 600 {file})")
    return token


def _load_profiles(path: Path, warn: list[str]) -> dict[str, dict]:
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if any(isinstance(p, dict) and "token" in p for p in data.values()) and _others_may_read(path):
        warn.append(f"warning: {path} holds a token and others may read it (chmod 600 {path})")
    return {name: p for name, p in data.items() if isinstance(p, dict)}


def _profile_url(profile: Mapping) -> str:
    """The server a profile's token belongs to (a profile without ``url``: the default one)."""
    return normalize_url(str(profile.get("url") or DEFAULT_URL))


def _profile_token(name: str, profile: Mapping, path: Path, warn: list[str]) -> str | None:
    if profile.get("token"):
        return str(profile["token"]).strip()
    if profile.get("token_file"):
        return _read_token_file(str(profile["token_file"]), f"profile {name!r}", warn)
    return None


def resolve(
    *,
    env: Mapping[str, str] | None = None,
    url: str | None = None,
    profile: str | None = None,
    warn: list[str] | None = None,
) -> ClientConfig:
    """The client's URL and token from the flags (``url``, ``profile``), the environment and
    the config file, in the precedence above. ``warn`` collects warnings to show.

    A token only goes to the server it belongs to: a profile's to the profile's ``url``, the
    environment's to ``CATACLOUD_URL`` (any URL when that is unset). With another URL (from
    ``--url`` or ``CATACLOUD_URL``), the profile whose ``url`` it is gives the token (what
    ``catacloud auth login`` stores), or there is none."""
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

    env_url = None if explicit_profile else (env.get("CATACLOUD_URL") or None)
    final_url = normalize_url(url or env_url or chosen.get("url") or DEFAULT_URL)
    found_token, source, owner = None, "", None
    if not explicit_profile and (env.get("CATACLOUD_TOKEN") or env.get("CATACLOUD_TOKEN_FILE")):
        owner = normalize_url(env_url) if env_url else final_url
        if owner == final_url:
            if env.get("CATACLOUD_TOKEN"):
                found_token, source = env["CATACLOUD_TOKEN"].strip(), "CATACLOUD_TOKEN"
            else:
                found_token = _read_token_file(env["CATACLOUD_TOKEN_FILE"], "CATACLOUD_TOKEN_FILE", warn)
                source = "CATACLOUD_TOKEN_FILE"
    used_profile = None
    if found_token is None:
        # the chosen profile first, then any profile for this very URL
        for pname in [name, *sorted(p for p in profiles if p != name)]:
            candidate = profiles.get(pname)
            if candidate is None or _profile_url(candidate) != final_url:
                continue
            found_token = _profile_token(pname, candidate, path, warn)
            if found_token:
                source, used_profile = f"profile {pname!r} in {path}", pname
                break
    if not found_token:
        elsewhere = ""
        if owner and owner != final_url:
            elsewhere = f"CATACLOUD_TOKEN is for {owner}, "
        elif (chosen.get("token") or chosen.get("token_file")) and _profile_url(chosen) != final_url:
            elsewhere = f"profile {name!r} holds a token for {_profile_url(chosen)}, "
        if elsewhere:
            raise ConfigError(
                f"no API token for {final_url}: {elsewhere}and a token only goes to its own server; "
                f"run `catacloud auth login --url {final_url}` or set CATACLOUD_TOKEN for it"
            )
        raise ConfigError(
            "no API token: run `catacloud auth login`, set CATACLOUD_TOKEN (or CATACLOUD_TOKEN_FILE), "
            f'or put `token = "cc_…"` in a profile of {path}; `python manage.py create_api_token` makes one'
        )
    return ClientConfig(url=final_url, token=found_token, profile=used_profile, source=source)


def save_login(*, env: Mapping[str, str], url: str, token: str, profile: str) -> Path:
    """Store ``url`` and ``token`` as ``profile`` of the config file (created 0600; the other
    profiles are kept, comments are not) and return its path."""
    path = config_path(env)
    profiles = _load_profiles(path, [])
    profiles[profile] = {**{k: v for k, v in profiles.get(profile, {}).items() if k != "token_file"}}
    profiles[profile].update(url=normalize_url(url), token=token)
    _write_profiles(path, profiles)
    return path


def remove_login(*, env: Mapping[str, str], url: str | None, profile: str | None) -> tuple[Path, str, str]:
    """Remove a stored login from the config file: ``profile``, else the profile holding a token
    for ``url`` (else ``CATACLOUD_URL``, else the default profile's URL). Returns the file, the
    profile removed and its URL; a ConfigError when there is none."""
    path = config_path(env)
    profiles = _load_profiles(path, [])
    if profile is not None:
        if profile not in profiles:
            known = ", ".join(sorted(profiles)) or "none"
            raise ConfigError(f"no profile {profile!r} in {path} (profiles: {known})")
        name = profile
    else:
        wanted = env.get("CATACLOUD_PROFILE") or "default"
        server = normalize_url(
            url or env.get("CATACLOUD_URL") or profiles.get(wanted, {}).get("url") or DEFAULT_URL
        )
        holding = [
            pname
            for pname, values in profiles.items()
            if _profile_url(values) == server and (values.get("token") or values.get("token_file"))
        ]
        if not holding:
            raise ConfigError(f"no stored login for {server} in {path}")
        name = wanted if wanted in holding else holding[0]
    removed_url = _profile_url(profiles.pop(name))
    _write_profiles(path, profiles)
    return path, name, removed_url


def _write_profiles(path: Path, profiles: Mapping[str, Mapping]) -> None:
    lines = ["# catacloud client profiles (catacloud auth login writes this file; keep it chmod 600)"]
    for pname, values in profiles.items():
        lines.append(f"\n[{_toml_key(pname)}]")
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in values.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write("\n".join(lines) + "\n")
    path.chmod(0o600)


def _toml_key(key: str) -> str:
    return key if key.replace("-", "").replace("_", "").isalnum() else json.dumps(key)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(str(value), ensure_ascii=False)  # a TOML basic string


def print_warnings(warn: list[str]) -> None:
    for line in warn:
        print(line, file=sys.stderr)
