"""What `catacloud` says about its own usage: the command list, a group without its command,
"did you mean" for a value. Django-free: the parser only, in this process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from catacloud.cli import build_parser


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as ended:
        build_parser().parse_args(list(argv))
    out, err = capsys.readouterr()
    return int(ended.value.code or 0), out, err


def test_help_lists_the_client_commands_first_and_no_hidden_one(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    assert "SUPPRESS" not in out and "dev-cleanup" not in out
    listed = [m[1] for line in out.splitlines() if (m := re.match(r"^ {4}([a-z][\w-]*)", line))]
    client = [
        "jobs", "run", "configs", "pools", "instances", "hosts", "artifacts", "events", "costs", "budgets",
        "registry-credentials", "github", "gitlab", "auth",
    ]  # fmt: skip
    assert listed[: len(client)] == client, listed
    assert {"dev", "services", "agent", "simulate"} <= set(listed[len(client) :])


@pytest.mark.parametrize(
    ("group", "commands"),
    [
        ("jobs", "submit, logs, cancel, ls, show"),
        ("pools", "ls, show, create, update, resize, acquire, release, drain, delete"),
        ("github", "connection, classes, jobs"),
        ("budgets", "ls, set"),
        ("instances", "ls, show, terminate"),
        ("hosts", "ls, show, cordon, uncordon, revoke, update, tokens"),
        ("hosts tokens", "create, ls, revoke"),
    ],
)
def test_a_group_without_its_command_lists_its_commands(
    capsys: pytest.CaptureFixture[str], group: str, commands: str
) -> None:
    code, _, err = _run(capsys, *group.split())
    assert code == 2
    assert f"catacloud {group}: error: name a command: {commands}" in err
    first = commands.split(", ")[0]
    assert re.search(rf"\n {{4}}{first}\b", err)  # each with what it does, as --help shows them


@pytest.mark.parametrize(("typed", "meant"), [("sucess", "succeeded"), ("wait", "waiting_for_machine")])
def test_a_mistyped_status_gets_a_suggestion(
    capsys: pytest.CaptureFixture[str], typed: str, meant: str
) -> None:
    code, _, err = _run(capsys, "jobs", "ls", "--status", typed)
    assert code == 2
    assert f"invalid choice: '{typed}'" in err and f"(did you mean {meant}?)" in err


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        (["jobs", "list"], ["jobs", "ls"]),
        (["jobs", "view", "abcd1234"], ["jobs", "show", "abcd1234"]),
        (["jobs", "get", "abcd1234"], ["jobs", "show", "abcd1234"]),
        (["jobs", "describe", "abcd1234"], ["jobs", "show", "abcd1234"]),
        (["pools", "list"], ["pools", "ls"]),
        (["pools", "get", "ci"], ["pools", "show", "ci"]),
        (["configs", "view", "nightly"], ["configs", "show", "nightly"]),
        (["instances", "list", "--all"], ["instances", "ls", "--all"]),
        (["registries", "list"], ["registry-credentials", "ls"]),
        (["github", "classes", "list"], ["github", "classes", "ls"]),
        (["gitlab", "connection", "view"], ["gitlab", "connection", "show"]),
        (["hosts", "list", "--all"], ["hosts", "ls", "--all"]),
        (["hosts", "get", "rack-1"], ["hosts", "show", "rack-1"]),
        (["hosts", "view", "rack-1"], ["hosts", "show", "rack-1"]),
        (["hosts", "tokens", "list"], ["hosts", "tokens", "ls"]),
    ],
)
def test_gh_and_kubectl_verbs_are_aliases_of_the_same_command(typed: list[str], meant: list[str]) -> None:
    """`gh run list`, `gh pr view`, `kubectl get`, `kubectl describe`: the verbs their users type."""
    parser = build_parser()
    a, b = parser.parse_args(typed), parser.parse_args(meant)
    assert a._parser is b._parser
    assert {k: v for k, v in vars(a).items() if k not in ("func", "cmd") and not k.endswith("_cmd")} == {
        k: v for k, v in vars(b).items() if k not in ("func", "cmd") and not k.endswith("_cmd")
    }


def test_the_aliases_show_in_help_beside_their_command(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _run(capsys, "jobs", "--help")
    assert re.search(r"^ {4}ls \(list\) ", out, re.M) and re.search(
        r"^ {4}show \(view, get, describe\)", out, re.M
    )


def test_a_one_off_command_is_quoted_as_given() -> None:
    from catacloud.client.base import UsageError
    from catacloud.client.run import command_line

    assert command_line(["--", "echo", "a b", "$HOME"]) == "echo 'a b' '$HOME'"
    assert command_line(["make && make test"]) == "make && make test"  # one word: a shell line
    with pytest.raises(UsageError, match="name a command"):
        command_line(["--"])
    parsed = build_parser().parse_args(["run", "-t", "small", "--json", "--", "sh", "-c", "exit 3", "--json"])
    assert parsed.machine_type == "small" and parsed.command == ["--", "sh", "-c", "exit 3", "--json"]


def test_a_secret_env_value_comes_from_the_environment_or_a_file_never_the_command_line(
    tmp_path: Path,
) -> None:
    from catacloud.client.base import UsageError, parse_secret_env

    (tmp_path / "key").write_text("from-a-file\n")
    assert parse_secret_env(["API_KEY", f"FILE_KEY=@{tmp_path / 'key'}"], {"API_KEY": "s3cret"}) == {
        "API_KEY": "s3cret",
        "FILE_KEY": "from-a-file",
    }
    with pytest.raises(UsageError, match="never a command-line value"):
        parse_secret_env(["API_KEY=s3cret"], {})
    with pytest.raises(UsageError, match="API_KEY is not set in this shell"):
        parse_secret_env(["API_KEY"], {})


def test_events_since_takes_an_age_or_a_time() -> None:
    from datetime import UTC, datetime

    from catacloud.client.base import UsageError
    from catacloud.client.events import since

    now = datetime(2030, 5, 1, 12, 0, tzinfo=UTC)
    assert since("10m", now) == "2030-05-01T11:50:00+00:00"
    assert since("2d", now) == "2030-04-29T12:00:00+00:00"
    assert since("2030-05-01T10:00:00Z") == "2030-05-01T10:00:00+00:00"
    with pytest.raises(UsageError, match="--since takes"):
        since("yesterday")


def test_a_connections_installations_and_projects_as_the_api_takes_them() -> None:
    from catacloud.client.base import UsageError
    from catacloud.client.ci import GITHUB, GITLAB, _children

    assert _children(GITHUB, ["1", "4242:acme-gh"]) == [{"id": 1}, {"id": 4242, "account": "acme-gh"}]
    assert _children(GITLAB, ["42:group/app"]) == [{"id": 42, "path": "group/app"}]
    with pytest.raises(UsageError, match="--project takes ID:PATH"):
        _children(GITLAB, ["42"])
    with pytest.raises(UsageError, match=r"--installation takes ID\[:ACCOUNT\]"):
        _children(GITHUB, ["acme"])


def test_durations_and_labels_as_hosts_commands_take_them() -> None:
    from catacloud.client.hosts import parse_duration, parse_labels

    assert [parse_duration(v) for v in ("90", "90s", "10m", "24h", "7d", "0")] == [
        90,
        90,
        600,
        86400,
        604800,
        0,
    ]
    with pytest.raises(ValueError, match="--ttl takes seconds or 90s, 10m, 24h, 7d; got 'soon'"):
        parse_duration("soon", "--ttl")
    with pytest.raises(ValueError, match="takes seconds"):
        parse_duration("1.5h")
    assert parse_labels(["gpu=a4000", "site=fsn1", "empty=", "url=a=b"]) == {
        "gpu": "a4000", "site": "fsn1", "empty": "", "url": "a=b",
    }  # fmt: skip
    with pytest.raises(ValueError, match="--label takes KEY=VALUE"):
        parse_labels(["gpu"])
    parsed = build_parser().parse_args(
        ["hosts", "tokens", "create", "--label", "a=1", "--label", "b=2", "--uses", "3"]
    )
    assert (parsed.label, parsed.uses, parsed.ttl) == (["a=1", "b=2"], 3, "24h")
    assert build_parser().parse_args(["hosts", "cordon", "rack-1", "--drain", "10m"]).drain == "10m"


def test_the_agent_refuses_an_insecure_registry_that_is_not_host_and_port(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each containers job's registries.conf lists these: a scheme or a path there broke every
    Podman command of such jobs. The agent says so at its start instead."""
    code, _, err = _run(capsys, "agent", "--url", "http://x", "--insecure-registry", "http://mirror:5000")
    assert code == 2 and "expected HOST[:PORT]" in err
    args = build_parser().parse_args(
        ["agent", "--url", "http://x", "--insecure-registry", "Mirror.Internal:5000"]
    )
    assert args.insecure_registry == ["mirror.internal:5000"]


def test_make_dev_names_the_line_that_installs_what_containers_need(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A host without Podman (or the networks' slirp4netns and iptables): `make dev` says which
    tools are missing and the one line that installs them, before a containers job fails."""
    import shutil

    from catacloud.agent import containers
    from catacloud.cli import containers_note

    everything_here = all(shutil.which(t, path=containers.SYSTEM_PATH) for t in containers.HOST_TOOLS)
    monkeypatch.setattr(containers, "SYSTEM_PATH", str(tmp_path))  # an empty PATH: none of them
    note = containers_note()
    assert note is not None and "no podman, crun, docker-compose, slirp4netns, iptables" in note
    assert note.endswith(
        "apt-get install podman crun docker-compose netavark aardvark-dns slirp4netns iptables"
    )
    monkeypatch.undo()
    if everything_here:  # as CI installs them (.ci/run)
        assert containers_note() is None
