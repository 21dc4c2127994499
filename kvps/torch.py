"""torch training on kvps: a distributed optimizer, broadcasts of parameters and optimizer state, join().

    import kvps.torch as kt
    opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), mode="sync")     # sync | async | allreduce
    kt.broadcast_parameters(model.state_dict(), root_rank=0)
    kt.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in my_shard:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    kt.join()                  # every worker calls it when its data runs out

sync and allreduce: gradients are grouped into buckets (as torch DDP groups them) and each bucket
is sent (one pushpull, summed over workers) from a backward hook as soon as its last gradient is
ready; step() waits for those replies, divides by the number of workers and runs the wrapped
torch optimizer locally. async: the servers run the optimizer (translated into
kvps.optimizer, MXNet's formulas) on each worker's gradient as it arrives and workers pull fresh
weights; or, with update_on="worker", workers step locally and push weight deltas.

The module is named after torch but shadows nothing: kvps imports torch absolutely, so
`import torch` here and in kvps.arrays is the real torch. docs/torch.md has the details.
"""
import collections
import json
import logging
import weakref

import torch

import kvps

log = logging.getLogger("kvps.torch")

MODES = {"sync": "dist_sync", "async": "dist_async", "allreduce": "allreduce"}
# kvstore types whose pushpull returns the sum of the workers' pushes (when no optimizer is set),
# and those that apply each push as it comes (local, one worker, is both).
SUMMING = {"dist_sync", "dist", "dist_sync_device", "allreduce", "local", "device"}
ASYNC = {"dist_async", "local", "device"}


class Session:
    """The kvstore that this process's kvps.torch calls share, and the counters that name keys.

    A process is one worker of one job and registers with the scheduler once, so it has one
    kvstore (Horovod's hvd.init()); the first call that needs one creates it, or adopts the one
    a caller passes. Keys are named by call order, so every worker must make the same calls."""

    def __init__(self):
        self.kv = None
        self.mode = None                               # the mode self.kv was made for, if made here
        self._counts = weakref.WeakKeyDictionary()     # kvstore -> Counter of key prefixes handed out

    def kvstore(self, mode=None, kvstore=None):
        if kvstore is not None:
            if self.kv is None:
                self.kv = kvstore
            return kvstore
        if self.kv is None:
            self.mode = mode or "sync"
            self.kv = kvps.create(_type(self.mode))
        elif mode is not None and self.mode is not None and mode != self.mode:
            raise ValueError(f"mode={mode!r} needs a {_type(mode)} kvstore, but this process's kvps.torch "
                             f"kvstore is {self.kv.type} (made for mode={self.mode!r} by an earlier call); call "
                             f"kvps.torch.init(mode={mode!r}) before anything else, or pass kvstore=")
        return self.kv

    def prefix(self, kv, kind):
        """A key prefix for one call, the same on every worker that makes the same calls in order."""
        counts = self._counts.setdefault(kv, collections.Counter())
        counts[kind] += 1
        return f"kvps.torch/{kind}{counts[kind]}/"


_SESSION = Session()   # the one piece of process state: see Session


def _type(mode):
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    return MODES[mode]


def init(mode="sync", kvstore=None):
    """The kvstore kvps.torch uses in this process: `kvstore` if given (adopted), else one created
    with kvps.create for `mode` (sync: dist_sync, async: dist_async, allreduce: allreduce).
    Call it first when the first kvps.torch call is not the one that sets the mode."""
    return _SESSION.kvstore(mode, kvstore)


# ---- broadcasts ----

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


def _broadcast(named, root_rank, kv, kind):
    """Every worker ends with the root's values of the tensors in [(name, tensor)], in place."""
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


def broadcast_parameters(params, root_rank=0, kvstore=None):
    """Overwrite every worker's tensors with root_rank's, in place. `params` is a state_dict or
    (name, tensor) pairs (named_parameters()); tensors of every dtype and shape, buffers too.
    Every worker must call it with the same names. Raises TypeError for a value that is not a tensor."""
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


def broadcast_optimizer_state(optimizer, root_rank=0, kvstore=None):
    """Give every worker root_rank's optimizer state (momentum buffers, Adam moments and steps, scalars)
    and hyperparameters (lr, betas, ...), through optimizer.load_state_dict. Workers whose optimizer
    has not stepped yet get the root's state all the same."""
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


# ---- the optimizer, on the servers (async mode) ----

def _refuse(name, what, instead="use update_on='worker' (workers step locally and push weight deltas)"):
    raise ValueError(f"the servers cannot run {name} with {what}; {instead}")


def _server_rule(cls, g):
    """kvps.optimizer for one param group (all numbers as floats)."""
    num = {k: float(v) if torch.is_tensor(v) or type(v) in (int, float) else v for k, v in g.items() if k != "params"}
    name, lr, wd = cls.__name__, num["lr"], num.get("weight_decay", 0.0)
    if g.get("maximize"):
        _refuse(name, "maximize=True")
    if issubclass(cls, torch.optim.SGD):
        if num["momentum"] and num["dampening"]:
            _refuse(name, f"dampening={num['dampening']} (MXNet's momentum has none)")
        return kvps.optimizer.SGD(learning_rate=lr, momentum=num["momentum"], nesterov=bool(g["nesterov"]), wd=wd)
    if issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)):
        if g.get("amsgrad"):
            _refuse(name, "amsgrad=True")
        beta1, beta2 = (float(b) for b in g["betas"])
        if issubclass(cls, torch.optim.AdamW) or g.get("decoupled_weight_decay"):
            # torch decays by lr*wd*w; MXNet's adamw by eta*wd*w: fold lr into wd, eta = 1
            return kvps.optimizer.AdamW(learning_rate=lr, beta1=beta1, beta2=beta2, epsilon=num["eps"],
                                        wd=lr * wd, eta=1.0)
        return kvps.optimizer.Adam(learning_rate=lr, beta1=beta1, beta2=beta2, epsilon=num["eps"], wd=wd)
    if issubclass(cls, torch.optim.Adagrad):
        if num["lr_decay"] or num["initial_accumulator_value"]:
            _refuse(name, f"lr_decay={num['lr_decay']} or initial_accumulator_value="
                          f"{num['initial_accumulator_value']} (MXNet's AdaGrad has neither)")
        # MXNet adds epsilon inside the square root, torch outside: eps**2 agrees where it matters most
        return kvps.optimizer.AdaGrad(learning_rate=lr, epsilon=num["eps"] ** 2, wd=wd)
    if issubclass(cls, torch.optim.RMSprop):
        if g.get("centered") or num["momentum"]:
            _refuse(name, "centered=True or momentum (kvps's RMSProp is MXNet's plain one)")
        return kvps.optimizer.RMSProp(learning_rate=lr, gamma1=num["alpha"], epsilon=num["eps"] ** 2, wd=wd)
    _refuse(name, "its update rule", "the servers know SGD, Adam, AdamW, Adagrad and RMSprop; "
                                     "use update_on='worker' (workers step locally and push weight deltas)")


def server_optimizer(optimizer):
    """The kvps.optimizer that applies, on the servers, what the torch `optimizer` does locally
    (docs/torch.md says which match torch exactly). Raises ValueError for optimizers and options
    the servers cannot run, and for param groups that differ (the servers run one rule)."""
    rules = [_server_rule(type(optimizer), g) for g in optimizer.param_groups]
    for i, rule in enumerate(rules[1:], 1):
        if rule.spec() != rules[0].spec():
            raise ValueError(f"param groups 0 and {i} have different hyperparameters ({rules[0]} and {rule}); "
                             f"the servers run one rule for all keys: use update_on='worker'")
    return rules[0]


# ---- the distributed optimizer ----

BUCKET_BYTES = 25 << 20          # torch DDP's bucket_cap_mb
FIRST_BUCKET_BYTES = 1 << 20     # DDP's first bucket: the last layers' gradients start travelling early


def buckets(params, limit=BUCKET_BYTES, first=FIRST_BUCKET_BYTES):
    """Group parameters as DDP does: [[indices into params]], in reverse order (the order backward
    completes their gradients). A bucket ends where the dtype or device changes or the next
    gradient would take it past `limit` bytes (the first bucket past min(limit, first)); a gradient
    bigger than that is a bucket of its own. limit=0: one bucket per parameter."""
    groups, current, size, kind = [], [], 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        cap = limit if groups else min(limit, first)
        if current and ((p.dtype, p.device) != kind or size + nbytes > cap):
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        kind = (p.dtype, p.device)
    if current:
        groups.append(current)
    return groups


class _Distributed:
    """Mixed in before the wrapped optimizer's class; see DistributedOptimizer."""

    def _setup(self, named, mode, compression, passes, kv, update_on, bucket_bytes):
        self._mode, self._kv, self._k = mode, kv, passes
        self._update_on = update_on
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        prefix = _SESSION.prefix(kv, "o")
        self._keys = [prefix + name for name in self._names]
        n = len(self._params)
        if mode == "async":
            bucket_bytes = 0                           # each push is an update of its own on the servers
        elif kv.type == "allreduce":                   # the ring fuses up to this much into one collective
            bucket_bytes = min(bucket_bytes, kv.cfg.fusion_bytes)
        self._buckets = buckets(self._params, bucket_bytes)
        self._bucket_of = [0] * n
        for b, members in enumerate(self._buckets):
            for i in members:
                self._bucket_of[i] = b
        # The ring needs every worker to run the same collectives in the same order: send buckets in
        # bucket order, whatever order their gradients complete in. Servers take keys in any order.
        self._ordered = mode == "allreduce"
        self._reset()
        self._skip = False
        if compression is not None:
            kv.set_gradient_compression({"type": compression} if isinstance(compression, str) else compression)
        weights = [p.detach() for p in self._params]
        kv.init(self._keys, weights)
        if mode == "async":
            kv.pull(self._keys, out=weights)           # every worker starts from rank 0's weights
            if update_on == "server":
                self._rule = server_optimizer(self)
                kv.set_optimizer(self._rule)
                self._fresh = [torch.empty_like(w) for w in weights]
            else:
                self._base = [w.clone() for w in weights]
            kv.barrier()                               # nobody's pushes reach a worker's first pull
        if not (mode == "async" and update_on == "worker"):
            for i, p in enumerate(self._params):
                p.register_post_accumulate_grad_hook(self._hook(i))
        log.info("W%s: %s over %s (mode %s%s), %d parameters in %d buckets as keys %s*", kv.rank,
                 type(self).__name__, kv.type, mode, f", updates on the {update_on}" if mode == "async" else "",
                 n, len(self._buckets), prefix)

    @property
    def buckets(self):
        """The parameter names of each bucket, in the order the buckets are sent."""
        return [[self._names[i] for i in members] for members in self._buckets]

    def _reset(self):
        self._handles = [None] * len(self._buckets)
        self._missing = [len(members) for members in self._buckets]   # gradients each bucket waits for
        self._passes = [0] * len(self._params)
        self._next = 0                                 # the first bucket not sent yet (ordered)

    def _hook(self, index):
        def hook(param):
            self._passes[index] += 1
            if self._passes[index] > self._k:
                raise RuntimeError(f"a backward pass reached {self._names[index]!r} after its gradient was sent "
                                   f"(or queued with its bucket); call step() after every {self._k} backward "
                                   f"pass(es) (backward_passes_per_step)")
            if self._passes[index] == self._k:
                b = self._bucket_of[index]
                self._missing[b] -= 1
                if self._missing[b] == 0:
                    self._ready(b)
        return hook

    def _ready(self, b):
        if not self._ordered:
            self._handles[b] = self._send(b)
            return
        while self._next < len(self._buckets) and self._missing[self._next] == 0:
            self._handles[self._next] = self._send(self._next)
            self._next += 1

    def _send(self, b):
        """Send bucket b as one call (one fused collective on the ring; one message per server)."""
        members = self._buckets[b]
        # The first layers, which the next forward pass needs first, rank highest where a kvstore
        # orders requests.
        priority = -min(members)
        if self._mode != "async":
            for i in members:
                p = self._params[i]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)       # an unused parameter still takes part in the round
            return self._kv.pushpull([self._keys[i] for i in members], [self._params[i].grad for i in members],
                                     priority=priority, async_op=True)
        (i,) = members                                 # async: buckets of one
        p, key = self._params[i], self._keys[i]
        if p.grad is None:
            return self._kv.pull(key, out=self._fresh[i], priority=priority, async_op=True)
        return self._kv.pushpull(key, p.grad, out=self._fresh[i], priority=priority, async_op=True)

    def synchronize(self):
        """Wait for every bucket's reduction (sending, in bucket order, those not sent yet: a bucket
        with an unused parameter, which goes as zeros, or fewer backward passes than
        backward_passes_per_step) and average the gradients (sync, allreduce), or fetch the servers'
        fresh weights (async)."""
        if self._mode == "async" and self._update_on == "worker":
            return
        for b in range(len(self._buckets)):
            if self._handles[b] is None:
                self._handles[b] = self._send(b)
        for handle in self._handles:
            handle.wait()
        self._reset()
        self._kv.wait_all()                            # all done: this only empties the kvstore's list
        with torch.no_grad():
            if self._mode != "async":
                if self._kv.num_workers > 1:
                    torch._foreach_div_([p.grad for p in self._params], float(self._kv.num_workers))
            else:
                torch._foreach_copy_([p.data for p in self._params], self._fresh)

    def skip_synchronize(self):
        """with opt.skip_synchronize(): opt.step() -- after an explicit synchronize() (to clip the
        averaged gradients, say), step without synchronizing again."""
        return _Skip(self)

    def step(self, closure=None):
        """closure (if any) runs first, once; then synchronize() and the update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._mode == "async" and self._update_on == "worker":
            self._step_deltas()
            return loss
        if self._mode == "async" and server_optimizer(self).spec() != self._rule.spec():
            raise ValueError(f"the servers run {self._rule}, set when the optimizer was wrapped, and the "
                             f"param groups now ask for {server_optimizer(self)} (an lr schedule?); "
                             f"use update_on='worker' to change hyperparameters during training")
        if not self._skip:
            self.synchronize()
        if self._mode != "async":
            super().step()
        return loss

    step.hooked = True      # torch must not wrap this step in its hooks: the wrapped class's step runs them

    def _step_deltas(self):
        """Step locally, push the change to the weights (dist_async adds it), take the sum back."""
        super().step()
        with torch.no_grad():
            torch._foreach_sub_(self._base, [p.detach() for p in self._params])
            torch._foreach_neg_(self._base)            # base now holds this step's delta
            self._kv.pushpull(self._keys, self._base, out=[p.detach() for p in self._params])
            torch._foreach_copy_(self._base, [p.detach() for p in self._params])

    def zero_grad(self, set_to_none=True):
        if any(h is not None for h in self._handles):
            raise RuntimeError("zero_grad() while gradients are being reduced: call step() or synchronize() first")
        self._reset()
        super().zero_grad(set_to_none)


class _Skip:
    def __init__(self, opt):
        self.opt = opt

    def __enter__(self):
        self.opt._skip = True

    def __exit__(self, *exc):
        self.opt._skip = False


def DistributedOptimizer(optimizer, named_parameters=None, mode="sync", compression=None,
                         backward_passes_per_step=1, kvstore=None, update_on=None, bucket_bytes=BUCKET_BYTES):
    """Wrap a torch optimizer for a kvps job; returns an optimizer of the same class to use instead.

    mode: "sync" (dist_sync servers sum gradients), "allreduce" (ring all-reduce), or "async"
    (dist_async: update_on="server", the default, runs the optimizer on the servers; "worker"
    steps locally and pushes weight deltas). compression: None, "fp16", "bf16", "2bit", "1bit",
    "topk" or a dict as kv.set_gradient_compression takes. backward_passes_per_step: gradients
    accumulate locally (summed, as torch does) and are sent on every k-th backward pass.
    kvstore: use this kvstore instead of the process's (kvps.torch.init). bucket_bytes (sync,
    allreduce): gradients travel in buckets of about this size (25 MiB, as torch DDP; the first
    bucket at most 1 MiB; on the ring at most KVPS_FUSION_BYTES), each bucket one pushpull, sent
    when its last gradient is ready; 0 sends each parameter on its own. opt.buckets lists them.

    The result shares the wrapped optimizer's param groups and state; use it, not the original.
    Every worker must wrap the same parameters, with the same names, in the same order.
    Raises ValueError for bad arguments and for optimizers the servers cannot run (async)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not a {type(optimizer).__name__}")
    if isinstance(optimizer, _Distributed):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    _type(mode)
    if update_on not in (None, "server", "worker") or (update_on is not None and mode != "async"):
        raise ValueError(f"update_on={update_on!r}: give 'server' or 'worker', and only with mode='async'")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be an int >= 1")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} must be an int >= 0 (0: one bucket per parameter)")
    named = _named(optimizer, named_parameters)
    kv = _SESSION.kvstore(mode, kvstore)
    if kv.type not in (SUMMING if mode != "async" else ASYNC if update_on != "worker" else {"dist_async"}):
        raise ValueError(f"mode={mode!r}{', update_on=' + repr(update_on) if update_on else ''} cannot run on "
                         f"a {kv.type} kvstore (it needs {_type(mode)})")
    cls = type(type(optimizer).__name__, (_Distributed, type(optimizer)), {"__module__": __name__})
    opt = cls.__new__(cls)
    torch.optim.Optimizer.__init__(opt, optimizer.param_groups, optimizer.defaults)   # the same group dicts
    for attr, value in vars(optimizer).items():
        if attr != "step":                             # an lr scheduler's patch of the original's step
            vars(opt).setdefault(attr, value)
    opt.state = optimizer.state
    opt._setup(named, mode, compression, backward_passes_per_step, kv, update_on or "server", bucket_bytes)
    return opt


def _named(optimizer, named_parameters):
    """[(name, param)] for the optimizer's trainable parameters, in the order given (model order)."""
    in_opt = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        named = [(f"param.{i}", p) for i, p in enumerate(in_opt)]
    else:
        named = list(named_parameters)
        names = [n for n, _ in named]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"named_parameters has these names more than once: {', '.join(dup)}")
        known = {id(p) for _, p in named}
        missing = [i for i, p in enumerate(in_opt) if id(p) not in known]
        if missing:
            raise ValueError(f"{len(missing)} of the optimizer's parameters are not in named_parameters "
                             f"(positions {missing[:5]}); pass model.named_parameters()")
        ids = {id(p) for p in in_opt}
        named = [(n, p) for n, p in named if id(p) in ids]
    return [(n, p) for n, p in named if p.requires_grad]


# ---- join ----

def join(kvstore=None):
    """Say this worker has no more data, wait until every worker has said so (Horovod's join), and
    return the rank of the last worker to join: the one that trained longest, so
    broadcast_parameters(model.state_dict(), root_rank=join()) leaves every worker its weights.

    In sync mode a joined worker counts as pushing zeros, so the others' rounds close without it
    and their averages still divide by all workers. Every worker calls join() when its data runs
    out. Raises KVPSError where the kvstore cannot join."""
    kv = _SESSION.kvstore(kvstore=kvstore)
    try:
        return kv.join()
    except NotImplementedError as exc:
        raise kvps.KVPSError(str(exc)) from None
