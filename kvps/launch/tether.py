"""The far end of a launcher's connection: runs one process of a job and ties its life to that
connection, so a launcher that stops, is killed or loses the network leaves nothing behind.

    ssh HOST 'cd DIR && exec PYTHON -m kvps.launch.tether'  < {"argv": [...], "env": {...}}

The launcher writes one JSON line on the tether's stdin (the command and the variables to add to
its environment: nothing of them shows on a command line, in `ps`) and then holds stdin open
without writing. The tether starts the command in a session of its own and waits. When stdin
reaches end of file (the launcher closed it, died, or the ssh connection or Ray actor is gone), or
the tether gets SIGTERM, SIGHUP or SIGINT, it stops the command's process group (SIGTERM, SIGKILL
after STOP_GRACE). Its exit code is the command's; for a command killed by signal N it prints a
line saying so and exits with 128+N, the way a shell reports it, so the launcher can name the signal.
"""
import json
import os
import signal
import subprocess
import sys
import threading

from kvps.errors import ConfigError
from kvps.launch.job import signal_name
from kvps.supervisor import STOP_GRACE, Supervisor, exit_code

MAX_SPEC_BYTES = 1 << 20       # the JSON line: a command and its variables, never near this
SPEC_TIMEOUT = 60.0            # seconds to wait for that line (ssh has connected by then)


def encode(argv, env):
    """The line a launcher writes on a tether's stdin."""
    return (json.dumps({"argv": list(argv), "env": dict(env)}) + "\n").encode()


def decode(line):
    """(argv, env) from a tether's first line; raises ConfigError naming what is wrong."""
    if len(line) > MAX_SPEC_BYTES:
        raise ConfigError(f"the tether's command line is {len(line)} bytes; at most {MAX_SPEC_BYTES}")
    try:
        spec = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"the tether's first line is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"the tether's first line is a JSON {type(spec).__name__}, not an object")
    argv, env = spec.get("argv"), spec.get("env", {})
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ConfigError("the tether's 'argv' must be a non-empty list of strings")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ConfigError("the tether's 'env' must map strings to strings")
    return argv, env


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def _read_line(fd, limit):
    """One line from a file descriptor, read unbuffered: a buffered stdin held by a thread blocked
    in read() would make the interpreter abort at exit."""
    data = b""
    while b"\n" not in data and len(data) <= limit:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    return data.partition(b"\n")[0]


def main():
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _raise_exit)
    stdin = sys.stdin.fileno()
    ready = threading.Event()
    first = []

    def read_first():
        first.append(_read_line(stdin, MAX_SPEC_BYTES))
        ready.set()
    threading.Thread(target=read_first, daemon=True).start()
    if not ready.wait(SPEC_TIMEOUT) or not first[0]:
        print(f"kvps tether: no command arrived on stdin within {SPEC_TIMEOUT:g} s", file=sys.stderr)
        return 2
    try:
        argv, env = decode(first[0])
    except ConfigError as exc:
        print(f"kvps tether: {exc}", file=sys.stderr)
        return 2

    def write(name, line):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    children = Supervisor(out=write)
    try:
        try:
            children.spawn("child", argv, env=dict(os.environ, **env), stdin=subprocess.DEVNULL)
        except OSError as exc:
            print(f"kvps tether: cannot start {argv[0]!r}: {exc.strerror}", file=sys.stderr)
            return 127

        def watch_stdin():
            while os.read(stdin, 65536):     # nobody writes: this returns only at end of file
                pass
            children.stop(STOP_GRACE)        # the launcher is gone
        threading.Thread(target=watch_stdin, daemon=True).start()
        _, code = children.wait_any(None)
    finally:
        children.stop(STOP_GRACE)
    if code < 0:
        print(f"kvps tether: {argv[0]} was killed by {signal_name(-code)}", file=sys.stderr, flush=True)
    return exit_code(code)


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as stop:           # a signal, after main's finally stopped the command
        code = stop.code if isinstance(stop.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)           # the stdin thread may still be in read(): no interpreter teardown to wait on it
