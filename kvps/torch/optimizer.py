"""DistributedOptimizer: a torch optimizer whose gradients are reduced by kvps (sync, allreduce) or
whose update runs on the servers (async), sent bucket by bucket from backward hooks."""
import logging
import time

import torch

from kvps.torch import horovod
from kvps.torch.bucketing import BUCKET_BYTES, buckets
from kvps.torch.server_optimizer import server_optimizer
from kvps.torch.session import _SESSION, ASYNC, SUMMING, _telemetry, _type

log = logging.getLogger("kvps.torch")

_WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}   # compressions the ring runs as a dtype


class _Distributed:
    """Mixed in before the wrapped optimizer's class; see DistributedOptimizer."""

    def _groups(self):
        # Code that reads the gradients through the optimizer between backward() and step()
        # (GradScaler.unscale_, which scaler.step(opt) calls) gets them reduced: the reduction
        # finishes first, as if it had called synchronize(). (Stored under the same name, so torch's
        # own __init__ and __setstate__ work unchanged.)
        d = self.__dict__
        if d.get("_mode") in ("sync", "allreduce") and self._reducing():
            self.synchronize()
        return d["param_groups"]

    def _set_groups(self, groups):
        self.__dict__["param_groups"] = groups

    param_groups = property(_groups, _set_groups)

    def _reducing(self):
        """Whether gradients are being reduced (sent, not yet synchronized)."""
        return any(h is not None for h in self.__dict__.get("_handles", ()))

    def add_param_group(self, param_group):
        if "_keys" in self.__dict__:        # (torch's own __init__ adds the wrapped groups first)
            raise ValueError("add_param_group on a DistributedOptimizer: it reduces the parameters it was "
                             "made with, so a group added later would train on each worker's own gradients "
                             "alone. Give the optimizer every group before wrapping it (frozen parameters "
                             "too: a parameter without a gradient goes as zeros), or wrap a new optimizer")
        super().add_param_group(param_group)

    def _setup(self, named, mode, compression, passes, kv, update_on, bucket_bytes):
        self._mode, self._kv, self._k = mode, kv, passes
        self._update_on = update_on
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        prefix = _SESSION.prefix(kv, "o")
        self._keys = [prefix + name for name in self._names]
        n = len(self._params)
        if mode in ("async", "geo"):
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
        # KVPS_TIMELINE: each bucket's hook-to-sync time; otherwise None, and the hooks test only that
        self._telemetry = _telemetry(kv)
        if self._telemetry is not None:
            self._bucket_args = [{"keys": [self._keys[i] for i in members][:16], "nkeys": len(members),
                                  "bytes": sum(self._params[i].numel() * self._params[i].element_size()
                                               for i in members)} for members in self._buckets]
        # The ring sums what it is given: fp16 or bf16 compression (Horovod's Compression.fp16) casts
        # each bucket's gradients to that dtype for the collective and back. Servers compress themselves.
        self._wire = _WIRE.get(compression) if kv.type == "allreduce" and isinstance(compression, str) else None
        self._lows = [None] * len(self._buckets)
        self._reset()
        self._skip = False
        self._synced = False       # synchronize() has run since the last gradient: step() need not
        if compression is not None and self._wire is None:
            kv.set_gradient_compression({"type": compression} if isinstance(compression, str) else compression)
        weights = [p.detach() for p in self._params]
        kv.init(self._keys, weights if self._wire is None else [w.to(self._wire) for w in weights])
        if mode == "async":
            kv.pull(self._keys, out=weights)           # every worker starts from rank 0's weights
            if update_on == "server":
                self._rule = server_optimizer(self)
                kv.set_optimizer(self._rule)
                self._fresh = [torch.empty_like(w) for w in weights]
            else:
                self._base = [w.clone() for w in weights]
            kv.barrier()                               # nobody's pushes reach a worker's first pull
        if mode == "geo":
            kv.pull(self._keys, out=weights)           # every worker starts from rank 0's weights ...
            kv.barrier()                               # ... before anyone's first sync changes them
        if not (mode == "async" and update_on == "worker") and mode != "geo":
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
        self._versions = [None] * len(self._buckets)   # each sent gradient's torch version counter
        self._missing = [len(members) for members in self._buckets]   # gradients each bucket waits for
        self._passes = [0] * len(self._params)
        self._next = 0                                 # the first bucket not sent yet (ordered)
        if self._telemetry is not None:
            self._times = [[None, None, None] for _ in self._buckets]    # ready, handed, synced

    def _hook(self, index):
        def hook(param):
            self._synced = False
            self._passes[index] += 1
            if self._passes[index] > self._k:
                raise RuntimeError(f"a backward pass reached {self._names[index]!r} after its gradient was sent "
                                   f"(or queued with its bucket); call step() after every {self._k} backward "
                                   f"pass(es) (backward_passes_per_step)")
            if self._passes[index] == self._k:
                b = self._bucket_of[index]
                self._missing[b] -= 1
                if self._missing[b] == 0:
                    if self._telemetry is not None:
                        self._times[b][0] = time.time()
                    self._ready(b)
            if self._telemetry is not None:
                self._seen_synced()
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
        if self._telemetry is not None:
            times = self._times[b]
            times[1] = time.time()
            times[0] = times[0] or times[1]            # sent by synchronize(): a gradient was missing
        # The first layers, which the next forward pass needs first, rank highest where a kvstore
        # orders requests.
        priority = -min(members)
        if self._mode != "async":
            for i in members:
                p = self._params[i]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)       # an unused parameter still takes part in the round
                elif p.grad.is_sparse:
                    p.grad = p.grad.to_dense()         # Horovod's sparse_as_dense: kvps sends gradients dense
            if self._predivide != 1.0:
                torch._foreach_div_([self._params[i].grad for i in members], self._predivide)
            grads = [self._params[i].grad for i in members]
            if self._wire is not None or all(g.device.type == "cpu" and g.is_contiguous() for g in grads):
                # (a reply written into a CPU gradient leaves its version as it is: a change is the caller's)
                self._versions[b] = [g._version for g in grads]
            if self._wire is not None:
                grads = self._lows[b] = [g.to(self._wire) for g in grads]
            return self._kv.pushpull([self._keys[i] for i in members], grads, priority=priority, async_op=True)
        (i,) = members                                 # async: buckets of one
        p, key = self._params[i], self._keys[i]
        if p.grad is None:
            return self._kv.pull(key, out=self._fresh[i], priority=priority, async_op=True)
        return self._kv.pushpull(key, p.grad, out=self._fresh[i], priority=priority, async_op=True)

    def synchronize(self):
        """Wait for every bucket's reduction (sending, in bucket order, those not sent yet: a bucket
        with an unused parameter, which goes as zeros, or fewer backward passes than
        backward_passes_per_step) and average the gradients (sync, allreduce), or fetch the servers'
        fresh weights (async). geo: a collective that sends every change not sent yet and leaves every
        worker the merged weights (call it at the end of training, on every worker)."""
        if self._mode == "geo":
            weights = [p.detach() for p in self._params]
            self._kv.sync(self._keys)
            self._kv.pull(self._keys, out=weights)
            return
        if self._mode == "async" and self._update_on == "worker":
            return
        for b in range(len(self._buckets)):
            if self._handles[b] is None:
                self._handles[b] = self._send(b)
        timed = self._telemetry is not None
        for handle in self._handles:
            if timed:
                self._seen_synced()
            handle.wait()
        if self._mode != "async":
            self._check_unchanged()
        if self._wire is not None:
            with torch.no_grad():
                for members, lows in zip(self._buckets, self._lows):
                    torch._foreach_copy_([self._params[i].grad for i in members], lows)
            self._lows = [None] * len(self._buckets)
        if timed:
            self._seen_synced()
            for b, (ready, handed, synced) in enumerate(self._times):
                self._telemetry.bucket(b, ready, handed, synced, self._bucket_args[b])
        self._reset()
        self._kv.wait_all()                            # all done: this only empties the kvstore's list
        with torch.no_grad():
            if self._mode != "async":
                if self._kv.num_workers > 1 and self._average:
                    torch._foreach_div_([p.grad for p in self._params], self._kv.num_workers / self._predivide)
                elif self._predivide != 1.0:
                    torch._foreach_mul_([p.grad for p in self._params], self._predivide)
            else:
                torch._foreach_copy_([p.data for p in self._params], self._fresh)
        self._synced = self._mode != "async"

    def _check_unchanged(self):
        """Raise if a gradient was changed in place while it was being reduced (clipped or unscaled
        between backward() and step() without synchronize() first): the reduced values would
        overwrite the change without a word, and every worker would step with unclipped gradients."""
        changed = [self._names[i] for members, versions in zip(self._buckets, self._versions) if versions
                   for i, version in zip(members, versions) if self._params[i].grad._version != version]
        if changed:
            self._reset()
            raise RuntimeError(
                f"the gradients of {', '.join(map(repr, changed[:4]))}{' ...' if len(changed) > 4 else ''} were "
                f"changed in place while being reduced (clip_grad_norm_ or an unscale between backward() and "
                f"step()?): the reduced values would have overwritten the change. Call opt.synchronize() "
                f"first, then change the gradients, then opt.step() (as with Horovod: inside "
                f"opt.skip_synchronize())")

    def _seen_synced(self):
        """Timeline: mark the buckets whose sync is now complete (at each hook and each wait of
        synchronize(), so within one backward hook's interval of the last reply)."""
        now = None
        for times, handle in zip(self._times, self._handles):
            if times[2] is None and handle is not None and handle.done():
                times[2] = now = now or time.time()

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
        if self._mode == "geo":
            super().step()                             # a local step; every K-th also syncs (GEO)
            weights = [p.detach() for p in self._params]
            self._kv.pushpull(self._keys, weights, out=weights)
            return loss
        if self._mode == "async" and server_optimizer(self).spec() != self._rule.spec():
            raise ValueError(f"the servers run {self._rule}, set when the optimizer was wrapped, and the "
                             f"param groups now ask for {server_optimizer(self)} (an lr schedule?); "
                             f"use update_on='worker' to change hyperparameters during training")
        if not self._skip and not self._synced:
            self.synchronize()
        if self._mode != "async":
            super().step()
        self._synced = False
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
        if self._reducing():
            raise RuntimeError("zero_grad() while gradients are being reduced: call step() or synchronize() first. "
                               "(A backward through these parameters for another optimizer's loss, such as a "
                               "GAN's generator loss through its discriminator, starts their reduction too: "
                               "turn requires_grad off on them for that backward, as under Horovod)")
        self._reset()
        self._synced = False
        super().zero_grad(set_to_none)


class _Skip:
    def __init__(self, opt):
        self.opt = opt

    def __enter__(self):
        self.opt._skip = True

    def __exit__(self, *exc):
        self.opt._skip = False


def DistributedOptimizer(optimizer, named_parameters=None, mode=None, compression=None,
                         backward_passes_per_step=1, kvstore=None, update_on=None, bucket_bytes=BUCKET_BYTES,
                         k_steps=None, op=None, gradient_predivide_factor=1.0, sparse_as_dense=False, staleness=0):
    """Wrap a torch optimizer for a kvps job; returns an optimizer of the same class to use instead.

    mode: None (the mode of the process's kvstore: kvps.torch.init), "sync" (dist_sync servers sum
    gradients), "allreduce" (ring all-reduce), or "async"
    (dist_async: update_on="server", the default, runs the optimizer on the servers; "worker"
    steps locally and pushes weight deltas), or "geo" (dist_geo, GEO-SGD: every worker steps
    locally and every k_steps steps sends its weights' change and takes the merged weights;
    synchronize() at the end leaves every worker the same weights). compression: None, "fp16",
    "bf16", "2bit", "1bit", "topk" or a dict as kv.set_gradient_compression takes ("pull": True
    compresses what comes back too). backward_passes_per_step: gradients
    accumulate locally (summed, as torch does) and are sent on every k-th backward pass.
    kvstore: use this kvstore instead of the process's (kvps.torch.init). bucket_bytes (sync,
    allreduce): gradients travel in buckets of about this size (25 MiB, as torch DDP; the first
    bucket at most 1 MiB; on the ring at most KVPS_FUSION_BYTES), each bucket one pushpull, sent
    when its last gradient is ready; 0 sends each parameter on its own. opt.buckets lists them.
    op (Horovod's): hvd.Average (the default) divides the summed gradients by the number of
    workers, hvd.Sum leaves the sum (sync, allreduce). gradient_predivide_factor (Horovod's): with
    hvd.Average, divide by it before the sum and by size/factor after. sparse_as_dense: accepted
    for Horovod's scripts; kvps always sends a sparse gradient (nn.Embedding(sparse=True)) dense.
    staleness (BytePS's): 0 only; BytePS's pipelined steps are kvps's mode="async" or dist_ssp.

    The result shares the wrapped optimizer's param groups and state; use it, not the original.
    Every worker must wrap the same parameters, with the same names, in the same order.
    Raises ValueError for bad arguments and for optimizers the servers cannot run (async)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not a {type(optimizer).__name__}")
    if isinstance(optimizer, _Distributed):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if staleness != 0:
        raise ValueError(f"staleness={staleness!r}: BytePS's pipelined steps are not supported; kvps's stale "
                         f"training is mode='async' or a dist_ssp:S kvstore (docs/consistency.md)")
    if mode is None:
        mode = _SESSION.mode_of(_SESSION.kvstore(kvstore=kvstore, k_steps=k_steps))
    average = horovod.reduction(op)
    if not isinstance(gradient_predivide_factor, (int, float)) or gradient_predivide_factor <= 0 or \
            (gradient_predivide_factor != 1.0 and (not average or mode not in ("sync", "allreduce"))):
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} must be a number > 0, and "
                         f"other than 1 only with op=hvd.Average in mode 'sync' or 'allreduce' (as in Horovod)")
    if not average and mode not in ("sync", "allreduce"):
        raise ValueError(f"op=hvd.Sum applies to mode='sync' or 'allreduce', not mode={mode!r}")
    _type(mode)
    if update_on not in (None, "server", "worker") or (update_on is not None and mode != "async"):
        raise ValueError(f"update_on={update_on!r}: give 'server' or 'worker', and only with mode='async'")
    if k_steps is not None and mode != "geo":
        raise ValueError(f"k_steps={k_steps!r} applies to mode='geo' only, not mode={mode!r}")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be an int >= 1")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} must be an int >= 0 (0: one bucket per parameter)")
    named = _named(optimizer, named_parameters)
    kv = _SESSION.kvstore(mode, kvstore, k_steps)
    if mode == "geo":
        if getattr(kv, "mode", None) != "geo":
            raise ValueError(f"mode='geo' cannot run on a {kv.type} kvstore (it needs dist_geo:K)")
        if k_steps is not None and kv.k_steps != k_steps:
            raise ValueError(f"k_steps={k_steps!r}, but this process's kvstore syncs every {kv.k_steps} steps")
    elif kv.type not in (SUMMING if mode != "async" else ASYNC if update_on != "worker" else {"dist_async"}):
        raise ValueError(f"mode={mode!r}{', update_on=' + repr(update_on) if update_on else ''} cannot run on "
                         f"a {kv.type} kvstore (it needs {_type(mode)})")
    cls = type(type(optimizer).__name__, (_Distributed, type(optimizer)), {"__module__": "kvps.torch"})
    opt = cls.__new__(cls)
    torch.optim.Optimizer.__init__(opt, optimizer.param_groups, optimizer.defaults)   # the same group dicts
    for attr, value in vars(optimizer).items():
        if attr != "step":                             # an lr scheduler's patch of the original's step
            vars(opt).setdefault(attr, value)
    opt.state = optimizer.state
    opt._setup(named, mode, compression, backward_passes_per_step, kv, update_on or "server", bucket_bytes)
    opt._average = average
    opt._predivide = float(gradient_predivide_factor)
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
