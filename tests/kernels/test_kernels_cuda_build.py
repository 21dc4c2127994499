"""The CUDA sources compile (sm_80 and sm_90) and export the ABI of csrc/kvps_kernels.h.

Runs wherever nvcc is installed, GPU or not (CI compiles the CUDA code this way); the
kernels themselves are tested on a GPU by tests/gpu/ (scripts/gpu_check.sh).
Run: pytest tests/kernels/test_kernels_cuda_build.py
"""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_cuda_sources_compile_and_export_the_abi(tmp_path):
    out = tmp_path / "_kvps_cuda.so"
    cmd = [NVCC, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
           "-fmad=false", "-cudart", "static", "-Werror", "all-warnings",
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
           "-I", os.path.join(ROOT, "csrc"), "-o", str(out), os.path.join(ROOT, "csrc", "cuda_kernels.cu")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"nvcc failed:\n{result.stdout}\n{result.stderr}"
    with open(os.path.join(ROOT, "csrc", "kvps_kernels.h")) as f:
        declared = set(re.findall(r"KVPS_API \w[\w ]*?\**(kvps_cuda_\w+)\(", f.read()))
    nm = subprocess.run(["nm", "-D", "--defined-only", str(out)], capture_output=True, text=True, check=True)
    exported = set(re.findall(r" T (kvps_\w+)", nm.stdout))
    assert declared and declared == exported, f"declared only: {declared - exported}; exported only: {exported - declared}"
