"""Every environment variable kvps reads, in one registry, parsed once.

    cfg = Config.from_env()          # reads os.environ
    cfg.scheduler                    # ("127.0.0.1", 9091)

MXNet's DMLC_* names are accepted where kvps has an equivalent, so an MXNet
launch script starts a kvps job unchanged; a KVPS_* variable wins over its DMLC_*
twin. docs/config.md lists the same variables (tests/unit/test_units.py keeps it true).
"""
import dataclasses
import os

from kvps.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Var:
    name: str
    default: object
    kind: type
    meaning: str
    alias: tuple = ()          # DMLC_* (or Horovod's) names read when `name` is unset


ROLES = ("scheduler", "server", "worker")

VARIABLES = (
    Var("KVPS_ROLE", "worker", str, "this process's role: scheduler, server or worker", ("DMLC_ROLE",)),
    Var("KVPS_SCHEDULER", None, str, "the scheduler's HOST:PORT (DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT also work)"),
    Var("KVPS_NUM_WORKERS", 1, int, "number of workers in the job", ("DMLC_NUM_WORKER",)),
    Var("KVPS_NUM_SERVERS", 1, int, "number of servers in the job (0: an all-reduce job)", ("DMLC_NUM_SERVER",)),
    Var("KVPS_RANK", -1, int, "rank this node asks the scheduler for (-1: any; the launcher sets it)"),
    Var("KVPS_HOST", None, str, "address this node advertises to its peers (default: the one that reaches the scheduler)", ("DMLC_NODE_HOST",)),
    Var("KVPS_INTERFACE", None, str, "network interface whose IPv4 address kvps launch --launcher ssh gives the "
                                     "scheduler (default: the route to the first host; --host wins)", ("DMLC_INTERFACE",)),
    Var("KVPS_PORT", 0, int, "port a server binds (0: any free port)"),
    Var("KVPS_TIMEOUT", 300.0, float, "seconds any single blocking call may wait before it raises KVTimeoutError"),
    Var("KVPS_CONNECT_TIMEOUT", 120.0, float, "seconds to wait for all nodes to register with the scheduler"),
    Var("KVPS_HEARTBEAT_INTERVAL", 1.0, float, "seconds between heartbeats to the scheduler"),
    Var("KVPS_HEARTBEAT_TIMEOUT", 10.0, float, "seconds of silence after which a node is declared dead"),
    Var("KVPS_STALL_WARNING", 60.0, float, "seconds a sync round may wait for live workers before its server "
                                           "names them and the keys they hold up (Horovod's stall check; 0: never)",
        ("HOROVOD_STALL_CHECK_TIME_SECONDS",)),
    Var("KVPS_BIGARRAY_BOUND", 250_000, int, "arrays with at least this many elements are split over all servers "
                                           "(MXNet's default is 1,000,000; smaller spreads the load evenly)", ("MXNET_KVSTORE_BIGARRAY_BOUND",)),
    Var("KVPS_PARTITION_BYTES", 4 << 20, int, "a split array is cut into parts of at most this size (0: one part "
                                               "per server), dealt round the servers"),
    Var("KVPS_MESSAGE_BYTES", 1 << 20, int, "a call's data to one server goes in messages of about this size, so "
                                           "the server can answer early ones while later ones arrive (16x that to a "
                                           "co-located server through shared memory, whose payloads skip the socket)"),
    Var("KVPS_SEND_CREDIT", 4 << 20, int, "a worker hands the network at most this many bytes of data messages "
                                          "at a time, so a call with a higher priority overtakes bulk already "
                                          "queued (ByteScheduler's credit; 0: send in call order, priority ignored)"),
    Var("KVPS_LANE_BYTES", 1 << 18, int, "a call of at most this many payload bytes (not async_op=True) is sent and "
                                         "answered on the calling thread's own connections, without the hand-offs "
                                         "to the I/O thread (kvps/wire/lane.py); 0: every call goes through the "
                                         "I/O thread"),
    Var("KVPS_COALESCE_US", 1000, int, "small blocking pushes (and small `async_op=True` pushpulls) called one "
                                       "after another wait up to this many microseconds to go as one request, sent "
                                       "by any other call or a wait on their handle (kvps/kvstore/coalesce.py); 0: "
                                       "every call goes at once"),
    Var("KVPS_SHM", 1, int, "1: a worker and a server on one host move big payloads through shared memory, "
                            "and ZeroMQ carries only headers (kvps/wire/shm.py), small calls go on the server's "
                            "Unix socket (kvps/wire/local.py), and ring neighbours on one host share memory "
                            "too (kvps/collective/shared.py); 0: everything over TCP"),
    Var("KVPS_MAX_MESSAGE_BYTES", 2 << 30, int, "the biggest frame a node accepts (ZMQ_MAXMSGSIZE on every socket): "
                                                "zmq drops a peer that sends a bigger one, so garbage of any size "
                                                "costs no memory"),
    Var("KVPS_SERVER_THREADS", 1, int, "threads that merge a server's sync rounds: 1, the I/O thread itself; N > 1, "
                                       "a pool of N that sums (and updates) keys of at least 1 MiB while the I/O "
                                       "thread goes on receiving and replying, each key's rounds in order "
                                       "(kvps/ps/pool.py)"),
    Var("KVPS_PEER_QUEUE", 10000, int, "messages a daemon queues for one peer each way (ZMQ_RCVHWM and ZMQ_SNDHWM "
                                       "of its ROUTER): a peer that sends faster than it is served waits (TCP "
                                       "backpressure), and replies to one that reads none are dropped, logged "
                                       "(0: no bound)"),
    Var("KVPS_PEER_REPLY_BYTES", 4 << 30, int, "bytes of big replies a daemon hands zmq for one peer that the "
                                               "peer has not read yet; past it, replies to that peer are dropped "
                                               "and logged, so a peer that pulls and never reads pins bounded "
                                               "memory (0: no bound)"),
    Var("KVPS_FAULTS", None, str, "test only: inject faults into data messages, e.g. drop:0.01,dup:0.01,delay:5ms "
                                  "(see docs/faults.md; requests are then resent and de-duplicated)"),
    Var("KVPS_FAULTS_SEED", 0, int, "seed of the injected faults (with the node's role and rank)"),
    Var("KVPS_RESEND_TIMEOUT", 0.0, float, "seconds a worker waits for a server's reply before it resends the "
                                           "request, doubling each time (0: never, or 0.5 with KVPS_FAULTS)"),
    Var("KVPS_SCHEDULER_GRACE", 0.0, float, "seconds a node keeps working past KVPS_HEARTBEAT_TIMEOUT without the "
                                            "scheduler, for 'kvps scheduler --recover' to take over (0: the job ends)"),
    Var("KVPS_ELASTIC", 0, int, "1: a dead worker of a parameter-server job is removed instead of ending the "
                                "job, and a replacement may join (kvps launch --elastic)"),
    Var("KVPS_REPLICAS", 0, int, "chain replication: each server's key ranges are also held by the next R servers, "
                                 "so the job survives R server deaths (kvps launch --replicas; docs/replication.md)"),
    Var("KVPS_FUSION_BYTES", 64 << 20, int, "ring all-reduce packs a call's small tensors into buffers of up to "
                                            "this size (Horovod's fusion threshold)", ("HOROVOD_FUSION_THRESHOLD",)),
    Var("KVPS_RING_CHUNK_BYTES", 4 << 20, int, "ring all-reduce sends segments in chunks of this size, so "
                                               "sending and reducing overlap"),
    Var("KVPS_RING_LINK", 1, int, "1: ring neighbours that share no memory (other hosts, or KVPS_SHM=0) send chunks "
                                  "on a TCP connection of their own, read straight into place "
                                  "(kvps/collective/link.py; not under CURVE, not in elastic jobs); 0: through ZeroMQ"),
    Var("KVPS_KERNELS", "auto", str, "compute-kernel backend: auto, c, cuda, numba or numpy"),
    Var("KVPS_STRAGGLER", None, str, "slow this worker down by an extra delay per step: fixed:S, exp:MEAN or "
                                      "uniform:LO:HI seconds (kvps launch --straggler sets it; see kvps/straggler.py)"),
    Var("KVPS_STRAGGLER_SEED", 0, int, "seed of the random straggler delays (with the worker's rank)"),
    Var("KVPS_RESUME", None, str, "a checkpoint directory (kv.save's): every kv.init of a parameter-server "
                                  "kvstore loads its keys, optimizer state and counters from it (kvps launch --resume)"),
    Var("KVPS_CHECKPOINT_DIR", None, str, "worker 0 keeps a checkpoint here, replaced every "
                                          "KVPS_CHECKPOINT_EVERY steps (docs/checkpoint.md)"),
    Var("KVPS_CHECKPOINT_EVERY", 0, int, "steps between periodic checkpoints (a step ends when worker 0 pushes a "
                                         "key again; 0: none); training pauses only for the copy of the state"),
    Var("KVPS_LOG_LEVEL", "WARNING", str, "logging level of kvps's loggers (DEBUG shows every message)"),
    Var("KVPS_METRICS_PORT", None, int, "serve Prometheus metrics on this port (0: any free port, reported on the "
                                        "READY line and to the scheduler's /targets; unset: no metrics)"),
    Var("KVPS_TIMELINE", None, str, "directory where every node writes Chrome trace events "
                                    "(kvps timeline merge DIR -o trace.json)"),
    Var("KVPS_CURVE", "auto", str, "authenticate and encrypt every link with CurveZMQ: 1, 0 (off, on a trusted "
                                   "network), or auto: on unless the job is loopback-only (docs/security.md)"),
    Var("KVPS_SECRET_FILE", None, str, "this node's secret file (JSON, mode 0600): its CURVE secret key and the job's "
                                       "public keys (kvps keys new DIR; kvps launch makes them)"),
    Var("KVPS_SECRET", None, str, "the secret file's JSON text itself, for a Kubernetes Secret given as a variable "
                                  "(KVPS_SECRET_FILE wins)"),
)

_BY_NAME = {v.name: v for v in VARIABLES}


def _parse(var, text, source):
    try:
        value = var.kind(text)
    except ValueError:
        raise ConfigError(f"{source}={text!r} is not a valid {var.kind.__name__} ({var.meaning})") from None
    if var.kind in (int, float) and value < 0 and var.name != "KVPS_RANK":
        raise ConfigError(f"{source}={text!r} must not be negative ({var.meaning})")
    return value


def _lookup(var, environ):
    for name in (var.name,) + var.alias:
        text = environ.get(name)
        if text not in (None, ""):
            return _parse(var, text, name)
    return var.default


def _scheduler(environ):
    text = environ.get("KVPS_SCHEDULER")
    if text:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"KVPS_SCHEDULER={text!r} is not HOST:PORT")
        return host, int(port)
    uri, port = environ.get("DMLC_PS_ROOT_URI"), environ.get("DMLC_PS_ROOT_PORT")
    if uri and port:
        if not port.isdigit():
            raise ConfigError(f"DMLC_PS_ROOT_PORT={port!r} is not a port number")
        return uri, int(port)
    return None


def _default(field):
    return _BY_NAME["KVPS_" + field.upper()].default


@dataclasses.dataclass(frozen=True)
class Config:
    """The parsed variables: field NAME is KVPS_NAME, with VARIABLES' default (written only there)."""
    role: str = _default("role")
    scheduler: tuple = None            # (host, port) or None when not in a job
    num_workers: int = _default("num_workers")
    num_servers: int = _default("num_servers")
    rank: int = _default("rank")
    host: str = _default("host")
    interface: str = _default("interface")
    port: int = _default("port")
    timeout: float = _default("timeout")
    connect_timeout: float = _default("connect_timeout")
    heartbeat_interval: float = _default("heartbeat_interval")
    heartbeat_timeout: float = _default("heartbeat_timeout")
    stall_warning: float = _default("stall_warning")
    bigarray_bound: int = _default("bigarray_bound")
    partition_bytes: int = _default("partition_bytes")
    message_bytes: int = _default("message_bytes")
    send_credit: int = _default("send_credit")
    lane_bytes: int = _default("lane_bytes")
    coalesce_us: int = _default("coalesce_us")
    max_message_bytes: int = _default("max_message_bytes")
    peer_queue: int = _default("peer_queue")
    server_threads: int = _default("server_threads")
    peer_reply_bytes: int = _default("peer_reply_bytes")
    faults: str = _default("faults")
    faults_seed: int = _default("faults_seed")
    resend_timeout: float = _default("resend_timeout")
    elastic: int = _default("elastic")
    replicas: int = _default("replicas")
    scheduler_grace: float = _default("scheduler_grace")
    shm: int = _default("shm")
    fusion_bytes: int = _default("fusion_bytes")
    ring_chunk_bytes: int = _default("ring_chunk_bytes")
    ring_link: int = _default("ring_link")
    kernels: str = _default("kernels")
    straggler: str = _default("straggler")
    straggler_seed: int = _default("straggler_seed")
    resume: str = _default("resume")
    checkpoint_dir: str = _default("checkpoint_dir")
    checkpoint_every: int = _default("checkpoint_every")
    log_level: str = _default("log_level")
    metrics_port: int = _default("metrics_port")
    timeline: str = _default("timeline")
    curve: str = _default("curve")
    secret_file: str = _default("secret_file")
    secret: str = dataclasses.field(default=_default("secret"), repr=False)     # never in a log line

    @classmethod
    def from_env(cls, environ=None):
        """Parse the environment; raises ConfigError naming the bad variable and value."""
        environ = os.environ if environ is None else environ
        values = {}
        for field in dataclasses.fields(cls):
            if field.name == "scheduler":
                values["scheduler"] = _scheduler(environ)
            else:
                values[field.name] = _lookup(_BY_NAME["KVPS_" + field.name.upper()], environ)
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self):
        if self.role not in ROLES:
            raise ConfigError(f"KVPS_ROLE={self.role!r} is not one of {', '.join(ROLES)}")
        if self.num_workers < 1:
            raise ConfigError(f"KVPS_NUM_WORKERS={self.num_workers} must be at least 1")
        if self.num_servers < 0:
            raise ConfigError(f"KVPS_NUM_SERVERS={self.num_servers} must not be negative")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError(f"KVPS_HEARTBEAT_TIMEOUT={self.heartbeat_timeout} must exceed "
                              f"KVPS_HEARTBEAT_INTERVAL={self.heartbeat_interval}")
        if self.straggler:
            from kvps.straggler import parse
            parse(self.straggler)
        if self.max_message_bytes < 1:
            raise ConfigError(f"KVPS_MAX_MESSAGE_BYTES={self.max_message_bytes} must be at least 1")
        if self.server_threads < 1:
            raise ConfigError(f"KVPS_SERVER_THREADS={self.server_threads} must be at least 1")
        if self.peer_queue < 0 or self.peer_reply_bytes < 0:
            raise ConfigError(f"KVPS_PEER_QUEUE={self.peer_queue} and KVPS_PEER_REPLY_BYTES="
                              f"{self.peer_reply_bytes} must not be negative (0: no bound)")
        if self.coalesce_us < 0:
            raise ConfigError(f"KVPS_COALESCE_US={self.coalesce_us} must not be negative (0: no coalescing)")
        if self.shm not in (0, 1):
            raise ConfigError(f"KVPS_SHM={self.shm} must be 0 or 1")
        if self.ring_link not in (0, 1):
            raise ConfigError(f"KVPS_RING_LINK={self.ring_link} must be 0 or 1")
        if self.elastic not in (0, 1):
            raise ConfigError(f"KVPS_ELASTIC={self.elastic} must be 0 or 1")
        if self.replicas < 0:
            raise ConfigError(f"KVPS_REPLICAS={self.replicas} must not be negative")
        if self.curve not in ("auto", "0", "1"):
            raise ConfigError(f"KVPS_CURVE={self.curve!r} must be auto, 0 or 1")
        if self.metrics_port is not None and self.metrics_port > 65535:
            raise ConfigError(f"KVPS_METRICS_PORT={self.metrics_port} is not a port number (0: any free port)")
        if self.bigarray_bound < 1:
            raise ConfigError(f"KVPS_BIGARRAY_BOUND={self.bigarray_bound} must be at least 1")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError(f"KVPS_CHECKPOINT_EVERY={self.checkpoint_every} needs KVPS_CHECKPOINT_DIR (where to write)")

    @property
    def resend_after(self):
        """Seconds before a worker resends an unanswered data request (0: it never does): on when
        faults are injected or KVPS_RESEND_TIMEOUT is set, so a normal job sends nothing extra."""
        return self.resend_timeout or (0.5 if self.faults else 0.0)

    def require_scheduler(self):
        """The scheduler address; raises ConfigError naming the variables to set."""
        if self.scheduler is None:
            raise ConfigError("no scheduler address: set KVPS_SCHEDULER=HOST:PORT "
                              "(or DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT), or start the job with 'kvps launch'")
        return self.scheduler

    def replace(self, **changes):
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg


def for_role(role, **changes):
    """The config a daemon runs with: the environment, then the non-None `changes` (its flags);
    also sets the process's log format, which names the role."""
    import logging
    import sys
    cfg = Config.from_env().replace(role=role, **{k: v for k, v in changes.items() if v is not None})
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s kvps-{role} %(levelname)s %(message)s")
    return cfg
