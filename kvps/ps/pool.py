"""Threads that merge a server's big sync rounds (KVPS_SERVER_THREADS > 1) while its I/O thread
goes on receiving and replying.

    pool = MergePool(2, post=van.call_soon)     # post(fn) runs fn on the I/O thread
    pool.submit(work, finish)                   # work() on a pool thread, then finish(error or None) posted
    pool.drain()                                # on the I/O thread: wait for every job and finish it now

The store (kvps/ps/store.py) hands a job only pure arithmetic on buffers that nothing else touches
while the job runs (the slot is busy: its pulls wait, its next round does not close), and does all
bookkeeping in `finish`, on the I/O thread. The sums and the update rules run in C or numpy, which
release the GIL, so the threads really overlap the I/O thread.
"""
import logging
import queue
import threading

log = logging.getLogger("kvps.server")


class _Job:
    __slots__ = ("work", "finish", "error", "done", "finished")

    def __init__(self, work, finish):
        self.work, self.finish = work, finish
        self.error = None
        self.done = threading.Event()
        self.finished = False            # finish() ran (by drain or by the posted call), on the I/O thread


class MergePool:
    def __init__(self, threads, post, name="server"):
        self._post = post
        self._jobs = queue.SimpleQueue()
        self._running = set()            # jobs submitted and not yet finished (I/O thread only)
        self._threads = [threading.Thread(target=self._serve, name=f"kvps-merge-{name}-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def __len__(self):
        return len(self._running)

    def submit(self, work, finish):
        """Run work() on a pool thread; then finish(the exception it raised, or None) on the I/O thread."""
        job = _Job(work, finish)
        self._running.add(job)
        self._jobs.put(job)

    def drain(self):
        """Wait for every job submitted and run the finish of each not finished yet (I/O thread),
        so that the caller sees every round closed."""
        while self._running:
            job = next(iter(self._running))
            job.done.wait()
            self._finish(job)

    def stop(self):
        for _ in self._threads:
            self._jobs.put(None)

    def _serve(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.work()
            except Exception as exc:        # the finish reports it to the round's workers
                job.error = exc
            job.done.set()
            try:
                self._post(lambda job=job: self._finish(job))
            except Exception:               # the I/O thread has stopped: nobody is left to answer
                log.debug("merge finished after the I/O thread stopped")

    def _finish(self, job):
        if job.finished:
            return
        job.finished = True
        self._running.discard(job)
        job.finish(job.error)
