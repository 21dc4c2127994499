"""An emulated cluster network: one Linux network namespace per host, joined by a bridge, with a
rate limit on each host's link in both directions.

    ok, why = permitted()                       # (False, reason) where namespaces are not allowed
    with Network().up(3, rate="1gbit") as net:  # hosts h0, h1, h2 at 198.18.0.1, .2, .3
        proc = net.popen("h1", ["python", "-c", "print('hello from h1')"])
        proc.wait(10)
    # every namespace this object made, and every process it started, is gone here

Layout (PREFIX is unique to the object: kvem<pid>x<4 hex digits>):

    PREFIX-sw   the switch: bridge br0 and one port p<i> per host
    PREFIX-h<i> a host: lo, and eth0 = 198.18.0.0/15 + i + 1; eth0 and p<i> are the two ends of a veth

Each veth is created straight inside the two namespaces, so nothing is ever added to the
caller's namespace. The link's limit is a tbf qdisc on eth0 (what the host sends) and another on
p<i> (what it receives), so a host link is full duplex at the configured rate, like a switched
Ethernet port. A delay is a netem qdisc in front of each tbf, half the delay on each side, so a
packet from one host to another is delayed by `delay_ms` (round trip: twice that).

down() stops the processes popen() started (by pid, SIGTERM then SIGKILL) and deletes exactly
the namespaces up() created; it is idempotent, runs on leaving the `with` block, at interpreter
exit, and on SIGTERM/SIGHUP (which up() turns into SystemExit, so `with` blocks and `finally`
clauses run). Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), `ip` and `tc` from iproute2.
"""
import atexit
import ipaddress
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading

from kvps.errors import ConfigError, KVPSError

SUBNET = ipaddress.ip_network("198.18.0.0/15")   # RFC 2544's benchmarking range: never routed
COMMAND_TIMEOUT = 20.0     # seconds for one `ip` or `tc` command
STOP_TIMEOUT = 5.0         # seconds a process gets after SIGTERM before SIGKILL
TBF_LATENCY = "10ms"       # tbf queue: 10 ms at the link rate, about a switch port's buffer (a deeper one
                           # delays the ACKs of one direction behind data of the other)
HOST_LINK = "eth0"         # every host's interface to the switch (GLOO_SOCKET_IFNAME, DMLC_INTERFACE)
HOST_NAME = re.compile(r"^[a-z][a-z0-9]{0,9}$")
_SIGNALS = ("SIGTERM", "SIGHUP")


class EmulationError(KVPSError):
    """Building or removing the emulated network failed; the message has the command and its error."""


class NotPermitted(EmulationError):
    """This machine does not allow network namespaces (or lacks ip/tc); the message says why."""


def parse_rate(text):
    """Bits per second from '1gbit', '50mbit', '2.5Gbit/s', '800k' or '1000000' (decimal prefixes,
    as tc's). Byte units are refused: tc reads 'mbps' as megabytes per second, people rarely do."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([kmgt]?)(?:bit)?(?:/s)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConfigError(f"rate {text!r} is not a bit rate like 1gbit, 100mbit or 500kbit")
    bits = float(m.group(1)) * 1000 ** " kmgt".index(m.group(2).lower() or " ")
    if bits < 8000:
        raise ConfigError(f"rate {text!r} is {bits:g} bit/s; the emulation needs at least 8kbit")
    return int(bits)


def show_rate(bits):
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


def _run(argv, check=True):
    """Run one ip/tc command; raises EmulationError naming it and what it printed."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    except FileNotFoundError:
        raise NotPermitted(f"{argv[0]!r} is not installed (it comes with iproute2)") from None
    except subprocess.TimeoutExpired:
        raise EmulationError(f"`{shlex.join(argv)}` did not finish within {COMMAND_TIMEOUT:g} s") from None
    if check and proc.returncode:
        raise EmulationError(f"`{shlex.join(argv)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def namespaces():
    """The names of the network namespaces `ip netns list` shows (everyone's)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def _unique_prefix():
    return f"kvem{os.getpid()}x{secrets.token_hex(2)}"


def permitted(delay=False):
    """(True, what works) or (False, why not): tries a throwaway namespace with a veth pair and a
    tbf qdisc (and a netem one with delay=True), then removes it. Never raises."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"{tool!r} is not installed (it comes with iproute2)"
    name = _unique_prefix() + "-probe"
    try:
        try:
            _run(["ip", "netns", "add", name])
        except EmulationError as exc:
            return False, (f"cannot create a network namespace (root with CAP_SYS_ADMIN and CAP_NET_ADMIN "
                           f"is needed): {exc}")
        try:
            _run(["ip", "-n", name, "link", "add", "va", "type", "veth", "peer", "name", "vb"])
            _run(["tc", "-n", name, "qdisc", "add", "dev", "va", "root", "tbf", "rate", "1gbit", "burst", "128kb",
                  "latency", TBF_LATENCY])
        except EmulationError as exc:
            return False, f"namespaces work but veth or tc do not: {exc}"
        if delay:
            try:
                _run(["tc", "-n", name, "qdisc", "add", "dev", "vb", "root", "netem", "delay", "1ms"])
            except EmulationError as exc:
                return False, f"a delay needs the netem qdisc (kernel option CONFIG_NET_SCH_NETEM): {exc}"
    finally:
        if os.path.exists(f"/run/netns/{name}"):
            _run(["ip", "netns", "del", name], check=False)
    return True, "network namespaces, veth pairs, bridges and tbf" + (" and netem" if delay else "") + " work"


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


_raise_exit.kvps_emulate = True       # marks the handler as ours, so a later Network may replace it


class Network:
    """The namespaces, links and processes of one emulated network; see the module docstring."""

    def __init__(self, prefix=None):
        self.prefix = prefix or _unique_prefix()
        self.switch = f"{self.prefix}-sw"
        self.hosts = {}            # name -> (namespace, address), in creation order
        self.rate = None           # bits per second of every host link
        self.delay_ms = 0.0
        self._made = []            # namespaces this object created, in order
        self._procs = []           # Popen objects popen() started
        self._lock = threading.Lock()
        self._old_handlers = {}

    # ---- building ----
    def up(self, hosts, rate="1gbit", delay_ms=0.0, mtu=1500):
        """Create the hosts (an int N: h0..h(N-1); or a list of short names), each on its own link
        limited to `rate` both ways, `delay_ms` one way between any two hosts. Returns self.
        Raises ConfigError for a bad argument, EmulationError (NotPermitted) when a command fails,
        after removing whatever it had made."""
        names = [f"h{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        if not names or len(names) > SUBNET.num_addresses - 2:
            raise ConfigError(f"hosts={hosts!r}: need between 1 and {SUBNET.num_addresses - 2} hosts")
        bad = [n for n in names if not isinstance(n, str) or not HOST_NAME.match(n)]
        if bad or len(set(names)) != len(names):
            raise ConfigError(f"host names {names!r} must be distinct, lowercase letters and digits, "
                              "starting with a letter, at most 10 characters")
        if delay_ms < 0:
            raise ConfigError(f"delay_ms={delay_ms!r} must not be negative")
        if not 68 <= mtu <= 65535:
            raise ConfigError(f"mtu={mtu!r} must be between 68 and 65535")
        if self._made:
            raise EmulationError(f"network {self.prefix} is already up; call down() first")
        self.rate, self.delay_ms = parse_rate(rate), float(delay_ms)
        self._install_signal_handlers()
        atexit.register(self.down)
        try:
            self._add_namespace(self.switch)
            _run(["ip", "-n", self.switch, "link", "set", "lo", "up"])
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for i, name in enumerate(names):
                self._add_host(i, name, mtu)
        except BaseException:
            self.down()
            raise
        return self

    def _add_namespace(self, name):
        _run(["ip", "netns", "add", name])
        self._made.append(name)

    def _add_host(self, i, name, mtu):
        ns, port = f"{self.prefix}-{name}", f"p{i}"
        address = SUBNET[i + 1]
        self._add_namespace(ns)
        _run(["ip", "-n", self.switch, "link", "add", port, "mtu", str(mtu), "type", "veth",
              "peer", "name", HOST_LINK, "netns", ns])
        _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", HOST_LINK])
        _run(["ip", "-n", ns, "link", "set", HOST_LINK, "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        self._limit(ns, HOST_LINK)           # what the host sends
        self._limit(self.switch, port)       # what the host receives
        self.hosts[name] = (ns, str(address))

    def _limit(self, ns, dev):
        # A burst of 4 ms at the rate, at least 128 KB so a 64 KB GSO packet always fits.
        burst = max(128 * 1024, self.rate // 8 // 250)
        tbf = ["tbf", "rate", f"{self.rate}bit", "burst", str(burst), "latency", TBF_LATENCY]
        if not self.delay_ms:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])
            return
        # netem delays, tbf (its child) paces; tc-netem(8) shows this pairing.
        try:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                  "delay", f"{self.delay_ms / 2 * 1000:.0f}us", "limit", "100000"])
        except EmulationError as exc:
            raise EmulationError(f"a delay needs the netem qdisc (kernel option CONFIG_NET_SCH_NETEM), "
                                 f"which this kernel does not offer; run without --delay-ms. ({exc})") from None
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])

    # ---- using ----
    def address(self, host):
        """The 198.18 address of a host; raises ConfigError for an unknown host."""
        return self._host(host)[1]

    def namespace(self, host):
        return self._host(host)[0]

    def _host(self, host):
        if host not in self.hosts:
            raise ConfigError(f"no host {host!r} in network {self.prefix} (hosts: {', '.join(self.hosts) or 'none'})")
        return self.hosts[host]

    def command(self, host, argv):
        """argv wrapped to run inside the host's namespace (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def popen(self, host, argv, env=None, **kwargs):
        """Start argv inside the host's namespace, in a session of its own; returns the Popen.
        down() stops it if it is still running. Raises ConfigError for an unknown host."""
        kwargs.setdefault("start_new_session", True)
        with self._lock:
            if not self._made:
                raise EmulationError(f"network {self.prefix} is not up")
            proc = subprocess.Popen(self.command(host, argv), env=env, **kwargs)
            proc.kvps_own_session = kwargs["start_new_session"]
            self._procs.append(proc)
        return proc

    # ---- tearing down ----
    def stop(self, procs=None):
        """Stop processes popen() started (all of them by default): SIGTERM to each one's session,
        then SIGKILL after STOP_TIMEOUT. Processes this object did not start are never touched."""
        with self._lock:
            mine = [p for p in (self._procs if procs is None else procs) if p in self._procs]
        live = [p for p in mine if p.poll() is None]
        for p in live:
            _signal_session(p, signal.SIGTERM)
        for p in live:
            try:
                p.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                _signal_session(p, signal.SIGKILL)
                try:
                    p.wait(STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    pass           # stuck in the kernel; its namespace goes away when it finally exits

    def down(self):
        """Stop this object's processes and delete the namespaces it made (with their links).
        Idempotent; never touches another namespace. Raises EmulationError if a namespace it made
        cannot be deleted (after trying all of them)."""
        self.stop()
        errors = []
        for name in reversed(list(self._made)):
            proc = _run(["ip", "netns", "del", name], check=False)
            if proc.returncode and os.path.exists(f"/run/netns/{name}"):
                errors.append(f"{name}: {proc.stderr.strip()}")
            else:
                self._made.remove(name)
        if errors:
            raise EmulationError("could not delete namespaces " + "; ".join(errors))
        self.hosts.clear()
        atexit.unregister(self.down)
        self._restore_signal_handlers()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.down()

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return                 # only the main thread may set handlers; atexit still cleans up
        for sig in (getattr(signal, s) for s in _SIGNALS):
            old = signal.getsignal(sig)
            if old is signal.SIG_DFL or getattr(old, "kvps_emulate", False):
                self._old_handlers[sig] = old
                signal.signal(sig, _raise_exit)

    def _restore_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            if signal.getsignal(sig) is _raise_exit:
                signal.signal(sig, old)
        self._old_handlers.clear()

    def __repr__(self):
        state = f"{len(self.hosts)} hosts at {show_rate(self.rate)}" if self.hosts else "down"
        return f"Network({self.prefix!r}, {state})"


def _signal_session(proc, sig):
    try:
        if proc.kvps_own_session:
            os.killpg(proc.pid, sig)   # the child leads its own session: it and what it started
        else:
            proc.send_signal(sig)      # it shares the caller's process group: only the child itself
    except (ProcessLookupError, PermissionError):
        pass
