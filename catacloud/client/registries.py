"""``catacloud registry-credentials …`` (``/registry-credentials/``): the organization's
credentials for private container registries. Everyone reads the host and user name; admins
set and remove them; the password goes in on standard input and never comes back."""

from __future__ import annotations

import argparse
from typing import Any

from catacloud.client.api import Api
from catacloud.client.base import Commands, find_row, read_secret, show_list
from catacloud.client.output import age, print_json, short

PATH = "registry-credentials/"


def register(at: Commands) -> None:
    creds = at.group(
        "registry-credentials",
        "credentials for private container registries (the images jobs and pools pull)",
        aliases=("registries",),
    )
    at.command(creds, "ls", cmd_registries_ls, "list registries with credentials (host and user name)")
    p = at.command(
        creds,
        "set",
        cmd_registries_set,
        "set (or replace) a registry's credentials (admin)",
        description="Set a registry's user name and password (admin), replacing any earlier ones. "
        "The password is read from standard input (a hidden prompt on a terminal) or --password-file, "
        "never from the command line, and is never shown again.",
    )
    p.add_argument(
        "registry", metavar="REGISTRY", help="host or host:port as image references name it (docker.io)"
    )
    p.add_argument("--username", "-u", required=True, help="the registry's user name")
    p.add_argument("--password-file", metavar="FILE", help="read the password from this file (- for stdin)")
    p = at.command(creds, "delete", cmd_registries_delete, "remove a registry's credentials (admin)")
    p.add_argument("registry", metavar="REGISTRY", help="its host (or id)")


def _cells(r: dict) -> list[Any]:
    return [r["registry"], r["username"], short(r["id"]), age(r["updated_at"])]


def cmd_registries_ls(api: Api, args: argparse.Namespace) -> int:
    rows = api.pages(PATH, limit=1000)
    empty = "no registry credentials (catacloud registry-credentials set HOST -u USER)"
    return show_list(args, rows, ("REGISTRY", "USERNAME", "ID", "UPDATED"), _cells, empty=empty)


def cmd_registries_set(api: Api, args: argparse.Namespace) -> int:
    password = read_secret(f"Password for {args.username} at {args.registry}", file=args.password_file)
    saved = api.post(PATH, {"registry": args.registry, "username": args.username, "password": password})
    if args.json:
        print_json(saved)
    else:
        print(f"registry {saved['registry']}: {saved['username']}'s credentials stored (password write-only)")
    return 0


def cmd_registries_delete(api: Api, args: argparse.Namespace) -> int:
    row = find_row(api.pages(PATH, limit=1000), args.registry, "registry credentials", key="registry")
    api.delete(f"{PATH}{row['id']}/")
    if args.json:
        print_json({"id": row["id"], "registry": row["registry"], "deleted": True})
    else:
        print(f"registry {row['registry']}: credentials removed")
    return 0
