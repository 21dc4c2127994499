"""A C build that fails is loud: setup.py records why beside the library, loading says it, and
`kvps info` prints it; KVPS_REQUIRE_NATIVE=1 makes the failure fatal.

The builds run setup.py the way pip does, in a temporary copy of the sources with a broken
compiler (CC), so the real library is never touched.
Run: pytest tests/kernels/test_kernels_build.py
"""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from kvps.errors import KernelUnavailable
from kvps.kernels import api, base, native, select

ROOT = pathlib.Path(__file__).parents[2]
BAD_CC = """#!/bin/sh
echo "csrc/dispatch.c:1:10: fatal error: kvps_missing.h: No such file or directory" >&2
exit 1
"""


@pytest.fixture
def source_copy(tmp_path):
    """setup.py, pyproject.toml, csrc/ and an empty kvps/kernels package in a temporary folder."""
    root = tmp_path / "src"
    root.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, root / name)
    shutil.copytree(ROOT / "csrc", root / "csrc")
    for package in ("kvps", "kvps/kernels", "server", "scheduler"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    return root


def build(root, cc, require_native=False):
    """`setup.py build_ext --inplace` with compiler cc and without CUDA; the finished process."""
    env = {k: v for k, v in os.environ.items() if k != "KVPS_REQUIRE_NATIVE"}
    env.update(CC=str(cc), KVPS_BUILD_CUDA="0", **({"KVPS_REQUIRE_NATIVE": "1"} if require_native else {}))
    return subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_broken_compiler_is_recorded_and_reported(source_copy):
    cc = source_copy / "bad-cc"
    cc.write_text(BAD_CC)
    cc.chmod(0o755)
    stale = source_copy / "kvps" / "kernels" / native.LIBRARY
    stale.write_bytes(b"left by an earlier build")
    done = build(source_copy, cc)
    assert done.returncode == 0, f"a failed C build must not fail the install:\n{done.stderr[-3000:]}"
    assert "WARNING: the C kernels did not build" in done.stderr
    assert not stale.exists(), "a library that did not build this time must not stay behind"

    state, reason, output = base.build_status(str(stale))
    assert state == "failed"
    assert reason.startswith(f"{cc} exited with status 1 building csrc/dispatch.c: ")
    assert "fatal error: kvps_missing.h" in reason
    assert "command: " in output and "kvps_missing.h" in output

    with pytest.raises(KernelUnavailable, match="was not built .*fatal error: kvps_missing.h"):
        native.load(str(stale))
    line = select.c_kernels_line(select.default_registry(str(stale)))
    assert line.startswith(f"C kernels: NOT BUILT: {cc} exited with status 1")
    assert "; using numba (slower): rebuild with pip install" in line


def test_require_native_makes_the_failure_fatal(source_copy):
    done = build(source_copy, "/bin/false", require_native=True)
    assert done.returncode != 0
    assert "KVPS_REQUIRE_NATIVE=1 but the C kernels did not build: /bin/false exited with status 1" in done.stderr
    status, = source_copy.glob(f"build/lib*/kvps/kernels/{base.BUILD_STATUS}")   # the build stopped before copying
    assert status.read_text().startswith("failed: /bin/false exited with status 1 building csrc/dispatch.c: no output")


def test_a_successful_build_records_ok():
    # the real build (./run setup, pip install -e .) left its status beside the real library
    if not os.path.exists(native.library_path()):
        pytest.skip("the C library was not built here")
    assert base.build_status(native.library_path())[0] in ("ok", "unknown")


def test_kvps_info_says_why_the_c_kernels_are_missing(tmp_path, monkeypatch, capsys):
    (tmp_path / base.BUILD_STATUS).write_text(
        "failed: cc exited with status 1 building csrc/topk.c: csrc/topk.c:3:1: error: expected ';'\n"
        "command: cc -c csrc/topk.c\ncsrc/topk.c:3:1: error: expected ';'\n")
    registry = select.default_registry(str(tmp_path / native.LIBRARY))   # a library that is not there
    monkeypatch.setattr(api, "_kernels", api.Kernels(registry))
    monkeypatch.setenv("KVPS_KERNELS", "auto")
    from kvps import cli
    assert cli.main(["info"]) == 0
    out, err = capsys.readouterr()
    expected = ("C kernels: NOT BUILT: cc exited with status 1 building csrc/topk.c: csrc/topk.c:3:1: error: "
                "expected ';'; using numba (slower): rebuild with ")
    assert out.splitlines()[1].startswith(expected), out
    assert "kernel backend: numba" in out
    assert f"WARNING: {expected}" in err


def test_kvps_info_without_a_recorded_build(tmp_path, monkeypatch, capsys):
    registry = select.default_registry(str(tmp_path / native.LIBRARY))
    monkeypatch.setattr(api, "_kernels", api.Kernels(registry))
    from kvps import cli
    cli.main(["info"])
    out = capsys.readouterr().out
    assert f"C kernels: NOT BUILT: {tmp_path / native.LIBRARY} is missing (no build was recorded" in out
