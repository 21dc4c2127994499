"""Build hook: compiles the native kernels in csrc/ (see csrc/README.md). Everything else is in pyproject.toml.

    csrc/*.c  -> kvps/kernels/_kvps_kernels.so   always tried; if it fails, pip still installs kvps
                                                 (with a warning) and the numba backend takes over
    csrc/*.cu -> kvps/kernels/_kvps_cuda.so      when nvcc is on PATH (or in $CUDA_HOME/bin);
                                                 KVPS_BUILD_CUDA=0 skips it, =1 makes a failure fatal

Both are plain shared libraries loaded with ctypes (no CPython API), built by `pip install .`,
`pip install -e .` (into the source tree) and `pip install --no-build-isolation -e .`.
The SIMD files get their own -m flags; dispatch.c picks the path from CPUID at run time.
CC, CFLAGS and NVCC_FLAGS from the environment are honoured.
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


class SharedLibrary(Extension):
    """A plain shared library for ctypes, not a CPython extension module."""

    def __init__(self, name, sources, kind):
        # depends: the headers, so that an sdist carries them
        headers = ["csrc/kvps_kernels.h", "csrc/kvps_common.h", "csrc/kvps_isa.h"]
        super().__init__(name, sources, depends=headers)
        self.kind = kind


def _say(msg):
    print(f"kvps build: {msg}", file=sys.stderr, flush=True)


def _run(cmd):
    _say(" ".join(cmd))
    subprocess.run(cmd, check=True)


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = os.path.join(home, "bin", "nvcc")
    return candidate if os.access(candidate, os.X_OK) else None


class build_native(build_ext):
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
            except (OSError, subprocess.CalledProcessError) as exc:
                _say(f"WARNING: the C kernels did not build ({exc}); kvps will use its numba kernels")
            return
        setting = os.environ.get("KVPS_BUILD_CUDA", "auto").strip().lower()
        if setting in ("0", "no", "false", "off"):
            _say("KVPS_BUILD_CUDA=0: not building the CUDA kernels")
            return
        nvcc = _nvcc()
        if not nvcc:
            if setting in ("1", "yes", "true", "on"):
                raise RuntimeError("KVPS_BUILD_CUDA=1 but nvcc was not found (PATH, CUDA_HOME)")
            _say("nvcc not found: not building the CUDA kernels")
            return
        try:
            _run([nvcc] + NVCC_FLAGS + CUDA_ARCHS + shlex.split(os.environ.get("NVCC_FLAGS", "")) +
                 ["-Icsrc", "-o", out] + list(ext.sources))
        except (OSError, subprocess.CalledProcessError) as exc:
            if setting in ("1", "yes", "true", "on"):
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
                    _run(cc + C_FLAGS + extra + flags + ["-Icsrc", "-c", src, "-o", obj])
                    break
                except subprocess.CalledProcessError:
                    if i == len(variants) - 1:
                        raise
                    _say(f"retrying {src} without {' '.join(set(flags) - set(variants[i + 1]))}")
            objects.append(obj)
        _run(cc + ["-shared", "-pthread"] + objects + ["-lm", "-o", out])


setup(
    ext_modules=[
        SharedLibrary("kvps.kernels._kvps_kernels",
                      [f"csrc/{f}" for f in ("dispatch.c", "parallel.c", "topk.c", "simd_scalar.c",
                                             "simd_avx2.c", "simd_avx512.c")], "c"),
        SharedLibrary("kvps.kernels._kvps_cuda", ["csrc/cuda_kernels.cu"], "cuda"),
    ],
    cmdclass={"build_ext": build_native},
)
