"""The job network's helper: a script the agent runs (``python -I -S``) for every job network it
makes, at a job's start or ahead of it (:class:`catacloud.agent.netns.Egress` runs it; that
module's docstring says what a job network is).

It loads the job's nftables rules in the job's namespaces as the job's uid, then becomes the
job's pasta. It imports as little as it can: ``os``, ``sys``, ``_signal``, ``_socket``, ``fcntl``
and ``ctypes`` (no ``ctypes.util``, ``signal``, ``socket``, ``dataclasses`` or ``typing``). When
it was :mod:`catacloud.agent.netns` run as a script, a job network's helper and pasta cost about
61 ms of CPU, most of it imports (``python -X importtime``); as this script, about 32 ms, of which
a Python start (some 12 ms). So the agent keeps one helper running (``serve``): each job network
is a child forked from it, which does what the script does, without a Python start of its own.
The script run once per network is what the agent falls back on when that helper cannot start.
"""

import _signal  # signal's C half: the module ``signal`` imports enum (some 9 ms)
import _socket  # socket's C half, for ``serve`` (the module ``socket`` imports enum too)
import ctypes
import fcntl
import os
import sys

# Every import is here, at the top: after the uid change (the job's uid) the Python install's
# own folder may be closed to this process (a home of 0700), so a late import would fail.

# The user and network namespaces' flags (linux/sched.h), the ioctl that names the user namespace
# owning a namespace (linux/nsfs.h), and prctl's PR_SET_DUMPABLE (linux/prctl.h).
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_NS_GET_USERNS = 0xB701
_PR_SET_DUMPABLE = 4
# The environment variable that names libnftables as the agent found it (netns.libnftables()),
# when its soname does not load: finding it here (ctypes.util) would run ldconfig on every job.
LIBRARY_ENV = "CATACLOUD_LIBNFTABLES"


def _setns(fd: int, kind: int, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, kind) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"cannot join the job's {what} namespace: {os.strerror(errno)}")


def load_rules(net: int, user: int, ruleset: str, lib: ctypes.CDLL) -> None:
    """Join the network namespace ``net`` (through ``user``, the user namespace that owns it)
    and load ``ruleset`` there with ``lib`` (libnftables)."""
    _setns(user, CLONE_NEWUSER, "user")
    _setns(net, CLONE_NEWNET, "network")
    _load(ruleset, lib)


def _load(ruleset: str, lib: ctypes.CDLL) -> None:
    """Load ``ruleset`` into this process's network namespace with ``lib`` (libnftables)."""
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ctx = lib.nft_ctx_new(0)
    if not ctx:
        raise OSError("libnftables: cannot create a context")
    lib.nft_ctx_buffer_error(ctx)
    if lib.nft_run_cmd_from_buffer(ctx, ruleset.encode()) != 0:
        message = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace").strip()
        raise OSError(f"nftables refused the job's rules: {message or 'no message'}")


def _as_job(uid: "int | None", gid: "int | None", ruleset: str) -> "tuple[str, ctypes.CDLL]":
    """The rules and libnftables, then this helper becomes the job's uid."""
    try:  # before the uid change (the library's folder may be private); by its soname: quick
        lib = ctypes.CDLL("libnftables.so.1")
    except OSError:
        lib = ctypes.CDLL(os.environ.get(LIBRARY_ENV) or "libnftables.so")
    if uid is not None:
        os.setgroups([])
        os.setresgid(gid if gid is not None else uid, gid if gid is not None else uid, -1)
        os.setresuid(uid, uid, uid)
    return ruleset, lib


def _report(exc: OSError) -> None:
    print(exc.strerror if exc.strerror and len(exc.args) > 1 else str(exc), file=sys.stderr)
    sys.stderr.flush()


def _attach(
    pid: int, uid: "int | None", gid: "int | None", pid_file: str, pasta: "list[str]", rules: str
) -> int:
    """Rules, then pasta, for the namespaces of the running sandbox ``pid``."""
    ruleset, lib = _as_job(uid, gid, rules)
    net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    # The sandbox's first process may already sit in a nested user namespace (bubblewrap's
    # --disable-userns): the one that owns the network namespace is what pasta and the rules need.
    user = fcntl.ioctl(net, _NS_GET_USERNS)
    child = os.fork()
    if child == 0:  # the rules, from a process that joins the job's namespaces for good
        code = 0
        try:
            load_rules(net, user, ruleset, lib)
        except OSError as exc:
            _report(exc)
            code = 1
        finally:
            os._exit(code)
    if os.waitpid(child, 0)[1] != 0:
        return 1
    return _become_pasta(net, user, pid_file, pasta)


def _prepare(
    uid: "int | None", gid: "int | None", folder: str, keep: int, pasta: "list[str]", rules: str
) -> int:
    """Namespaces for the next job, made now: a child of this helper (as the job's uid) unshares
    new user and network namespaces, maps its own uid and gid into them and nothing else, loads
    the rules there (it holds every capability in them) and waits until ``keep`` closes (the agent
    has opened its namespaces by then); this helper writes the child's pid in
    ``folder``/holder.pid and becomes their pasta."""
    ruleset, lib = _as_job(uid, gid, rules)
    ready, told = os.pipe()
    child = os.fork()
    if child == 0:
        code = 0
        try:
            os.close(ready)
            libc = ctypes.CDLL(None, use_errno=True)
            # The uid change cleared it, which leaves /proc/self/* to root: the maps below are
            # written there, and the agent (and this helper) open this process's namespaces next.
            libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
            me, group = os.geteuid(), os.getegid()  # unmapped (65534) in the new namespace
            if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"cannot make the job's namespaces: {os.strerror(errno)}")
            for name, line in (
                ("setgroups", "deny"),
                ("uid_map", f"{me} {me} 1"),
                ("gid_map", f"{group} {group} 1"),
            ):
                with open(f"/proc/self/{name}", "w") as fh:
                    fh.write(line + "\n")
            _load(ruleset, lib)
            os.write(told, b"1")
            os.close(told)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # the agent waits for the helper's stderr to close
                os.dup2(devnull, fd)
            while os.read(keep, 64):
                pass
        except OSError as exc:
            _report(exc)
            code = 1
        finally:
            os._exit(code)
    os.close(told)
    os.close(keep)
    if os.read(ready, 1) != b"1":
        os.waitpid(child, 0)
        return 1
    os.close(ready)
    with open(os.path.join(folder, "holder.pid"), "w") as fh:
        fh.write(f"{child}\n")
    net = os.open(f"/proc/{child}/ns/net", os.O_RDONLY)
    user = os.open(f"/proc/{child}/ns/user", os.O_RDONLY)
    return _become_pasta(net, user, os.path.join(folder, "pasta.pid"), pasta)


def _become_pasta(net: int, user: int, pid_file: str, pasta: "list[str]") -> int:
    """Exec pasta for the namespaces ``net`` and ``user``: it connects the namespace, writes its
    pid in ``pid_file`` and goes to the background (the helper's exit says ready)."""
    os.set_inheritable(net, True)
    os.set_inheritable(user, True)
    _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)  # Python ignores it; pasta refuses to start so
    os.execv(
        pasta[0],
        [*pasta, "--pid", pid_file, "--userns", f"/proc/self/fd/{user}", "--netns", f"/proc/self/fd/{net}"],
    )
    return 1  # not reached


def _ids(uid: str, gid: str) -> "tuple[int | None, int | None]":
    """The UID GID arguments (``-``: stay the agent's), as netns.id_args writes them."""
    return (int(uid) if uid != "-" else None), (int(gid) if gid != "-" else None)


def main(argv: "list[str]", rules: "str | None" = None) -> int:
    """One job network (``rules``: its nftables rules; read from stdin when not given)."""
    usage = (
        "usage: netns_helper.py attach PID UID|- GID|- PID_FILE PASTA [ARGS...]\n"
        "       netns_helper.py prepare UID|- GID|- FOLDER KEEP_FD PASTA [ARGS...]  (rules on stdin)\n"
        "       netns_helper.py serve SOCKET_FD"
    )
    try:
        if len(argv) >= 6 and argv[0] == "attach" and argv[1].isdigit():
            uid, gid = _ids(argv[2], argv[3])
            ruleset = sys.stdin.read() if rules is None else rules
            return _attach(int(argv[1]), uid, gid, argv[4], list(argv[5:]), ruleset)
        if len(argv) >= 6 and argv[0] == "prepare" and argv[4].isdigit():
            uid, gid = _ids(argv[1], argv[2])
            ruleset = sys.stdin.read() if rules is None else rules
            return _prepare(uid, gid, argv[3], int(argv[4]), list(argv[5:]), ruleset)
        if len(argv) == 2 and argv[0] == "serve" and argv[1].isdigit() and rules is None:
            return serve(int(argv[1]))
    except OSError as exc:
        print(f"cannot set the job's network up: {exc}", file=sys.stderr)
        return 1
    print(usage, file=sys.stderr)
    return 2


# ---- the helper kept running ---------------------------------------------------------------------

# A request: one message on the agent's socket (SOCK_SEQPACKET: one message, one request) holding
# the rules, two NULs, then the arguments (``attach ...`` or ``prepare ...``) separated by NULs; its
# descriptors the request's stderr, then (prepare) KEEP_FD, which its argument names as the agent
# numbered it. Answers: ``pid N`` (the child doing it), then ``exit N`` (its exit status, as the
# script's: pasta's once it became pasta).
_MAX_REQUEST = 1 << 20
_MAX_FDS = 4


def _request(sock: "_socket.socket") -> "tuple[bytes, list[int]]":
    """The next request and its descriptors; ``b""`` once the agent closed its end."""
    size = _socket.CMSG_SPACE(_MAX_FDS * 4)
    data, ancillary, _flags, _address = sock.recvmsg(_MAX_REQUEST, size)
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds += [int.from_bytes(payload[i : i + 4], sys.byteorder) for i in range(0, usable, 4)]
    return data, fds


def serve(fd: int) -> int:
    """Run job networks for the agent at the other end of the socket ``fd``, one at a time, each
    in a child forked from this (single-threaded) process, until the agent closes its end."""
    sock = _socket.socket(fileno=fd)
    while True:
        try:
            data, fds = _request(sock)
        except OSError:
            return 1
        if not data:
            return 0  # the agent closed its end (it stopped, or it died: the kernel closed it)
        rules, _, args = data.partition(b"\0\0")
        argv = [a.decode() for a in args.split(b"\0")]
        child = os.fork()
        if child == 0:
            _child(sock, argv, rules.decode(), fds)
        for received in fds:
            os.close(received)
        try:
            sock.send(b"pid %d" % child)
            status = os.waitpid(child, 0)[1]
            sock.send(b"exit %d" % os.waitstatus_to_exitcode(status))
        except OSError:
            return 1


def _child(sock: "_socket.socket", argv: "list[str]", rules: str, fds: "list[int]") -> None:
    """A request's child: its stderr the request's, nothing of the agent's socket, then what the
    script does with these arguments (the rules given)."""
    code = 1
    try:
        sock.close()
        if not fds:
            os._exit(2)
        os.dup2(fds[0], 2)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        for fd in (devnull, fds[0]):
            os.close(fd)
        if argv[:1] == ["prepare"] and len(argv) > 4:  # KEEP_FD: as this process received it
            if len(fds) < 2:
                os._exit(2)
            argv[4] = str(fds[1])
        code = main(argv, rules)
    except BaseException as exc:  # never back into the serving loop
        print(f"cannot set the job's network up: {exc}", file=sys.stderr)
    finally:
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
