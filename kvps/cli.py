"""The `kvps` command: run the daemons, launch jobs, benchmark, and describe the install.

    kvps scheduler --port 0 --num-workers 2 --num-servers 1
    kvps server --scheduler 127.0.0.1:9091 [--plugin my_rules]
    kvps launch -n 2 -s 1 [--launcher local|ssh|ray] [-H hostfile] [--env K=V] [--straggler 1=fixed:0.05] -- python train.py
    kvps k8s render -n 2 -s 2 --image IMAGE -- python train.py    # Kubernetes manifests (docs/launch.md)
    kvps bench pushpull|priority|kernels|compare [options]
    kvps emulate -n 4 -s 1 -- python train.py                   # on emulated hosts (root)
    kvps experiment --quick                                     # train real models in every mode; report
    kvps simulate sweep --workers 2..1024                       # a calibrated model of a sync step, PS and ring
    kvps fuzz --frames 100000 [--seed S]                        # hostile frames at a job's daemons; report
    kvps soak --minutes 10                                      # long jobs; each daemon's memory growth per minute
    kvps timeline merge DIR -o trace.json                       # one Chrome trace from KVPS_TIMELINE=DIR
    kvps top HOST:PORT                                          # a live view of a job (its scheduler's metrics)
    kvps keys new DIR -n 2 -s 1                                 # CURVE keys for daemons started by hand
    kvps info
"""
import argparse
import importlib
import logging
import signal
import sys

from kvps.errors import KVPSError


def _command(args):
    return args.command[1:] if args.command[:1] == ["--"] else args.command


def cmd_launch(args):
    from kvps import launch
    from kvps.config import Config
    command = _command(args)
    env = launch.parse_env(args.env)
    if args.curve:          # the launcher makes the job's keys (kvps/launch/job.py make_keys)
        env["KVPS_CURVE"] = "1"
    if args.elastic:        # every process reads it through kvps/config.py
        env["KVPS_ELASTIC"] = "1"
    if args.replicas:       # chain replication: every process reads it through kvps/config.py
        env["KVPS_REPLICAS"] = str(args.replicas)
    if args.metrics:        # each node serves /metrics on a free port; the scheduler prints them all
        env.setdefault("KVPS_METRICS_PORT", "0")
    if args.resume:         # every kv.init loads its keys from it (kvps/kvstore/checkpointer.py)
        import os
        env["KVPS_RESUME"] = os.path.abspath(args.resume)
    worker_env = launch.straggler_env(args.straggler, args.num_workers, args.straggler_seed)
    if args.launcher == "ssh":
        from kvps.launch.ssh import launch_ssh
        if not args.hostfile:
            raise KVPSError("--launcher ssh needs -H HOSTFILE")
        options = (["-F", args.ssh_config] if args.ssh_config else []) + \
                  (["-i", args.ssh_identity_file] if args.ssh_identity_file else [])
        return launch_ssh(args.num_workers, args.num_servers, command, args.hostfile,
                          9091 if args.port is None else args.port, env, dry_run=args.dry_run,
                          worker_env=worker_env, python=args.python, sync_dst_dir=args.sync_dst_dir,
                          host=args.host, interface=Config.from_env().interface, ssh_options=options,
                          restart_servers=args.restart_servers, restart_workers=args.restart_workers)
    if args.launcher == "ray":
        from kvps.ray import launch_ray
        if args.dry_run or args.hostfile:
            raise KVPSError("--dry-run and -H are for --launcher ssh")
        if args.restart_servers:
            raise KVPSError("--restart-servers is for --launcher local and ssh (under Ray a dead server ends the job)")
        if args.restart_workers:
            raise KVPSError("--restart-workers is for --launcher local and ssh")
        return launch_ray(args.num_workers, args.num_servers, command, env, address=args.address,
                          worker_env=worker_env, python=args.python, cpus=args.cpus_per_process)
    return launch.launch_local(args.num_workers, args.num_servers, command, env, worker_env, args.restart_servers,
                               args.restart_workers)


def cmd_k8s(args):
    from kvps import launch
    from kvps.launch import k8s
    manifests = k8s.render(args.num_workers, args.num_servers, args.image, _command(args), name=args.name,
                           namespace=args.namespace, port=args.port, env=launch.parse_env(args.env),
                           resources=k8s.Resources(args.cpu, args.memory, args.gpus, args.server_cpu,
                                                   args.server_memory),
                           keys=None if args.keys_placeholder else k8s.secret_data(args.num_workers, args.num_servers),
                           elastic=args.elastic, restart_workers=args.restart_workers)
    text = k8s.dump(manifests)
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        import os           # the file holds secret keys: readable by its owner only
        with os.fdopen(os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(text)
    return 0


def cmd_bench(args):
    module = importlib.import_module(f"kvps.tools.bench.{args.what}")
    return module.main(args.rest)


def cmd_keys(args):
    """Write the job's CURVE keys, one secret file per node (docs/security.md)."""
    from kvps.wire.keys import job_names, make_job_keys
    paths = make_job_keys(args.dir, job_names(args.num_workers, args.num_servers))
    print(f"wrote {len(paths)} secret files (mode 0600) to {args.dir}: {', '.join(sorted(paths))}")
    print("give each node its own: KVPS_SECRET_FILE=DIR/NAME.json (H: the scheduler, S<rank>: a server, "
          "W<rank>: a worker); never copy a file to a node it does not name")
    return 0


def cmd_info(args):
    """The version and kernels.describe(), whose first line says whether the C kernels are built
    (or why not, with the reason setup.py recorded); when they cannot run, that line goes to
    stderr too as a WARNING, since everything then runs on slower kernels."""
    import kvps
    from kvps import kernels
    print(f"kvps {kvps.__version__}")
    text = kernels.describe()
    print(text)
    if not kernels.available_backends()["c"][0]:
        print(f"WARNING: {text.splitlines()[0]}", file=sys.stderr)
    return 0


def parser():
    p = argparse.ArgumentParser(prog="kvps", description="kvps: a parameter server for distributed training")
    sub = p.add_subparsers(dest="cmd", required=True)

    sub.add_parser("scheduler", add_help=False, help="run the scheduler (prints READY HOST:PORT)")
    sub.add_parser("server", add_help=False, help="run a key-value server (prints READY HOST:PORT)")

    s = sub.add_parser("launch", help="start a whole job: scheduler, servers and workers")
    s.add_argument("-n", "-np", "--num-workers", "--num-proc", type=int, required=True,
                   help="workers (-np and --num-proc are horovodrun's spelling)")
    s.add_argument("-s", "--num-servers", type=int, default=1)
    s.add_argument("--launcher", choices=("local", "ssh", "ray"), default="local",
                   help="where servers and workers run (docs/launch.md)")
    g = s.add_argument_group("ssh and ray")
    g.add_argument("--python", default=None, help="the Python that runs kvps on the hosts (default: this one's path)")
    g = s.add_argument_group("ssh (MXNet's tools/launch.py flags)")
    g.add_argument("-H", "--hostfile", default=None, help="hosts for --launcher ssh, one per line")
    g.add_argument("--host", default=None, help="the address the scheduler binds and the hosts connect to "
                                                "(default: KVPS_INTERFACE's, else the route to the first host)")
    g.add_argument("--port", type=int, default=None, help="scheduler port for --launcher ssh (default 9091; 0: any)")
    g.add_argument("--sync-dst-dir", default=None, help="copy this directory to DIR on every host and run there")
    g.add_argument("--ssh-config", default=None, help="an ssh_config file for every ssh (ssh -F)")
    g.add_argument("--ssh-identity-file", default=None, help="the private key ssh uses (ssh -i)")
    g.add_argument("--dry-run", action="store_true", help="with ssh: print the commands, start nothing")
    g = s.add_argument_group("ray")
    g.add_argument("--address", default=None, help="an existing Ray cluster (ray.init's address; default: "
                                                   "RAY_ADDRESS, else a local cluster started for the job)")
    g.add_argument("--cpus-per-process", type=float, default=1.0,
                   help="CPUs the placement group reserves for each server and worker")
    s.add_argument("--env", action="append", default=[], help="KEY=VALUE for every process (repeatable)")
    s.add_argument("--curve", action="store_true",
                   help="authenticate and encrypt a local job's links with CurveZMQ (KVPS_CURVE=1; a job on "
                        "other hosts always is, unless KVPS_CURVE=0); the launcher makes the keys")
    s.add_argument("--elastic", action="store_true", help="a dead worker is removed instead of ending the job, "
                                                          "and a replacement may join (KVPS_ELASTIC=1)")
    s.add_argument("--replicas", type=int, default=0, metavar="R",
                   help="each server's key ranges are also held by the next R servers, so the job survives R "
                        "server deaths (KVPS_REPLICAS; needs -s above R; docs/replication.md)")
    s.add_argument("--restart-servers", type=int, default=None, metavar="N",
                   help="with --replicas: start a new server in place of one that dies, at most N times over the "
                        "job (default: the number of servers; 0: never), so the job gets its R replicas back")
    s.add_argument("--restart-workers", type=int, default=0, metavar="N",
                   help="with --elastic: start a worker again, with the same command and rank, in place of one "
                        "that dies, at most N times over the job (default 0: the job goes on without it)")
    s.add_argument("--straggler", action="append", default=[], metavar="RANK=SPEC",
                   help="slow worker RANK by an extra delay per step: fixed:S, exp:MEAN or uniform:LO:HI "
                        "seconds (repeatable; see kvps/straggler.py)")
    s.add_argument("--straggler-seed", type=int, default=0, help="seed of random straggler delays")
    s.add_argument("--metrics", action="store_true",
                   help="every node serves Prometheus /metrics on a free port (KVPS_METRICS_PORT=0); the "
                        "scheduler prints each address and serves /targets for Prometheus (docs/observability.md)")
    s.add_argument("--resume", default=None, metavar="PATH",
                   help="restore the job from the checkpoint directory PATH (kv.save's, or KVPS_CHECKPOINT_DIR), "
                        "whatever number of servers saved it (sets KVPS_RESUME; docs/checkpoint.md)")
    s.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command")
    s.set_defaults(fn=cmd_launch)

    s = sub.add_parser("k8s", help="write Kubernetes manifests for a job (docs/launch.md)")
    k8s_sub = s.add_subparsers(dest="k8s_cmd", required=True)
    s = k8s_sub.add_parser("render", help="manifests in MXJob's roles: scheduler Pod and Service, "
                                          "servers StatefulSet, workers Indexed Job")
    s.add_argument("-n", "--num-workers", type=int, required=True)
    s.add_argument("-s", "--num-servers", type=int, default=1)
    s.add_argument("--image", required=True, help="the container image with kvps and the training script")
    s.add_argument("--name", default="kvps-job", help="the job's name: prefix of every object")
    s.add_argument("--namespace", default=None, help="the Kubernetes namespace (default: kubectl's)")
    s.add_argument("--port", type=int, default=9091, help="the scheduler's port")
    s.add_argument("--cpu", default="1", help="CPU request of each worker")
    s.add_argument("--memory", default="2Gi", help="memory request of each worker")
    s.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu limit of each worker")
    s.add_argument("--server-cpu", default="1", help="CPU request of each server")
    s.add_argument("--server-memory", default="2Gi", help="memory request of each server")
    s.add_argument("--env", action="append", default=[], help="KEY=VALUE for every container (repeatable)")
    s.add_argument("--elastic", action="store_true", help="a dead worker is removed instead of ending the job "
                                                          "(KVPS_ELASTIC=1 on every node)")
    s.add_argument("--restart-workers", type=int, default=0, metavar="N",
                   help="with --elastic: a failed worker's container starts again in its pod, at most N times")
    s.add_argument("--keys-placeholder", action="store_true",
                   help="leave the keys Secret empty (fill it from `kvps keys new`) instead of making keys")
    s.add_argument("-o", "--output", default=None, help="write here (mode 0600: it holds keys) instead of stdout")
    s.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command")
    s.set_defaults(fn=cmd_k8s)

    s = sub.add_parser("bench", help="benchmarks: pushpull, priority, kernels, compare")
    s.add_argument("what", choices=("pushpull", "priority", "kernels", "compare", "checkpoint"))
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_bench)

    sub.add_parser("emulate", add_help=False,
                   help="run a job on an emulated multi-host cluster: network namespaces, tc links (root)")

    sub.add_parser("experiment", add_help=False,
                   help="train real models under every consistency mode, with and without a straggler; "
                        "write a report (docs/experiment.md)")

    sub.add_parser("simulate", add_help=False,
                   help="a calibrated discrete-event model of a sync step, PS and ring, up to 1,024 workers "
                        "(docs/simulate.md)")

    sub.add_parser("fuzz", add_help=False,
                   help="send hostile frames to a job's daemons; report crashes and memory (kvps/tools/fuzz)")

    sub.add_parser("soak", add_help=False,
                   help="run jobs for minutes; report each daemon's memory growth per minute (kvps/tools/soak)")

    sub.add_parser("timeline", add_help=False, help="merge a KVPS_TIMELINE directory into one Chrome trace")
    sub.add_parser("top", add_help=False, help="a live terminal view of a running job (kvps/tools/top)")

    s = sub.add_parser("keys", help="make a job's CurveZMQ keys for daemons started by hand (docs/security.md)")
    keys_sub = s.add_subparsers(dest="keys_cmd", required=True)
    s = keys_sub.add_parser("new", help="write DIR/NAME.json (mode 0600) for H, S0.., W0..; never overwrites")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("-n", "--num-workers", type=int, required=True)
    s.add_argument("-s", "--num-servers", type=int, default=1)
    s.set_defaults(fn=cmd_keys)

    s = sub.add_parser("info", help="print the kernel backend, CPU features and CUDA status")
    s.set_defaults(fn=cmd_info)
    return p


def hear_interrupts():
    """Take SIGINT back when it is ignored. A shell starts a background job (`cmd &` in a script)
    with SIGINT ignored, and the processes it starts inherit that: a SIGINT sent on purpose (`kill
    -INT`, or `kvps experiment` stopping the `kvps launch` it runs: SIGINT, then SIGKILL after a
    grace period) would never reach their cleanup (the job's processes, emulated hosts). A job in
    the background still gets no Ctrl-C from the terminal."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    hear_interrupts()
    if argv[:1] in (["server"], ["scheduler"]):     # the daemons' own parsers (server/, scheduler/)
        from kvps import roles
        try:
            return roles.run(argv[0], argv[1:])
        except KVPSError as exc:
            print(f"kvps {argv[0]}: error: {exc}", file=sys.stderr)
            return 2
    if argv[:1] == ["emulate"]:          # its own parser: options before and after "--"
        from kvps.tools.emulate import main as emulate_main
        return emulate_main(argv[1:])
    if argv[:1] == ["experiment"]:       # its own parser too (kvps/tools/experiment/cli.py)
        from kvps.tools.experiment import main as experiment_main
        return experiment_main(argv[1:])
    if argv[:1] == ["simulate"]:         # and kvps/tools/simulate
        from kvps.tools.simulate import main as simulate_main
        return simulate_main(argv[1:])
    if argv[:1] == ["fuzz"]:             # and kvps/tools/fuzz
        from kvps.tools.fuzz import main as fuzz_main
        return fuzz_main(argv[1:])
    if argv[:1] == ["soak"]:             # and kvps/tools/soak
        from kvps.tools.soak import main as soak_main
        return soak_main(argv[1:])
    if argv[:1] == ["timeline"]:         # and kvps/tools/timeline
        from kvps.tools.timeline import main as timeline_main
        return timeline_main(argv[1:])
    if argv[:1] == ["top"]:              # and kvps/tools/top
        from kvps.tools.top import main as top_main
        return top_main(argv[1:])
    args = parser().parse_args(argv)
    try:
        return args.fn(args) or 0
    except KVPSError as exc:
        print(f"kvps {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
