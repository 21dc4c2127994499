"""Shared memory between a worker and a server on the same host (BytePS's IPC, for kvps).

A worker and a server that share a host move big payloads through memory that both map, and
ZeroMQ carries only the headers. The worker owns every segment: it makes them with
memfd_create, so they have no name in /dev/shm and vanish when the last process that maps them
exits, however it exits (kill -9 included). The server maps a segment by opening the worker's
descriptor through /proc/<pid>/fd/<fd> (an ATTACH request), and only after checking that the
descriptor is a kvps memfd of that worker's registered pid holding the nonce the worker wrote
at its start: a process that is not that worker cannot make the server map anything else, and
a worker on another host (or in another pid namespace, or across an emulated link) never
passes the check, so it stays on TCP.

Within its segments the worker keeps one region per (key, part) and direction:
  - a push region holds the push's values; the server sums straight out of it, and the worker
    writes it again only once that push is answered (in dist_sync after the round closed);
  - a reply region is where the server copies a pulled value; the worker copies it into the
    caller's `out` and reuses the region only once that reply has arrived.
A region still in use sends its entry over TCP instead, so nothing ever waits for a region.

    arena = Arena("S0", attach)          # worker side; attach(segment) sends ATTACH and waits
    region = arena.region(("w", 0, "push"), nbytes)    # or None: no room / shm refused
    mapped = Mapped(pid)                 # server side, one per worker
    mapped.attach(fd, segment, nonce)    # raises ShmRefused naming what did not fit
    view = mapped.view(segment, offset, nbytes)
"""
import logging
import mmap
import os

import numpy as np

from kvps.errors import KVPSError

log = logging.getLogger("kvps.shm")

NONCE_BYTES = 16
SEGMENT_BYTES = 64 << 20        # a segment's size unless one region needs more
MIN_BYTES = 1 << 16             # smaller entries travel inline: copying them is cheaper than the bookkeeping
PREFIX = "kvps-"                # the memfd's name, which the server checks
MAX_SEGMENTS = 4096             # per worker on one server: bounds what a peer can make a server map


_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class ShmRefused(KVPSError):
    """A segment could not be shared (another host, no /proc access, a bad descriptor): use TCP."""


class Region:
    """nbytes at `offset` of segment `segment`; `busy` is the handle of the request using it."""
    __slots__ = ("segment", "offset", "nbytes", "view", "busy")

    def __init__(self, segment, offset, nbytes, view):
        self.segment, self.offset, self.nbytes, self.view = segment, offset, nbytes, view
        self.busy = None

    def free(self):
        return self.busy is None or self.busy.done()

    def array(self, dtype, count):
        """The region's first `count` items of `dtype`, as a flat array."""
        return self.view[:count * np.dtype(dtype).itemsize].view(dtype)


class Segment:
    def __init__(self, segment_id, nbytes):
        self.id = segment_id
        self.size = nbytes
        self.fd = os.memfd_create(f"{PREFIX}{os.getpid()}-{segment_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            # Populated now, by the worker: a page first touched later costs a fault and zeroing
            # on whichever thread touches it, the server's I/O thread included.
            self.map = mmap.mmap(self.fd, nbytes, flags=_FLAGS)
        except OSError:
            os.close(self.fd)
            raise
        self.nonce = os.urandom(NONCE_BYTES)
        self.map[:NONCE_BYTES] = self.nonce
        self.used = 64                   # regions start past the nonce, 64-byte aligned

    def take(self, nbytes):
        offset = self.used
        if offset + nbytes > self.size:
            return None
        self.used = (offset + nbytes + 63) & ~63
        return offset

    def close(self):
        try:
            self.map.close()
        except BufferError:
            pass                         # a view still holds it; the memory goes when that does
        os.close(self.fd)


class Arena:
    """One worker's segments shared with one server, and their regions (worker side).

    attach(segment_id, fd, nonce) is called for each new segment and must return once the server
    has mapped it, or raise ShmRefused; after a refusal the arena gives no more regions."""

    def __init__(self, server, attach, segment_bytes=SEGMENT_BYTES):
        self.server = server
        self._attach = attach
        self._segment_bytes = segment_bytes
        self._segments = []
        self._regions = {}               # (key, part, direction) -> Region
        self.refused = None              # why the server cannot share memory with us, once known

    def region(self, slot, nbytes):
        """The region for `slot` ((key, part, "push" or "reply")) of `nbytes`, or None: the arena is
        refused or the region is in use (then the entry goes over TCP)."""
        region = self._regions.get(slot)
        if region is not None and region.nbytes == nbytes:
            return region if region.free() else None
        if self.refused is not None:
            return None
        region = self._new(nbytes)
        if region is not None:
            self._regions[slot] = region
        return region

    def existing(self, slot):
        """The region of `slot`, busy or not (None if there is none)."""
        return self._regions.get(slot)

    def _new(self, nbytes):
        for segment in self._segments[-1:]:
            offset = segment.take(nbytes)
            if offset is not None:
                return Region(segment.id, offset, nbytes, _view(segment, offset, nbytes))
        if len(self._segments) >= MAX_SEGMENTS:
            return None
        try:
            segment = Segment(len(self._segments), max(self._segment_bytes, nbytes + 64))
        except OSError as exc:
            self.refused = f"cannot make a memfd segment: {exc}"
            log.info("shared memory with %s off: %s", self.server, self.refused)
            return None
        try:
            self._attach(segment.id, segment.fd, segment.nonce)
        except ShmRefused as exc:
            segment.close()
            self.refused = str(exc)
            log.info("shared memory with %s off: %s", self.server, self.refused)
            return None
        self._segments.append(segment)
        offset = segment.take(nbytes)
        return Region(segment.id, offset, nbytes, _view(segment, offset, nbytes))

    def close(self):
        self._regions.clear()
        for segment in self._segments:
            segment.close()
        self._segments = []


def _view(segment, offset, nbytes):
    return np.frombuffer(segment.map, np.uint8, nbytes, offset)


class Mapped:
    """The segments of one worker that a server has mapped (server side)."""

    def __init__(self, pid):
        self.pid = pid
        self._maps = {}                  # segment id -> np.uint8 view of the whole segment

    def attach(self, fd, segment, nonce):
        """Map the worker's segment `segment` from its descriptor `fd`. Raises ShmRefused."""
        if len(self._maps) >= MAX_SEGMENTS:
            raise ShmRefused(f"a worker shares at most {MAX_SEGMENTS} segments")
        if segment in self._maps:
            raise ShmRefused(f"segment {segment} is already attached")
        path = f"/proc/{self.pid}/fd/{fd}"
        try:
            target = os.readlink(path)
        except OSError as exc:
            raise ShmRefused(f"cannot see the worker's descriptor ({exc.strerror}): another host or "
                             f"pid namespace") from None
        if not target.startswith(f"/memfd:{PREFIX}"):
            raise ShmRefused(f"descriptor {fd} of pid {self.pid} is not a kvps memfd")
        try:
            handle = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ShmRefused(f"cannot open the worker's segment ({exc.strerror})") from None
        try:
            size = os.fstat(handle).st_size
            if size < 64:
                raise ShmRefused(f"segment {segment} is {size} bytes")
            area = mmap.mmap(handle, size, flags=_FLAGS)
        except OSError as exc:
            raise ShmRefused(f"cannot map the worker's segment ({exc.strerror})") from None
        finally:
            os.close(handle)
        if area[:NONCE_BYTES] != nonce:
            area.close()
            raise ShmRefused("the segment does not hold the worker's nonce: another host shares its pid")
        self._maps[segment] = np.frombuffer(area, np.uint8)

    def view(self, segment, offset, nbytes):
        """nbytes of a mapped segment at offset, as np.uint8; raises ShmRefused when out of bounds."""
        area = self._maps.get(segment)
        if area is None:
            raise ShmRefused(f"segment {segment} is not attached")
        if offset < 64 or nbytes < 0 or offset + nbytes > area.size:
            raise ShmRefused(f"bytes {offset}..{offset + nbytes} are outside segment {segment} "
                             f"({area.size} bytes)")
        return area[offset:offset + nbytes]
