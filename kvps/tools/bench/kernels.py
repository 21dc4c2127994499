"""kvps bench kernels: GB/s of every kernel, beside numpy, torch and the memory bandwidth.

    kvps bench kernels                    # every CPU backend, 64 MB arrays
    kvps bench kernels --quick            # 16 MB, fewer repeats: a smoke run
    kvps bench kernels --backend cuda     # torch CUDA tensors, beside torch on the GPU
    python -m kvps.tools.bench.kernels --size-mb 256 --backend c --only sum,adam

GB/s counts the bytes each operation must read and write (an in-place update of a
64 MB float32 array from a 64 MB gradient moves 192 MB), so rows compare with each
other and with the memory bandwidth, measured in the same run as a large numpy copy
(read + write; a copy also pays a hidden read of its destination, so in-place kernels
can beat it). Each figure is the best of --repeat rounds after a warm-up; every round runs
each contender once, so noise from other processes hits them alike. The numpy column
is the same operation written as numpy expressions (for the optimizers, the reference
implementation), the torch column torch's CPU equivalent on the same memory. Ends with
the issue's targets and whether each is met. This is a benchmark, not a test.
"""
import argparse
import dataclasses
import os
import platform
import sys
import time

import numpy as np

from kvps import kernels
from kvps.errors import KernelUnavailable
from kvps.kernels import reference
from kvps.kernels.reference import bfloat16

F32, F16 = np.float32, np.float16
@dataclasses.dataclass
class Case:
    op: str
    dtype: str
    nbytes: int                 # bytes read + written by one call
    run: object                 # run(kernel_module): one call on the backend under test
    numpy: object = None        # one call of the numpy equivalent
    torch: object = None        # one call of the torch equivalent, or None
    input_bytes: int = 0        # float32 input bytes (compression: the per-core target)


def _interleaved(fns, repeat):
    """Best time of each function over `repeat` rounds, each round running every function
    once, so a burst of noise from other processes hits them all alike."""
    best = {}
    for name, fn in fns.items():
        fn()  # warm-up: first-touch page faults, numba compilation
        best[name] = float("inf")
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def registry_backend(name):
    """The public kvps.kernels functions with `name` as the active backend."""
    if kernels.backend() != name:
        kernels.use_backend(name)
    return kernels


def _best(fn, repeat):
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _t(torch, a):
    """A torch view of a numpy array (bfloat16 through its bits)."""
    if a.dtype == np.dtype(bfloat16):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _fill(n, dtype, rng, low=0.5, high=1.5):
    a = np.empty(n, dtype)
    if np.dtype(dtype).kind in "iu":
        a[...] = rng.integers(-1000, 1000, size=n)
    else:
        a[...] = rng.uniform(low, high, size=n).astype(np.float32)
    return a


def build_cases(size_mb, only=None):
    """The benchmark cases at the given array size (bytes of the largest operand)."""
    rng = np.random.default_rng(0)
    torch = _torch()
    size = int(size_mb * 2**20)
    cases = []

    def want(op):
        return not only or any(o in op for o in only)

    # ---- sums -----------------------------------------------------------------------
    for dt in (np.float32, np.float64, np.float16, bfloat16, np.int32, np.int64):
        if not want("sum_into"):
            break
        n = size // np.dtype(dt).itemsize
        d, s = _fill(n, dt, rng), _fill(n, dt, rng, -1e-3, 1e-3)
        td, ts = (_t(torch, d), _t(torch, s)) if torch else (None, None)
        cases.append(Case("sum_into", np.dtype(dt).name, 3 * d.nbytes,
                          lambda k, d=d, s=s: k.sum_into(d, s),
                          lambda d=d, s=s: np.add(d, s, out=d),
                          (lambda td=td, ts=ts: td.add_(ts)) if torch else None))
    for dt in (np.float32, np.float16, bfloat16):
        if not want("sum_sources"):
            break
        n = size // np.dtype(dt).itemsize
        srcs = [_fill(n, dt, rng) for _ in range(4)]
        d = np.empty(n, dt)
        tsrcs, td = ([_t(torch, x) for x in srcs], _t(torch, d)) if torch else (None, None)

        def np_sources(d=d, srcs=srcs):
            np.add(srcs[0], srcs[1], out=d)
            for x in srcs[2:]:
                np.add(d, x, out=d)

        def torch_sources(td=td, tsrcs=tsrcs):
            torch.add(tsrcs[0], tsrcs[1], out=td)
            for x in tsrcs[2:]:
                td.add_(x)

        cases.append(Case("sum_sources(4)", np.dtype(dt).name, 5 * d.nbytes,
                          lambda k, d=d, srcs=srcs: k.sum_sources(d, srcs), np_sources,
                          torch_sources if torch else None))

    # ---- scale, axpy, casts -----------------------------------------------------------
    for dt in (np.float32, np.float16, bfloat16):
        n = size // np.dtype(dt).itemsize
        x, y = _fill(n, dt, rng), _fill(n, dt, rng)
        tx, ty = (_t(torch, x), _t(torch, y)) if torch else (None, None)
        name = np.dtype(dt).name
        if want("scale"):
            cases.append(Case("scale", name, 2 * x.nbytes, lambda k, x=x: k.scale(x, 1.0),
                              lambda x=x, dt=dt: np.multiply(x, np.dtype(dt).type(1.0), out=x),
                              (lambda tx=tx: tx.mul_(1.0)) if torch else None))
        if want("axpy"):
            cases.append(Case("axpy", name, 3 * x.nbytes, lambda k, x=x, y=y: k.axpy(y, 1e-3, x),
                              lambda x=x, y=y, dt=dt: np.add(y, np.dtype(dt).type(1e-3) * x, out=y),
                              (lambda tx=tx, ty=ty: ty.add_(tx, alpha=1e-3)) if torch else None))
    if want("cast"):
        n = size // 4
        f = _fill(n, F32, rng)
        for low in (np.float16, bfloat16):
            h = np.empty(n, low)
            tf, th = (_t(torch, f), _t(torch, h)) if torch else (None, None)
            lname = np.dtype(low).name
            cases.append(Case("cast", f"float32->{lname}", f.nbytes + h.nbytes, lambda k, f=f, h=h: k.cast(f, h),
                              lambda f=f, h=h: np.copyto(h, f, casting="unsafe"),
                              (lambda tf=tf, th=th: th.copy_(tf)) if torch else None))
            cases.append(Case("cast", f"{lname}->float32", f.nbytes + h.nbytes, lambda k, f=f, h=h: k.cast(h, f),
                              lambda f=f, h=h: np.copyto(f, h, casting="unsafe"),
                              (lambda tf=tf, th=th: tf.copy_(th)) if torch else None))

    # ---- optimizers (float32 weights; float16/bfloat16 gradients for multi-precision) ---
    n = size // 4
    grads = {np.dtype(g): _fill(n, g, rng, -1e-3, 1e-3) for g in (np.float32, np.float16, bfloat16)}
    common = dict(wd=1e-4, rescale_grad=1.0, clip_gradient=None)
    opts = [
        ("sgd_update(momentum)", 1, lambda m, w, g, s: m.sgd_update(w, g, s[0], lr=1e-3, momentum=0.9, **common)),
        ("sgd_update(nesterov)", 1, lambda m, w, g, s: m.sgd_update(w, g, s[0], lr=1e-3, momentum=0.9,
                                                                     nesterov=True, **common)),
        ("adam_update", 2, lambda m, w, g, s: m.adam_update(w, g, s[0], s[1], lr=1e-3, **common)),
        ("adamw_update", 2, lambda m, w, g, s: m.adamw_update(w, g, s[0], s[1], lr=1e-3, **common)),
        ("adagrad_update", 1, lambda m, w, g, s: m.adagrad_update(w, g, s[0], lr=1e-3, **common)),
        ("rmsprop_update", 1, lambda m, w, g, s: m.rmsprop_update(w, g, s[0], lr=1e-3, **common)),
    ]
    for op, nstates, fn in opts:
        if not want(op.split("(")[0]):
            continue
        # each update its own weight and states: second moments must stay >= 0
        w = _fill(n, F32, rng)
        states = [_fill(n, F32, rng, 1e-4, 1e-3) for _ in range(2)]
        for gdt in ((np.float32, np.float16, bfloat16) if op == "adam_update" else (np.float32,)):
            g = grads[np.dtype(gdt)]
            nbytes = 2 * w.nbytes + g.nbytes + 2 * nstates * w.nbytes
            tw = _torch_update(torch, op, w, g, states) if torch else None
            cases.append(Case(op, f"grad {np.dtype(gdt).name}", nbytes,
                              lambda k, fn=fn, w=w, g=g, states=states: fn(k, w, g, states),
                              lambda fn=fn, w=w, g=g, states=states: fn(reference, w, g if g.dtype == F32 else g.astype(F32), states),
                              tw))

    # ---- compression -------------------------------------------------------------------
    g = _fill(n, F32, rng, -1.0, 1.0)
    r = _fill(n, F32, rng, -0.25, 0.25)
    dst = np.zeros(n, F32)
    if want("2bit"):
        words2 = kernels.reference.compress_2bit(g, r.copy(), 0.5)
        cases.append(Case("compress_2bit", "float32", 3 * g.nbytes + words2.nbytes,
                          lambda k: k.compress_2bit(g, r, 0.5), lambda: reference.compress_2bit(g, r, 0.5),
                          input_bytes=g.nbytes))
        cases.append(Case("decompress_2bit_add", "float32", 2 * dst.nbytes + words2.nbytes,
                          lambda k: k.decompress_2bit_add(words2, 0.5, dst),
                          lambda: reference.decompress_2bit_add(words2, 0.5, dst)))
    if want("1bit"):
        words1 = kernels.reference.compress_1bit(g, r.copy(), 0.0)
        cases.append(Case("compress_1bit", "float32", 3 * g.nbytes + words1.nbytes,
                          lambda k: k.compress_1bit(g, r, 0.0), lambda: reference.compress_1bit(g, r, 0.0),
                          input_bytes=g.nbytes))
        cases.append(Case("decompress_1bit_add", "float32", 2 * dst.nbytes + words1.nbytes,
                          lambda k: k.decompress_1bit_add(words1, dst),
                          lambda: reference.decompress_1bit_add(words1, dst)))
    if want("topk"):
        k_top = max(1, n // 1000)
        cases.append(Case(f"compress_topk(k=n/1000)", "float32", 3 * g.nbytes,
                          lambda k: k.compress_topk(g, r, k_top), lambda: reference.compress_topk(g, r, k_top),
                          (lambda tg=_t(torch, g), tr=_t(torch, r): _torch_topk(torch, tg, tr, k_top))
                          if torch else None))
    return cases


def _torch_update(torch, op, w, g, states):
    """The same update written with torch's in-place CPU tensor operations."""
    tw, tg = _t(torch, w), _t(torch, g).float() if g.dtype != F32 else _t(torch, g)
    s0, s1 = _t(torch, states[0]), _t(torch, states[1])
    lr, mu, wd, b1, b2, eps = 1e-3, 0.9, 1e-4, 0.9, 0.999, 1e-8

    def sgd_mom():
        s0.mul_(mu).add_(tw, alpha=-lr * wd).add_(tg, alpha=-lr)
        tw.add_(s0)

    def nag():
        gg = tg + wd * tw
        s0.mul_(mu).add_(gg)
        tw.add_(gg.add_(s0, alpha=mu), alpha=-lr)

    def adam(decoupled=False):
        gg = tg if decoupled else tg + wd * tw
        s0.mul_(b1).add_(gg, alpha=1 - b1)
        s1.mul_(b2).addcmul_(gg, gg, value=1 - b2)
        step = s0 / (s1.sqrt().add_(eps))
        if decoupled:
            step.mul_(lr).add_(tw, alpha=wd)
            tw.sub_(step)
        else:
            tw.add_(step, alpha=-lr)

    def adagrad():
        s0.addcmul_(tg, tg)
        tw.add_(tg / (s0 + 1e-7).sqrt_() + wd * tw, alpha=-lr)

    def rmsprop():
        gg = tg + wd * tw
        s0.mul_(0.9).addcmul_(gg, gg, value=0.1)
        tw.add_(gg / (s0 + eps).sqrt_(), alpha=-lr)

    return {"sgd_update(momentum)": sgd_mom, "sgd_update(nesterov)": nag, "adam_update": adam,
            "adamw_update": lambda: adam(True), "adagrad_update": adagrad, "rmsprop_update": rmsprop}[op]


def _torch_topk(torch, g, r, k):
    r.add_(g)
    idx = torch.topk(r.abs(), k, sorted=False).indices.sort().values
    vals = r[idx]
    r[idx] = 0
    return idx, vals


def memory_bandwidth(size_mb, repeat):
    """GB/s of a numpy copy of a large float32 array, counting read + write (STREAM's way),
    and counting the destination's write-allocate read too (what the memory really moves)."""
    n = max(int(size_mb * 4 * 2**20) // 4, 1 << 20)  # four times the case size, past the caches
    a, b = np.ones(n, F32), np.ones(n, F32)
    seconds = _best(lambda: np.copyto(b, a), repeat)
    return 2 * a.nbytes / seconds / 1e9, 3 * a.nbytes / seconds / 1e9


def run_cpu(args, out):
    backends = [b for b in args.backend.split(",") if b] if args.backend != "all" else ["c", "numba"]
    usable = []
    for b in backends:
        try:
            kernels.use_backend(b)
            usable.append(b)
        except KernelUnavailable as exc:
            print(f"(skipping backend {b}: {exc})", file=out)
    if not usable:
        print("no kernel backend to benchmark", file=out)
        return 1
    torch = _torch()
    threads = None
    if "c" in usable:
        from kvps.kernels import native
        threads = native.load().num_threads()
    copy_bw, bw = memory_bandwidth(args.size_mb, args.repeat)
    print(f"## kvps kernels at {args.size_mb:g} MB per array\n", file=out)
    print(f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.python_implementation()} "
          f"{platform.python_version()}, numpy {np.__version__}"
          + (f", torch {torch.__version__} ({torch.get_num_threads()} threads)" if torch else ", torch absent"),
          file=out)
    if threads:
        print(f"- C library: SIMD path {native.load().simd_path()}, {threads} threads", file=out)
    print(f"- memory bandwidth, numpy copy of {4 * args.size_mb:g} MB: **{copy_bw:.1f} GB/s** counting read + "
          f"write, **{bw:.1f} GB/s** counting the write-allocate read of the destination too (the % column)\n",
          file=out)
    print("| op | dtype | backend | GB/s | numpy GB/s | torch GB/s | x numpy | x torch | % of mem bw |", file=out)
    print("|---|---|---|---:|---:|---:|---:|---:|---:|", file=out)
    cases = build_cases(args.size_mb, args.only)
    results = {}
    for case in cases:
        contenders = {"numpy": case.numpy, "torch": case.torch}
        for b in usable:
            contenders[b] = (lambda b=b, case=case: case.run(registry_backend(b)))
        seconds = _interleaved({k: f for k, f in contenders.items() if f is not None}, args.repeat)
        base_np = case.nbytes / seconds["numpy"] / 1e9 if "numpy" in seconds else None
        base_t = case.nbytes / seconds["torch"] / 1e9 if "torch" in seconds else None
        for b in usable:
            gbs = case.nbytes / seconds[b] / 1e9
            results[(case.op, case.dtype, b)] = (gbs, base_np, base_t)
            print(f"| {case.op} | {case.dtype} | {b} | {gbs:.1f} | {_f(base_np)} | {_f(base_t)} | "
                  f"{_ratio(gbs, base_np)} | {_ratio(gbs, base_t)} | {100 * gbs / bw:.0f}% |", file=out, flush=True)
    if "c" in usable:
        _per_core_compression(cases, results, args.repeat)
    kernels.use_backend("auto")
    return _targets(results, usable, out)


def _per_core_compression(cases, results, repeat):
    from kvps.kernels import native
    lib = native.load()
    before = lib.num_threads()
    lib.set_num_threads(1)
    try:
        kernels.use_backend("c")
        for case in cases:
            if case.input_bytes:
                seconds = _interleaved({"c": lambda case=case: case.run(kernels)}, repeat)["c"]
                results[(case.op, "per-core", "c")] = case.input_bytes / seconds / 1e9
    finally:
        lib.set_num_threads(before)


def _f(x):
    return "-" if x is None else f"{x:.1f}"


def _ratio(a, b):
    return "-" if not b else f"{a / b:.2f}x"


def _targets(results, usable, out):
    b = "c" if "c" in usable else usable[0]
    rows = []

    def check(what, value, goal, text):
        if value is None:
            rows.append((what, "not measured", text, "-"))
        elif goal is None:
            rows.append((what, f"{value:.2f}", "(information)", ""))
        else:
            rows.append((what, f"{value:.2f}", text, "met" if value >= goal else "NOT met"))

    def ratio(op, dtype, idx):
        r = results.get((op, dtype, b))
        return None if r is None or r[idx] is None else r[0] / r[idx]

    check("float32 sum vs numpy add", ratio("sum_into", "float32", 1), 0.9, ">= 0.9x")
    f16_numpy = results.get(("sum_into", "float16", b), (None, None))[1]
    for dt in ("float16", "bfloat16"):
        r = results.get(("sum_into", dt, b))
        check(f"{dt} sum vs numpy float16 add", r[0] / f16_numpy if r and f16_numpy else None, 20, ">= 20x")
        check(f"{dt} sum vs torch {dt} add", ratio("sum_into", dt, 2), 0.8, ">= 0.8x")
    check("bfloat16 sum vs numpy bfloat16 add (ml_dtypes)", ratio("sum_into", "bfloat16", 1), None, "")
    for (op, dtype, backend), r in results.items():
        if backend == b and dtype.startswith("grad"):
            check(f"{op} ({dtype}) vs numpy", r[0] / r[1] if r[1] else None, 2, ">= 2x")
    per_core = results.get(("compress_2bit", "per-core", "c"))
    check("2-bit compression, GB/s of float32 input on one core", per_core, 2.0, ">= 2 GB/s")
    print(f"\n### targets (backend {b})\n", file=out)
    print("| target | measured | goal | |", file=out)
    print("|---|---:|---|---|", file=out)
    for what, value, goal, status in rows:
        print(f"| {what} | {value} | {goal} | {status} |", file=out)
    return 0


def run_cuda(args, out):
    from kvps.kernels import cuda
    usable, reason = cuda.status()
    if not usable:
        print(f"CUDA kernels not usable: {reason}", file=out)
        return 1
    import torch
    dev = torch.device("cuda")
    n = int(args.size_mb * 2**20) // 4

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(args.repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best

    a, b = torch.ones(4 * n, device=dev), torch.empty(4 * n, device=dev)
    bw = 2 * a.nbytes / timed(lambda: b.copy_(a)) / 1e9
    del a, b
    print(f"## kvps CUDA kernels at {args.size_mb:g} MB per array on {torch.cuda.get_device_name()}\n", file=out)
    print(f"- device memory bandwidth (torch copy, read + write): **{bw:.0f} GB/s**\n", file=out)
    print("| op | dtype | kvps GB/s | torch GB/s | x torch | % of copy bw |", file=out)
    print("|---|---|---:|---:|---:|---:|", file=out)
    rows = []
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        m = n * 4 // torch.tensor([], dtype=dt).element_size()
        d, s = torch.rand(m, device=dev).to(dt), torch.rand(m, device=dev).to(dt) * 1e-3
        rows.append(("sum_into", str(dt), 3 * d.nbytes, lambda d=d, s=s: cuda.sum_into(d, s),
                     lambda d=d, s=s: d.add_(s)))
        srcs = [torch.rand(m, device=dev).to(dt) for _ in range(4)]
        rows.append(("sum_sources(4)", str(dt), 5 * d.nbytes, lambda d=d, srcs=srcs: cuda.sum_sources(d, srcs),
                     lambda d=d, srcs=srcs: torch.stack(srcs).sum(0, out=d)))
    w, g = torch.rand(n, device=dev), torch.rand(n, device=dev) * 1e-3
    m1, m2 = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    h = torch.empty(n, device=dev, dtype=torch.float16)
    rows.append(("cast", "float32->float16", 6 * n, lambda: cuda.cast(w, h), lambda: h.copy_(w)))
    rows.append(("adam_update", "grad float32", 28 * n,
                 lambda: cuda.adam_update(w, g, m1, m2, lr=1e-3),
                 lambda: torch._fused_adam_([w], [g], [m1], [m2], [], [torch.ones((), device=dev)], lr=1e-3,
                                            beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
                                            maximize=False)))
    rows.append(("sgd_update(momentum)", "grad float32", 20 * n,
                 lambda: cuda.sgd_update(w, g, m1, lr=1e-3, momentum=0.9), None))
    r = torch.zeros(n, device=dev)
    rows.append(("compress_2bit", "float32", 12 * n + n // 4, lambda: cuda.compress_2bit(g, r, 0.5), None))
    words = cuda.compress_2bit(g, r, 0.5)
    rows.append(("decompress_2bit_add", "float32", 8 * n + n // 4,
                 lambda: cuda.decompress_2bit_add(words, 0.5, r), None))
    rows.append(("compress_1bit", "float32", 12 * n + n // 8, lambda: cuda.compress_1bit(g, r, 0.0), None))
    for op, dtype, nbytes, fn, base in rows:
        gbs = nbytes / timed(fn) / 1e9
        try:
            tgbs = nbytes / timed(base) / 1e9 if base else None
        except (RuntimeError, TypeError, AttributeError):
            tgbs = None
        print(f"| {op} | {dtype} | {gbs:.0f} | {_f(tgbs)} | {_ratio(gbs, tgbs)} | {100 * gbs / bw:.0f}% |",
              file=out, flush=True)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="kvps bench kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=64.0, help="size of each array in MB (default 64)")
    parser.add_argument("--quick", action="store_true", help="16 MB arrays and 2 repeats: a smoke run")
    parser.add_argument("--repeat", type=int, default=7,
                        help="timed rounds per case, contenders interleaved; the best counts (default 7)")
    parser.add_argument("--backend", default="all",
                        help="comma-separated: c, numba, numpy, or cuda (torch CUDA tensors); default all CPU ones")
    parser.add_argument("--only", default="", help="comma-separated op name fragments, e.g. sum,adam,2bit")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mb, args.repeat = min(args.size_mb, 16.0), min(args.repeat, 3)
    args.only = [o for o in args.only.split(",") if o]
    out = sys.stdout
    if args.backend == "cuda":
        return run_cuda(args, out)
    return run_cpu(args, out)


if __name__ == "__main__":
    sys.exit(main())
