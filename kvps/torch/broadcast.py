"""Broadcasts from one worker to all: parameters and buffers (any dtype, sent as exact int32 words)
and optimizer state (tensors as words, the rest as JSON)."""
import json

import torch

from kvps.errors import KVPSError
from kvps.torch.session import _SESSION, SUMMING


def _words(t):
    """(int32 tensor holding t's bytes, copy-back callable or None). Any dtype travels as words:
    exact, never compressed, and summable (zeros from non-root ranks leave the bits as they are)."""
    t = t.detach()
    n = t.numel() * t.element_size()
    if t.device.type == "cpu" and t.is_contiguous() and n % 4 == 0 and t.storage_offset() * t.element_size() % 4 == 0:
        return t.reshape(-1).view(torch.uint8).view(torch.int32), None
    words = torch.zeros(-(-n // 4), dtype=torch.int32)
    words.view(torch.uint8)[:n] = t.reshape(-1).view(torch.uint8).cpu()
    return words, lambda: t.copy_(words.view(torch.uint8)[:n].view(t.dtype).reshape(t.shape))


def _refuse_late(kv, what):
    """A worker that joined a running elastic job (kvps launch --elastic) would get, from a broadcast,
    what the root sent when the job began: the others do not broadcast again. Where the weights live
    on the workers (sync), that is a stale model, so it is refused, loudly."""
    node = getattr(kv, "_node", None)
    if node is not None and node.membership.get("late") and _SESSION.mode_of(kv) != "async":
        raise KVPSError(f"{what}: this worker joined a running elastic job, and in mode "
                        f"{_SESSION.mode_of(kv)!r} the weights live on the workers, which do not broadcast "
                        f"again: it would start from the job's first values. Train an elastic job whose "
                        f"workers may be replaced with mode='async' (the weights live on the servers), or "
                        f"restart the whole job from a checkpoint (kvps launch --resume)")


def _broadcast(named, root_rank, kv, kind):
    """Every worker ends with the root's values of the tensors in [(name, tensor)], in place."""
    _refuse_late(kv, "broadcast")
    prefix = _SESSION.prefix(kv, kind)
    if not isinstance(root_rank, int) or not 0 <= root_rank < kv.num_workers:
        raise ValueError(f"root_rank={root_rank!r} is not a worker rank (0..{kv.num_workers - 1})")
    named = [(name, t) for name, t in named if t.numel()]
    if not named:
        return
    keys = [prefix + name for name, _ in named]
    packed = [_words(t) for _, t in named]
    words = [w for w, _ in packed]
    if root_rank == 0:
        kv.init(keys, words)                       # rank 0's values are stored; the others wait for them
        if kv.rank != 0:
            kv.pull(keys, out=words)
    else:
        if kv.type not in SUMMING:
            raise ValueError(f"broadcast from root_rank={root_rank} needs a kvstore whose pushpull sums "
                             f"(dist_sync, allreduce); {kv.type} applies each push: use root_rank=0")
        kv.init(keys, words)
        sent = words if kv.rank == root_rank else [torch.zeros_like(w) for w in words]
        kv.pushpull(keys, sent, out=words)         # the root's words plus zeros
    for _, back in packed:
        if back is not None:
            back()


def broadcast_parameters(params, root_rank=0, kvstore=None, prefix=None):
    """Overwrite every worker's tensors with root_rank's, in place. `params` is a state_dict or
    (name, tensor) pairs (named_parameters()); tensors of every dtype and shape, buffers too.
    Every worker must call it with the same names. Raises TypeError for a value that is not a tensor.
    prefix: BytePS's, accepted (the names are the params' own)."""
    items = list(params.items()) if isinstance(params, dict) else list(params)
    for name, t in items:
        if not torch.is_tensor(t):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(t).__name__}, not a tensor")
    _broadcast(items, root_rank, _SESSION.kvstore(kvstore=kvstore), "p")


def _broadcast_json(obj, root_rank, kv):
    """root_rank's `obj` (JSON-able) on every worker."""
    data = json.dumps(obj).encode() if kv.rank == root_rank else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    _broadcast([("size", size)], root_rank, kv, "j")
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(int(size), dtype=torch.uint8)
    _broadcast([("json", buf)], root_rank, kv, "j")
    return json.loads(bytes(buf.numpy()))


def _plain(where, value):
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    if value is None or isinstance(value, (bool, int, float, str, list)):
        return value
    raise TypeError(f"broadcast_optimizer_state: {where} is a {type(value).__name__}, which cannot be sent")


def _like(local, value):
    """A received plain value in the type the local value has (tuple, tensor)."""
    if torch.is_tensor(local):
        return torch.tensor(value, dtype=local.dtype, device=local.device)
    return tuple(value) if isinstance(local, tuple) else value


def broadcast_optimizer_state(optimizer, root_rank=0, kvstore=None, prefix=None):
    """Give every worker root_rank's optimizer state (momentum buffers, Adam moments and steps, scalars)
    and hyperparameters (lr, betas, ...), through optimizer.load_state_dict. Workers whose optimizer
    has not stepped yet get the root's state all the same. prefix: BytePS's, accepted."""
    kv = _SESSION.kvstore(kvstore=kvstore)
    local = optimizer.state_dict()
    meta = None
    if kv.rank == root_rank:
        meta = {"groups": [{k: _plain(f"param group {i} {k}", v) for k, v in g.items() if k != "params"}
                           for i, g in enumerate(local["param_groups"])],
                "state": {str(i): {k: ["tensor", str(v.dtype).split(".")[1], list(v.shape)] if torch.is_tensor(v)
                                   else ["value", _plain(f"state {i} {k}", v)] for k, v in s.items()}
                          for i, s in local["state"].items()}}
    meta = _broadcast_json(meta, root_rank, kv)
    if len(meta["groups"]) != len(local["param_groups"]):
        raise ValueError(f"broadcast_optimizer_state: rank {root_rank} has {len(meta['groups'])} param groups, "
                         f"rank {kv.rank} has {len(local['param_groups'])}")
    state, tensors = {}, []
    for index, entries in meta["state"].items():
        mine = local["state"].get(int(index), {})
        state[int(index)] = {}
        for name, (kind, *rest) in entries.items():
            if kind == "value":
                state[int(index)][name] = rest[0]
                continue
            dtype, shape = getattr(torch, rest[0]), tuple(rest[1])
            t = mine.get(name)
            if not (torch.is_tensor(t) and t.dtype == dtype and tuple(t.shape) == shape):
                t = torch.zeros(shape, dtype=dtype)
            state[int(index)][name] = t
            tensors.append((f"{index}.{name}", t))
    _broadcast(tensors, root_rank, kv, "s")
    groups = [dict(g, **{k: _like(g.get(k), v) for k, v in root.items()})
              for g, root in zip(local["param_groups"], meta["groups"])]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
