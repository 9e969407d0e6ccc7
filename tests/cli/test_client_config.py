"""Where the client CLI takes its URL and token from (README, "The command line client").
Django-free: runs with ``-p no:django`` too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from catacloud.client.config import ConfigError, resolve, save_login

CONFIG = """
[default]
url = "http://default.example:8000/api/v1/"
token = "cc_default"

[prod]
url = "https://prod.example"
token_file = "{token_file}"
"""


@pytest.fixture
def home(tmp_path: Path) -> dict[str, str]:
    """An environment whose config file (under XDG_CONFIG_HOME) has two profiles."""
    (tmp_path / "prod-token").write_text("cc_prod\n")
    path = tmp_path / "catacloud" / "config.toml"
    path.parent.mkdir()
    path.write_text(CONFIG.format(token_file=tmp_path / "prod-token"))
    path.chmod(0o600)
    return {"XDG_CONFIG_HOME": str(tmp_path)}


def test_the_default_profile_is_used_when_nothing_else_is_set(home: dict[str, str]) -> None:
    config = resolve(env=home)
    assert (config.url, config.token, config.profile) == (
        "http://default.example:8000",
        "cc_default",
        "default",
    )
    assert config.api == "http://default.example:8000/api/v1"


def test_the_environment_beats_the_default_profile(home: dict[str, str]) -> None:
    config = resolve(env={**home, "CATACLOUD_URL": "http://env.example", "CATACLOUD_TOKEN": "cc_env"})
    assert (config.url, config.token) == ("http://env.example", "cc_env")
    # CATACLOUD_PROFILE picks the profile the environment does not override.
    config = resolve(env={**home, "CATACLOUD_PROFILE": "prod"})
    assert (config.url, config.token) == ("https://prod.example", "cc_prod")


def test_an_explicit_profile_ignores_the_environment(home: dict[str, str]) -> None:
    """An exported dev token is never sent to the server another profile names."""
    env = {**home, "CATACLOUD_URL": "http://dev.example", "CATACLOUD_TOKEN": "cc_dev"}
    config = resolve(env=env, profile="prod")
    assert (config.url, config.token) == ("https://prod.example", "cc_prod")


def test_the_url_flag_beats_everything(home: dict[str, str]) -> None:
    assert resolve(env={**home, "CATACLOUD_TOKEN": "cc_env"}, url="http://flag.example/").url == (
        "http://flag.example"
    )
    # the profile whose url it is gives the token
    assert resolve(env=home, url="https://prod.example/api/v1").token == "cc_prod"


def test_a_token_only_goes_to_the_server_it_belongs_to(home: dict[str, str]) -> None:
    """With CATACLOUD_URL (or --url) naming another server, the default profile's token stays
    home, and so does an exported token for another CATACLOUD_URL."""
    with pytest.raises(ConfigError) as raised:
        resolve(env={**home, "CATACLOUD_URL": "http://elsewhere.example"})
    message = str(raised.value)
    assert message.startswith("no API token for http://elsewhere.example: profile 'default' holds a token")
    assert "catacloud auth login --url http://elsewhere.example" in message and "cc_default" not in message
    with pytest.raises(ConfigError, match="no API token for http://flag.example"):
        resolve(env=home, url="http://flag.example", profile="prod")
    env = {**home, "CATACLOUD_URL": "http://env.example", "CATACLOUD_TOKEN": "cc_env"}
    with pytest.raises(ConfigError, match="CATACLOUD_TOKEN is for http://env.example"):
        resolve(env=env, url="http://flag.example")
    assert resolve(env=env, url="http://env.example/").token == "cc_env"


def test_a_token_file_others_can_read_is_warned_about(home: dict[str, str], tmp_path: Path) -> None:
    token_file = tmp_path / "prod-token"
    token_file.chmod(0o600)
    warnings: list[str] = []
    resolve(env=home, profile="prod", warn=warnings)
    assert warnings == []
    token_file.chmod(0o644)
    resolve(env=home, profile="prod", warn=warnings)
    assert warnings == [
        f"warning: the token file {token_file} may be read by others (chmod 600 {token_file})"
    ]
    warnings.clear()
    resolve(
        env={"XDG_CONFIG_HOME": str(tmp_path / "none"), "CATACLOUD_TOKEN_FILE": str(token_file)},
        warn=warnings,
    )
    assert len(warnings) == 1 and "cc_prod" not in warnings[0]


def test_a_login_is_stored_privately_and_found_by_its_url(home: dict[str, str]) -> None:
    path = save_login(env=home, url="http://lab.example:8000/", token="cc_lab", profile="lab")
    assert path.stat().st_mode & 0o777 == 0o600
    config = resolve(env={**home, "CATACLOUD_URL": "http://lab.example:8000"})
    assert (config.token, config.profile) == ("cc_lab", "lab")
    assert resolve(env=home, profile="prod").token == "cc_prod"  # the other profiles are kept
    save_login(env=home, url="http://lab.example:8000", token="cc_lab2", profile="lab")
    assert resolve(env=home, profile="lab").token == "cc_lab2"


def test_a_token_file_from_the_environment(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("cc_file\n")
    env = {"XDG_CONFIG_HOME": str(tmp_path), "CATACLOUD_TOKEN_FILE": str(tmp_path / "t")}
    config = resolve(env=env)
    assert (config.url, config.token) == ("http://127.0.0.1:8000", "cc_file")


def test_missing_token_unknown_profile_and_bad_url_are_clear_errors(
    home: dict[str, str], tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="no API token: run `catacloud auth login`, set CATACLOUD_TOKEN"):
        resolve(env={"XDG_CONFIG_HOME": str(tmp_path / "empty")})
    with pytest.raises(ConfigError, match=r"no profile 'staging' .*profiles: default, prod"):
        resolve(env=home, profile="staging")
    with pytest.raises(ConfigError, match="must start with http"):
        resolve(env={**home, "CATACLOUD_URL": "ftp://x"})


def test_a_token_is_never_in_the_configs_repr(home: dict[str, str]) -> None:
    assert "cc_default" not in repr(resolve(env=home))


def test_a_config_file_others_can_read_is_warned_about(home: dict[str, str]) -> None:
    path = Path(home["XDG_CONFIG_HOME"]) / "catacloud" / "config.toml"
    warnings: list[str] = []
    resolve(env=home, warn=warnings)
    assert warnings == []
    path.chmod(0o644)
    resolve(env=home, warn=warnings)
    assert len(warnings) == 1 and "chmod 600" in warnings[0] and "cc_default" not in warnings[0]


def test_the_client_imports_no_django() -> None:
    """The client runs on laptops and CI runners without the server's settings."""
    code = (
        "import sys, catacloud.cli, catacloud.client.commands; "
        "catacloud.cli.build_parser(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'rest_framework', 'apps')))"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_config_file_follows_xdg_config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """XDG Base Directory rules: an absolute XDG_CONFIG_HOME holds it; unset, empty or relative
    (which the specification says to ignore) mean ~/.config; CATACLOUD_CONFIG names the file."""
    from catacloud.client.config import config_path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    default = tmp_path / "home" / ".config" / "catacloud" / "config.toml"
    assert (
        config_path({"XDG_CONFIG_HOME": str(tmp_path / "xdg")})
        == tmp_path / "xdg" / "catacloud" / "config.toml"
    )
    assert config_path({}) == default
    assert config_path({"XDG_CONFIG_HOME": ""}) == default
    assert config_path({"XDG_CONFIG_HOME": "relative/dir"}) == default
    assert (
        config_path({"CATACLOUD_CONFIG": str(tmp_path / "c.toml"), "XDG_CONFIG_HOME": "/x"})
        == tmp_path / "c.toml"
    )
    path = save_login(
        env={"XDG_CONFIG_HOME": str(tmp_path / "xdg")}, url="http://a.example", token="cc_a", profile="a"
    )
    assert path == tmp_path / "xdg" / "catacloud" / "config.toml" and not default.exists()
