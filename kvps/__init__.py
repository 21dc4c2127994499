"""kvps: a parameter server for distributed training, with MXNet KVStore's API.

    import kvps
    kv = kvps.create("dist_sync")      # in a job started by `kvps launch`
    kv.init("w", weights); kv.push("w", grad); kv.pull("w", out=weights)
"""
from . import optimizer
from .errors import (KVPSError, ConfigError, ProtocolError, KVTimeoutError, NodeFailure, RemoteError,
                     KernelUnavailable)
from .kvstore import KVStore, create

__version__ = "0.1.0"

__all__ = ["create", "KVStore", "optimizer", "KVPSError", "ConfigError", "ProtocolError", "KVTimeoutError",
           "NodeFailure", "RemoteError", "KernelUnavailable", "__version__"]
