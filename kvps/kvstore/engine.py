"""A thread that runs one kvstore's collectives in call order, so asynchronous calls return at once."""
import collections
import itertools
import threading

from kvps.errors import KVPSError
from kvps.wire.requests import Handle


class Engine:
    """Runs a kvstore's collectives one after another on a thread of its own, so that
    asynchronous calls return at once and every worker runs them in call order."""

    def __init__(self, name, timeout):
        self._jobs = collections.deque()
        self._ready = threading.Condition()
        self._timeout = timeout
        self._ids = itertools.count(1)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"kvps-ring-{name}", daemon=True)
        self._thread.start()

    def submit(self, what, fn):
        # A job's own waits have KVPS_TIMEOUT deadlines and end it with an error naming what they
        # waited for, which handle.wait() raises; the handle's deadline is only a backstop for a
        # wedged job (or one queued behind a slow one), so it must not run out before theirs.
        handle = Handle(what, 2 * self._timeout + 5)
        job_id = next(self._ids)
        handle._expect(job_id, "the ring")
        handle._arm()
        with self._ready:
            if self._stopped:
                raise KVPSError(f"{what}: this kvstore is closed")
            self._jobs.append((job_id, handle, fn))
            self._ready.notify()
        return handle

    def _run(self):
        while True:
            with self._ready:
                while not self._jobs and not self._stopped:
                    self._ready.wait()
                if not self._jobs:
                    return
                job_id, handle, fn = self._jobs.popleft()
            try:
                fn()
                handle._answered(job_id)
            except Exception as exc:     # the caller gets it from handle.wait()
                handle._answered(job_id, exc)

    def stop(self):
        with self._ready:
            self._stopped = True
            self._ready.notify()
        self._thread.join(5)
