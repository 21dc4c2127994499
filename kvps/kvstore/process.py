"""A process's place in a job: one kvstore per process, how it leaves the job (its farewell on
close(), when it is collected, or at interpreter exit; never from a child the script forked), and
the jobs it has left, which it cannot join again.

    process.claim(kv)                       # before its node starts: refuse a second member
    kv._finalizer = process.join(kv, node, leave, send)   # once it has joined: leave() runs once
    process.exit_reason()                   # "its script failed: ..." at exit after an exception
"""
import atexit
import gc
import logging
import os
import socket
import sys
import time
import weakref

from kvps.errors import KVPSError
from kvps.wire.throttle import escape

log = logging.getLogger("kvps")

LIVE = weakref.WeakSet()        # kvstores of this process that are members of a job
_LEFT = {}                      # the jobs this process has left (scheduler address) -> (rank, kvstore type)
_EXIT = {"watched": False, "exiting": False}
MAX_REASON = 300                # characters of an exception's text that go to the other nodes


def claim(kv):
    """Refuse `kv` (not started yet) if this process is already a member of a job, or has left the
    job kv.cfg names and that job has ended."""
    if any(not other._closed for other in list(LIVE)):
        gc.collect()            # a kvstore that a returned function dropped, in a cycle, leaves now
    job = _job(kv.cfg)
    if job is not None and job in _LEFT and _ended(kv.cfg.scheduler):
        rank, kind = _LEFT[job]
        raise KVPSError(
            f"this process was worker W{rank} of the job at {job} and left it when its {kind!r} kvstore "
            f"was closed (or dropped), and that job has ended (nothing listens there now): a job ends once "
            f"every worker has left it. Create one kvstore for the whole script (at module level, or "
            f"once in main() and passed on) and keep it for every phase of training")
    for other in list(LIVE):
        if not other._closed:
            raise KVPSError(
                f"this process is already worker W{other.rank} of the job through its {other.type!r} "
                f"kvstore; a process is one worker of one job, so create one kvstore per process and "
                f"use it for every call (its pushpull sums over workers like an all-reduce), instead "
                f"of creating {kv.type!r}")


def join(kv, node, leave, send=None):
    """`kv` is now the process's member of the job: the weakref.finalize that runs its farewell."""
    LIVE.add(kv)
    job, rank, kind = _job(kv.cfg), node.rank, kv.type

    def leave_for_good(reason=None):
        _LEFT[job] = (rank, kind)
        leave(reason)
    finalizer = weakref.finalize(kv, _farewell, kv._returned, kv._pending, lambda: node.failure is None,
                                 leave_for_good, kind, send, os.getpid())
    _watch_exit()
    return finalizer


def _forked():
    """In a child the script forked, every kvstore is its parent's: closed here, so a call says so."""
    for kv in list(LIVE):
        kv._closed = True


os.register_at_fork(after_in_child=_forked)


def _ended(address, wait=2.0):
    """Whether nothing accepts TCP connections at (host, port) now or within `wait` seconds: the
    scheduler of a job that every worker has left exits at once, but it may still be closing."""
    deadline = time.monotonic() + wait
    while True:
        try:
            socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic())).close()
        except OSError:
            return True
        if time.monotonic() >= deadline:
            return False        # a job runs there: the old one still, or a new one
        time.sleep(0.05)


def _job(cfg):
    """A job's name: its scheduler's address."""
    address = getattr(cfg, "scheduler", None)
    return None if address is None else f"{address[0]}:{address[1]}"


def _watch_exit():
    """Note when the interpreter starts to exit. Registered after the first kvstore's
    weakref.finalize (which registers its own exit hook first), so it runs before the farewells:
    atexit runs its hooks last registered first."""
    if not _EXIT["watched"]:
        _EXIT["watched"] = True
        atexit.register(_EXIT.__setitem__, "exiting", True)


def exit_reason():
    """Why this process leaves its job, when it is because its script raised: "its script failed:
    RuntimeError: ..." (the exception Python just printed, sys.last_value), else None. Only at
    interpreter exit: an interactive session keeps sys.last_value after any error."""
    exc = getattr(sys, "last_value", None)
    if not _EXIT["exiting"] or exc is None:
        return None
    return "its script failed: " + escape(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
                                          MAX_REASON)


def _farewell(returned, pending, healthy, leave, kind, send=None, pid=None):
    """A kvstore's last act (weakref.finalize): finish its calls, report any error, leave the job.
    Not in a child that the script forked (os.fork, then sys.exit): the kvstore is its parent's,
    whose job it would leave, through connections and threads the child does not have."""
    if pid is not None and os.getpid() != pid:
        return
    try:
        if healthy():
            if send is not None:
                try:
                    send()
                except Exception as exc:
                    log.error("%s kvstore: sending its last pushes failed: %s", kind, exc)
            for queue in (returned, pending):
                while queue:
                    handle = queue.popleft()
                    try:
                        handle.wait()
                    except Exception as exc:     # nobody is left to raise it to: say it loudly
                        log.error("%s kvstore: %s failed: %s", kind, handle.what, exc)
    finally:
        leave(exit_reason())
