"""The ``catacloud agent``, ``catacloud job-meta`` and ``catacloud checkpoint`` commands: their
options, logging, the bootstrap token's way in, and the agent's run until it is told to stop."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
import threading
from typing import Any

from catacloud.agent import __version__
from catacloud.agent.client import (
    AgentClient,
    RedactingFormatter,
    register_secret,
)
from catacloud.agent.files import (
    checkpoint_command,
)
from catacloud.agent.imds import KINDS
from catacloud.agent.jobrun import REASON_AGENT_STOPPED
from catacloud.agent.main import Agent
from catacloud.agent.meta import job_meta_command
from catacloud.agent.sandbox import (
    DEFAULT_JOB_UIDS,
    UidRange,
    can_switch_to,
    make_undumpable,
)
from catacloud.agent.signals import handle_signals

log = logging.getLogger("catacloud.agent")

BOOTSTRAP_ENV = "CATACLOUD_BOOTSTRAP_TOKEN"
ENROLMENT_ENV = "CATACLOUD_ENROLMENT_TOKEN"


# -- commands -----------------------------------------------------------------------------------


def registry_host(text: str) -> str:
    """``--insecure-registry``: ``HOST[:PORT]``, lowercased, as skopeo and each containers job's
    registries.conf take it (a scheme or a path there broke every Podman command of such jobs)."""
    value = text.strip().lower()
    if not re.fullmatch(r"(\[[0-9a-f:]+\]|[a-z0-9]([a-z0-9.-]*[a-z0-9])?)(:[0-9]{1,5})?", value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST[:PORT], e.g. mirror.internal:5000")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be a number of at least 0")
    return value


def _move_env_token_to_a_file(args: argparse.Namespace) -> None:
    """A bootstrap token given in the environment stays readable in ``/proc/<pid>/environ``
    for the process's whole life, whatever ``os.environ`` says later. Write it to a 0600 file
    (removed once enrolled) and re-execute the agent without it; the pid stays the same."""
    token = os.environ.get(BOOTSTRAP_ENV, "").strip()
    if not token or args.bootstrap_token or args.bootstrap_token_file:
        return
    folder = tempfile.mkdtemp(prefix="catacloud-bootstrap-")  # 0700
    path = os.path.join(folder, "token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    env = {key: value for key, value in os.environ.items() if key != BOOTSTRAP_ENV}
    argv = [sys.executable, "-m", "catacloud.agent", *sys.argv[1:], "--bootstrap-token-file", path]
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execve(sys.executable, argv, env)


def _read_bootstrap_token(args: argparse.Namespace) -> str | None:
    if args.bootstrap_token:
        return str(args.bootstrap_token).strip()
    if args.bootstrap_token_file:
        with open(args.bootstrap_token_file, encoding="utf-8") as handle:
            return handle.read().strip()
    return os.environ.get(BOOTSTRAP_ENV, "").strip() or None


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s catacloud-agent: %(message)s"))
    for name in ("catacloud.agent", "urllib3"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
    logging.getLogger("catacloud.agent").setLevel(level)
    logging.getLogger("urllib3").setLevel(logging.WARNING)


def cmd_agent(args: argparse.Namespace) -> int:
    """``catacloud agent``: run this machine's agent until terminated."""
    _setup_logging(args.log_level)
    _move_env_token_to_a_file(args)
    saved = bool(args.state_file and os.path.exists(args.state_file))
    try:
        token = _read_bootstrap_token(args)
    except FileNotFoundError:
        token = None  # removed after enrolling; a restart resumes from the state file
        if not saved:
            log.error("the bootstrap token file %s does not exist", args.bootstrap_token_file)
            return 2
    except OSError as exc:
        log.error("cannot read the bootstrap token file: %s", exc)
        return 2
    os.environ.pop(BOOTSTRAP_ENV, None)  # jobs must never see it
    job_uids: UidRange | None = None
    if os.geteuid() == 0:
        try:
            job_uids = UidRange.parse(args.job_uids) if args.job_uids else DEFAULT_JOB_UIDS
        except ValueError as exc:
            log.error("--job-uids: %s", exc)
            return 2
        if not can_switch_to(job_uids):
            log.info(
                "job uids %s are not mapped here; jobs run as this agent's uid in a user namespace", job_uids
            )
            job_uids = None
    elif args.job_uids:
        log.error("--job-uids: only an agent running as root can run jobs as other uids")
        return 2
    if job_uids is not None:
        log.info("jobs run as uids %s, a new one for each job (never root)", job_uids)
    else:
        log.info("jobs run as this agent's uid, each in a user namespace of its own (never root)")
        make_undumpable()  # a job of the same uid may not read this process's memory or environ
    if not token and not saved:
        log.error("no bootstrap token: pass --bootstrap-token-file PATH or set %s", BOOTSTRAP_ENV)
        return 2
    if token:
        register_secret(token)
    agent = Agent(
        AgentClient(args.url, user_agent=f"catacloud-agent/{__version__}"),
        bootstrap_token=token or "",  # none: resumed from the saved enrollment
        work_dir=args.work_dir,
        heartbeat_interval=args.heartbeat_interval,
        imds_url=args.imds_url,
        imds_kind=args.imds_kind,
        state_file=args.state_file,
        job_uids=job_uids,
        bootstrap_token_file=args.bootstrap_token_file,
        limits_file=args.limits_file,
        sandbox=not args.no_sandbox,
        shared_dirs=tuple(args.shared_dir or ()),
        network=args.network != "none",
        network_ahead=not args.no_network_ahead,
        disk_reserve_bytes=int(args.disk_reserve_gb * 10**9),
        disk_limit_bytes=int(args.disk_gb * 10**9) if args.disk_gb else None,
        unreachable_limit=args.exit_when_unreachable,
        image_dir=args.image_dir,
        insecure_registries=tuple(args.insecure_registry or ()),
    )

    def on_signal(signum: int) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        agent.request_stop(REASON_AGENT_STOPPED, 130 if signum == signal.SIGINT else 0)

    if threading.current_thread() is threading.main_thread():
        handle_signals((signal.SIGTERM, signal.SIGINT), on_signal)  # request_stop takes a lock
    return agent.run()


def cmd_host(args: argparse.Namespace) -> int:
    """``catacloud host``: enroll this host (or resume) and run the slots it is given."""
    from catacloud.agent.host import HostAgent, Offer

    _setup_logging(args.log_level)
    token = ""
    if args.enrolment_token_file:
        try:
            with open(args.enrolment_token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except FileNotFoundError:
            token = ""  # removed after enrolling; a restart resumes from the state file
    token = token or os.environ.pop(ENROLMENT_ENV, "").strip()
    if token:
        register_secret(token)
    config: dict[str, Any] = {
        "disk_reserve_gb": args.disk_reserve_gb,
        "mounts": args.mount or [],
        # A slot's agent keeps trying while the control plane is away (an upgrade must not end a
        # host's running jobs); the host stops a slot the control plane no longer has.
        "unreachable_limit_seconds": 0,
    }
    host = HostAgent(
        AgentClient(args.url, user_agent=f"catacloud-host/{__version__}"),
        url=args.url,
        enrolment_token=token,
        state_file=args.state_file,
        slots_dir=args.slots_dir,
        offer=Offer(cpus=args.cpus, memory_mb=args.memory_mb, disk_gb=args.disk_gb, gpus=args.gpus),
        provider_config=config,
    )

    def on_signal(signum: int) -> None:
        log.info("received %s; stopping (the slots keep running)", signal.Signals(signum).name)
        host.request_stop()

    if threading.current_thread() is threading.main_thread():
        handle_signals((signal.SIGTERM, signal.SIGINT), on_signal)  # request_stop takes a lock
    code = host.run()
    if code == 0 and args.enrolment_token_file:  # used: it is no longer anywhere on this host
        with contextlib.suppress(OSError):
            os.unlink(args.enrolment_token_file)
    return code


def _mount(text: str) -> dict[str, Any]:
    """``SOURCE:TARGET[:rw]`` as the local provider's mount (both absolute paths)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("rw", "ro")):
        raise argparse.ArgumentTypeError("SOURCE:TARGET, or SOURCE:TARGET:rw")
    if not (os.path.isabs(parts[0]) and os.path.isabs(parts[1])):
        raise argparse.ArgumentTypeError("SOURCE and TARGET must be absolute paths")
    return {"source": parts[0], "target": parts[1], "writable": len(parts) == 3 and parts[2] == "rw"}


def _host_options(host: argparse.ArgumentParser) -> None:
    """The options of ``catacloud host``."""
    host.add_argument("--url", required=True, help="control plane base URL, e.g. https://catacloud.example")
    host.add_argument(
        "--enrolment-token-file",
        metavar="PATH",
        help=f"file holding the enrolment token (or ${ENROLMENT_ENV}); removed once enrolled",
    )
    host.add_argument(
        "--state-file",
        default="/var/lib/catacloud/host.json",
        metavar="PATH",
        help="this host's credential (0600), so a restart resumes (default %(default)s)",
    )
    host.add_argument(
        "--slots-dir",
        default="/var/lib/catacloud/slots",
        metavar="DIR",
        help="where the slots live: their folders, disks and logs (default %(default)s)",
    )
    for name, what in (
        ("cpus", "CPUs"),
        ("memory-mb", "MB of memory"),
        ("disk-gb", "GB of disk"),
        ("gpus", "GPUs"),
    ):
        host.add_argument(
            f"--{name}", type=int, metavar="N", help=f"offer at most N {what} (default: all it has)"
        )
    host.add_argument(
        "--mount",
        action="append",
        type=_mount,
        metavar="SOURCE:TARGET[:rw]",
        help="a folder of this host shown in every slot at TARGET, read-only unless :rw (a runner's "
        "install, a data set); repeatable",
    )
    host.add_argument(
        "--disk-reserve-gb",
        type=_non_negative_float,
        default=2.0,
        metavar="GB",
        help="free disk the host keeps for itself: no slot starts below it (default 2)",
    )
    host.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )


def cmd_job_meta(args: argparse.Namespace) -> int:
    """``catacloud job-meta NAME``: metadata of a resource of the running job."""
    return job_meta_command(args.name)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """``catacloud checkpoint``: save the running job's checkpoint directory now."""
    return checkpoint_command(timeout=args.timeout)


def _agent_options(agent: argparse.ArgumentParser) -> None:
    """The options of ``catacloud agent``."""
    agent.add_argument("--url", required=True, help="control plane base URL, e.g. https://catacloud.example")
    source = agent.add_mutually_exclusive_group()
    source.add_argument(
        "--bootstrap-token",
        help="single-use enrollment token (visible in the process list: "
        f"prefer --bootstrap-token-file or ${BOOTSTRAP_ENV})",
    )
    source.add_argument("--bootstrap-token-file", metavar="PATH", help="file holding the bootstrap token")
    agent.add_argument("--work-dir", metavar="DIR", help="parent of the jobs' working directories")
    agent.add_argument(
        "--job-uids",
        metavar="START+COUNT",
        default=os.environ.get("CATACLOUD_JOB_UIDS") or None,
        help="when the agent runs as root: the uids its jobs run as, a new one for each job "
        f"(default {DEFAULT_JOB_UIDS}; env CATACLOUD_JOB_UIDS)",
    )
    agent.add_argument(
        "--no-sandbox",
        action="store_true",
        help="run jobs without a bubblewrap sandbox (still as their own uid, never root)",
    )
    agent.add_argument(
        "--network",
        choices=["internet", "none"],
        default="internet",
        help="what a sandboxed job's network reaches: the internet through pasta (default; "
        "loopback, private, link-local ranges and this host refused unless the machine type "
        "allows them), or nothing but its own loopback",
    )
    agent.add_argument(
        "--no-network-ahead",
        action="store_true",
        help="make each job's network at its start (about 0.1 s) instead of ahead, while the job "
        "before it runs or the machine idles (the default: the job waits for nothing)",
    )
    agent.add_argument(
        "--disk-reserve-gb",
        type=_non_negative_float,
        default=1.0,
        metavar="GB",
        help="end a job (disk_limit_exceeded) once the free space of the disk it writes to drops "
        "below this (default 1)",
    )
    agent.add_argument(
        "--disk-gb",
        type=_positive_float,
        metavar="GB",
        help="the machine type's disk_gb: as root, jobs write to a file system of this size of their "
        "own, loop-mounted on --work-dir (the kernel refuses more); else the watchdog ends a job over it",
    )
    agent.add_argument(
        "--shared-dir",
        action="append",
        metavar="DIR",
        help="a folder jobs may write besides their own work folder (repeatable; everything else "
        "of the machine is read-only to them)",
    )
    agent.add_argument(
        "--image-dir",
        metavar="DIR",
        help="the machine's image store (images jobs run in, pulled once; default: 'images' beside "
        "--work-dir, else a temporary folder)",
    )
    agent.add_argument(
        "--insecure-registry",
        action="append",
        type=registry_host,
        metavar="HOST[:PORT]",
        help="a registry reached over plain HTTP (repeatable; one on this machine's loopback always is)",
    )
    _agent_state_options(agent)


def _agent_state_options(agent: argparse.ArgumentParser) -> None:
    """Where the agent keeps its state and learns its limits, and how it talks and logs."""
    agent.add_argument(
        "--limits-file",
        metavar="PATH",
        help="JSON the machine's host wrote: the resource limits it enforces on this machine "
        "(reported at enrollment)",
    )
    agent.add_argument(
        "--state-file",
        metavar="PATH",
        help="keep this machine's enrollment here (mode 0600) so a restarted agent resumes "
        "instead of enrolling again with the single-use bootstrap token",
    )
    agent.add_argument(
        "--heartbeat-interval",
        type=_positive_float,
        metavar="SECONDS",
        help="override the heartbeat interval the control plane sets",
    )
    agent.add_argument(
        "--exit-when-unreachable",
        type=_positive_float,
        metavar="SECONDS",
        help="stop (exit status 3) once no call has reached the control plane for this long "
        "(default: keep trying; local machines get 600 s, their provider's unreachable_limit_seconds)",
    )
    agent.add_argument(
        "--imds-url",
        metavar="URL",
        help="watch for spot interruptions at this metadata service (on AWS and Azure: http://169.254.169.254)",
    )
    agent.add_argument(
        "--imds-kind",
        choices=KINDS,
        default="ec2",
        help="what the metadata service is: EC2's (spot/instance-action) or Azure's (Scheduled Events)",
    )
    agent.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
    )


def add_agent_commands(subparsers: Any) -> None:
    """Register ``agent``, ``job-meta`` and ``checkpoint`` on an ``add_subparsers()`` object."""
    agent = subparsers.add_parser(
        "agent",
        help="run the machine agent (enroll, heartbeat, run jobs)",
        description="Run the Catacloud agent on this machine until the control plane terminates it.",
    )
    _agent_options(agent)
    agent.set_defaults(func=cmd_agent)

    host = subparsers.add_parser(
        "host",
        help="run an enrolled host: a machine you own that runs Catacloud jobs in slots",
        description="Enroll this host with an enrolment token (once), then run the slots the control "
        "plane gives it, each a sandboxed machine of its own, until stopped.",
    )
    _host_options(host)
    host.set_defaults(func=cmd_host)

    meta = subparsers.add_parser(
        "job-meta",
        help="inside a job: print the metadata of one of its resources as JSON",
        description="Print the JSON metadata of the running job's resource NAME (exit 1 on error).",
    )
    meta.add_argument("name", metavar="NAME", help="the resource's name in the job configuration")
    meta.set_defaults(func=cmd_job_meta)

    checkpoint = subparsers.add_parser(
        "checkpoint",
        help="inside a job: save $CATACLOUD_CHECKPOINT_DIR to the control plane now",
        description="Upload the running job's checkpoint directory; returns once it is stored "
        "(exit 0), or prints why not (exit 1).",
    )
    checkpoint.add_argument(
        "--timeout",
        type=_positive_float,
        default=3600.0,
        metavar="SECONDS",
        help="give up waiting for the agent after this long (default 3600)",
    )
    checkpoint.set_defaults(func=cmd_checkpoint)
