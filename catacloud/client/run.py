"""``catacloud run -- CMD``: run one command on a machine once, and follow it, like ``docker run``.

The API runs jobs of job configurations only (``POST /jobs/`` names one), and has no one-off
submit. So a one-off job is a job of the configuration ``run-<machine type>``, whose command
runs the command the job carries in its env (``CC_RUN_COMMAND``): one configuration per machine
type, made the first time it is needed (an admin's ``catacloud run``), then used by every
member's. Each run is an ordinary job (quotas, budgets, events, ``jobs ls``, costs under that
configuration); the configuration's other settings (timeout, reuse, priority) are the API's
defaults, which an admin may change with ``configs update``. A ``run-<type>`` configuration
whose command is not exactly the one-off command is not used: the client will not run a
command it did not write."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from catacloud.client.api import Api, ApiError
from catacloud.client.base import Commands, UsageError
from catacloud.client.jobs import RUN_COMMAND_ENV, submission, submission_flags, submit_and_wait, timeout_flag

CONFIG_PREFIX = "run-"
CONFIG_COMMAND = f'eval "${RUN_COMMAND_ENV}"'


def register(at: Commands) -> None:
    p = at.command(
        at.subparsers,
        "run",
        cmd_run,
        "run one command on a machine and follow its output (catacloud run -- CMD …)",
        description="Run one command once on a machine of a type, following its output, and exit "
        "with its exit status. The words after -- are the command, quoted as given; a single word "
        f"is a shell command line ('make && make test'). It runs as a job of the configuration "
        f"{CONFIG_PREFIX}<machine type> (made the first time it is needed: that takes an admin), "
        f"which runs the command the job carries in its env ({RUN_COMMAND_ENV}).",
    )
    p.add_argument("--machine-type", "-t", metavar="TYPE", help="the machine type (default: the only one)")
    submission_flags(p)
    p.add_argument("--detach", "-d", action="store_true", help="submit it and print its id; do not follow")
    timeout_flag(p)
    p.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="-- CMD", help="the command and its arguments"
    )


def command_line(words: list[str]) -> str:
    """The shell command line a job runs: one word as it is, several quoted as given."""
    if words[:1] == ["--"]:
        words = words[1:]
    if not words:
        raise UsageError("name a command: catacloud run [--machine-type TYPE] -- CMD [ARG …]")
    return words[0] if len(words) == 1 else shlex.join(words)


def _machine_type(api: Api, wanted: str | None) -> str:
    if wanted:
        return wanted
    names = [t["name"] for t in api.pages("machine-types/", limit=100)]
    if len(names) != 1:
        raise UsageError(f"name a machine type with --machine-type ({', '.join(names) or 'none'})")
    return names[0]


def run_config(api: Api, machine_type: str) -> str:
    """The name of ``run-<machine type>``, made when missing; refused when it runs another command."""
    name = f"{CONFIG_PREFIX}{machine_type}"
    found: list[dict[str, Any]] = api.get("job-configs/", name=name)["results"]
    if found:
        if found[0]["command"] != CONFIG_COMMAND:
            raise UsageError(
                f"the configuration {name} runs another command than a one-off's ({CONFIG_COMMAND}); "
                f"not using it (rename it, or catacloud configs update {name} --command '{CONFIG_COMMAND}')"
            )
        return name
    try:
        api.post("job-configs/", {"name": name, "machine_type": machine_type, "command": CONFIG_COMMAND})
    except ApiError as exc:
        if exc.status == 403:
            exc.detail += (
                f"; the first one-off on {machine_type} makes the configuration {name}: ask an admin "
                f"to run `catacloud run --machine-type {machine_type} -- true` once"
            )
        raise
    print(f"catacloud: made the configuration {name} for one-off jobs on {machine_type}", file=sys.stderr)
    return name


def cmd_run(api: Api, args: argparse.Namespace) -> int:
    line = command_line(args.command)
    config = run_config(api, _machine_type(api, args.machine_type))
    body = submission(config, args)
    body["env"] = {**body.get("env", {}), RUN_COMMAND_ENV: line}
    args.follow, args.wait = not args.detach, False
    return submit_and_wait(api, body, args)
