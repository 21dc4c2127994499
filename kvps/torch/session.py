"""The process's kvps.torch session: the modes, the one kvstore every kvps.torch call in this process
shares (Session), init() to choose it and join() to leave the job."""
import collections
import logging
import weakref

import kvps
from kvps.config import Config

log = logging.getLogger("kvps.torch")

MODES = {"sync": "dist_sync", "async": "dist_async", "allreduce": "allreduce", "geo": "dist_geo"}
# kvstore types whose pushpull returns the sum of the workers' pushes (when no optimizer is set),
# and those that apply each push as it comes (local, one worker, is both).
SUMMING = {"dist_sync", "dist", "dist_sync_device", "allreduce", "local", "device"}
ASYNC = {"dist_async", "local", "device"}


class Session:
    """The kvstore that this process's kvps.torch calls share, and the counters that name keys.

    A process is one worker of one job and registers with the scheduler once, so it has one
    kvstore (Horovod's hvd.init()); the first call that needs one creates it, or adopts the one
    a caller passes. Keys are named by call order, so every worker must make the same calls."""

    def __init__(self):
        self.kv = None
        self.mode = None                               # the mode self.kv was made for, if made here
        self._counts = weakref.WeakKeyDictionary()     # kvstore -> Counter of key prefixes handed out

    def kvstore(self, mode=None, kvstore=None, k_steps=None):
        if kvstore is not None:
            if self.kv is None:
                self.kv = kvstore
            return kvstore
        if self.kv is None:
            if mode is None and not in_job():
                # Horovod's hvd.init() in a script run without horovodrun: one worker, itself
                log.info("kvps.torch: not in a kvps job (no scheduler address): this process is the only "
                         "worker (size 1), as under Horovod without horovodrun")
                self.kv = kvps.create("local")
                return self.kv
            self.mode = mode or default_mode()
            if self.mode == "geo" and k_steps is None:
                raise ValueError("mode='geo' needs k_steps=K (the local steps between two syncs)")
            self.kv = kvps.create(_type(self.mode), **({"k_steps": k_steps} if self.mode == "geo" else {}))
        elif mode is not None and self.mode is not None and mode != self.mode:
            raise ValueError(f"mode={mode!r} needs a {_type(mode)} kvstore, but this process's kvps.torch "
                             f"kvstore is {self.kv.type} (made for mode={self.mode!r} by an earlier call); call "
                             f"kvps.torch.init(mode={mode!r}) before anything else, or pass kvstore=")
        return self.kv

    def prefix(self, kv, kind):
        """A key prefix for one call, the same on every worker that makes the same calls in order."""
        counts = self._counts.setdefault(kv, collections.Counter())
        counts[kind] += 1
        return f"kvps.torch/{kind}{counts[kind]}/"

    def mode_of(self, kv):
        """The mode a kvstore runs: the one it was made for, or the one its type implies."""
        if kv is self.kv and self.mode is not None:
            return self.mode
        if getattr(kv, "mode", None) == "geo":
            return "geo"
        return {"dist_async": "async", "allreduce": "allreduce"}.get(kv.type, "sync")


_SESSION = Session()   # the one piece of process state: see Session


def _telemetry(kv):
    """The telemetry of kv's node where it writes a timeline (KVPS_TIMELINE), else None: the
    distributed kvstores have a node (kvps.wire.membership), the local one none."""
    telemetry = getattr(getattr(kv, "_node", None), "telemetry", None)
    return telemetry if telemetry is not None and telemetry.timeline is not None else None


def in_job():
    """Whether this process was started as a worker of a job (kvps launch, or KVPS_SCHEDULER /
    DMLC_PS_ROOT_URI set by hand)."""
    return Config.from_env().scheduler is not None


def default_mode():
    """sync in a job with servers; allreduce in one without (kvps launch -s 0), as Horovod runs."""
    return "allreduce" if Config.from_env().num_servers == 0 else "sync"


def _type(mode):
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    return MODES[mode]


def init(mode=None, kvstore=None, k_steps=None):
    """The kvstore kvps.torch uses in this process: `kvstore` if given (adopted), else one created
    with kvps.create for `mode` (sync: dist_sync, async: dist_async, allreduce: allreduce, geo:
    dist_geo with k_steps=K; None: sync, or allreduce in a job without servers, so Horovod's
    hvd.init() runs either way, and outside a job, a local kvstore: the process is the only
    worker, as a Horovod script run without horovodrun is). Call it first when the first
    kvps.torch call is not the one that sets the mode."""
    return _SESSION.kvstore(mode, kvstore, k_steps)


def join(kvstore=None):
    """Say this worker has no more data, wait until every worker has said so (Horovod's join), and
    return the rank of the last worker to join: the one that trained longest, so
    broadcast_parameters(model.state_dict(), root_rank=join()) leaves every worker its weights.

    In sync mode a joined worker counts as pushing zeros, so the others' rounds close without it
    and their averages still divide by all workers. Every worker calls join() when its data runs
    out. Raises KVPSError where the kvstore cannot join."""
    kv = _SESSION.kvstore(kvstore=kvstore)
    try:
        return kv.join()
    except NotImplementedError as exc:
        raise kvps.KVPSError(str(exc)) from None
