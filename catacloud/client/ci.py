"""``catacloud github …`` and ``catacloud gitlab …``: the organization's connection to a forge,
its runner classes (which CI jobs run on which machine type) and the records of the CI jobs
seen. The two forges are one set of commands over one :class:`Forge` description each, as on
the server they are adapters of one CI core; they differ in names, in the fields of a
connection and a class, and in the columns of a record."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from catacloud.client.api import Api
from catacloud.client.base import (
    Commands,
    UsageError,
    find_row,
    names_by_id,
    read_secret_file,
    resolve_id,
    show_list,
)
from catacloud.client.output import age, fields, print_json, short, table


@dataclass(frozen=True)
class Option:
    """A command-line flag that sets one field of the API's body."""

    flag: str
    field: str
    help: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        """Its own name in the parsed arguments (``url`` would be the global ``--url``'s)."""
        return f"set_{self.field}"


@dataclass(frozen=True)
class Forge:
    name: str  # the command and the API's path: github, gitlab
    title: str
    match: str  # the field a class matches CI jobs by: labels, tags
    waiting: str  # the field counting a class's CI jobs waiting for a runner: queued, pending
    records: str  # the API's list of CI jobs seen
    record_filters: tuple[Option, ...]
    record_columns: tuple[str, ...]
    record_cells: Callable[[dict], list[Any]]
    class_options: tuple[Option, ...]  # besides the ones every forge's class has (CLASS_OPTIONS)
    connection_options: tuple[Option, ...]
    connection_secrets: tuple[Option, ...]  # read from a file, never the command line
    children: Option  # the connection's installations or projects: ``ID:TEXT`` each
    child_text: str  # what TEXT is in the API's body: account, path
    child_metavar: str  # ID[:ACCOUNT] (optional text) or ID:PATH
    child_text_required: bool
    connection_rows: Callable[[dict], list[tuple[str, Any]]]
    endpoints: Callable[[dict], list[tuple[str, dict]]]  # (what, its health) of a connection


CLASS_OPTIONS = (
    Option(
        "--pool", "pool", "a pool of the class's machine type to keep warm for it (name or id; '' for none)"
    ),
    Option("--priority", "priority", "higher runs first", int),
    Option("--timeout", "timeout_seconds", "a runner job is ended after this (seconds)", int),
    Option("--max-attempts", "max_attempts", "attempts on machine loss", int),
    Option("--online-timeout", "online_timeout_seconds", "seconds for the runner to come online", int),
    Option("--idle-timeout", "idle_timeout_seconds", "seconds a runner waits for its CI job", int),
    Option("--command", "command", "the runner job's command (default: the forge's runner)"),
)


def _github_record(r: dict) -> list[Any]:
    return [r["github_id"], r["repository"], r["workflow"], r["name"], r["status"], r.get("conclusion"),
            r.get("runner_class"), short(r["job"]) if r.get("job") else None, age(r["seen_at"])]  # fmt: skip


def _gitlab_record(r: dict) -> list[Any]:
    return [r["gitlab_id"], r["project"], r.get("pipeline_id"), r["name"], r["status"], r.get("conclusion"),
            r.get("runner_class"), short(r["job"]) if r.get("job") else None, age(r["seen_at"])]  # fmt: skip


def _set(value: bool) -> str:
    return "set" if value else "NOT set"


GITHUB = Forge(
    name="github",
    title="GitHub",
    match="labels",
    waiting="queued",
    records="github/workflow-jobs/",
    record_filters=(Option("--repository", "repository", "only this repository's (owner/name)"),),
    record_columns=(
        "GITHUB ID",
        "REPOSITORY",
        "WORKFLOW",
        "NAME",
        "STATUS",
        "CONCLUSION",
        "CLASS",
        "JOB",
        "SEEN",
    ),
    record_cells=_github_record,
    class_options=(
        Option("--scope", "scope", "where runners register", choices=("org", "repo")),
        Option("--runner-group-id", "runner_group_id", "the runner group (default 1)", int),
        Option("--runner-dir", "runner_dir", "where the machines' image has the Actions runner"),
    ),
    connection_options=(
        Option("--app-id", "app_id", "the GitHub App's id", int),
        Option("--api-url", "api_url", "GitHub Enterprise Server's API (default https://api.github.com)"),
    ),
    connection_secrets=(
        Option("--private-key-file", "private_key", "the App's private key (PEM file; - for stdin)"),
        Option("--webhook-secret-file", "webhook_secret", "a file holding the App's webhook secret"),
    ),
    children=Option(
        "--installation", "installations", "an installation of the App: ID[:ACCOUNT] (repeatable)"
    ),
    child_text="account",
    child_metavar="ID[:ACCOUNT]",
    child_text_required=False,
    connection_rows=lambda c: [
        ("app", f"{c['app_id']} at {c.get('api_url') or 'https://api.github.com'}"),
        ("webhook", c["webhook_url"]),
        (
            "secrets",
            f"private key {_set(c['private_key_set'])}, webhook secret {_set(c['webhook_secret_set'])}",
        ),
    ],
    endpoints=lambda c: [
        (f"installation {i['id']} {i.get('account') or ''}".strip(), i) for i in c["installations"]
    ],
)

GITLAB = Forge(
    name="gitlab",
    title="GitLab",
    match="tags",
    waiting="pending",
    records="gitlab/jobs/",
    record_filters=(
        Option("--project", "project", "only this project's (group/name)"),
        Option("--pipeline", "pipeline_id", "only this pipeline's", int),
    ),
    record_columns=(
        "GITLAB ID",
        "PROJECT",
        "PIPELINE",
        "NAME",
        "STATUS",
        "CONCLUSION",
        "CLASS",
        "JOB",
        "SEEN",
    ),
    record_cells=_gitlab_record,
    class_options=(
        Option("--scope", "scope", "where the runner is created", choices=("project", "group")),
        Option("--group-id", "group_id", "the group, with --scope group", int),
        Option("--executor", "executor", "how the CI job's script runs", choices=("shell", "docker")),
        Option("--image", "image", "a container image the shell executor runs in"),
        Option("--runner-path", "runner_path", "where the machines' image has gitlab-runner"),
    ),
    connection_options=(Option("--gitlab-url", "url", "GitLab's URL, e.g. https://gitlab.com"),),
    connection_secrets=(
        Option("--token-file", "token", "a file holding the access token (glpat-…; - for stdin)"),
        Option("--webhook-token-file", "webhook_token", "a file holding the webhook's secret token"),
    ),
    children=Option("--project", "projects", "a project: ID:PATH, e.g. 42:group/app (repeatable)"),
    child_text="path",
    child_metavar="ID:PATH",
    child_text_required=True,
    connection_rows=lambda c: [
        ("gitlab", c["url"]),
        ("webhook", c["webhook_url"]),
        ("secrets", f"token {_set(c['token_set'])}, webhook token {_set(c['webhook_token_set'])}"),
        ("projects", ", ".join(f"{p['id']}:{p['path']}" for p in c["projects"]) or None),
    ],
    endpoints=lambda c: [(c["url"], c["health"])],
)

FORGES = (GITHUB, GITLAB)


def register(at: Commands) -> None:
    for forge in FORGES:
        _register(at, forge)


def _add(p: argparse.ArgumentParser, option: Option) -> None:
    metavar = None if option.choices else option.flag[2:].upper().replace("-", "_")
    p.add_argument(
        option.flag,
        dest=option.dest,
        type=option.type,
        choices=option.choices,
        metavar=metavar,
        help=option.help,
    )


def _given(args: argparse.Namespace, options: tuple[Option, ...]) -> dict[str, Any]:
    """The fields of ``options`` given on the command line (None: not given)."""
    values = {o.field: getattr(args, o.dest) for o in options}
    return {field: value for field, value in values.items() if value is not None}


def _register(at: Commands, forge: Forge) -> None:
    title, flag = forge.title, f"--{forge.match[:-1]}"
    top = at.group(forge.name, f"{title}: the connection, runner classes and the CI jobs seen")
    conn = at.group("connection", f"the organization's {title} connection", parent=top)
    p = at.command(conn, "show", _bind(cmd_connection_show, forge), f"the {title} connection and its health")
    p = at.command(
        conn, "set", _bind(cmd_connection_set, forge), f"create or change the {title} connection (admin)",
        description=f"Create or change the {title} connection (admin): only what is given changes. "
        "Secrets are read from files, never from the command line, and are never shown again.",
    )  # fmt: skip
    for option in (*forge.connection_options, *forge.connection_secrets):
        _add(p, option)
    p.add_argument(
        forge.children.flag,
        dest="children",
        action="append",
        metavar=forge.child_metavar,
        help=forge.children.help,
    )
    at.command(conn, "delete", _bind(cmd_connection_delete, forge), f"remove the {title} connection (admin)")

    classes = at.group(
        "classes", f"runner classes: which {title} CI jobs run on which machine type", parent=top
    )
    at.command(
        classes, "ls", _bind(cmd_classes_ls, forge), "list runner classes with their waiting jobs and runners"
    )
    for name, func, what in (
        ("create", cmd_classes_create, "create"),
        ("update", cmd_classes_update, "change"),
    ):
        p = at.command(classes, name, _bind(func, forge), f"{what} a runner class (admin)")
        p.add_argument("name", metavar="NAME", help="the class's name, e.g. linux-2cpu")
        p.add_argument(
            flag,
            dest="match",
            action="append",
            metavar=forge.match[:-1].upper(),
            required=name == "create",
            help=f"a {forge.match[:-1]} it matches (repeatable; the whole list)",
        )
        p.add_argument(
            "--machine-type", required=name == "create", metavar="TYPE", help="machine type name or id"
        )
        for option in (*CLASS_OPTIONS, *forge.class_options):
            _add(p, option)
    p = at.command(
        classes,
        "delete",
        _bind(cmd_classes_delete, forge),
        "delete a runner class with no live runner (admin)",
    )
    p.add_argument("name", metavar="NAME", help="the class's name (or id)")

    jobs = at.group("jobs", f"the {title} CI jobs seen, and the Catacloud job that ran each", parent=top)
    p = at.command(jobs, "ls", _bind(cmd_records_ls, forge), f"list the {title} CI jobs seen, newest first")
    p.add_argument("--status", action="append", default=[], metavar="STATUS", help="only these (repeatable)")
    p.add_argument("--class", dest="runner_class", metavar="CLASS", help="only this runner class's")
    for option in forge.record_filters:
        _add(p, option)
    p.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")


def _bind(
    func: Callable[[Forge, Api, argparse.Namespace], int], forge: Forge
) -> Callable[[Api, argparse.Namespace], int]:
    return lambda api, args: func(forge, api, args)


# ---- the connection -----------------------------------------------------------------------------


def cmd_connection_show(forge: Forge, api: Api, args: argparse.Namespace) -> int:
    conn = api.get(f"{forge.name}/connection/")
    if args.json:
        print_json(conn)
        return 0
    fields(forge.connection_rows(conn))
    endpoints = forge.endpoints(conn)
    if endpoints:
        print()
        table(
            ["ENDPOINT", "AVAILABLE", "CALLS THIS HOUR", "RATE LEFT", "RECONCILED"],
            [[what, "yes" if h["available"] else f"no: {h.get('unavailable_reason') or '?'}",
              h.get("calls_this_hour"), h.get("rate_remaining"), age(h.get("reconciled_at"))]
             for what, h in endpoints],
        )  # fmt: skip
    return 0


def _children(forge: Forge, values: list[str]) -> list[dict[str, Any]]:
    """``--installation 1:demo-org`` or ``--project 42:group/app``, as the API takes them."""
    out: list[dict[str, Any]] = []
    for value in values:
        ident, _, text = value.partition(":")
        if not ident.isdigit() or (forge.child_text_required and not text):
            raise UsageError(f"{forge.children.flag} takes {forge.child_metavar}, got {value!r}")
        out.append({"id": int(ident), forge.child_text: text} if text else {"id": int(ident)})
    return out


def cmd_connection_set(forge: Forge, api: Api, args: argparse.Namespace) -> int:
    body = _given(args, forge.connection_options)
    for field, path in _given(args, forge.connection_secrets).items():
        body[field] = read_secret_file(path, field)
    if args.children:
        body[forge.children.field] = _children(forge, args.children)
    if not body:
        raise UsageError(f"nothing to set: see catacloud {forge.name} connection set --help")
    conn = api.put(f"{forge.name}/connection/", body)
    if args.json:
        print_json(conn)
        return 0
    print(f"{forge.title} connection saved: {', '.join(sorted(body))}")
    fields(forge.connection_rows(conn))
    return 0


def cmd_connection_delete(forge: Forge, api: Api, args: argparse.Namespace) -> int:
    api.delete(f"{forge.name}/connection/")
    if args.json:
        print_json({"deleted": True})
    else:
        print(f"{forge.title} connection removed")
    return 0


# ---- runner classes -----------------------------------------------------------------------------


def _classes_path(forge: Forge) -> str:
    return f"{forge.name}/runner-classes/"


def cmd_classes_ls(forge: Forge, api: Api, args: argparse.Namespace) -> int:
    rows = api.pages(_classes_path(forge), limit=1000)
    types = names_by_id(api, "machine-types/") if rows and not args.json else {}
    pools = names_by_id(api, "pools/") if any(r.get("pool") for r in rows) and not args.json else {}

    def cells(c: dict) -> list[Any]:
        return [
            c["name"],
            short(c["id"]),
            ",".join(c[forge.match]),
            types.get(str(c["machine_type"]), c["machine_type"]),
            pools.get(str(c["pool"]), c["pool"]) if c.get("pool") else None,
            c[forge.waiting],
            c["runners"],
        ]

    headers = ("NAME", "ID", forge.match.upper(), "MACHINE TYPE", "POOL", forge.waiting.upper(), "RUNNERS")
    return show_list(
        args, rows, headers, cells, empty=f"no runner classes (catacloud {forge.name} classes create …)"
    )


def _class_body(forge: Forge, api: Api, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if args.match:
        body[forge.match] = args.match
    if args.machine_type:
        body["machine_type"] = args.machine_type
    body.update(_given(args, (*CLASS_OPTIONS, *forge.class_options)))
    if body.get("pool"):
        body["pool"] = resolve_id(api, "pool", "pools/", body["pool"], by_name=True)
    elif "pool" in body:
        body["pool"] = None
    return body


def cmd_classes_create(forge: Forge, api: Api, args: argparse.Namespace) -> int:
    rc = api.post(_classes_path(forge), {"name": args.name, **_class_body(forge, api, args)})
    if args.json:
        print_json(rc)
    else:
        print(
            f"runner class {rc['name']} {short(rc['id'])} created: {forge.match} {', '.join(rc[forge.match])}"
        )
    return 0


def _class(forge: Forge, api: Api, ref: str) -> dict:
    return find_row(api.pages(_classes_path(forge), limit=1000), ref, "runner class")


def cmd_classes_update(forge: Forge, api: Api, args: argparse.Namespace) -> int:
    body = _class_body(forge, api, args)
    if not body:
        raise UsageError(f"nothing to change: see catacloud {forge.name} classes update --help")
    rc = api.patch(f"{_classes_path(forge)}{_class(forge, api, args.name)['id']}/", body)
    if args.json:
        print_json(rc)
    else:
        print(f"runner class {rc['name']} {short(rc['id'])} updated: {', '.join(sorted(body))}")
    return 0


def cmd_classes_delete(forge: Forge, api: Api, args: argparse.Namespace) -> int:
    rc = _class(forge, api, args.name)
    api.delete(f"{_classes_path(forge)}{rc['id']}/")
    if args.json:
        print_json({"id": rc["id"], "name": rc["name"], "deleted": True})
    else:
        print(f"runner class {rc['name']} {short(rc['id'])} deleted")
        print(
            f"its configuration {forge.name}-{rc['name']} goes too unless jobs refer to it", file=sys.stderr
        )
    return 0


# ---- the CI jobs seen ---------------------------------------------------------------------------


def cmd_records_ls(forge: Forge, api: Api, args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"status": args.status or None, "runner_class": args.runner_class}
    params.update(_given(args, forge.record_filters))
    rows = api.pages(forge.records, limit=max(1, args.limit), **params)
    return show_list(
        args, rows, forge.record_columns, forge.record_cells, empty=f"no {forge.title} CI jobs seen"
    )
