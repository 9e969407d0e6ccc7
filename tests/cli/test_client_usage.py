"""What `catacloud` says about its own usage: the command list, a group without its command,
"did you mean" for a value. Django-free: the parser only, in this process."""

from __future__ import annotations

import re

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
    client = ["jobs", "configs", "pools", "instances", "artifacts", "auth"]
    assert listed[: len(client)] == client, listed
    assert {"dev", "services", "agent", "simulate"} <= set(listed[len(client) :])


@pytest.mark.parametrize(
    ("group", "commands"),
    [
        ("jobs", "submit, logs, cancel, ls, show"),
        ("pools", "ls, create, acquire, release, drain, delete"),
        ("instances", "ls, show, terminate"),
    ],
)
def test_a_group_without_its_command_lists_its_commands(
    capsys: pytest.CaptureFixture[str], group: str, commands: str
) -> None:
    code, _, err = _run(capsys, group)
    assert code == 2
    assert f"catacloud {group}: error: name a command: {commands}" in err
    first = commands.split(", ")[0]
    assert f"\n    {first} " in err  # each with what it does, as --help shows them


@pytest.mark.parametrize(("typed", "meant"), [("sucess", "succeeded"), ("wait", "waiting_for_machine")])
def test_a_mistyped_status_gets_a_suggestion(
    capsys: pytest.CaptureFixture[str], typed: str, meant: str
) -> None:
    code, _, err = _run(capsys, "jobs", "ls", "--status", typed)
    assert code == 2
    assert f"invalid choice: '{typed}'" in err and f"(did you mean {meant}?)" in err
