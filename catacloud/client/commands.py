"""``catacloud jobs|configs|pools|instances|artifacts|auth|…``: the client commands on the REST API.

Every command takes ``--url``, ``--profile`` and ``--json``, before or after the subcommand
(see :mod:`catacloud.client.config` for where the URL and token come from). Objects are named
as the console shows them: a name, a whole id, or its first hex digits (``bd3d252e``) when
they are unique, like git and docker. Tables and progress are for people; ``--json`` prints
the API's answer for scripts. Exit status: 0 done, 1 the API refused or could not be reached
(the ``{code, detail}`` is shown on stderr), 2 bad usage; ``--wait`` / ``--follow`` end with
the job's own: 0 succeeded, its exit code when it failed with one, else 1.
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import os
import sys
from pathlib import Path
from typing import Any

from catacloud.client import billing, ci, events, hosts, jobs, registries
from catacloud.client import run as one_off
from catacloud.client.api import Api, ApiError
from catacloud.client.base import (
    Commands,
    UsageError,
    as_uuid,
    names_by_id,
    parse_env,
    parse_secret_env,
    resolve_id,
    show_error,
    show_list,
    status_filter,
)
from catacloud.client.config import (
    DEFAULT_URL,
    ClientConfig,
    ConfigError,
    normalize_url,
    remove_login,
    save_login,
)
from catacloud.client.jobs import JOB_STATUSES, find_job, secret_env_flag
from catacloud.client.output import age, duration, fields, print_json, short, size, table

__all__ = ["JOB_STATUSES", "add_client_commands"]

# A machine's states (the API's InstanceStatus), and those of a machine that exists or may
# exist at its provider (INSTANCE_LIVE): what `instances ls` shows unless asked for all.
INSTANCE_STATUSES = (
    "pending",
    "provisioning",
    "warming",
    "ready",
    "claimed",
    "terminating",
    "terminated",
    "failed",
    "lost",
)
INSTANCE_LIVE = INSTANCE_STATUSES[:6]


def add_client_commands(subparsers: Any) -> None:
    """Register the client's commands on an ``add_subparsers()`` object (whose parser carries
    the global flags too): the daily ones first, then money, records and integrations."""
    at = Commands(subparsers)
    for register in (
        jobs.register,
        one_off.register,
        _configs,
        _pools,
        _instances,
        hosts.register,
        _artifacts,
        events.register,
        billing.register,
        registries.register,
        ci.register,
        _auth,
    ):
        register(at)


def _configs(at: Commands) -> None:
    configs = at.group("configs", "list, create, change and delete job configurations")
    at.command(configs, "ls", cmd_configs_ls, "list job configurations")
    p = at.command(configs, "show", cmd_configs_show, "one job configuration, all of it")
    p.add_argument("config", metavar="CONFIG", help="its name or id")
    p = at.command(configs, "create", cmd_configs_create, "create a job configuration (admin)")
    p.add_argument("name", metavar="NAME", help="its name, e.g. unit-tests")
    _config_flags(p, creating=True)
    p = at.command(
        configs, "update", cmd_configs_update, "change a job configuration: only what is given (admin)"
    )
    p.add_argument("config", metavar="CONFIG", help="its name or id")
    _config_flags(p, creating=False)
    p = at.command(configs, "delete", cmd_configs_delete, "delete a job configuration no job uses (admin)")
    p.add_argument("config", metavar="CONFIG", help="its name or id")


def _config_flags(p: argparse.ArgumentParser, *, creating: bool) -> None:
    """The fields of a job configuration, as ``configs create`` and ``configs update`` take them."""
    p.add_argument("--machine-type", metavar="TYPE", help="machine type name or id (or --requires)")
    p.add_argument(
        "--requires",
        action="append",
        default=[],
        metavar="K=N",
        help="what a job needs instead of a machine type: cpus=N, memory_mb=N, gpus=N, arch=arm64, "
        "or a label the type must carry, e.g. disk=nvme (repeatable); its jobs run on the cheapest "
        "granted type with at least that",
    )
    p.add_argument("--command", required=creating, help="what the job runs, under /bin/sh -c")
    p.add_argument("--image", metavar="REF", help="a container image the command runs in ('' for none)")
    env = "env of every run (repeatable)" if creating else "set or change one env variable (repeatable)"
    p.add_argument("--env", action="append", default=[], metavar="K=V", help=env)
    secret_env_flag(p, "of every run" if creating else "of every run; replaces all of them")
    p.add_argument("--timeout", type=int, metavar="SECONDS", help="the job is killed after this")
    p.add_argument("--priority", type=int, help="higher runs first (default 0)")
    p.add_argument("--max-attempts", type=int, help="attempts on machine loss (default 3)")
    p.add_argument("--reuse", choices=["reuse", "ephemeral"], help="keep the machine for the next job or not")
    p.add_argument(
        "--resource",
        action="append",
        default=None,
        metavar="TYPE",
        help="a resource type it needs (repeatable)" + ("" if creating else "; replaces the list"),
    )
    if not creating:
        p.add_argument(
            "--unset-env", action="append", default=[], metavar="NAME", help="remove an env variable"
        )
        p.add_argument(
            "--no-requires",
            action="store_true",
            help="state no requirements (with --machine-type: run there)",
        )
        p.add_argument("--no-secret-env", action="store_true", help="remove every secret env value")


def _pools(at: Commands) -> None:
    pools = at.group(
        "pools", "list, create, resize, drain and delete warm pools; acquire and release their machines"
    )
    at.command(pools, "ls", cmd_pools_ls, "list pools with their members by state")
    p = at.command(pools, "show", cmd_pools_show, "one pool: sizes, limit, and each member")
    p.add_argument("pool", metavar="POOL", help="pool name or id")
    p = at.command(pools, "create", cmd_pools_create, "create a warm pool (admin)")
    p.add_argument("name", metavar="NAME", help="its name, e.g. ci")
    p.add_argument("--machine-type", required=True, metavar="TYPE", help="machine type name or id")
    p.add_argument("--size", type=int, required=True, help="machines to keep warm (target_size)")
    _pool_flags(p)
    p = at.command(pools, "update", cmd_pools_update, "change a pool's sizes, images, description (admin)")
    p.add_argument("pool", metavar="POOL", help="pool name or id")
    p.add_argument("--size", type=int, help="machines to keep warm (target_size)")
    _pool_flags(p)
    p.add_argument("--no-images", action="store_true", help="hold no image any more")
    p = at.command(
        pools,
        "resize",
        cmd_pools_resize,
        "set how many machines a pool keeps warm (admin; like kubectl scale)",
    )
    p.add_argument("pool", metavar="POOL", help="pool name or id")
    p.add_argument("size", type=int, metavar="SIZE", help="machines to keep warm (target_size)")
    p = at.command(pools, "acquire", cmd_pools_acquire, "take a ready machine from a pool (never waits)")
    p.add_argument("pool", metavar="POOL", help="pool name or id")
    p.add_argument("--by", default="", help="who holds it (acquired_by), e.g. runner-7")
    p.add_argument("--for", dest="purpose", default="", help="what for (acquired_for), e.g. 'build 1234'")
    p.add_argument("--lease", type=int, metavar="SECONDS", help="the claim ends by itself after this")
    p = at.command(pools, "release", cmd_pools_release, "hand back an acquired machine (it is terminated)")
    p.add_argument("instance", metavar="INSTANCE", help="instance id (or its first digits)")
    p.add_argument("--claim", metavar="CLAIM_ID", help="release only if this claim still holds it")
    p = at.command(
        pools, "drain", cmd_pools_drain, "stop keeping machines: no new member, no acquire (admin)"
    )
    p.add_argument("pool", metavar="POOL", help="pool name or id")
    p.add_argument(
        "--terminate-members",
        action="store_true",
        help="destroy its members now (else the unclaimed ones are released and end with their paid period)",
    )
    p = at.command(pools, "delete", cmd_pools_delete, "delete a drained pool (admin)")
    p.add_argument("pool", metavar="POOL", help="pool name or id")


def _pool_flags(p: argparse.ArgumentParser) -> None:
    """The sizes and settings ``pools create`` and ``pools update`` share."""
    p.add_argument("--min", type=int, dest="min_size", help="min_size (default 0)")
    p.add_argument("--max", type=int, dest="max_size", help="max_size (create's default: --size)")
    p.add_argument("--warmup-grace", type=int, metavar="SECONDS", help="a member warming longer is replaced")
    p.add_argument("--description", help="what it is for")
    p.add_argument(
        "--image",
        action="append",
        default=None,
        metavar="REF",
        help="a container image every member pulls before it is ready (repeatable; the whole list)",
    )


def _instances(at: Commands) -> None:
    instances = at.group("instances", "list, show and terminate machines")
    p = at.command(
        instances, "ls", cmd_instances_ls, "list machines, newest first: the live ones unless --all"
    )
    status_filter(p, INSTANCE_STATUSES, " (default: the live ones)")
    p.add_argument("--all", "-a", action="store_true", help="ended machines too (terminated, failed, lost)")
    p.add_argument("--pool", metavar="POOL", help="only members of this pool (name or id)")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    p = at.command(
        instances, "show", cmd_instances_show, "one machine: status, pool, provider, address, cost"
    )
    p.add_argument("instance", metavar="INSTANCE", help="instance id (or its first digits)")
    p = at.command(
        instances, "terminate", cmd_instances_terminate, "destroy a machine at its provider (admin)"
    )
    p.add_argument("instance", metavar="INSTANCE", help="instance id (or its first digits)")


def _artifacts(at: Commands) -> None:
    artifacts = at.group("artifacts", "list and download the files a job kept")
    p = at.command(artifacts, "ls", cmd_artifacts_ls, "list a job's artifacts")
    p.add_argument("job", metavar="JOB", help="job id (or its first digits)")
    p = at.command(artifacts, "get", cmd_artifacts_get, "download one artifact (its sha256 is checked)")
    p.add_argument("job", metavar="JOB", help="job id (or its first digits)")
    p.add_argument("name", metavar="NAME", help="artifact name, e.g. reports/junit.xml")
    p.add_argument(
        "--output", "-o", metavar="PATH", help="file or directory (- for stdout; default ./BASENAME)"
    )


def _auth(at: Commands) -> None:
    auth = at.group("auth", "store and check the token for a server (like gh auth)")
    at.command(
        auth,
        "login",
        cmd_auth_login,
        "check a token and store it for a URL in the config file",
        api=False,
        description="Check a token against the server and store it, with the URL, as a profile of "
        "the config file ($XDG_CONFIG_HOME/catacloud/config.toml, mode 0600). The token is read "
        "from standard input (a prompt on a terminal), never from the command line.",
    )
    at.command(auth, "status", cmd_auth_status, "which server and token the client uses, checked")
    at.command(
        auth,
        "logout",
        cmd_auth_logout,
        "remove a stored token from the config file",
        api=False,
        description="Remove the profile holding the token for a URL (--url, else CATACLOUD_URL, else "
        "the default profile's), or the profile --profile names, from the config file.",
    )


# ---- pools --------------------------------------------------------------------------------------

POOL_COLUMNS = ("NAME", "ID", "STATUS", "MACHINE TYPE", "READY", "MEMBERS", "TARGET", "MIN", "MAX", "LIMIT")


def _pool_cells(p: dict) -> list[Any]:
    return [
        p["name"],
        short(p["id"]),
        p["status"],
        p.get("machine_type_name") or p["machine_type"],
        p["ready_count"],
        p["member_count"],
        p["target_size"],
        p["min_size"],
        p["max_size"],
        p.get("limit_reason"),
    ]


def cmd_pools_ls(api: Api, args: argparse.Namespace) -> int:
    return show_list(args, api.pages("pools/", limit=1000), POOL_COLUMNS, _pool_cells, empty="no pools")


def cmd_pools_show(api: Api, args: argparse.Namespace) -> int:
    pool = _pool(api, args.pool)
    if args.json:
        print_json(pool)
        return 0
    fields(
        [
            ("pool", f"{pool['name']} {pool['id']}"),
            ("status", pool["status"]),
            ("type", pool.get("machine_type_name") or pool["machine_type"]),
            ("sizes", _sizes(pool)),
            ("ready", f"{pool['ready_count']} of {pool['member_count']} members"),
            ("limit", pool.get("limit_reason")),
            ("images", ", ".join(pool.get("images") or [])),
            ("about", pool.get("description")),
        ]
    )
    if pool["members"]:
        print("\nmembers:")
        table(
            ["  INSTANCE", "STATUS", "PROVIDER ID", "AGE", "CLAIMED BY", "FOR"],
            [
                [f"  {short(m['instance_id'])}", m["status"], m.get("provider_id"), age(m["created_at"]),
                 m.get("claimed_by"), m.get("claimed_for")]
                for m in pool["members"]
            ],
        )  # fmt: skip
    return 0


def _sizes(pool: dict) -> str:
    return f"target {pool['target_size']} (min {pool['min_size']}, max {pool['max_size']})"


def cmd_pools_acquire(api: Api, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"acquired_by": args.by, "acquired_for": args.purpose}
    if args.lease:
        body["lease_seconds"] = args.lease
    claim = api.post(f"pools/{resolve_id(api, 'pool', 'pools/', args.pool, by_name=True)}/acquire/", body)
    if args.json:
        print_json(claim)
        return 0
    inst = claim["instance"]
    fields(
        [
            ("instance", inst["id"]),
            ("claim", claim["claim_id"]),
            ("status", inst["status"]),
            ("type", inst["machine_type"]),
            ("provider", f"{inst['provider']} {inst.get('provider_id') or ''}".strip()),
            ("address", inst.get("public_ip")),
            ("lease", inst.get("lease_expires_at") and f"until {inst['lease_expires_at']}"),
        ]
    )
    print(f"release: catacloud pools release {inst['id']}", file=sys.stderr)
    return 0


def cmd_pools_release(api: Api, args: argparse.Namespace) -> int:
    body = {"claim_id": as_uuid(args.claim, "--claim")} if args.claim else {}
    answer = api.post(f"instances/{resolve_id(api, 'instance', 'instances/', args.instance)}/release/", body)
    if args.json:
        print_json(answer)
    else:
        print(f"instance {answer['id']} released ({answer['status']})")
    return 0


def _pool_body(args: argparse.Namespace) -> dict[str, Any]:
    """What ``pools create`` and ``pools update`` send: the flags given, and no other."""
    images = [] if getattr(args, "no_images", False) else args.image
    given = {
        "target_size": args.size,
        "min_size": args.min_size,
        "max_size": args.max_size,
        "warmup_grace_seconds": args.warmup_grace,
        "description": args.description,
        "images": images,
    }
    return {key: value for key, value in given.items() if value is not None}


def cmd_pools_create(api: Api, args: argparse.Namespace) -> int:
    body = {"name": args.name, "machine_type": args.machine_type, **_pool_body(args)}
    body.setdefault("max_size", max(args.size, args.min_size or 0))
    pool = api.post("pools/", body)
    if args.json:
        print_json(pool)
        return 0
    print(
        f"pool {pool['name']} {short(pool['id'])} created: {pool['status']}, "
        f"{pool['target_size']} × {pool.get('machine_type_name') or args.machine_type} "
        f"(min {pool['min_size']}, max {pool['max_size']})"
    )
    print(f"watch it: catacloud pools ls; take one: catacloud pools acquire {pool['name']}", file=sys.stderr)
    return 0


def cmd_pools_update(api: Api, args: argparse.Namespace) -> int:
    body = _pool_body(args)
    if not body:
        raise UsageError(
            "nothing to change: give --size, --min, --max, --warmup-grace, --description or --image"
        )
    return _patch_pool(api, args, body)


def cmd_pools_resize(api: Api, args: argparse.Namespace) -> int:
    return _patch_pool(api, args, {"target_size": args.size})


def _patch_pool(api: Api, args: argparse.Namespace, body: dict[str, Any]) -> int:
    pool = api.patch(f"pools/{resolve_id(api, 'pool', 'pools/', args.pool, by_name=True)}/", body)
    if args.json:
        print_json(pool)
        return 0
    print(f"pool {pool['name']} {short(pool['id'])} updated: {_sizes(pool)}, {pool['status']}")
    print("the pool converges to it: catacloud pools ls", file=sys.stderr)
    return 0


def _pool(api: Api, ref: str) -> dict:
    return dict(api.get(f"pools/{resolve_id(api, 'pool', 'pools/', ref, by_name=True)}/"))


def cmd_pools_drain(api: Api, args: argparse.Namespace) -> int:
    pool = _pool(api, args.pool)
    answer = api.post(f"pools/{pool['id']}/drain/", {"terminate_members": args.terminate_members})
    if args.json:
        print_json(answer)
    elif args.terminate_members:
        n = answer["terminated_count"]
        print(f"pool {pool['name']} drained: {n} member{'' if n == 1 else 's'} terminated")
    else:
        released = "its unclaimed members are released (they end with their paid period)"
        print(f"pool {pool['name']} drained: {released}")
    if not args.json:
        print(f"delete it: catacloud pools delete {pool['name']}", file=sys.stderr)
    return 0


def cmd_pools_delete(api: Api, args: argparse.Namespace) -> int:
    pool = _pool(api, args.pool)
    api.delete(f"pools/{pool['id']}/")
    if args.json:
        print_json({"id": pool["id"], "name": pool["name"], "deleted": True})
    else:
        print(f"pool {pool['name']} {short(pool['id'])} deleted")
    return 0


# ---- instances ----------------------------------------------------------------------------------


def _instance_id(api: Api, ref: str) -> str:
    return resolve_id(api, "instance", "instances/", ref)


INSTANCE_COLUMNS = (
    "ID",
    "STATUS",
    "MACHINE TYPE",
    "POOL",
    "PROVIDER",
    "ADDRESS",
    "CLAIMED FOR",
    "AGE",
    "COST",
)


def cmd_instances_ls(api: Api, args: argparse.Namespace) -> int:
    """Like ``docker ps``: the machines that exist (or may) at their provider, unless ``--all``
    or ``--status`` asks for others."""
    params: dict[str, Any] = {"ordering": "-created_at"}
    if args.status or not args.all:
        params["status"] = args.status or list(INSTANCE_LIVE)
    if args.pool:
        params["pool"] = resolve_id(api, "pool", "pools/", args.pool, by_name=True)
    rows = api.pages("instances/", limit=max(1, args.limit), **params)
    pools = names_by_id(api, "pools/") if any(r["pool"] for r in rows) and not args.json else {}

    def cells(i: dict) -> list[Any]:
        return [
            short(i["id"]),
            i["status"],
            i["machine_type"],
            pools.get(str(i["pool"]), short(i["pool"])) if i["pool"] else None,
            i["provider"],
            i.get("public_ip") or i.get("private_ip"),
            i.get("claimed_for"),
            age(i["created_at"]),
            i.get("cost"),
        ]

    empty = "no instances" if args.status or args.all else "no live instances (--all: the ended ones too)"
    return show_list(args, rows, INSTANCE_COLUMNS, cells, empty=empty)


def cmd_instances_show(api: Api, args: argparse.Namespace) -> int:
    inst = api.get(f"instances/{_instance_id(api, args.instance)}/")
    if args.json:
        print_json(inst)
        return 0
    cost = inst.get("cost_detail") or {}
    rows = [
        ("instance", inst["id"]),
        ("status", inst["status"]),
        ("type", inst["machine_type"]),
        ("pool", inst.get("pool")),
        ("provider", f"{inst['provider']} {inst.get('provider_id') or ''}".strip()),
        ("address", inst.get("public_ip") or inst.get("private_ip")),
        ("claimed", " ".join(x for x in (inst.get("claimed_by"), inst.get("claimed_for")) if x) or None),
        ("lease", inst.get("lease_expires_at") and f"until {inst['lease_expires_at']}"),
        ("age", age(inst["created_at"])),
        ("reason", inst.get("failure_reason") or inst.get("end_cause")),
        ("cost", f"{cost['cost']} {cost['currency']}" if cost.get("cost") is not None else inst.get("cost")),
    ]
    fields(rows)
    return 0


def cmd_instances_terminate(api: Api, args: argparse.Namespace) -> int:
    answer = api.post(f"instances/{_instance_id(api, args.instance)}/terminate/")
    if args.json:
        print_json(answer)
    else:
        print(f"instance {answer['id']} {answer['status']}")
    return 0


# ---- job configurations -------------------------------------------------------------------------


CONFIG_COLUMNS = ("NAME", "ID", "MACHINE TYPE", "REUSE", "TIMEOUT", "PRIORITY", "ATTEMPTS", "COMMAND")


def _config_cells(c: dict) -> list[Any]:
    return [
        c["name"],
        short(c["id"]),
        c.get("machine_type_name") or c["machine_type"],
        c["reuse"],
        duration(c["timeout_seconds"]),
        c["priority"],
        c["max_attempts"],
        c["command"] if len(c["command"]) <= 40 else c["command"][:39] + "…",
    ]


def cmd_configs_ls(api: Api, args: argparse.Namespace) -> int:
    rows = api.pages("job-configs/", limit=1000)
    empty = "no job configurations (catacloud configs create NAME …)"
    return show_list(args, rows, CONFIG_COLUMNS, _config_cells, empty=empty)


def _config(api: Api, ref: str) -> dict:
    path = "job-configs/"
    return dict(api.get(f"{path}{resolve_id(api, 'job configuration', path, ref, by_name=True)}/"))


def cmd_configs_show(api: Api, args: argparse.Namespace) -> int:
    c = _config(api, args.config)
    if args.json:
        print_json(c)
        return 0
    env = (
        "(hidden from your role)"
        if c.get("env_hidden")
        else " ".join(f"{k}={v}" for k, v in c["env"].items())
    )
    fields(
        [
            ("config", f"{c['name']} {c['id']}"),
            ("type", c.get("machine_type_name") or c["machine_type"]),
            ("requires", _shown_requirements(c.get("requirements") or {})),
            ("command", c["command"]),
            ("image", c.get("image")),
            ("env", env),
            ("secrets", ", ".join(c.get("secret_env_keys") or [])),
            ("timeout", duration(c["timeout_seconds"])),
            ("priority", c["priority"]),
            ("attempts", c["max_attempts"]),
            ("reuse", c["reuse"]),
            ("needs", ", ".join(c.get("resources") or [])),
        ]
    )
    return 0


def _config_body(args: argparse.Namespace, current: dict | None = None) -> dict[str, Any]:
    """What ``configs create`` and ``configs update`` send: the flags given, and no other. An
    update's ``--env`` and ``--unset-env`` change the ``current`` env, one variable at a time."""
    env: dict[str, str] | None = parse_env(args.env) or None
    if current is not None and (env or args.unset_env):
        env = {k: v for k, v in {**current["env"], **(env or {})}.items() if k not in args.unset_env}
    secret_env: dict[str, str] | None = parse_secret_env(args.secret_env) or None
    if getattr(args, "no_secret_env", False):
        if secret_env:
            raise UsageError("--no-secret-env and --secret-env: give one or the other")
        secret_env = {}
    given = {
        "machine_type": args.machine_type,
        "requirements": _requirements(args.requires)
        if args.requires
        else ({} if getattr(args, "no_requires", False) else None),
        "command": args.command,
        "image": args.image,
        "env": env,
        "secret_env": secret_env,
        "timeout_seconds": args.timeout,
        "priority": args.priority,
        "max_attempts": args.max_attempts,
        "reuse": args.reuse,
        "resources": args.resource,
    }
    return {key: value for key, value in given.items() if value is not None}


SIZES = ("cpus", "memory_mb", "gpus")


def _requirements(pairs: list[str]) -> dict[str, Any]:
    """``["cpus=6", "arch=arm64", "gpu=a4000"]`` -> ``{"cpus": 6, "arch": "arm64", "labels":
    {"gpu": "a4000"}}``: sizes are numbers, ``arch`` a name, any other NAME=VALUE a label."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = (part.strip() for part in pair.partition("="))
        if not sep or not name:
            raise UsageError(f"--requires {pair!r}: give NAME=VALUE, e.g. cpus=4")
        if name in SIZES:
            if not value.isdigit():
                raise UsageError(f"--requires {pair!r}: {name} is a whole number")
            out[name] = int(value)
        elif name == "arch":
            out["arch"] = value
        else:
            out.setdefault("labels", {})[name] = value
    return out


def _shown_requirements(requirements: dict[str, Any]) -> str:
    labels = requirements.get("labels") or {}
    shown = [f"{k}={v}" for k, v in requirements.items() if k != "labels"]
    return " ".join([*shown, *(f"{k}={v}" for k, v in labels.items())])


def cmd_configs_create(api: Api, args: argparse.Namespace) -> int:
    if not args.machine_type and not args.requires:
        raise UsageError("give --machine-type TYPE, or --requires cpus=N (the cheapest type that fits)")
    config = api.post("job-configs/", {"name": args.name, **_config_body(args)})
    if args.json:
        print_json(config)
        return 0
    print(
        f"job configuration {config['name']} {short(config['id'])} created "
        f"(machine type {config.get('machine_type_name') or args.machine_type})"
    )
    print(f"run it: catacloud jobs submit {config['name']} --follow", file=sys.stderr)
    return 0


def cmd_configs_update(api: Api, args: argparse.Namespace) -> int:
    current = _config(api, args.config)
    if current.get("env_hidden") and (args.env or args.unset_env):
        raise UsageError("your role may not read this configuration's env, so it cannot change it")
    body = _config_body(args, current)
    if not body:
        raise UsageError("nothing to change: give the fields to change (catacloud configs update --help)")
    config = api.patch(f"job-configs/{current['id']}/", body)
    if args.json:
        print_json(config)
        return 0
    print(f"job configuration {config['name']} {short(config['id'])} updated: {', '.join(sorted(body))}")
    return 0


def cmd_configs_delete(api: Api, args: argparse.Namespace) -> int:
    config = _config(api, args.config)
    api.delete(f"job-configs/{config['id']}/")
    if args.json:
        print_json({"id": config["id"], "name": config["name"], "deleted": True})
    else:
        print(f"job configuration {config['name']} {short(config['id'])} deleted")
    return 0


# ---- auth ---------------------------------------------------------------------------------------


def _check_token(api: Api) -> dict:
    """Ask the server something every role may read: a wrong token or URL fails here."""
    page = api.get("machine-types/", limit=100)
    return {"machine_types": [m["name"] for m in page["results"]]}


def cmd_auth_login(args: argparse.Namespace) -> int:
    """Like ``gh auth login --with-token``: read a token, check it against the server, store it
    with the URL as a profile (``--profile``, default ``default``) of the config file."""
    url = normalize_url(args.url or os.environ.get("CATACLOUD_URL") or DEFAULT_URL)
    profile = args.profile or "default"
    if sys.stdin.isatty():
        token = getpass.getpass(f"Token for {url} (input hidden): ")
    else:
        token = sys.stdin.readline()
    token = token.strip()
    if not token:
        print("catacloud: no token given (pipe one in, or paste it at the prompt)", file=sys.stderr)
        return 2
    api = Api(ClientConfig(url=url, token=token, profile=profile, source="auth login"))
    try:
        checked = _check_token(api)
    except ApiError as exc:
        show_error(exc, args, url=url)
        print("catacloud: the token was not stored", file=sys.stderr)
        return 1
    except (KeyError, TypeError, AttributeError):
        print(f"error: {url} is not a Catacloud server (its answer has no machine types)", file=sys.stderr)
        return 1
    path = save_login(env=os.environ, url=url, token=token, profile=profile)
    if args.json:
        print_json({"url": url, "profile": profile, "config": str(path), **checked})
    else:
        types = ", ".join(checked["machine_types"]) or "none"
        print(f"logged in to {url}: token checked (machine types: {types})")
        print(f"stored as profile {profile!r} in {path} (mode 0600)")
    return 0


def cmd_auth_logout(args: argparse.Namespace) -> int:
    """Like ``gh auth logout``: forget the stored token of a server (the profile holding it)."""
    try:
        path, profile, url = remove_login(env=os.environ, url=args.url, profile=args.profile)
    except ConfigError as exc:
        print(f"catacloud: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print_json({"url": url, "profile": profile, "config": str(path), "removed": True})
    else:
        print(f"logged out of {url}: profile {profile!r} removed from {path}")
    if os.environ.get("CATACLOUD_TOKEN") or os.environ.get("CATACLOUD_TOKEN_FILE"):
        print("catacloud: CATACLOUD_TOKEN (or CATACLOUD_TOKEN_FILE) is still set here", file=sys.stderr)
    return 0


def cmd_auth_status(api: Api, args: argparse.Namespace) -> int:
    checked = _check_token(api)
    config = api.config
    if args.json:
        print_json({"url": config.url, "profile": config.profile, "source": config.source, **checked})
    else:
        print(f"{config.url}: token from {config.source} works")
        print(f"machine types: {', '.join(checked['machine_types']) or 'none'}")
    return 0


# ---- artifacts ----------------------------------------------------------------------------------


def cmd_artifacts_ls(api: Api, args: argparse.Namespace) -> int:
    rows = api.get(f"jobs/{find_job(api, args.job)}/artifacts/")
    return show_list(
        args,
        rows,
        ["NAME", "KIND", "SIZE", "STATUS", "ATTEMPT", "SHA256"],
        lambda a: [a["name"], a["kind"], size(a["size"]), a["status"], a["attempt"], a["sha256"][:16]],
        empty="no artifacts",
    )


def cmd_artifacts_get(api: Api, args: argparse.Namespace) -> int:
    job_id = find_job(api, args.job)
    response, chunks = api.download(f"jobs/{job_id}/artifacts/{args.name}")
    expected = response.headers.get("X-Checksum-Sha256")
    digest = hashlib.sha256()
    total = 0
    to_stdout = args.output == "-"
    target = None if to_stdout else Path(args.output or args.name.rsplit("/", 1)[-1])
    if target is not None and target.is_dir():
        target = target / args.name.rsplit("/", 1)[-1]
    partial = None if target is None else target.with_name(f".{target.name}.part")
    sink = sys.stdout.buffer if partial is None else partial.open("wb")
    try:
        for chunk in chunks:
            digest.update(chunk)
            sink.write(chunk)
            total += len(chunk)
    finally:
        if partial is not None:
            sink.close()
        response.close()
    if expected and digest.hexdigest() != expected:
        if partial is not None:
            partial.unlink(missing_ok=True)
        raise ApiError(0, "checksum_mismatch", f"{args.name}: the download does not match its sha256")
    if target is not None and partial is not None:
        os.replace(partial, target)
        if args.json:
            print_json({"name": args.name, "path": str(target), "size": total, "sha256": digest.hexdigest()})
        else:
            sha = digest.hexdigest()[:16]
            print(f"{args.name} → {target} ({size(total)}, sha256 {sha}…)", file=sys.stderr)
    return 0
