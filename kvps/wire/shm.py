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

The other way, a server keeps the values of its big keys in segments of its own (Values), and a
co-located worker maps them read-only (Reader) and copies a pulled value straight out of them:
the server copies nothing into the worker's reply region. Its replies offer each new segment
(descriptor and nonce), the worker maps it with the same checks, and its later requests say how
many it has mapped. No value changes under a reader: the reply carries a number, the worker's
later requests list the numbers of the replies it has copied, and until then the server puts
updates of those values into other memory (server/reads.py).

    arena = Arena("S0", attach)          # worker side; attach(segment) sends ATTACH and waits
    region = arena.region(("w", 0, "push"), nbytes)    # or None: no room / shm refused
    mapped = Mapped(pid)                 # server side, one per worker
    mapped.attach(fd, segment, nonce)    # raises ShmRefused naming what did not fit
    view = mapped.view(segment, offset, nbytes)

    values = Values()                    # server side: where its big values live
    array = values.alloc(("w", 0), dtype, shape)        # or None: small, or the key has its blocks
    segment, offset = values.locate(array)               # or None: not in a segment
    reader = Reader("S0", pid)           # worker side, one per co-located server
    reader.offered(values.offers(reader.claim()))        # maps the new segments read-only
    view = reader.view(segment, offset, nbytes)

A request that names a worker's memory means something only to the server it was sent to. When it
must go to another one (KVPS_REPLICAS: a copy along the chain, or a request sent again to the new
head of its range), inlined() carries its values in the message instead:

    header, payloads = inlined(header, payloads, arena.view, drop=LINK_META)
"""
import logging
import math
import mmap
import os
import threading

import numpy as np

from kvps.errors import KVPSError
from kvps.wire.protocol import Entry, Header, numpy_dtype

log = logging.getLogger("kvps.shm")

NONCE_BYTES = 16
SEGMENT_BYTES = 64 << 20        # a segment's size unless one region needs more
MIN_BYTES = 1 << 16             # smaller entries travel inline: copying them is cheaper than the bookkeeping
PREFIX = "kvps-"                # the memfd's name, which the server checks
MAX_SEGMENTS = 4096             # per worker on one server: bounds what a peer can make a server map
# a request's meta about its sender's shared memory with the server it went to: the regions holding
# its values and those its values go into, the server segments mapped, the replies read out of them
LINK_META = ("shm", "into", "mapped", "done")


_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class ShmRefused(KVPSError):
    """A segment could not be shared (another host, no /proc access, a bad descriptor): use TCP."""


class Region:
    """nbytes at `offset` of segment `segment`, shared with server `owner` (its name); `busy` is the
    handle of the request using it."""
    __slots__ = ("segment", "offset", "nbytes", "view", "owner", "busy")

    def __init__(self, segment, offset, nbytes, view, owner):
        self.segment, self.offset, self.nbytes, self.view, self.owner = segment, offset, nbytes, view, owner
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
    has mapped it, or raise ShmRefused; after a refusal the arena gives no more regions. `pid`: the
    server's process, where the caller needs to tell it from another that takes its name later."""

    def __init__(self, server, attach, segment_bytes=SEGMENT_BYTES, pid=None):
        self.server = server
        self.pid = pid
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

    def view(self, segment, offset, nbytes):
        """nbytes of our segment `segment` at offset (np.uint8, no copy); raises ShmRefused."""
        if not 0 <= segment < len(self._segments):
            raise ShmRefused(f"segment {segment} is not one of the {len(self._segments)} shared with {self.server}")
        found = self._segments[segment]
        _check_range(segment, offset, nbytes, found.size)
        return _view(found, offset, nbytes)

    def _new(self, nbytes):
        try:
            room = _room(self._segments, nbytes, self._segment_bytes)
        except OSError as exc:
            self.refused = f"cannot make a memfd segment: {exc}"
            log.info("shared memory with %s off: %s", self.server, self.refused)
            return None
        if room is None:
            return None
        segment, offset = room
        if offset is None:               # a new segment: the server maps it before any request names it
            try:
                self._attach(segment.id, segment.fd, segment.nonce)
            except ShmRefused as exc:
                segment.close()
                self.refused = str(exc)
                log.info("shared memory with %s off: %s", self.server, self.refused)
                return None
            self._segments.append(segment)
            offset = segment.take(nbytes)
        return Region(segment.id, offset, nbytes, _view(segment, offset, nbytes), self.server)

    def close(self):
        self._regions.clear()
        for segment in self._segments:
            segment.close()
        self._segments = []


def _room(segments, nbytes, segment_bytes):
    """Room for nbytes after `segments` (a process's own, filled in order): (segment, offset) in the
    last one, or (a new Segment numbered after them, None), or None once there are MAX_SEGMENTS.
    Raises OSError when no memfd can be made."""
    for segment in segments[-1:]:
        offset = segment.take(nbytes)
        if offset is not None:
            return segment, offset
    if len(segments) >= MAX_SEGMENTS:
        return None
    return Segment(len(segments), max(segment_bytes, nbytes + 64)), None


def _view(segment, offset, nbytes):
    return np.frombuffer(segment.map, np.uint8, nbytes, offset)


class Mapped:
    """The segments of another process mapped into this one: a worker's, by a server (writable: the
    server writes replies into them), or a server's values, by a worker (read-only)."""

    def __init__(self, pid, writable=True):
        self.pid = pid
        self.writable = writable
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
            raise ShmRefused(f"cannot see descriptor {fd} of pid {self.pid} ({exc.strerror}): another host or "
                             f"pid namespace") from None
        if not target.startswith(f"/memfd:{PREFIX}"):
            raise ShmRefused(f"descriptor {fd} of pid {self.pid} is not a kvps memfd")
        try:
            handle = os.open(path, os.O_RDWR if self.writable else os.O_RDONLY)
        except OSError as exc:
            raise ShmRefused(f"cannot open the segment ({exc.strerror})") from None
        try:
            size = os.fstat(handle).st_size
            if size < 64:
                raise ShmRefused(f"segment {segment} is {size} bytes")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
            area = mmap.mmap(handle, size, flags=_FLAGS, prot=prot)
        except OSError as exc:
            raise ShmRefused(f"cannot map the segment ({exc.strerror})") from None
        finally:
            os.close(handle)
        if area[:NONCE_BYTES] != nonce:
            area.close()
            raise ShmRefused("the segment does not hold its owner's nonce: another host shares its pid")
        self._maps[segment] = np.frombuffer(area, np.uint8)

    def view(self, segment, offset, nbytes):
        """nbytes of a mapped segment at offset, as np.uint8; raises ShmRefused when out of bounds."""
        area = self._maps.get(segment)
        if area is None:
            raise ShmRefused(f"segment {segment} is not attached")
        _check_range(segment, offset, nbytes, area.size)
        return area[offset:offset + nbytes]


def _check_range(segment, offset, nbytes, size):
    """Raises ShmRefused unless nbytes at offset lie in a segment of `size` bytes, past its header."""
    if offset < 64 or nbytes < 0 or offset + nbytes > size:
        raise ShmRefused(f"bytes {offset}..{offset + nbytes} are outside segment {segment} ({size} bytes)")


def inlined(header, payloads, view, drop=LINK_META):
    """(header, payloads) of a request with the values it names in shared memory (meta "shm") carried
    as payload frames instead, and without the meta fields in `drop`. view(segment, offset, nbytes)
    gives the memory (Arena.view, Mapped.view); the frames are views of it, not copies, so it must
    not change until the message is answered (the sender's region stays busy until then). The
    request keeps its op, id and source."""
    meta = {k: v for k, v in header.meta.items() if k not in drop}
    named = {index: (segment, offset) for index, segment, offset in header.meta.get("shm", ())}
    if not named:
        return Header(header.op, header.id, header.src, header.keys, meta), list(payloads)
    keys, out, frames = [], [], iter(payloads)
    for index, e in enumerate(header.keys):
        if index in named:
            nbytes = math.prod(e.shape) * numpy_dtype(e.dtype).itemsize
            out.append(view(*named[index], nbytes))
            e = Entry(e.key, e.part, e.dtype, e.shape, nbytes)
        elif e.nbytes:
            out.append(next(frames))
        keys.append(e)
    return Header(header.op, header.id, header.src, keys, meta), out


BLOCKS = 2      # a key's value and the buffer its next round is summed into (kvps/ps/store.py swaps them)


class Values:
    """A server's segments holding the values of its big keys, which co-located workers map
    read-only and copy pulls out of (server side).

    Each key gets at most `blocks` blocks, handed out once and never moved: in dist_sync the store
    sums a round into one while the other holds the value, then swaps them. A value that must
    change while a reply still reads it moves to another block, and the store reuses the old one
    once nobody reads it (kvps/ps/store.py: _retire, server/reads.py). With every block of a key
    in use the value goes to private memory for a while, and its replies go the copying way."""

    def __init__(self, segment_bytes=SEGMENT_BYTES, blocks=BLOCKS):
        self._segment_bytes = segment_bytes
        self._blocks = blocks
        self._segments = []              # Segment
        self._starts = []                # each segment's address in this process
        self._given = {}                 # owner -> blocks handed out
        self._lock = threading.Lock()    # alloc runs on the merge pool's threads too (kvps/ps/pool.py)
        self.refused = None              # why no segment can be made, once known

    @property
    def count(self):
        return len(self._segments)

    def alloc(self, owner, dtype, shape):
        """A new array of `dtype` and `shape` in a segment, for `owner` (a slot id), or None: too
        small to share, `owner` has its blocks already, or no segment can be made."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * dtype.itemsize
        if nbytes < MIN_BYTES:
            return None
        with self._lock:
            if self.refused is not None or self._given.get(owner, 0) >= self._blocks:
                return None
            place = self._take(nbytes)
            if place is None:
                return None
            self._given[owner] = self._given.get(owner, 0) + 1
        segment, offset = place
        return np.frombuffer(segment.map, dtype, count, offset).reshape(shape)

    def _take(self, nbytes):
        try:
            room = _room(self._segments, nbytes, self._segment_bytes)
        except OSError as exc:
            self.refused = f"cannot make a memfd segment: {exc}"
            log.info("values in private memory from now on: %s", self.refused)
            return None
        if room is not None and room[1] is None:
            segment = room[0]
            self._segments.append(segment)
            self._starts.append(np.frombuffer(segment.map, np.uint8, 1).ctypes.data)
            room = segment, segment.take(nbytes)
        return room

    def locate(self, array):
        """(segment, offset) of a C-contiguous array that lies in one of the segments, else None."""
        if not array.flags.c_contiguous:
            return None
        address = array.ctypes.data
        for segment, start in zip(self._segments, self._starts):
            if start <= address and address + array.nbytes <= start + segment.size:
                return segment.id, address - start
        return None

    def offers(self, start):
        """[[segment, fd, nonce]] of the segments from number `start` on, for a reply to offer."""
        return [[s.id, s.fd, s.nonce] for s in self._segments[start:]]

    def close(self):
        for segment in self._segments:
            segment.close()
        self._segments, self._starts = [], []


class Reader:
    """The value segments of one co-located server that this worker has mapped read-only (worker
    side). claim() is what the worker's requests tell the server: how many segments it may name
    in a reply (None once mapping failed: the server then copies, as to any worker)."""

    def __init__(self, server, pid):
        self.server = server
        self._mapped = Mapped(pid, writable=False)
        self._lock = threading.Lock()    # replies are read on the I/O thread and, pulled ahead, the caller's
        self.count = 0                   # segments 0 .. count - 1 are mapped
        self.refused = None
        self._read = []                  # numbers of replies copied out, not yet told (meta done)

    pid = property(lambda self: self._mapped.pid)     # the server's process

    def claim(self):
        return None if self.refused is not None else self.count

    def copied(self, number):
        """The values of reply `number` (its meta read) are copied out: the server may change them."""
        with self._lock:
            self._read.append(number)

    def done(self):
        """The numbers to tell the server (a request's meta done), once each; [] if none."""
        if not self._read:
            return []
        with self._lock:
            read, self._read = self._read, []
        return read

    def offered(self, offers):
        """Map the segments a reply offers ([[segment, fd, nonce]], numbered on from 0)."""
        with self._lock:
            for segment, fd, nonce in offers:
                if self.refused is not None:
                    return
                if segment < self.count:
                    continue                         # offered again by a reply sent before we said
                if segment != self.count:
                    self.refused = f"{self.server} offered segment {segment} before segment {self.count}"
                else:
                    try:
                        self._mapped.attach(fd, segment, nonce)
                        self.count += 1
                        continue
                    except ShmRefused as exc:
                        self.refused = str(exc)
                log.info("reading %s's values by copy: %s", self.server, self.refused)

    def view(self, segment, offset, nbytes):
        """nbytes of a mapped segment at offset (read-only np.uint8); raises ShmRefused."""
        return self._mapped.view(segment, offset, nbytes)
