"""The backend interface and the registry that finds backends by name.

A backend implements `Backend` for numpy arrays that kvps.kernels has already
validated (C-contiguous, dtypes and sizes checked). Backends register a factory under a
name; a factory raises KernelUnavailable, with the reason, where its backend cannot run.
`choose(requested)` resolves a KVPS_KERNELS value: "auto" takes the first available of
AUTO_ORDER, any other name must be available or KernelUnavailable is raised.
"""
import abc

from kvps.errors import KernelUnavailable

from kvps.kernels import reference

# The CPU backends in order of preference for KVPS_KERNELS=auto.
AUTO_ORDER = ("c", "numba", "numpy")
# Accepted KVPS_KERNELS values. "cuda" keeps the best CPU backend for numpy arrays and
# requires kvps.kernels.cuda (torch CUDA tensors) to be usable.
CHOICES = ("auto", "c", "cuda", "numba", "numpy")


class Backend(abc.ABC):
    """Kernels over validated numpy arrays; every operation works in place."""

    name = None

    def details(self):
        """One line for describe(): where the code comes from and how it runs."""
        return ""

    @abc.abstractmethod
    def sum_into(self, dst, src): ...

    @abc.abstractmethod
    def sum_sources(self, dst, srcs): ...

    @abc.abstractmethod
    def scale(self, x, alpha): ...

    @abc.abstractmethod
    def axpy(self, y, alpha, x): ...

    @abc.abstractmethod
    def cast(self, src, dst): ...

    @abc.abstractmethod
    def sgd_update(self, weight, grad, mom, *, lr, momentum, wd, rescale_grad, clip_gradient, nesterov): ...

    @abc.abstractmethod
    def adam_update(self, weight, grad, mean, var, *, lr, beta1, beta2, epsilon, wd, rescale_grad,
                    clip_gradient): ...

    @abc.abstractmethod
    def adamw_update(self, weight, grad, mean, var, *, lr, beta1, beta2, epsilon, wd, rescale_grad,
                     clip_gradient, eta): ...

    @abc.abstractmethod
    def adagrad_update(self, weight, grad, history, *, lr, epsilon, wd, rescale_grad, clip_gradient): ...

    @abc.abstractmethod
    def rmsprop_update(self, weight, grad, n, *, lr, gamma1, epsilon, wd, rescale_grad, clip_gradient,
                       clip_weights): ...

    @abc.abstractmethod
    def compress_2bit(self, grad, residual, threshold): ...

    @abc.abstractmethod
    def decompress_2bit_add(self, packed, threshold, dst): ...

    @abc.abstractmethod
    def compress_1bit(self, grad, residual, threshold): ...

    @abc.abstractmethod
    def decompress_1bit_add(self, packed, dst): ...

    @abc.abstractmethod
    def compress_topk(self, grad, residual, k): ...

    @abc.abstractmethod
    def decompress_topk_add(self, indices, values, dst): ...


class NumpyBackend(Backend):
    """The reference itself (kvps/kernels/reference.py), as a backend."""

    name = "numpy"

    def details(self):
        return "numpy reference (kvps/kernels/reference.py)"

    def sum_into(self, dst, src):
        reference.sum_into(dst, src)

    def sum_sources(self, dst, srcs):
        reference.sum_sources(dst, srcs)

    def scale(self, x, alpha):
        reference.scale(x, alpha)

    def axpy(self, y, alpha, x):
        reference.axpy(y, alpha, x)

    def cast(self, src, dst):
        reference.cast(src, dst)

    def sgd_update(self, weight, grad, mom, **kw):
        reference.sgd_update(weight, grad, mom, **kw)

    def adam_update(self, weight, grad, mean, var, **kw):
        reference.adam_update(weight, grad, mean, var, **kw)

    def adamw_update(self, weight, grad, mean, var, **kw):
        reference.adamw_update(weight, grad, mean, var, **kw)

    def adagrad_update(self, weight, grad, history, **kw):
        reference.adagrad_update(weight, grad, history, **kw)

    def rmsprop_update(self, weight, grad, n, **kw):
        reference.rmsprop_update(weight, grad, n, **kw)

    def compress_2bit(self, grad, residual, threshold):
        return reference.compress_2bit(grad, residual, threshold)

    def decompress_2bit_add(self, packed, threshold, dst):
        reference.decompress_2bit_add(packed, threshold, dst)

    def compress_1bit(self, grad, residual, threshold):
        return reference.compress_1bit(grad, residual, threshold)

    def decompress_1bit_add(self, packed, dst):
        reference.decompress_1bit_add(packed, dst)

    def compress_topk(self, grad, residual, k):
        return reference.compress_topk(grad, residual, k)

    def decompress_topk_add(self, indices, values, dst):
        reference.decompress_topk_add(indices, values, dst)


def _make_c():
    from kvps.kernels.native import CBackend
    return CBackend()


def _make_numba():
    try:
        import numba  # noqa: F401
    except ImportError as exc:
        raise KernelUnavailable(f"numba is not installed ({exc})") from None
    from kvps.kernels.numba_impl import NumbaBackend
    return NumbaBackend()


class Registry:
    """Backend factories by name; each backend is built at most once."""

    def __init__(self):
        self._factories = {}
        self._built = {}
        self._errors = {}

    def add(self, name, factory):
        self._factories[name] = factory

    def names(self):
        return list(self._factories)

    def get(self, name):
        """The backend, built on first use; KernelUnavailable (with the reason) if it cannot run."""
        if name not in self._factories:
            raise KernelUnavailable(f"no kernel backend named {name!r} (known: {', '.join(self._factories)})")
        if name in self._built:
            return self._built[name]
        if name in self._errors:
            raise KernelUnavailable(self._errors[name])
        try:
            backend = self._factories[name]()
        except KernelUnavailable as exc:
            self._errors[name] = f"kernel backend {name!r} is not available: {exc}"
            raise KernelUnavailable(self._errors[name]) from None
        self._built[name] = backend
        return backend

    def status(self, name):
        """(available, reason) without raising."""
        try:
            self.get(name)
            return True, ""
        except KernelUnavailable as exc:
            return False, str(exc)


def default_registry():
    registry = Registry()
    registry.add("c", _make_c)
    registry.add("numba", _make_numba)
    registry.add("numpy", NumpyBackend)
    return registry


def choose(registry, requested):
    """The backend for a KVPS_KERNELS value; raises KernelUnavailable naming the problem."""
    requested = (requested or "auto").strip().lower()
    if requested not in CHOICES:
        raise KernelUnavailable(f"KVPS_KERNELS={requested!r} is not one of {', '.join(CHOICES)}")
    if requested == "cuda":
        from kvps.kernels import cuda
        usable, reason = cuda.status()
        if not usable:
            raise KernelUnavailable(f"KVPS_KERNELS=cuda, but {reason}")
        requested = "auto"
    if requested != "auto":
        try:
            return registry.get(requested)
        except KernelUnavailable as exc:
            raise KernelUnavailable(f"KVPS_KERNELS={requested}: {exc}") from None
    for name in AUTO_ORDER:
        try:
            return registry.get(name)
        except KernelUnavailable:
            continue
    raise KernelUnavailable("no kernel backend is available")  # numpy always is; kept for safety
