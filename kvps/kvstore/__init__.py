"""The worker API: `create` picks a kvstore by type name (MXNet's names).

    kv = kvps.create("dist_sync")         # local | dist_sync (dist) | dist_async | dist_ssp:S | allreduce (ring)
    kv = kvps.create("dist_ssp:4")        # consistency options: docs/consistency.md
    kv = kvps.create("dist_sync", backup_workers=1)
    kv = kvps.create("dist_geo:4")        # GEO-SGD: local training, weight changes pushed every 4 steps

Modules: base (the API and its argument checks, shared by all), local (one process),
ps (the parameter-server client), geo (GEO-SGD on top of it), allreduce (the ring), engine (its call-order thread).
"""
from kvps.kvstore.base import KVStore
from kvps.ps.consistency import Consistency

# base type name -> implementation ("local", "allreduce") or the consistency mode of a dist kvstore
# (type names are case-insensitive, as MXNet's are)
TYPES = {
    "local": "local", "device": "local",
    "dist_sync": "sync", "dist": "sync", "dist_sync_device": "sync",
    "dist_async": "async",
    "dist_ssp": "ssp",
    "dist_geo": "geo",
    "allreduce": "allreduce",
}
# MXNet's other type names -> the nearest kvps type (docs/mxnet.md): the device variants differ in
# where MXNet reduces (GPU or CPU), which kvps's kernels choose for themselves.
ALIASES = {
    "dist_device_sync": "dist_sync", "dist_device_async": "dist_async",
    "local_update_cpu": "local", "local_allreduce_cpu": "local", "local_allreduce_device": "local", "nccl": "local",
    "horovod": "allreduce", "byteps": "dist_sync",
}
VALID = ("local, device, dist_sync, dist, dist_sync_device (each also as NAME:backup=B, B backup workers), "
         "dist_async, dist_ssp:S (S the staleness bound: an int >= 0, or inf), dist_geo:K (GEO-SGD, "
         "K local steps between syncs), allreduce; MXNet's "
         + ", ".join(f"{a} ({t})" for a, t in ALIASES.items()))
CONSISTENCY_OPTIONS = ("staleness", "backup_workers", "k_steps")


def create(name="local", **options):
    """A kvstore of the given type: a name of TYPES, for a dist kvstore with its consistency options
    after a ':' ("dist_ssp:4", "dist_ssp:inf", "dist_sync:backup=1") or as keywords
    (staleness=4, backup_workers=1, k_steps=4). Raises ValueError listing the valid types, or naming a bad option."""
    base, colon, suffix = name.partition(":") if isinstance(name, str) else (None, "", "")
    base = base and base.lower()
    kind = TYPES.get(ALIASES.get(base, base))
    if kind is None or (colon and kind in ("local", "allreduce")):
        raise ValueError(f"unknown kvstore type {name!r}; valid types: {VALID}")
    if kind in ("local", "allreduce"):
        given = [o for o in CONSISTENCY_OPTIONS if o in options]
        if given:
            raise ValueError(f"{given[0]}={options[given[0]]!r} applies to dist_ssp, dist_sync and dist_geo "
                             f"kvstores, not {name!r}")
        if kind == "local":
            from kvps.kvstore.local import LocalKVStore
            return LocalKVStore(name, **options)
        from kvps.kvstore.allreduce import RingKVStore
        return RingKVStore(name, **options)
    consistency = Consistency.parse(kind, suffix, name=name, staleness=options.pop("staleness", None),
                                    backup_workers=options.pop("backup_workers", None),
                                    k_steps=options.pop("k_steps", None))
    if consistency.mode == "geo":
        from kvps.kvstore.geo import GeoKVStore
        return GeoKVStore(name, consistency, **options)
    from kvps.kvstore.ps import DistKVStore
    return DistKVStore(name, consistency, **options)


__all__ = ["KVStore", "create", "TYPES", "ALIASES"]
