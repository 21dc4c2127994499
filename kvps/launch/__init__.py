"""`kvps launch`: start a whole job (scheduler, S servers, W workers) and supervise it.

    kvps launch -n 2 -s 1 -- python train.py --epochs 3                       # this machine
    kvps launch -n 2 -s 2 --launcher ssh -H hosts -- python train.py          # over ssh
    kvps launch -n 2 -s 2 --launcher ray [--address ADDR] -- python train.py  # on a Ray cluster
    kvps k8s render -n 2 -s 2 --image IMAGE -- python train.py                # Kubernetes manifests

Every child's output is printed with its role and rank ([H], [S0], [W1]). The launcher returns
the first non-zero worker exit code (0 when all succeed), or that of a daemon that died while the
workers ran, and stops every child it started, by pid, when one fails or on Ctrl-C.

One module per launcher: job (the processes of a job, and the local placement), ssh (hosts from a
hostfile; tether runs on the far side of each ssh connection), k8s (manifests), and kvps.ray;
restarts decides which dead servers of a replicated job get a replacement, and when.
docs/launch.md describes them all.
"""
from kvps.errors import ConfigError
from kvps.launch.job import Job, Local, run


def parse_env(items, option="--env"):
    """{KEY: VALUE} from ["KEY=VALUE", ...]; raises ConfigError naming a bad item."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{option} {item!r} is not KEY=VALUE")
        env[key] = value
    return env


def straggler_env(items, num_workers, seed=0):
    """{rank: variables} that make the workers named by --straggler RANK=SPEC options stragglers."""
    from kvps.straggler import parse_assignments
    return {rank: {"KVPS_STRAGGLER": str(spec), "KVPS_STRAGGLER_SEED": str(seed)}
            for rank, spec in parse_assignments(items, num_workers).items()}


def launch_local(num_workers, num_servers, command, env=None, worker_env=None, restart_servers=None,
                 restart_workers=0):
    """Run a job on this machine; returns its exit code (130 after Ctrl-C). restart_servers: the most
    replacements of dead servers in a replicated job (default: one per server); restart_workers: of
    dead workers in an elastic job (default: none)."""
    return run(Job(num_workers, num_servers, command, env, worker_env=worker_env, restart_servers=restart_servers,
                   restart_workers=restart_workers))


__all__ = ["Job", "Local", "run", "parse_env", "straggler_env", "launch_local"]
