"""A cap on the connections a node's ROUTER accepts, below its file-descriptor limit.

libzmq accepts every TCP connection to a bound ROUTER. At the process's fd limit accept() fails
with EMFILE and libzmq retries at once, for good: the I/O thread of zmq spins at 100% CPU and every
later peer, the job's own included, hangs in connect. So each ROUTER's socket monitor reports the
connections accepted and closed, and past the cap a new one is shut down at once (its peer sees
the connection closed; libzmq then closes its fd), logged with the peer's address, rate-limited:

    gate = Connections(complaints=van.complaints, node=lambda: van.name)
    gate.event(zmq.EVENT_ACCEPTED, fd)      # from the monitor: refused past the cap
    gate.event(zmq.EVENT_DISCONNECTED, fd)

The cap is what the soft RLIMIT_NOFILE leaves when the ROUTER is bound (the descriptors then open
counted in /proc/self/fd) less RESERVE for the node's own later sockets and files; a connection is
refused too whenever fewer than RESERVE / 2 descriptors are left. Daemons raise their soft limit
to the hard one first (raise_fd_limit()). A job needs one connection per peer, so the cap only
bites on a flood.
"""
import errno
import logging
import os
import resource
import socket

import zmq

log = logging.getLogger("kvps.wire")

RESERVE = 32            # fds kept for the node's own DEALERs, zmq's mailboxes, checkpoint files
MONITORED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED


def raise_fd_limit(most=1 << 20):
    """Raise this process's soft fd limit to its hard limit (at most `most`); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else most, most)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def fds_left():
    """How many more descriptors this process may open (None where /proc/self/fd cannot tell)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError as exc:
        return 0 if exc.errno in (errno.EMFILE, errno.ENFILE) else None     # none left to even look
    return (1 << 30 if soft == resource.RLIM_INFINITY else soft) - used


class Connections:
    """Counts a ROUTER's accepted connections and shuts down those past the cap (see the module docstring)."""

    def __init__(self, complaints, node, left=fds_left):
        self._left = left
        now = left()
        self.cap = None if now is None else max(1, now - RESERVE)
        self.open = set()           # fds of the accepted connections still open
        self.refused = 0
        self._complaints = complaints
        self._node = node

    def event(self, kind, fd):
        if kind == zmq.EVENT_ACCEPTED:
            left = self._left() if self.cap is not None else None
            if self.cap is not None and (len(self.open) >= self.cap or left < RESERVE // 2):
                self._refuse(fd)
            else:
                self.open.add(fd)
        elif kind == zmq.EVENT_DISCONNECTED:
            self.open.discard(fd)
        elif kind == zmq.EVENT_ACCEPT_FAILED:
            self._complaints(log, logging.ERROR, "%s: cannot accept a connection (%s) with %d open: the process "
                             "is out of file descriptors (raise `ulimit -n`)", self._node(), os.strerror(fd),
                             len(self.open))

    def _refuse(self, fd):
        self.refused += 1
        host = None
        try:
            s = socket.socket(fileno=fd)        # no dup: at the fd limit there is none to spare
        except OSError:
            return
        try:
            host = s.getpeername()[0]
            s.shutdown(socket.SHUT_RDWR)        # libzmq sees the end and closes its fd
        except OSError:
            pass
        finally:
            s.detach()                          # the fd stays libzmq's
        self._complaints(log, logging.WARNING, "%s: refused a connection from %s: %d connections are open, the "
                         "cap below the fd limit is %d (%d refused so far)", self._node(), host or "an unknown address",
                         len(self.open), self.cap, self.refused)
