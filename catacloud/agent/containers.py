"""A job's own container engine, on machine types that allow containers (``containers: true``).

Such a job gets rootless Podman (Debian's ``podman`` and ``crun``) running as the job's own uid
inside the job's sandbox, its Docker API at ``$DOCKER_HOST`` (also ``/run/docker.sock``), a
``docker`` command that is Podman (``docker compose`` is Debian's ``docker-compose``, which speaks
that API), its images and containers under the job's work folder (so inside the job's disk
bound), and all of it ends with the job (the sandbox's PID namespace; the work folder goes).

What that costs in isolation (SECURITY.md, "Containers in jobs"): the sandbox of such a job
allows user namespaces of its own (``--disable-userns`` is left out; Podman needs one to be
"root" in a container). Nothing else changes: the job's uid is still unprivileged on the machine,
a container's root is that uid outside, and containers use the job's own network namespace
(``netns = "host"`` here is the *job's* namespace: every rule of the job network holds for
them). A network the job makes (``docker network create``, a compose file's, the GitHub
runner's) lives in Podman's rootless network namespace, made inside the job's, whose only way out
is slirp4netns (over the machine's ``/dev/net/tun``, which such a job gets), a process of the
job's in the job's namespace: it leaves through the job's rules too. It needs ``slirp4netns`` and
``iptables`` (netavark's firewall inside that namespace), the job's resolv.conf bound from a
file that exists (catacloud/agent/sandbox.py) and :data:`CNI_DIR`.

Why Podman: it runs without a daemon of root's and without subordinate uid ranges (one uid
mapped: the job's; image files of other owners become the job's, ``ignore_chown_errors``), and
its API service speaks Docker's API (the GitHub runner, GitLab's docker executor, docker-py and
docker-compose call it). Why these settings (measured on Debian 12, Podman 4.3.1, a cgroup v1
hybrid host): crun refuses a hybrid host's cgroup v2 mount (``cgroups in hybrid mode not
supported``), so the sandbox hides ``/sys/fs/cgroup/unified`` and containers get no cgroup of
their own (``cgroups = "disabled"``: they stay in the job's, under the machine's limits).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
from collections.abc import Sequence

from catacloud.agent.netns import resolv_conf
from catacloud.agent.registry_proxy import Login, registries_conf_entries

# Where the engine's run-time files and socket live inside the sandbox: a private tmpfs of the job's.
RUN_DIR = "/run/user/{uid}"
SOCKET_NAME = "docker.sock"
# How long the job waits for its engine's socket before it fails (exit 125, Docker's "the engine
# could not run it"), and how often it looks.
START_TIMEOUT_SECONDS = 30
_POLL_SECONDS = 0.02

# Inside the job's sandbox. Containers share the job's network namespace (its rules hold) unless a
# compose file asks for a network of its own; no cgroup of their own (see the module docstring).
CONTAINERS_CONF = """\
# Written by the Catacloud agent for this job (catacloud/agent/containers.py).
[containers]
netns = "host"
cgroups = "disabled"
log_driver = "k8s-file"

[engine]
runtime = "crun"
cgroup_manager = "cgroupfs"
events_logger = "file"
image_copy_tmp_dir = "storage"

[network]
network_backend = "netavark"
"""
# Images and containers in the job's work folder (inside its disk bound, removed with it). The
# kernel's own rootless overlay; files of other owners in an image become the job's.
STORAGE_CONF = """\
# Written by the Catacloud agent for this job (catacloud/agent/containers.py).
[storage]
driver = "overlay"
rootless_storage_path = "{storage}"

[storage.options.overlay]
ignore_chown_errors = "true"
"""
# Image names as Docker reads them (containers-registries.conf(5)): a short name is Docker Hub's
# (``busybox`` is docker.io/library/busybox; Debian's own file names no registry to search, and
# Podman refused such names), and a registry on the job's loopback is reached over plain HTTP, as
# Docker's daemon allows for 127.0.0.0/8, as are those the machine's operator named (the agent's
# ``--insecure-registry``). A location without a port matches every port of its host (Podman
# 4.3's prefix match; tests/security/test_containers.py pulls from a random port through it).
REGISTRIES_CONF = """\
# Written by the Catacloud agent for this job (catacloud/agent/containers.py).
unqualified-search-registries = ["docker.io"]
"""
REGISTRY = "\n[[registry]]\nlocation = {location}\ninsecure = {insecure}\n"
# A registry the organization holds credentials for: pulled through the agent's mirror on the
# job's loopback, which adds them (catacloud/agent/registry_proxy.py); plain HTTP on loopback.
MIRROR = "\n[[registry.mirror]]\nlocation = {location}\ninsecure = true\n"
LOOPBACK_REGISTRIES = ("localhost", "127.0.0.1")
# Podman's rootless bridge networks bind a folder of theirs over /var/lib/cni, or over its nearest
# existing parent (libpod networking_linux.go, RootlessNetNS.Do): over /var/lib, which would hide
# /var/lib/catacloud (the job's folder, its engine's network settings) from the network's set-up.
CNI_DIR = "/var/lib/cni"
# `docker` is Podman; `docker compose` is docker-compose against the job's engine. `docker rm`
# kills a running container it is forced to remove at once, as Docker's does ("--force: uses
# SIGKILL", docker rm's reference); Podman's first sends the stop signal and waits its stop
# timeout, 10 s for a PID 1 that ignores SIGTERM (the GitHub runner's `docker rm --force` of each
# service and job container paid it).
DOCKER_SHIM = """\
#!/bin/sh
# The job's Docker is its own rootless Podman (catacloud/agent/containers.py).
if [ "$1" = compose ]; then
    shift
    exec docker-compose "$@"
fi
if [ "$1" = rm ] || { [ "$1" = container ] && [ "$2" = rm ]; }; then
    [ "$1" = container ] && shift
    shift
    for a in "$@"; do
        case "$a" in
            --force|--force=true|-[!-]*f*) exec podman rm --time 0 "$@" ;;  # (Podman: --time needs it)
        esac
    done
    exec podman rm "$@"
fi
exec podman "$@"
"""


SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What a machine needs (Debian's packages): the engine, its runtime, compose, and for the networks
# a job makes netavark, aardvark-dns, slirp4netns and iptables.
HOST_TOOLS = ("podman", "crun", "docker-compose", "slirp4netns", "iptables")
HOST_PACKAGES = ("podman", "crun", "docker-compose", "netavark", "aardvark-dns", "slirp4netns", "iptables")


def engine_path() -> str | None:
    """Podman on this machine, or None (the machine cannot give jobs containers)."""
    return shutil.which("podman", path=SYSTEM_PATH)


def run_dir(uid: int) -> str:
    return RUN_DIR.format(uid=uid)


def socket_path(uid: int) -> str:
    return os.path.join(run_dir(uid), SOCKET_NAME)


def prepare(
    work_dir: str,
    uid: int | None,
    env: dict[str, str],
    insecure_registries: Sequence[str] = (),
    mirrors: Sequence[tuple[Login, str]] = (),
) -> dict[str, str]:
    """Make the job's engine ready to start (its files in the job's folder, under
    :func:`own_dir`: the caller gives that folder to the job's uid) and return the job's ``env``
    with what it needs (``uid`` None: the agent's own, in a user namespace)."""
    write_engine_files(work_dir, insecure_registries, mirrors)
    with contextlib.suppress(OSError):  # see CNI_DIR
        os.makedirs(CNI_DIR, mode=0o755, exist_ok=True)
    added = engine_env(uid if uid is not None else os.geteuid(), work_dir)
    return {**env, **added, "PATH": f"{bin_dir(work_dir)}:{env.get('PATH', '')}"}


def engine_env(uid: int, work_dir: str) -> dict[str, str]:
    """What the job's environment gains: where its engine answers, where its run-time files and
    settings are (:func:`prepare` also puts :func:`bin_dir` first in its PATH)."""
    return {
        "DOCKER_HOST": f"unix://{socket_path(uid)}",
        "XDG_RUNTIME_DIR": run_dir(uid),
        "CONTAINERS_CONF": os.path.join(config_dir(work_dir), "containers.conf"),
        "CONTAINERS_STORAGE_CONF": os.path.join(config_dir(work_dir), "storage.conf"),
        "CONTAINERS_REGISTRIES_CONF": os.path.join(config_dir(work_dir), "registries.conf"),
    }


def own_dir(work_dir: str) -> str:
    """What the agent writes for the engine in the job's folder (settings, the ``docker`` command)."""
    return os.path.join(work_dir, ".catacloud")


def resolver_file(work_dir: str) -> str:
    """The job's /etc/resolv.conf, a file in its folder, written with the engine's other files
    (before the folder is the job's): the sandbox binds it (catacloud/agent/sandbox.py), since
    Podman's networks mount over /etc/resolv.conf, which a file bound from a deleted one refuses."""
    return os.path.join(own_dir(work_dir), "resolv.conf")


def config_dir(work_dir: str) -> str:
    return os.path.join(own_dir(work_dir), "containers")


def bin_dir(work_dir: str) -> str:
    return os.path.join(own_dir(work_dir), "bin")


def write_engine_files(
    work_dir: str, insecure_registries: Sequence[str] = (), mirrors: Sequence[tuple[Login, str]] = ()
) -> None:
    """The engine's settings and the ``docker`` command, in the job's work folder (the job's own:
    it may change them for its own engine: the mirrors' grant is all they hold of the agent's)."""
    storage = os.path.join(work_dir, ".local", "share", "containers", "storage")
    registries = REGISTRIES_CONF
    for location, insecure, mirror in registries_conf_entries(
        mirrors, dict.fromkeys([*LOOPBACK_REGISTRIES, *insecure_registries])
    ):  # TOML strings written as JSON ones
        registries += REGISTRY.format(location=json.dumps(location), insecure=str(insecure).lower())
        if mirror is not None:
            registries += MIRROR.format(location=json.dumps(mirror))
    files = {
        os.path.join(config_dir(work_dir), "containers.conf"): (CONTAINERS_CONF, 0o644),
        os.path.join(config_dir(work_dir), "storage.conf"): (STORAGE_CONF.format(storage=storage), 0o644),
        os.path.join(config_dir(work_dir), "registries.conf"): (registries, 0o644),
        resolver_file(work_dir): (resolv_conf().decode(), 0o644),  # the job's, see resolver_file
        os.path.join(bin_dir(work_dir), "docker"): (DOCKER_SHIM, 0o755),
    }
    for path, (text, mode) in files.items():
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
        os.chmod(path, mode)


def start_script(uid: int) -> str:
    """Shell run in the sandbox as the job, before its command: the engine's API service starts
    (a child of the job: it ends with the job's PID namespace) and the command waits for its
    socket; an engine that does not start fails the job with its own words."""
    folder, sock = run_dir(uid), socket_path(uid)
    log = os.path.join(folder, "engine.log")
    tries = int(START_TIMEOUT_SECONDS / _POLL_SECONDS)
    failed = (
        "echo 'catacloud: the job'\"'\"'s container engine did not start:' >&2; "
        f"cat {shlex.quote(log)} >&2; exit 125"
    )
    return (
        f"podman system service --time=0 unix://{shlex.quote(sock)} >{shlex.quote(log)} 2>&1 & "
        f"_cc_e=$! _cc_i=0; while [ ! -S {shlex.quote(sock)} ]; do "
        f'_cc_i=$((_cc_i+1)); if [ $_cc_i -gt {tries} ] || ! kill -0 "$_cc_e" 2>/dev/null; '
        f"then {failed}; fi; "
        f"sleep {_POLL_SECONDS}; done; unset _cc_e _cc_i"
    )


def sandbox_options(uid: int) -> list[str]:
    """What the sandbox of such a job gains (bubblewrap options, after its private ``/run``):
    the engine's run-time folder (a tmpfs of the job's own, still writable once ``/run`` is
    made read-only), ``/run/docker.sock`` leading to the socket, the machine's tun device (a
    compose network's slirp4netns; the job's namespace is where it leads), and a hybrid host's
    cgroup v2 mount hidden (crun refuses to run beside it)."""
    args = ["--perms", "0755", "--dir", "/run/user", "--perms", "0700", "--tmpfs", run_dir(uid)]
    args += ["--symlink", socket_path(uid), "/run/docker.sock"]
    if _usable_tun():
        args += ["--perms", "0755", "--dir", "/dev/net", "--dev-bind", "/dev/net/tun", "/dev/net/tun"]
    if os.path.isdir("/sys/fs/cgroup/unified"):
        args += ["--tmpfs", "/sys/fs/cgroup/unified"]
    return args


def _usable_tun() -> bool:
    """The machine's tun device opens for every uid (Debian's default mode 0666)."""
    try:
        return os.stat("/dev/net/tun").st_mode & 0o006 == 0o006
    except OSError:
        return False
