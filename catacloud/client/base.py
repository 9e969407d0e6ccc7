"""What every client command shares: how it is registered (the global flags, the aliases gh and
kubectl users type), how it runs (the URL and token resolved, the API's errors shown, the exit
status), how it names objects (a name, a whole id or its first hex digits), and how it reads
what it must never take from the command line (secrets)."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from catacloud.client.api import Api, ApiError, answered
from catacloud.client.config import ConfigError, print_warnings, resolve
from catacloud.client.output import print_json, short, table, table_row
from catacloud.client.usage import add_global_flags

# The 401s Catacloud answers (ErrorCode): another server's 401 is not about our token.
TOKEN_REFUSED = frozenset({"not_authenticated", "authentication_failed"})
MIN_PREFIX = 4  # hex digits of a short id, like git's shortest abbreviation
POLL_SECONDS = 1.0
RETRIES_WHILE_WAITING = 10  # consecutive transient errors tolerated by --wait / -f / --watch
# Other names a command answers to, as gh (`gh run list`, `gh pr view`) and kubectl (`kubectl
# get`, `kubectl describe`) users type them.
ALIASES: Mapping[str, tuple[str, ...]] = {"ls": ("list",), "show": ("view", "get", "describe")}

Command = Callable[[Api, argparse.Namespace], int]


class UsageError(Exception):
    pass


# ---- registration -------------------------------------------------------------------------------


class Commands:
    """Where commands are registered: every one takes the global flags too, and answers to the
    names :data:`ALIASES` gives it as well."""

    def __init__(self, subparsers: Any) -> None:
        self.subparsers = subparsers
        self.common = argparse.ArgumentParser(add_help=False)
        add_global_flags(self.common, top=False)

    def group(self, name: str, help: str, *, parent: Any = None, aliases: Sequence[str] = ()) -> Any:
        """A group of commands (``catacloud jobs …``), or a group in a group (``catacloud github
        classes …``) when ``parent`` is given."""
        parser = (parent or self.subparsers).add_parser(
            name, help=help, description=help, aliases=list(aliases)
        )
        dest = f"{parser.prog.split(' ', 1)[-1].replace(' ', '_')}_cmd"
        return parser.add_subparsers(dest=dest, required=True, metavar="COMMAND")

    def command(
        self, sub: Any, name: str, func: Callable, help: str, *, api: bool = True, **kw: Any
    ) -> argparse.ArgumentParser:
        """``func(api, args)`` run by :func:`run`; with ``api=False``, ``func(args)`` as is (a
        command that finds its server itself: ``auth login``)."""
        kw.setdefault("description", help)
        parser = sub.add_parser(
            name, parents=[self.common], help=help, aliases=list(ALIASES.get(name, ())), **kw
        )
        parser.set_defaults(func=(lambda args: run(func, args)) if api else func, _parser=parser)
        return parser


def status_filter(parser: argparse.ArgumentParser, statuses: Sequence[str], what: str = "") -> None:
    """The ``--status`` option of a listing: repeatable, one of ``statuses`` each time."""
    parser.add_argument(
        "--status",
        action="append",
        default=[],
        choices=statuses,
        metavar="STATUS",
        help=f"only these statuses{what} (repeatable): " + ", ".join(statuses),
    )


def watch_flags(parser: argparse.ArgumentParser, what: str) -> None:
    """``--watch`` (kubectl's ``-w``) and its bounds, on a listing."""
    parser.add_argument(
        "--watch",
        "-w",
        action="store_true",
        help=f"after the list, print each {what} again as it changes (--json: one JSON object a line)",
    )
    parser.add_argument(
        "--interval", type=float, default=2.0, metavar="SECONDS", help="with --watch: poll this often"
    )
    parser.add_argument(
        "--timeout", type=float, metavar="SECONDS", help="with --watch: stop watching after this (exit 0)"
    )


# ---- running ------------------------------------------------------------------------------------


def run(func: Command, args: argparse.Namespace) -> int:
    warnings: list[str] = []
    try:
        config = resolve(url=args.url, profile=args.profile, warn=warnings)
    except ConfigError as exc:
        print_warnings(warnings)
        print(f"catacloud: {exc}", file=sys.stderr)
        return 2
    print_warnings(warnings)
    try:
        return func(Api(config), args)
    except UsageError as exc:
        print(f"catacloud: {exc}", file=sys.stderr)
        return 2
    except ApiError as exc:
        show_error(exc, args, url=config.url)
        return 1
    except (KeyError, TypeError, AttributeError):
        # A JSON answer without what every Catacloud answer has: another server at this URL.
        print(
            f"error: {config.url} answered with something this client does not understand; "
            "is it a Catacloud server? (check --url, CATACLOUD_URL or the profile's url)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `catacloud jobs ls | head -3`: the reader has gone, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def show_error(exc: ApiError, args: argparse.Namespace, *, url: str) -> None:
    if args.json:
        print_json(exc.as_dict(), out=sys.stderr)
        return
    where = f"HTTP {exc.status}" if exc.status else "no answer"
    print(f"error: {exc.detail} ({exc.code}, {where})", file=sys.stderr)
    for name, messages in sorted(exc.fields.items()):
        text = "; ".join(messages) if isinstance(messages, list) else str(messages)
        if f"{name}: {text}" != exc.detail:  # one message, not the same one twice
            print(f"  {name}: {text}", file=sys.stderr)
    if exc.status == 401 and exc.code in TOKEN_REFUSED:
        print(
            "  (check CATACLOUD_TOKEN or the profile's token; `catacloud auth login` stores one)",
            file=sys.stderr,
        )
    elif exc.status == 401:
        print(
            f"  ({url} answered 401 without Catacloud's error format: is it a Catacloud server? "
            "check --url, CATACLOUD_URL or the profile's url)",
            file=sys.stderr,
        )
    elif exc.code in ("http_error", "bad_response"):
        print(
            "  (is this a Catacloud server? check --url, CATACLOUD_URL or the profile's url)", file=sys.stderr
        )


def retrying(call: Callable[[], Any]) -> Any:
    """While waiting, ride out a restarting server or a dropped connection: once the server
    has answered this command (before, a server that cannot be reached is a wrong URL or one
    that is down, said at once instead of after a minute of retries)."""
    for attempt in range(RETRIES_WHILE_WAITING):
        try:
            return call()
        except ApiError as exc:
            if not exc.transient or not answered() or attempt == RETRIES_WHILE_WAITING - 1:
                raise
            time.sleep(min(10.0, 0.5 * 2**attempt))
    raise AssertionError("unreachable")


class Deadline:
    """The time limit of a wait (``--timeout``): none when ``seconds`` is None or 0."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds if seconds else None

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def sleep(self, seconds: float) -> None:
        """Sleep, but never past the deadline."""
        left = seconds if self.at is None else min(seconds, self.at - time.monotonic())
        if left > 0:
            time.sleep(left)


def show_list(
    args: argparse.Namespace,
    rows: list[dict],
    headers: Sequence[str],
    cells: Callable[[dict], Sequence[Any]],
    *,
    empty: str,
) -> int:
    """A listing: the API's rows under ``--json``, else a table, or ``empty`` on stderr."""
    if args.json:
        print_json(rows)
    elif not rows:
        print(empty, file=sys.stderr)
    else:
        table(headers, [cells(r) for r in rows])
    return 0


def watch_rows(
    fetch: Callable[[], list[dict]],
    headers: Sequence[str],
    cells: Callable[[dict], Sequence[Any]],
    args: argparse.Namespace,
    *,
    empty: str,
) -> int:
    """``--watch`` (kubectl's ``get -w``): the list, then each row again whenever it changes or
    a new one appears, in the list's columns, until ``--timeout`` (exit 0) or Ctrl-C. Under
    ``--json``, one JSON object a line (JSON Lines) instead of the table."""
    deadline = Deadline(args.timeout)
    seen: dict[str, dict] = {}
    widths: list[int] | None = None
    while True:
        rows = fetch()
        changed = [r for r in rows if seen.get(str(r["id"])) != r]
        seen.update((str(r["id"]), r) for r in changed)
        if args.json:
            for row in changed:
                print(json.dumps(row, sort_keys=True, default=str), flush=True)
        elif widths is None and changed:
            widths = table(headers, [cells(r) for r in changed])
            sys.stdout.flush()
        elif widths is None and not rows and not seen:
            print(empty, file=sys.stderr, flush=True)
            seen["-"] = {}  # said once
        elif widths is not None:
            for row in changed:
                table_row(widths, cells(row))
        if deadline.passed():
            return 0
        deadline.sleep(max(0.2, args.interval))


# ---- naming objects -----------------------------------------------------------------------------


def as_uuid(value: str, what: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise UsageError(f"{what} must be an id (a UUID), got {value!r}") from None


def resolve_id(api: Api, kind: str, path: str, ref: str, *, by_name: bool = False) -> str:
    """The id of the object ``ref`` names: a whole id, a name (``by_name``), or the first hex
    digits of an id when only one object's id starts with them (git's and docker's short ids)."""
    ref = ref.strip()
    try:
        return str(uuid.UUID(ref))
    except ValueError:
        pass
    if by_name:
        found = api.get(path, name=ref)["results"]
        if found:
            return str(found[0]["id"])
    digits = ref.replace("-", "").lower()
    if len(digits) < MIN_PREFIX or not re.fullmatch(r"[0-9a-f]+", digits):
        if by_name:
            raise ApiError(404, "not_found", f"no {kind} named {ref!r}")
        raise UsageError(
            f"{kind} {ref!r} is not an id: give its id, or at least its first {MIN_PREFIX} hex digits"
        )
    found = api.get(path, id_prefix=ref, limit=10)["results"]
    if not found:
        what = f"no {kind} named {ref!r} or" if by_name else f"no {kind}"
        raise ApiError(404, "not_found", f"{what} with an id starting {ref}")
    if len(found) > 1:
        ids = ", ".join(sorted(short(r["id"]) for r in found)[:3]) + ("…" if len(found) > 3 else "")
        raise UsageError(f"{ref} is the start of several {kind} ids ({ids}): give more of it")
    return str(found[0]["id"])


def find_row(rows: list[dict], ref: str, kind: str, *, key: str = "name") -> dict:
    """The row of a short list (the API filters it by nothing) that ``ref`` names: its
    ``key`` (a name, a registry host), its whole id, or the start of its id."""
    ref = ref.strip()
    for row in rows:
        if str(row.get(key)) == ref or str(row.get("id")) == ref:
            return row
    digits = ref.replace("-", "").lower()
    if len(digits) >= MIN_PREFIX and re.fullmatch(r"[0-9a-f]+", digits):
        found = [r for r in rows if str(r.get("id", "")).replace("-", "").startswith(digits)]
        if len(found) == 1:
            return found[0]
        if found:
            raise UsageError(f"{ref} is the start of several {kind} ids: give more of it")
    known = ", ".join(str(r.get(key)) for r in rows) or "none"
    raise ApiError(404, "not_found", f"no {kind} {ref!r} (there are: {known})")


def names_by_id(api: Api, path: str) -> dict[str, str]:
    """``{id: name}`` of a list (machine types, pools): what a table shows instead of ids."""
    return {str(r["id"]): r["name"] for r in api.pages(path, limit=1000)}


# ---- values from the command line, the environment and files ------------------------------------


def parse_env(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise UsageError(f"--env takes NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def read_secret_file(path: str, what: str) -> str:
    """A secret from a file (``-``: standard input), without its one trailing newline."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).expanduser().read_text()
    except OSError as exc:
        raise UsageError(f"{what}: cannot read {path}: {exc.strerror}") from None
    return text[:-1] if text.endswith("\n") else text


def parse_secret_env(specs: list[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``--secret-env NAME`` (the value of NAME in this shell's environment, like ``docker run
    -e NAME``) or ``--secret-env NAME=@FILE`` (a file's content; ``@-``: standard input). A
    value on the command line is refused: ``ps`` and shell history would show it."""
    environ = os.environ if environ is None else environ
    secrets: dict[str, str] = {}
    for spec in specs:
        name, sep, source = spec.partition("=")
        if not name:
            raise UsageError(f"--secret-env takes NAME or NAME=@FILE, got {spec!r}")
        if not sep:
            if name not in environ:
                raise UsageError(
                    f"--secret-env {name}: {name} is not set in this shell (export it, or give {name}=@FILE)"
                )
            secrets[name] = environ[name]
        elif source.startswith("@"):
            secrets[name] = read_secret_file(source[1:], f"--secret-env {name}")
        else:
            raise UsageError(
                f"--secret-env {name}=…: a secret is never a command-line value (ps and shell history "
                f"show those): export {name} and give --secret-env {name}, or give {name}=@FILE"
            )
    return secrets


def read_secret(prompt: str, *, file: str | None = None) -> str:
    """A secret from ``file`` when given, else from standard input: a hidden prompt on a
    terminal, the first line of a pipe (``echo "$PASSWORD" | catacloud …``)."""
    if file is not None:
        value = read_secret_file(file, prompt)
    elif sys.stdin.isatty():
        value = getpass.getpass(f"{prompt} (input hidden): ")
    else:
        value = sys.stdin.readline()
    value = value.strip() if file is None else value
    if not value:
        raise UsageError(f"no {prompt.lower()} given (pipe it in, or type it at the prompt)")
    return value
