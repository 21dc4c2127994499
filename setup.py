"""Build hook: compiles the native kernels in csrc/ (see csrc/README.md). Everything else is in pyproject.toml.

    csrc/*.c  -> kvps/kernels/_kvps_kernels.so   always tried; if it fails, pip still installs kvps
                                                 (with a warning) and the numba backend takes over;
                                                 KVPS_REQUIRE_NATIVE=1 makes a failure fatal
    csrc/*.cu -> kvps/kernels/_kvps_cuda.so      when nvcc is on PATH (or in $CUDA_HOME/bin);
                                                 KVPS_BUILD_CUDA=0 skips it, =1 makes a failure fatal

Both are plain shared libraries loaded with ctypes (no CPython API), built by `pip install .`,
`pip install -e .` (into the source tree) and `pip install --no-build-isolation -e .`.
The SIMD files get their own -m flags; dispatch.c picks the path from CPUID at run time.
CC, CFLAGS and NVCC_FLAGS from the environment are honoured. Every C build records its
outcome beside the library, in kvps/kernels/_build_status.txt: "ok", or "failed: <reason>"
followed by the command and the compiler's output (pip -q hides this script's warnings;
`kvps info` and ./run read the file).
"""
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

C_FLAGS = ["-O3", "-fPIC", "-std=c11", "-pthread", "-fvisibility=hidden", "-Wall",
           # numpy rounds every operation; a fused multiply-add would round once
           "-ffp-contract=off", "-fno-math-errno"]
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
# per-file SIMD flags, tried in order (an older compiler may lack -mavx512bf16)
SIMD_FLAGS = {
    "simd_avx2.c": [["-mavx2", "-mf16c"]],
    "simd_avx512.c": [["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mf16c"],
                      ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mf16c"]],
}
CUDA_ARCHS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
              "-gencode", "arch=compute_90,code=compute_90"]  # PTX: newer GPUs compile it at load
NVCC_FLAGS = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
              "-fmad=false", "-cudart", "static"]
BUILD_STATUS = "_build_status.txt"  # kvps/kernels/base.py reads it
OUTPUT_KEPT = 8000                  # characters of compiler output kept in the status file
YES = ("1", "yes", "true", "on")


class SharedLibrary(Extension):
    """A plain shared library for ctypes, not a CPython extension module."""

    def __init__(self, name, sources, kind):
        # depends: the headers, so that an sdist carries them
        headers = ["csrc/kvps_kernels.h", "csrc/kvps_common.h", "csrc/kvps_isa.h", "csrc/simd_body.h"]
        super().__init__(name, sources, depends=headers)
        self.kind = kind


def _say(msg):
    print(f"kvps build: {msg}", file=sys.stderr, flush=True)


def _run(cmd):
    _say(" ".join(cmd))
    subprocess.run(cmd, check=True)


class CompileError(Exception):
    """A compiler command failed: the one-line reason, the command and its output."""

    def __init__(self, reason, cmd, output):
        super().__init__(reason)
        self.reason, self.cmd, self.output = reason, cmd, output


def _compile(cmd):
    """Run a compiler command; its output goes to stderr and, on failure, into CompileError."""
    _say(" ".join(cmd))
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    except OSError as exc:
        raise CompileError(f"the C compiler {cmd[0]!r} could not be run: {exc.strerror or exc}", cmd, "") from None
    if done.stdout:
        sys.stderr.write(done.stdout)
    if done.returncode != 0:
        lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]
        detail = (errors or lines or ["no output"])[0]
        target = next((a for a in cmd if a.endswith(".c")), "the library")
        raise CompileError(f"{cmd[0]} exited with status {done.returncode} building {target}: {detail}",
                           cmd, done.stdout)


def _write_status(library, error=None):
    """Record the outcome of a C build beside its library (see the module docstring)."""
    path = os.path.join(os.path.dirname(library), BUILD_STATUS)
    if error is None:
        text = "ok\n"
    else:
        output = error.output[-OUTPUT_KEPT:]
        text = f"failed: {error.reason}\ncommand: {' '.join(error.cmd)}\n{output}"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = os.path.join(home, "bin", "nvcc")
    return candidate if os.access(candidate, os.X_OK) else None


class build_native(build_ext):
    def initialize_options(self):
        super().initialize_options()
        self._failed = set()  # names of the extensions whose build was tried and failed

    def get_ext_filename(self, fullname):
        return os.path.join(*fullname.split(".")) + ".so"  # _kvps_kernels.so: no CPython ABI tag

    def get_outputs(self):
        return [p for p in super().get_outputs() if os.path.exists(p)]

    def build_extension(self, ext):
        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if os.path.exists(out):  # a library left by an earlier build must not ship if this one fails
            os.remove(out)
        tmp = os.path.join(self.build_temp, ext.kind)
        os.makedirs(tmp, exist_ok=True)
        if ext.kind == "c":
            try:
                self._build_c(ext, out, tmp)
            except CompileError as exc:
                self._failed.add(ext.name)
                status = _write_status(out, exc)
                if os.environ.get("KVPS_REQUIRE_NATIVE", "").strip().lower() in YES:
                    raise RuntimeError(f"KVPS_REQUIRE_NATIVE=1 but the C kernels did not build: {exc.reason}") \
                        from None
                _say(f"WARNING: the C kernels did not build: {exc.reason}\n"
                     f"  kvps will use its numba kernels (slower); the command and the compiler's output are in\n"
                     f"  {status} (kvps/kernels/{BUILD_STATUS} of the installed package)")
            else:
                _write_status(out)
            return
        setting = os.environ.get("KVPS_BUILD_CUDA", "auto").strip().lower()
        if setting in ("0", "no", "false", "off"):
            _say("KVPS_BUILD_CUDA=0: not building the CUDA kernels")
            return
        nvcc = _nvcc()
        if not nvcc:
            if setting in YES:
                raise RuntimeError("KVPS_BUILD_CUDA=1 but nvcc was not found (PATH, CUDA_HOME)")
            _say("nvcc not found: not building the CUDA kernels")
            return
        try:
            _run([nvcc] + NVCC_FLAGS + CUDA_ARCHS + shlex.split(os.environ.get("NVCC_FLAGS", "")) +
                 ["-Icsrc", "-o", out] + list(ext.sources))
        except (OSError, subprocess.CalledProcessError) as exc:
            self._failed.add(ext.name)
            if setting in YES:
                raise
            _say(f"WARNING: the CUDA kernels did not build ({exc}); CUDA tensors will not be supported")

    def _build_c(self, ext, out, tmp):
        cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
        extra = shlex.split(os.environ.get("CFLAGS", ""))
        objects = []
        for src in ext.sources:
            obj = os.path.join(tmp, os.path.basename(src)[:-2] + ".o")
            variants = SIMD_FLAGS.get(os.path.basename(src), [[]]) if X86 else [[]]
            for i, flags in enumerate(variants):
                try:
                    _compile(cc + C_FLAGS + extra + flags + ["-Icsrc", "-c", src, "-o", obj])
                    break
                except CompileError:
                    if i == len(variants) - 1:
                        raise
                    _say(f"retrying {src} without {' '.join(set(flags) - set(variants[i + 1]))}")
            objects.append(obj)
        _compile(cc + ["-shared", "-pthread"] + objects + ["-lm", "-o", out])

    def copy_extensions_to_source(self):
        """--inplace and editable installs: copy what was built and the C build's status file;
        a library that did not build is removed from the source tree, not left stale."""
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace, built = self._get_inplace_equivalent(build_py, ext)
            if os.path.exists(built):
                self.copy_file(built, inplace, level=self.verbose)
            elif os.path.exists(inplace) and ext.name in self._failed:
                _say(f"removing {inplace}: it did not build this time")
                os.remove(inplace)
            status = os.path.join(os.path.dirname(built), BUILD_STATUS)
            if ext.kind == "c" and os.path.exists(status):
                self.copy_file(status, os.path.join(os.path.dirname(inplace), BUILD_STATUS), level=self.verbose)


setup(
    ext_modules=[
        SharedLibrary("kvps.kernels._kvps_kernels",
                      [f"csrc/{f}" for f in ("dispatch.c", "parallel.c", "topk.c", "simd_scalar.c",
                                             "simd_avx2.c", "simd_avx512.c")], "c"),
        SharedLibrary("kvps.kernels._kvps_cuda", ["csrc/cuda_kernels.cu"], "cuda"),
    ],
    cmdclass={"build_ext": build_native},
)
