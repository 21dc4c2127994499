"""A job's CurveZMQ keys: made once per job, handed to each node in a secret file, loaded by name.

    paths = make_job_keys(None, ["H", "S0", "W0", "W1"])    # {name: path}: one 0600 file per node
    keys = for_node(cfg, "worker", rank=1, hosts=["10.0.0.1"])  # Keys (or None: this job runs without CURVE)
    keys.name, keys.public, keys.secret, keys.peers["S0"]

Every node of a job has one key pair, used both as the CURVE server key of the ROUTER it binds
(scheduler, servers, and workers, which bind one for the ring) and as the CURVE client key of its
DEALERs. A node's name is bound to its key: the ZAP handler (kvps/wire/auth.py) names each
connection by the client key it proved, so a worker holding W1's key cannot speak as W0.

A secret file is JSON, written with mode 0600 and refused when group or others can read it:

    {"kvps": "curve-keys/1", "job": "<hex id>",
     "public": {"H": "<z85>", "S0": "<z85>", ...},    # every node of the job
     "secret": {"W1": "<z85>"}}                      # the secret key(s) this file is for

A node finds it through KVPS_SECRET_FILE, or gets the same JSON text in KVPS_SECRET (a Kubernetes
Secret exposed as a variable); never on a command line. `kvps keys new DIR -n W -s S` writes one
file per node for daemons started by hand.

CURVE is on (the KVPS_CURVE policy, `curve_required`) when KVPS_CURVE=1, or when KVPS_CURVE=auto
(the default) and the job is not loopback-only or the node was given keys; KVPS_CURVE=0 turns it
off (a trusted network, at the user's risk).
"""
import atexit
import dataclasses
import ipaddress
import json
import os
import secrets as _random
import shutil
import stat
import tempfile

import zmq
from zmq.utils import z85

from kvps.errors import ConfigError

FORMAT = "curve-keys/1"
_PREFIX = {"scheduler": "H", "server": "S", "worker": "W"}
_KEY_CHARS = 40                 # a Z85-encoded 32-byte key


@dataclasses.dataclass(frozen=True)
class Keys:
    """One node's view of its job's keys (Z85 text as bytes, as pyzmq's socket options take them)."""
    name: str
    public: bytes
    secret: bytes
    peers: dict                 # name -> public key, every node of the job (this one included)
    job: str = ""

    def peer(self, name):
        """The public key of node `name`; raises ConfigError when the job's keys have none for it."""
        try:
            return self.peers[name]
        except KeyError:
            raise ConfigError(f"the job's keys ({self.job or 'job ?'}) have no public key for node {name!r}; "
                              f"they were made for {', '.join(sorted(self.peers))}") from None


def job_names(num_workers, num_servers):
    """The node names of a job: H, S0..S{S-1}, W0..W{W-1}."""
    return ["H", *(f"S{i}" for i in range(num_servers)), *(f"W{i}" for i in range(num_workers))]


def make_job_keys(directory, names):
    """Make a key pair for each node name and write one secret file per node, DIRECTORY/NAME.json
    (mode 0600), holding that node's secret key and every node's public key. Returns {name: path}.

    With directory None the files go to a fresh private temporary directory (mode 0700) that is
    removed when this process exits (what a launcher wants: its children have read them by then).
    Raises ConfigError when a file exists already (keys are never overwritten) or cannot be written."""
    names = list(dict.fromkeys(names))
    bad = [n for n in names if not (isinstance(n, str) and n.isascii() and n.isalnum())]
    if bad or not names:
        raise ConfigError(f"node names must be non-empty ASCII letters and digits (H, S0, W1); got {bad or names!r}")
    if directory is None:
        directory = tempfile.mkdtemp(prefix="kvps-keys-")
        atexit.register(shutil.rmtree, directory, True)
    else:
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot make the key directory {directory}: {exc.strerror}") from None
    taken = [n for n in names if os.path.exists(os.path.join(directory, f"{n}.json"))]
    if taken:               # checked first: a refused call writes nothing, so no half-made job is left
        raise ConfigError(f"{directory} holds keys already ({', '.join(f'{n}.json' for n in taken)}); kvps never "
                          f"overwrites keys (remove them, or choose another directory)")
    pairs = {name: zmq.curve_keypair() for name in names}
    public = {name: pub.decode() for name, (pub, _) in pairs.items()}
    job = _random.token_hex(8)
    paths = {}
    for name, (_, secret) in pairs.items():
        path = os.path.join(directory, f"{name}.json")
        write_secret_file(path, {"kvps": FORMAT, "job": job, "public": public, "secret": {name: secret.decode()}})
        paths[name] = path
    return paths


def write_secret_file(path, content):
    """Write `content` (a secret file's JSON object) to a new file of mode 0600; ConfigError if it exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} exists already; kvps never overwrites keys (remove it, or choose another "
                          f"directory)") from None
    except OSError as exc:
        raise ConfigError(f"cannot write the secret file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        json.dump(content, f, indent=1)
        f.write("\n")


def read_secret_file(path):
    """The JSON object of a secret file; ConfigError when it is missing, readable by group or
    others (as ssh refuses an open private key), or not a kvps key file."""
    try:
        info = os.stat(path)
        with open(path) as f:
            text = f.read(1 << 20)
    except OSError as exc:
        raise ConfigError(f"KVPS_SECRET_FILE={path!r}: {exc.strerror}") from None
    if info.st_mode & 0o077:
        raise ConfigError(f"KVPS_SECRET_FILE={path!r} has mode {stat.filemode(info.st_mode)}: group and others "
                          f"must not read a secret key (chmod 600 it; in Kubernetes, defaultMode: 0400)")
    return parse_secret(text, f"KVPS_SECRET_FILE={path!r}")


def parse_secret(text, source="KVPS_SECRET"):
    """Check a secret file's JSON text; returns its object. Raises ConfigError naming `source`."""
    try:
        content = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{source} is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(content, dict) or content.get("kvps") != FORMAT:
        raise ConfigError(f"{source} is not a kvps key file (its \"kvps\" field must be {FORMAT!r}; "
                          f"make one with `kvps keys new DIR`)")
    for field in ("public", "secret"):
        table = content.get(field)
        if not isinstance(table, dict) or not table or not all(
                isinstance(k, str) and isinstance(v, str) and len(v) == _KEY_CHARS for k, v in table.items()):
            raise ConfigError(f"{source}: \"{field}\" must map node names to {_KEY_CHARS}-character Z85 keys")
        for name, key in table.items():
            try:
                z85.decode(key)
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{source}: the {field} key of {name!r} is not Z85 text") from None
    return content


def curve_required(cfg, hosts, given):
    """Whether this node runs CURVE: KVPS_CURVE=1; or auto, with keys `given` or any of `hosts`
    (the addresses it binds or dials) not loopback; never with KVPS_CURVE=0."""
    if cfg.curve == "0":
        return False
    return cfg.curve == "1" or given or not all(is_loopback(h) for h in hosts if h)


def is_loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False        # a host name (or 0.0.0.0): reachable from elsewhere, as far as we know


def for_node(cfg, role, rank, hosts):
    """This node's Keys, or None when its job runs without CURVE (see curve_required).

    The name is "H" for the scheduler, else the role's letter and `rank`; with rank -1 (a daemon
    started by hand) the file's one secret key of that role names the node. Raises ConfigError
    when CURVE is required and no keys are given, or the keys do not fit this node."""
    content, source = _secret(cfg)
    if not curve_required(cfg, hosts, content is not None):
        return None
    if content is None:
        where = ", ".join(h for h in hosts if h and not is_loopback(h))
        why = f"its links reach beyond this machine ({where})" if where else "KVPS_CURVE=1"
        raise ConfigError(f"this {role}'s job is authenticated and encrypted (CURVE) because {why}, but it has "
                          f"no keys: set KVPS_SECRET_FILE to its secret file (make the job's keys with "
                          f"`kvps keys new DIR -n W -s S`; kvps launch makes them itself), or set KVPS_CURVE=0 "
                          f"to run unauthenticated on a trusted network")
    held = content["secret"]
    prefix = _PREFIX[role]
    if role == "scheduler":
        name = "H"
    elif rank is not None and rank >= 0:
        name = f"{prefix}{rank}"
    else:
        mine = [n for n in held if n[:1] == prefix and n[1:].isdigit()]
        if len(mine) != 1:
            raise ConfigError(f"{source} holds secret keys for {', '.join(sorted(held))}: set KVPS_RANK to say "
                              f"which {role} this is")
        name = mine[0]
    if name not in held:
        raise ConfigError(f"{source} holds the secret key of {', '.join(sorted(held))}, not of {name} "
                          f"(this {role}); give each node its own file")
    peers = {n: k.encode() for n, k in content["public"].items()}
    secret = held[name].encode()
    try:
        public = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError):
        raise ConfigError(f"{source}: the secret key of {name} is not a CURVE key") from None
    if peers.get(name) != public:
        raise ConfigError(f"{source}: the public key listed for {name} does not belong to its secret key "
                          f"(a file mixed from two jobs?)")
    return Keys(name, public, secret, peers, str(content.get("job", "")))


def _secret(cfg):
    """(the secret file's object or None, where it came from)."""
    if cfg.secret_file:
        return read_secret_file(cfg.secret_file), f"KVPS_SECRET_FILE={cfg.secret_file!r}"
    if cfg.secret:
        return parse_secret(cfg.secret), "KVPS_SECRET"
    return None, "the environment"
