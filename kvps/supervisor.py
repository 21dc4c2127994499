"""Child processes started, watched and stopped by one object: what `kvps launch`, the benchmarks'
and the emulator's jobs, `kvps experiment` and the test harness share.

    sup = Supervisor(out=sys.stdout)                    # every line comes out as "[H] ...", "[W0] ..."
    sup.spawn("H", [python, "-m", "kvps.cli", "scheduler", "--port", "0"], env=env, ready=True)
    address = sup.ready("H", timeout=30)                # the HOST:PORT of the READY line it printed
    sup.spawn("W0", argv, env=dict(env, KVPS_SCHEDULER=address), log="W0.log")
    name, code = sup.wait_any(timeout=60)               # the next child to exit, or None at the deadline
    sup.stop(grace=5)                                   # SIGTERM, SIGKILL after 5 s, then reap

Output: each child's stdout (and stderr, unless `stderr=` names a file for it) is read line by line
by a thread of its own. A line goes to `out` as "[name] line" (`out` is a text stream, or a callable
taking (name, line)) and, raw, to the child's `log` file; the last lines are kept for error messages.
A child spawned with ready=True has its first "READY HOST:PORT" line taken as its address instead.

Exits: a second thread per child reports its exit; codes are Popen's (negative: killed by that
signal; exit_code() turns them into a shell's 128+N). Every wait takes a deadline.

Stopping touches only processes this object started, by pid, never by name. A child started with
new_session (the default) leads a session of its own: signals go to its process group, so what it
started goes with it, and such a child is not reaped until stop(): its zombie keeps the pid, so the
SIGKILL that stop() sends to the group (whatever the child left behind) cannot reach a process that
has since been given that number. Children still running when the interpreter exits are stopped.
"""
import collections
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref

from kvps.errors import ConfigError, KVTimeoutError

READY_TIMEOUT = 30.0       # seconds for a child to print READY
DRAIN_TIMEOUT = 30.0       # seconds for daemons to exit by themselves once the workers are done
STOP_GRACE = 5.0           # seconds between the first signal and SIGKILL
JOIN_TIMEOUT = 2.0         # seconds for the output threads to finish once the children are gone
TAIL_LINES = 40            # lines of each child's output kept for error messages


def exit_code(returncode):
    """A shell-style exit code: a process killed by signal N gives 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def leads_own_session():
    """True when this process leads its session: whoever started it did so with start_new_session
    (a shell makes a command a process-group leader, never a session leader)."""
    return os.getsid(0) == os.getpid()


class _Child:
    """One child: its Popen and what the two threads learn about it. Holds no reference to the
    Supervisor, so that the exit-time cleanup can own the children without keeping it alive."""

    def __init__(self, name, proc, own_session, log, wants_ready, tail_lines):
        self.name, self.proc, self.own_session, self.log = name, proc, own_session, log
        self.wants_ready = wants_ready
        self.address = None                  # the word after READY
        self.said = threading.Event()        # READY seen, or the output closed
        self.code = None                     # Popen-style return code, once exited
        self.exited = threading.Event()
        self.tail = collections.deque(maxlen=tail_lines)
        self.threads = []

    def status(self):
        return "running" if self.code is None else f"exit code {self.code}"


class Supervisor:
    """Child processes started and stopped by this object only; see the module docstring."""

    def __init__(self, out=None, new_session=True, tail_lines=TAIL_LINES):
        self._out = out
        self.new_session = new_session
        self.tail_lines = tail_lines
        self._children = {}                  # name -> _Child, in start order
        self._exits = queue.Queue()          # names, as children exit (wait_any reports each once)
        self._out_lock = threading.Lock()
        # Holds the children, not this object, so it also runs for a supervisor dropped unstopped.
        self._finalizer = weakref.finalize(self, _stop_children, self._children, STOP_GRACE, signal.SIGTERM, True)

    # ---- starting ----
    def spawn(self, name, argv, env=None, ready=False, log=None, stderr=None, cwd=None, stdin=None):
        """Start `argv` as child `name` (env: its whole environment, None for this one's); returns its
        Popen. ready=True: its READY line is kept for ready(). log: a file that gets its output.
        stderr: a file for its stderr alone (else merged into its output). Raises ConfigError for a
        name already used or an empty argv, OSError when the program cannot be started."""
        if name in self._children:
            raise ConfigError(f"a child named {name!r} was already started by this supervisor")
        if not argv:
            raise ConfigError(f"no command given for child {name!r}")
        log_file = open(log, "wb") if log is not None else None
        err_file = None
        try:
            err_file = open(stderr, "wb") if stderr is not None else None
            proc = subprocess.Popen(list(argv), env=env, cwd=cwd, stdin=stdin, stdout=subprocess.PIPE,
                                    stderr=err_file or subprocess.STDOUT, start_new_session=self.new_session)
        except BaseException:
            if log_file:
                log_file.close()
            raise
        finally:
            if err_file:
                err_file.close()             # the child has its own copy
        child = _Child(name, proc, self.new_session, log_file, ready, self.tail_lines)
        self._children[name] = child
        for target in (self._pump, self._watch):
            t = threading.Thread(target=target, args=(child,), daemon=True,
                                 name=f"supervisor-{name}-{target.__name__.strip('_')}")
            t.start()
            child.threads.append(t)
        return proc

    def ready(self, name, timeout=READY_TIMEOUT):
        """The HOST:PORT of the READY line child `name` printed (it was spawned with ready=True).
        Raises KVTimeoutError, naming it and quoting its last output, when it exits or `timeout`
        seconds pass first. Stops nothing: the caller stops its children."""
        child = self._child(name)
        if not child.wants_ready:
            raise ConfigError(f"child {name!r} was not spawned with ready=True")
        if child.said.wait(timeout) and child.address is not None:
            return child.address
        child.exited.wait(0.5 if child.said.is_set() else 0)    # its output closed: it is exiting
        what = "exited before it printed READY" if child.code is not None else \
            f"did not print READY within {timeout:g} s"
        raise KVTimeoutError(f"{name} {what} ({child.status()}); {self._tail_text(child)}")

    # ---- watching ----
    @property
    def procs(self):
        """{name: Popen} of every child, in start order."""
        return {n: c.proc for n, c in self._children.items()}

    def poll(self):
        """{name: return code, or None while it runs} of every child, in start order."""
        return {n: c.code for n, c in self._children.items()}

    def running(self, names=None):
        """The names (of `names`, default all) still running."""
        return [c.name for c in self._chosen(names) if c.code is None]

    def wait_any(self, timeout):
        """(name, return code) of the next child to exit not reported before, or None when `timeout`
        seconds pass first (timeout=None: no deadline, for a job that runs as long as it needs)."""
        try:
            name = self._exits.get(timeout=None if timeout is None else max(0.0, timeout))
        except queue.Empty:
            return None
        return name, self._children[name].code

    def wait(self, timeout, names=None):
        """Wait until the children named (default all) have exited or `timeout` seconds pass;
        returns {name: return code, or None for one still running}. Never raises for the deadline:
        the caller says what it waited for."""
        chosen = self._chosen(names)
        deadline = time.monotonic() + timeout
        for c in chosen:
            c.exited.wait(max(0.0, deadline - time.monotonic()))
        return {c.name: c.code for c in chosen}

    def tail(self, name):
        """The last lines child `name` printed (at most tail_lines)."""
        return list(self._child(name).tail)

    # ---- output ----
    def emit(self, prefix, text):
        """Send one line "[prefix] text" to `out`, as the children's lines go (a job's own messages)."""
        out = self._out
        if out is None:
            return
        with self._out_lock:
            if hasattr(out, "write"):
                out.write(f"[{prefix}] {text}\n")
                out.flush()
            else:
                out(prefix, text)

    # ---- stopping ----
    def stop(self, grace=STOP_GRACE, sig=signal.SIGTERM, group=True):
        """Stop every child still running: `sig` to each (to its process group when it leads its own
        session, unless group=False: a child that stops its own children when asked, as `kvps launch`
        does on SIGINT), SIGKILL to the group of each one still there `grace` seconds later. Then
        SIGKILL to what any child left in its group, reap the children and finish their output
        (bounded waits throughout). Idempotent; children spawned afterwards are stopped next time."""
        _stop_children(self._children, grace, sig, group)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # ---- inside ----
    def _child(self, name):
        if name not in self._children:
            raise ConfigError(f"no child named {name!r} (children: {', '.join(self._children) or 'none'})")
        return self._children[name]

    def _chosen(self, names):
        return list(self._children.values()) if names is None else [self._child(n) for n in names]

    def _tail_text(self, child):
        lines = list(child.tail)
        return "its last output:\n" + "\n".join(lines) if lines else "it printed nothing"

    def _pump(self, child):
        stream = child.proc.stdout
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip("\r\n")
                if child.wants_ready and child.address is None and line.startswith("READY "):
                    child.address = line.split()[1]
                    child.said.set()
                    continue
                child.tail.append(line)
                if child.log:
                    try:
                        child.log.write(line.encode() + b"\n")
                        child.log.flush()
                    except OSError:
                        pass                 # a full disk must not stop the reading: the child would block
                try:
                    self.emit(child.name, line)
                except Exception as exc:     # a broken sink must not stop the reading either
                    sys.stderr.write(f"kvps.supervisor: output of {child.name}: {exc!r}\n")
        finally:
            stream.close()
            if child.log:
                child.log.close()
            child.said.set()

    def _watch(self, child):
        proc, code = child.proc, None
        if child.own_session and hasattr(os, "waitid"):
            try:            # see the exit without reaping: the zombie keeps the pid (and group id) ours
                info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            except ChildProcessError:
                pass                         # someone reaped it through its Popen
        child.code = proc.wait() if code is None else code
        child.exited.set()
        self._exits.put(child.name)


def _signal(child, sig, group):
    if child.proc.returncode is not None:
        return                               # reaped: its pid may be another process's by now
    try:
        if group and child.own_session:
            os.killpg(child.proc.pid, sig)   # its session's group: it and what it started
        else:
            os.kill(child.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_children(children, grace, sig, group):
    chosen = list(children.values())
    live = [c for c in chosen if c.code is None]
    for c in live:
        _signal(c, sig, group)
    deadline = time.monotonic() + grace
    for c in live:
        c.exited.wait(max(0.0, deadline - time.monotonic()))
    late = [c for c in live if c.code is None]
    for c in late:
        _signal(c, signal.SIGKILL, True)
    deadline = time.monotonic() + grace
    for c in late:
        c.exited.wait(max(0.0, deadline - time.monotonic()))   # one stuck in the kernel is left
    for c in chosen:
        if c.code is None or c.proc.returncode is not None:
            continue
        if c.own_session:
            _signal(c, signal.SIGKILL, True)     # what it left in its group; the zombie holds the id
        try:
            c.proc.wait(JOIN_TIMEOUT)            # reap
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + JOIN_TIMEOUT
    for c in chosen:
        for t in c.threads:
            t.join(max(0.0, deadline - time.monotonic()))
