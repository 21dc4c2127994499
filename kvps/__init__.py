"""kvps: a parameter server for distributed training, with MXNet KVStore's API.

    import kvps
    kv = kvps.create("dist_sync")      # in a job started by `kvps launch`
    kv.init("w", weights); kv.push("w", grad); kv.pull("w", out=weights)
"""
from kvps import lr_scheduler, optimizer
from kvps.errors import (KVPSError, ConfigError, ProtocolError, KVTimeoutError, NodeFailure, RemoteError,
                     KernelUnavailable, PerformanceWarning)
from kvps import kvstore
from kvps import kvstore as kv          # MXNet's mx.kv.create(...) and mx.kvstore.create(...)
from kvps.kvstore import KVStore, create
from kvps.kvstore.allreduce import allreduce
from kvps.kvstore.updater import Updater, get_updater

optimizer.Updater, optimizer.get_updater = Updater, get_updater     # MXNet's mx.optimizer.get_updater

__version__ = "0.1.0"

__all__ = ["create", "allreduce", "KVStore", "kv", "kvstore", "optimizer", "lr_scheduler", "KVPSError", "ConfigError",
           "ProtocolError",
           "KVTimeoutError", "NodeFailure", "RemoteError", "KernelUnavailable", "__version__"]


def _serve_mxnet_style():
    """`DMLC_ROLE=server python -c "import kvps"` runs that daemon and exits, as `import mxnet`
    does, so MXNet-style launch scripts start kvps jobs unchanged. `python -m kvps.cli server`
    and the `kvps` command are left alone (sys.argv[0] is "-m" while -m imports packages)."""
    import os
    import sys
    role = os.environ.get("DMLC_ROLE")
    argv0 = sys.argv[0] if sys.argv else ""
    if role in ("server", "scheduler") and argv0 != "-m" and os.path.basename(argv0) != "kvps":
        from kvps import roles
        sys.exit(roles.run(role, []))


_serve_mxnet_style()
