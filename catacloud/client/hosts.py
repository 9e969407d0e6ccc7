"""``catacloud hosts …`` (``/hosts/``, ``/enrolment-tokens/``): the machines an organization owns
and enrolled (bare metal, long-lived VMs) beside the bought ones. Everyone lists and reads them
(the organization's own and the operator's shared ones it may use); admins cordon, drain,
uncordon, revoke and change their own, and make the enrolment tokens hosts join with (shown
once). Shared hosts are the operator's: the console manages them."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from catacloud.client.api import Api, ApiError
from catacloud.client.base import MIN_PREFIX, Commands, UsageError, show_list, status_filter
from catacloud.client.output import age, fields, print_json, short

HOSTS = "hosts/"
TOKENS = "enrolment-tokens/"
HOST_STATUSES = ("active", "lost", "revoked")
_DURATION = re.compile(r"(?P<n>\d+)(?P<unit>[smhd]?)")
_UNIT = {"": "seconds", "s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_duration(value: str, what: str = "a duration") -> int:
    """Seconds from ``90``, ``90s``, ``10m``, ``24h`` or ``7d``."""
    found = _DURATION.fullmatch(value.strip())
    if found is None:
        raise ValueError(f"{what} takes seconds or 90s, 10m, 24h, 7d; got {value!r}")
    return int(timedelta(**{_UNIT[found["unit"]]: int(found["n"])}).total_seconds())


def parse_labels(pairs: Sequence[str], flag: str = "--label") -> dict[str, str]:
    """``k=v`` pairs as labels (a value may be empty: ``k=``)."""
    labels: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} takes KEY=VALUE (e.g. gpu=a4000), got {pair!r}")
        labels[key] = value
    return labels


def register(at: Commands) -> None:
    hosts = at.group(
        "hosts",
        "machines your organization owns and enrolled (cordon, drain, revoke) and their enrolment tokens",
    )
    p = at.command(hosts, "ls", cmd_hosts_ls, "list enrolled hosts: capacity, what runs, cordon, last seen")
    status_filter(p, HOST_STATUSES, " (default: active and lost)")
    p.add_argument("--all", "-a", action="store_true", help="revoked hosts too")
    p = at.command(hosts, "show", cmd_hosts_show, "one host: capacity and use, labels, cordon, agent")
    p.add_argument("host", metavar="HOST", help="its name or id (or the id's first digits)")
    p = at.command(
        hosts,
        "cordon",
        cmd_hosts_cordon,
        "no new job on a host; with --drain, requeue its jobs after a deadline (admin)",
        description="Cordon a host (admin): no new job is placed on it, its idle slots end and its "
        "running jobs finish. With --drain, the jobs still running when the deadline passes are "
        "requeued elsewhere. uncordon takes it back.",
    )
    p.add_argument("host", metavar="HOST", help="its name or id")
    p.add_argument(
        "--drain", metavar="SECONDS", help="requeue its jobs still running after this (90, 10m, 2h; 0: now)"
    )
    p = at.command(hosts, "uncordon", cmd_hosts_uncordon, "take a cordoned or drained host back (admin)")
    p.add_argument("host", metavar="HOST", help="its name or id")
    p = at.command(
        hosts,
        "revoke",
        cmd_hosts_revoke,
        "refuse a host's agent for good and requeue its jobs (admin)",
        description="Revoke a host (admin): its credential is refused from now on and its jobs are "
        "requeued elsewhere. To use the machine again, enroll it with a new token.",
    )
    p.add_argument("host", metavar="HOST", help="its name or id")
    p = at.command(hosts, "update", cmd_hosts_update, "change a host's monthly price or labels (admin)")
    p.add_argument("host", metavar="HOST", help="its name or id")
    p.add_argument(
        "--monthly-price", metavar="AMOUNT", help="what it costs a month, for cost reports ('' clears)"
    )
    p.add_argument("--label", action="append", default=[], metavar="K=V", help="set a label (repeatable)")
    p.add_argument("--unset-label", action="append", default=[], metavar="KEY", help="remove a label")
    _tokens(at, hosts)


def _tokens(at: Commands, hosts: Any) -> None:
    tokens = at.group("tokens", "enrolment tokens hosts join with (shown once)", parent=hosts)
    p = at.command(
        tokens,
        "create",
        cmd_tokens_create,
        "make an enrolment token for your organization's hosts (admin; printed once)",
        description="Make an enrolment token (admin): a host started with it (catacloud host, "
        "CATACLOUD_ENROLMENT_TOKEN) joins your organization with these labels and runs only its "
        "jobs. The token is printed once, alone on stdout; only its hash is stored.",
    )
    p.add_argument("--account", metavar="NAME", help="the provider account of enrolled hosts (if several)")
    p.add_argument(
        "--label", action="append", default=[], metavar="K=V", help="a label its hosts get (repeatable)"
    )
    p.add_argument(
        "--uses", type=int, default=1, metavar="N", help="how many hosts may enroll with it (default 1)"
    )
    p.add_argument(
        "--ttl", default="24h", metavar="DURATION", help="it expires after this (default 24h; 30m, 7d)"
    )
    p.add_argument("--description", default="", help="what it is for")
    p = at.command(tokens, "ls", cmd_tokens_ls, "list enrolment tokens: prefix, labels, uses, expiry")
    p.add_argument("--all", "-a", action="store_true", help="revoked, expired and used-up ones too")
    p = at.command(tokens, "revoke", cmd_tokens_revoke, "no host enrolls with a token any more (admin)")
    p.add_argument("token", metavar="TOKEN", help="its prefix (ce_…), id or the id's first digits")


# ---- hosts --------------------------------------------------------------------------------------

HOST_COLUMNS = ("NAME", "ID", "STATUS", "ORG", "CPUS", "MEMORY", "SLOTS", "SCHEDULING", "LABELS", "SEEN")


def _gib(mb: int) -> str:
    return f"{mb / 1024:.0f}" if mb >= 10240 or mb % 1024 == 0 else f"{mb / 1024:.1f}"


def _scheduling(h: dict) -> str:
    if h["status"] == "revoked":
        return "-"
    if h["draining"]:
        return f"draining (until {h['drain_deadline'][:19].replace('T', ' ')})"
    return "cordoned" if h["cordoned"] else "schedulable"


def _labels(labels: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _host_cells(h: dict) -> list[Any]:
    cap, used = h["capacity"], h["used"]
    return [
        h["name"],
        short(h["id"]),
        h["status"],
        h["org"] or "shared",
        f"{used['cpus']}/{cap['cpus']}",
        f"{_gib(used['memory_mb'])}/{_gib(cap['memory_mb'])} GiB",
        used["slots"],
        _scheduling(h),
        _labels(h["labels"]),
        age(h["last_seen_at"]),
    ]


def cmd_hosts_ls(api: Api, args: argparse.Namespace) -> int:
    params: dict[str, Any] = {}
    if args.status or not args.all:
        params["status"] = args.status or ["active", "lost"]
    rows = api.pages(HOSTS, limit=1000, **params)
    empty = "no enrolled hosts (make a token: catacloud hosts tokens create)"
    return show_list(args, rows, HOST_COLUMNS, _host_cells, empty=empty)


def find_host(api: Api, ref: str) -> dict:
    """The host ``ref`` names: its name (one host of that name), its id, or the id's first digits."""
    ref = ref.strip()
    named = api.get(HOSTS, name=ref, limit=10)["results"]
    if len(named) > 1:
        ids = ", ".join(short(h["id"]) for h in named)
        raise UsageError(f"several hosts are named {ref} ({ids}): give its id")
    if named:
        return dict(named[0])
    digits = ref.replace("-", "").lower()
    if len(digits) >= MIN_PREFIX and re.fullmatch(r"[0-9a-f]+", digits):
        found = api.get(HOSTS, id_prefix=digits[:32], limit=10)["results"]
        if len(found) == 1:
            return dict(found[0])
        if found:
            raise UsageError(f"{ref} is the start of several host ids: give more of it")
    raise ApiError(404, "not_found", f"no host named {ref!r} or with an id starting {ref}")


def cmd_hosts_show(api: Api, args: argparse.Namespace) -> int:
    h = find_host(api, args.host)
    if args.json:
        print_json(h)
        return 0
    cap, used = h["capacity"], h["used"]
    gpus = f", {used['gpus']}/{cap['gpus']} gpus" if cap["gpus"] else ""
    disk = f", {used['disk_gb']}/{cap['disk_gb']} GB disk" if cap["disk_gb"] else ""
    seen = h["last_seen_at"] and f"{age(h['last_seen_at'])} ago (agent {h['agent_version'] or '?'})"
    memory = f"{_gib(used['memory_mb'])}/{_gib(cap['memory_mb'])} GiB"
    fields(
        [
            ("host", f"{h['name']} {h['id']}"),
            ("status", h["status"]),
            ("org", h["org"] or "shared (the operator's: managed in the console)"),
            ("account", h["provider_account"]),
            ("arch", cap["arch"]),
            ("used", f"{used['cpus']}/{cap['cpus']} cpus, {memory}{disk}{gpus}"),
            ("slots", used["slots"]),
            ("schedule", _scheduling(h)),
            ("labels", _labels(h["labels"])),
            ("price", h["monthly_price"] and f"{h['monthly_price']} a month"),
            ("seen", seen),
            ("enrolled", h["enrolled_at"] and f"{age(h['enrolled_at'])} ago"),
        ]
    )
    return 0


def _done(args: argparse.Namespace, h: dict, what: str) -> int:
    if args.json:
        print_json(h)
    else:
        print(f"host {h['name']} {short(h['id'])} {what}")
    return 0


def cmd_hosts_cordon(api: Api, args: argparse.Namespace) -> int:
    host = find_host(api, args.host)
    body: dict[str, Any] = {}
    if args.drain is not None:
        try:
            body["drain_seconds"] = parse_duration(args.drain, "--drain")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    h = api.post(f"{HOSTS}{host['id']}/cordon/", body)
    if h["draining"]:
        when = h["drain_deadline"][:19].replace("T", " ")
        return _done(args, h, f"draining: no new job; jobs still running at {when} UTC are requeued")
    return _done(args, h, "cordoned: no new job; running jobs finish (uncordon takes it back)")


def cmd_hosts_uncordon(api: Api, args: argparse.Namespace) -> int:
    h = api.post(f"{HOSTS}{find_host(api, args.host)['id']}/uncordon/")
    return _done(args, h, "uncordoned: jobs may run there again")


def cmd_hosts_revoke(api: Api, args: argparse.Namespace) -> int:
    h = api.post(f"{HOSTS}{find_host(api, args.host)['id']}/revoke/")
    return _done(args, h, "revoked: its agent is refused and its jobs are requeued")


def cmd_hosts_update(api: Api, args: argparse.Namespace) -> int:
    host = find_host(api, args.host)
    body: dict[str, Any] = {}
    if args.monthly_price is not None:
        body["monthly_price"] = args.monthly_price.strip() or None
    if args.label or args.unset_label:
        try:
            given = parse_labels(args.label)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        merged = {**host["labels"], **given}
        body["labels"] = {k: v for k, v in merged.items() if k not in args.unset_label}
    if not body:
        raise UsageError("nothing to change: give --monthly-price, --label or --unset-label")
    h = api.patch(f"{HOSTS}{host['id']}/", body)
    return _done(args, h, f"updated: {', '.join(sorted(body))}")


# ---- enrolment tokens ---------------------------------------------------------------------------

TOKEN_COLUMNS = ("PREFIX", "ID", "STATE", "USES", "EXPIRES", "ACCOUNT", "LABELS", "DESCRIPTION")


def _token_cells(t: dict) -> list[Any]:
    return [
        f"{t['prefix']}…",
        short(t["id"]),
        t["state"],
        f"{t['uses']}/{t['max_uses']}",
        t["expires_at"][:16].replace("T", " "),
        t["provider_account"],
        _labels(t["labels"]),
        t["description"],
    ]


def cmd_tokens_create(api: Api, args: argparse.Namespace) -> int:
    try:
        body: dict[str, Any] = {
            "labels": parse_labels(args.label),
            "max_uses": args.uses,
            "ttl_seconds": parse_duration(args.ttl, "--ttl"),
            "description": args.description,
        }
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.account:
        body["provider_account"] = args.account
    t = api.post(TOKENS, body)
    if args.json:
        print_json(t)
        return 0
    print(t["token"])
    uses = "1 host" if t["max_uses"] == 1 else f"{t['max_uses']} hosts"
    print(
        f"enrolment token {t['prefix']}… ({short(t['id'])}) for {uses} until "
        f"{t['expires_at'][:16].replace('T', ' ')} UTC: shown this once; on the host, give it to "
        "catacloud host as CATACLOUD_ENROLMENT_TOKEN",
        file=sys.stderr,
    )
    return 0


def cmd_tokens_ls(api: Api, args: argparse.Namespace) -> int:
    rows = api.pages(TOKENS, limit=1000)
    if not args.all:
        rows = [t for t in rows if t["state"] == "active"]
    empty = "no active enrolment tokens (--all: every one)" if not args.all else "no enrolment tokens"
    return show_list(args, rows, TOKEN_COLUMNS, _token_cells, empty=empty)


def find_token(api: Api, ref: str) -> dict:
    ref = ref.strip().rstrip("…")
    if ref.startswith("ce_"):
        found = api.get(TOKENS, prefix=ref[:10], limit=10)["results"]
        if found:
            return dict(found[0])
        raise ApiError(404, "not_found", f"no enrolment token {ref}…")
    digits = ref.replace("-", "").lower()
    if len(digits) < MIN_PREFIX or not re.fullmatch(r"[0-9a-f]+", digits):
        raise UsageError(
            f"{ref!r} names no token: give its prefix (ce_…), its id or its first {MIN_PREFIX} digits"
        )
    found = api.get(TOKENS, id_prefix=digits[:32], limit=10)["results"]
    if len(found) > 1:
        raise UsageError(f"{ref} is the start of several token ids: give more of it")
    if not found:
        raise ApiError(404, "not_found", f"no enrolment token with an id starting {ref}")
    return dict(found[0])


def cmd_tokens_revoke(api: Api, args: argparse.Namespace) -> int:
    t = api.post(f"{TOKENS}{find_token(api, args.token)['id']}/revoke/")
    if args.json:
        print_json(t)
    else:
        print(f"enrolment token {t['prefix']}… revoked: no host enrolls with it (enrolled hosts stay)")
    return 0
