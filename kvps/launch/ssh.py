"""`kvps launch --launcher ssh`: servers and workers on the hosts of a hostfile, over ssh, with the
flags of MXNet's tools/launch.py.

    kvps launch --launcher ssh -H hosts -n 2 -s 2 [--python PATH] [--sync-dst-dir DIR] -- python train.py

The scheduler runs here, bound to an address the hosts reach: --host ADDR, else the address of
the interface KVPS_INTERFACE (or DMLC_INTERFACE) names, else the local address of the route to
the first host. It is told the job's size (-n, -s). Servers go to the hosts in turn, and workers
continue the turn (with as many hosts as processes, each has a host of its own).

Each remote process runs under kvps.launch.tether, which gets its command and variables as one
JSON line on stdin (never on a command line) and stops the process when the ssh connection ends:
when the launcher stops, is killed, or the link breaks. Remote nodes get the job's variables, the
launcher's own KVPS_* variables and the --env ones; nothing else of the local environment.
"""
import errno
import os
import shlex
import socket
import subprocess
import sys

from kvps.config import Config
from kvps.errors import ConfigError, KVPSError
from kvps.launch import tether
from kvps.launch.job import Job, forwarded_env, run, signal_name
from kvps.launch.restarts import node_of

SYNC_TIMEOUT = 300.0       # seconds to copy the working directory to one host
SIOCGIFADDR = 0x8915       # <linux/sockios.h>: an interface's IPv4 address


def read_hostfile(path):
    """The hosts of a hostfile: one per line (the first word), # comments; raises ConfigError."""
    try:
        with open(path) as f:
            hosts = [line.split()[0] for line in f if line.strip() and not line.lstrip().startswith("#")]
    except OSError as exc:
        raise ConfigError(f"hostfile {path}: {exc.strerror}") from None
    if not hosts:
        raise ConfigError(f"hostfile {path} lists no hosts")
    return hosts


def interface_address(name):
    """The IPv4 address of network interface `name` (DMLC_INTERFACE's meaning); raises ConfigError
    naming the interface, and the ones there are, when it is absent or has no IPv4 address."""
    import fcntl
    import struct
    if not name or len(name.encode()) > 15:
        raise ConfigError(f"KVPS_INTERFACE={name!r} is not an interface name")
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()))
    except OSError as exc:
        names = ", ".join(n for _, n in socket.if_nameindex())
        why = "has no IPv4 address" if exc.errno == errno.EADDRNOTAVAIL else "does not exist"
        raise ConfigError(f"KVPS_INTERFACE={name!r}: that interface {why} here (interfaces: {names})") from None
    finally:
        probe.close()
    return socket.inet_ntoa(packed[20:24])


def scheduler_host(hosts, host=None, interface=None):
    """The address the scheduler binds and the hosts connect to: `host`, else `interface`'s address,
    else the local end of the route to the first host that resolves (127.0.0.1 when the hosts are
    this machine). Raises ConfigError when none of these gives one."""
    if host:
        return host
    if interface:
        return interface_address(interface)
    for name in hosts:
        try:
            peer = socket.gethostbyname(name)
        except OSError:
            continue
        if peer.startswith("127."):
            return "127.0.0.1"
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((peer, 9))         # a UDP connect only picks the route; nothing is sent
            return probe.getsockname()[0]
        except OSError:
            continue
        finally:
            probe.close()
    raise ConfigError(f"no address of this machine reaches the hosts {', '.join(hosts)}: "
                      "pass --host ADDR or set KVPS_INTERFACE to the interface they reach")


class Remote:
    """Runs each server and worker over ssh on a host of the list, under kvps.launch.tether."""

    name = "ssh"
    announce = True
    remote = True

    def __init__(self, hosts, num_servers, python, cwd, forward, ssh_options=()):
        self.hosts, self.num_servers = list(hosts), num_servers
        self.python, self.cwd, self.forward = python, cwd, dict(forward)
        self.ssh_options = list(ssh_options)
        self.where = {}                      # name -> host

    def host_of(self, name):
        """Servers take the hosts in turn; workers carry on from where the servers stopped. A
        replacement ("S1#2") runs where its node did."""
        name = node_of(name)
        rank = int(name[1:])
        return self.hosts[(rank if name[0] == "S" else self.num_servers + rank) % len(self.hosts)]

    def ssh(self, host, script):
        return ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", *self.ssh_options, host, script]

    def command(self, name, argv, job_env):
        """(ssh argv, the bytes for its stdin) that start `argv` as node `name` on its host."""
        host = self.host_of(name)
        script = f"cd {shlex.quote(self.cwd)} && exec {shlex.quote(self.python)} -m kvps.launch.tether"
        return self.ssh(host, script), tether.encode(argv, dict(self.forward, **job_env))

    def spawn(self, children, name, argv, env, job_env):
        ssh_argv, line = self.command(name, argv, job_env)
        self.where[name] = self.host_of(name)
        proc = children.spawn(name, ssh_argv, env=env, stdin=subprocess.PIPE)
        # Held open, never written again: its end of file is what stops the remote process.
        proc.stdin.write(line)
        proc.stdin.flush()
        return proc

    def secret_env(self, path):
        """The node's secret file's text, which travels on the tether's stdin, in its variables."""
        with open(path) as f:
            return {"KVPS_SECRET": f.read()}

    def describe(self, name, returncode):
        host = self.where.get(name, "?")
        if returncode < 0:
            return f"{name} (the ssh to {host}) was killed by {signal_name(-returncode)}"
        if returncode == 255:
            return f"{name} on {host}: ssh failed (exit code 255; see its output)"
        if 128 < returncode < 128 + 65:
            return f"{name} was killed by {signal_name(returncode - 128)} on {host}"
        return f"{name} on {host} exited with code {returncode}"

    def sync(self, source, hosts, out):
        """Copy directory `source` to self.cwd on each host (tar over ssh; .git left out)."""
        for host in dict.fromkeys(hosts):
            out.write(f"[launch] copying {source} to {host}:{self.cwd}\n")
            out.flush()
            pack = subprocess.Popen(["tar", "-C", source, "--exclude=.git", "--exclude=__pycache__", "-cf", "-", "."],
                                    stdout=subprocess.PIPE)
            try:
                unpack = subprocess.run(self.ssh(host, f"mkdir -p {shlex.quote(self.cwd)} && "
                                                       f"tar -C {shlex.quote(self.cwd)} -xf -"),
                                        stdin=pack.stdout, capture_output=True, timeout=SYNC_TIMEOUT)
            except subprocess.TimeoutExpired:
                raise KVPSError(f"copying {source} to {host} took more than {SYNC_TIMEOUT:g} s") from None
            finally:
                pack.stdout.close()
                pack.kill()
                pack.wait()
            if unpack.returncode:
                raise KVPSError(f"copying {source} to {host}:{self.cwd} failed (exit code {unpack.returncode}): "
                                f"{unpack.stderr.decode(errors='replace').strip()[-500:]}")


def launch_ssh(num_workers, num_servers, command, hostfile, port, env=None, dry_run=False, out=None,
               worker_env=None, python=None, sync_dst_dir=None, host=None, interface=None, ssh_options=(),
               restart_servers=None, restart_workers=0):
    """Run a job over ssh (see the module docstring); returns its exit code. dry_run: print the
    commands instead. Raises ConfigError for a bad hostfile or when no address reaches the hosts."""
    out = out or sys.stdout
    hosts = read_hostfile(hostfile)
    bind = scheduler_host(hosts, host, interface)
    cwd = sync_dst_dir or os.getcwd()
    remote = Remote(hosts, num_servers, python or sys.executable, cwd, forwarded_env(os.environ, env or {}),
                    ssh_options)
    job = Job(num_workers, num_servers, command, env, out, python=remote.python, worker_env=worker_env,
              placement=remote, scheduler_host=bind, scheduler_port=port, restart_servers=restart_servers,
              restart_workers=restart_workers)
    if dry_run:
        job.scheduler_address = f"{bind}:{port}"
        out.write(f"[H] {shlex.join(job.scheduler_argv())}\n")
        jobs = [(f"S{r}", [remote.python, "-m", "kvps.cli", "server"], {"KVPS_ROLE": "server"})
                for r in range(num_servers)]
        jobs += [(f"W{r}", list(command), dict({"KVPS_ROLE": "worker"}, **(worker_env or {}).get(r, {})))
                 for r in range(num_workers)]
        for name, argv, extra in jobs:
            if remote.remote and Config.from_env(job.env).curve != "0":
                extra["KVPS_SECRET"] = "<this node's secret keys, made at launch>"
            ssh_argv, line = remote.command(name, argv, dict(job.job_env(), KVPS_RANK=name[1:], **extra))
            out.write(f"[{name}] {shlex.join(ssh_argv)} <<< {shlex.quote(line.decode().strip())}\n")
        return 0
    if sync_dst_dir:
        remote.sync(os.getcwd(), [remote.host_of(f"S{r}") for r in range(num_servers)] +
                    [remote.host_of(f"W{r}") for r in range(num_workers)], out)
    return run(job)
