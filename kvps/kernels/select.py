"""Finding a backend: the registry of backend factories and the choice among them.

Backends register a factory under a name; a factory raises KernelUnavailable, with the
reason, where its backend cannot run. `choose(registry, requested)` resolves a
KVPS_KERNELS value: "auto" takes the first available of AUTO_ORDER, any other name must
be available or KernelUnavailable is raised. This is the one module that imports the
backends (native, numba_impl, cuda); they import only base and reference, so the
dependencies point one way: api -> select -> backends -> reference -> base.
"""
import functools
import os

from kvps.errors import KernelUnavailable

from kvps.kernels import cuda, native
from kvps.kernels.base import REBUILD, build_status
from kvps.kernels.reference import NumpyBackend

# The CPU backends in order of preference for KVPS_KERNELS=auto.
AUTO_ORDER = ("c", "numba", "numpy")
# Accepted KVPS_KERNELS values. "cuda" keeps the best CPU backend for numpy arrays and
# requires kvps.kernels.cuda (torch CUDA tensors) to be usable.
CHOICES = ("auto", "c", "cuda", "numba", "numpy")


def _make_c(path):
    return native.CBackend(native.load(path))


def _make_numba():
    try:
        import numba  # noqa: F401
    except ImportError as exc:
        raise KernelUnavailable(f"numba is not installed ({exc})") from None
    from kvps.kernels.numba_impl import NumbaBackend
    return NumbaBackend()


class Registry:
    """Backend factories by name; each backend is built at most once.

    c_library is the path of the C library that the "c" factory of default_registry()
    loads; c_kernels_line() reads the build status recorded beside it.
    """

    def __init__(self, c_library=None):
        self.c_library = c_library or native.library_path()
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


def default_registry(c_library=None):
    """c, numba and numpy; c loads c_library (default: the one setup.py built into the package)."""
    registry = Registry(c_library)
    registry.add("c", functools.partial(_make_c, registry.c_library))
    registry.add("numba", _make_numba)
    registry.add("numpy", NumpyBackend)
    return registry


def cuda_status():
    """(usable, text) of kvps.kernels.cuda: the devices, or why CUDA cannot be used."""
    return cuda.status()


def choose(registry, requested):
    """The backend for a KVPS_KERNELS value; raises KernelUnavailable naming the problem."""
    requested = (requested or "auto").strip().lower()
    if requested not in CHOICES:
        raise KernelUnavailable(f"KVPS_KERNELS={requested!r} is not one of {', '.join(CHOICES)}")
    if requested == "cuda":
        usable, reason = cuda_status()
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


def c_kernels_line(registry):
    """One line on the C kernels for describe() and `kvps info`: built, or why not and what runs instead.

    "NOT BUILT" quotes the reason setup.py recorded (kvps/kernels/_build_status.txt) when the
    build failed; "NOT USABLE" the reason a library that exists cannot be loaded.
    """
    ok, reason = registry.status("c")
    if ok:
        return f"C kernels: built, SIMD path {registry.get('c').native.simd_path()}"
    fallback = next((n for n in AUTO_ORDER if n != "c" and registry.status(n)[0]), "none")
    slower = {"numba": "slower", "numpy": "much slower"}.get(fallback, "no kernels at all")
    if os.path.exists(registry.c_library):
        what = f"NOT USABLE: {reason}"
    else:
        state, why, _ = build_status(registry.c_library)
        if state != "failed":
            why = f"{registry.c_library} is missing ({why})"
        what = f"NOT BUILT: {why}"
    return f"C kernels: {what}; using {fallback} ({slower}): rebuild with {REBUILD}"
