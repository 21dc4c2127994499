"""An emulated multi-host cluster on one Linux machine: every node of a kvps job in its own
network namespace, the hosts joined by a bridge, each host link rate-limited both ways.

    kvps emulate -n 4 -s 1 --rate 1gbit -- python train.py     # a job, as `kvps launch` runs one
    kvps emulate check                                         # measured link rate vs the configured one
    kvps emulate sync -n 4 -s 1,4 --placement dedicated,colocated   # step time vs the bandwidth bound
    kvps emulate sync -n 4 -s 1,4 --mxnet ~/mxvenv/bin/python        # ... beside gloo and MXNet

Loopback has no per-host bandwidth limit, so it cannot show how a parameter server's traffic
pattern compares with a ring all-reduce; here each host has a link like a real NIC's.
Modules, one concept each:

    network   Network: namespaces, bridge, veth pairs, tbf/netem limits; permitted()
    job       HostJob (nodes placed on hosts); EmulatedJob, run_job: a kvps job's scheduler, servers, workers
    baselines EmulatedGlooJob, EmulatedMXNetJob: the same placement for gloo and MXNet 1.9.1
    rendezvous the TCPStore the gloo ranks meet at (binds port 0, prints READY)
    sync      the `sync` benchmark: which systems, in what order, the table
    theory    theory(): seconds per step at the bandwidth bound, ring and PS
    probe     raw TCP transfers between hosts (the check)
    cli       main(argv): the `kvps emulate` command

Needs root; where namespaces are not permitted, permitted() says why and the command exits 77.
docs/emulate.md has the commands, the derivations and measured figures.
"""
from kvps.tools.emulate.baselines import EmulatedGlooJob, EmulatedMXNetJob
from kvps.tools.emulate.cli import main
from kvps.tools.emulate.job import EmulatedJob, HostJob, placement, run_job
from kvps.tools.emulate.network import EmulationError, Network, NotPermitted, parse_rate, permitted
from kvps.tools.emulate.theory import Prediction, theory

__all__ = ["Network", "permitted", "EmulationError", "NotPermitted", "parse_rate", "HostJob", "EmulatedJob",
           "EmulatedGlooJob", "EmulatedMXNetJob", "placement", "run_job", "theory", "Prediction", "main"]
