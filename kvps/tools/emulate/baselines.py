"""The baselines on the emulated hosts: torch.distributed gloo and MXNet 1.9.1 dist_sync jobs, placed
as a kvps job is (job.py), so the same links carry the same pattern of traffic.

    with Network() as net:
        job = EmulatedGlooJob(net, 4, "plan.json")                   # H: the store, W0..W3: ranks
        job = EmulatedMXNetJob(net, "~/mxvenv/bin/python", 4, 1, ["mxnet_worker.py", "plan.json"])
        net.up(job.hosts, rate="1gbit")
        codes = job.run(timeout=600)

gloo: kvps.tools.bench.gloo_worker (the `kvps bench compare` rank: DDP-style 25 MB buckets) on
h1..hW, as the kvps ring's workers; they meet at a TCPStore on h0 (rendezvous.py: it binds port
0 and prints READY, as kvps's scheduler does). Each rank is told GLOO_SOCKET_IFNAME=eth0: gloo
otherwise binds the address the machine's host name resolves to, which no other host can reach.

MXNet: ps-lite's scheduler on h0, servers and workers where a kvps job with the same W, S and
placement has them. ps-lite bootstraps from DMLC_* variables (kvps.tools.bench.mxnet_job does the same
on 127.0.0.1): DMLC_PS_ROOT_URI/PORT name the scheduler, DMLC_NODE_HOST is the address each node
registers (its host's), DMLC_INTERFACE its interface. The scheduler cannot report a port it chose,
so it gets SCHEDULER_PORT, which is free for certain: h0's namespace is new and holds nothing else.
MXNet's Python gets kvps.tools.bench.mxnet_job.environ() (no PYTHONPATH or venv variables of kvps's).
"""
import os
import sys

from kvps.tools.bench.mxnet_job import environ as mxnet_environ

from kvps.tools.emulate.job import HostJob, placement
from kvps.tools.emulate.network import HOST_LINK

SCHEDULER_PORT = 9091      # MXNet's scheduler, on h0 (a fresh namespace: no other process can hold it)


class EmulatedGlooJob(HostJob):
    """W ranks of kvps.tools.bench.gloo_worker on h1..hW and their TCPStore on h0."""

    daemons_exit = False        # the store serves until it is stopped

    def __init__(self, net, workers, plan_path, env=None, out=None, python=None, collective_timeout=120.0):
        super().__init__(net, placement(workers, 0), dict(os.environ, **(env or {})), out)
        self.plan_path = plan_path
        self.python = python or sys.executable
        self.collective_timeout = collective_timeout

    def start(self):
        """Start the store, wait for its READY line, then the ranks. Returns self; raises
        KVTimeoutError (after stopping what it started) if the store does not get ready."""
        base = {"PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": HOST_LINK}
        store = self._spawn("H", [self.python, "-m", "kvps.tools.emulate.rendezvous", "--host", self.address("H"),
                                  "--timeout", f"{self.collective_timeout * 4 + 60:g}"], base, ready=True)
        for rank in range(self.workers):
            self._spawn(f"W{rank}", [self.python, "-m", "kvps.tools.bench.gloo_worker", self.plan_path,
                                     "--rank", str(rank), "--world", str(self.workers), "--store", store,
                                     "--timeout", f"{self.collective_timeout:g}"], base)
        return self


class EmulatedMXNetJob(HostJob):
    """MXNet's scheduler, S servers and W workers (running `python *worker_args`), placed as kvps's."""

    def __init__(self, net, python, workers, servers, worker_args, colocated=False, env=None, out=None):
        super().__init__(net, placement(workers, servers, colocated), mxnet_environ(env), out)
        self.python = python
        self.servers, self.colocated = servers, colocated
        self.worker_args = list(worker_args)

    def start(self):
        """Start every node (ps-lite's nodes find the scheduler themselves). Returns self."""
        base = {"DMLC_PS_ROOT_URI": self.address("H"), "DMLC_PS_ROOT_PORT": str(SCHEDULER_PORT),
                "DMLC_NUM_SERVER": str(self.servers), "DMLC_NUM_WORKER": str(self.workers),
                "DMLC_INTERFACE": HOST_LINK, "PYTHONUNBUFFERED": "1"}
        daemon = [self.python, "-c", "import mxnet"]        # importing mxnet runs the scheduler's or server's loop
        self._spawn("H", daemon, self._node_env("H", base, "scheduler"))
        for j in range(self.servers):
            self._spawn(f"S{j}", daemon, self._node_env(f"S{j}", base, "server"))
        for i in range(self.workers):
            # ps-lite numbers the workers itself; W<i> is the start order (rank 0 prints the results).
            self._spawn(f"W{i}", [self.python, *self.worker_args], self._node_env(f"W{i}", base, "worker"))
        return self

    def _node_env(self, name, base, role):
        return dict(base, DMLC_ROLE=role, DMLC_NODE_HOST=self.address(name))
