"""The daemon roles and the packages that run them, which the library runs by name, never imports.

    run("server", ["--scheduler", "127.0.0.1:9091"])     # what `kvps server ...` does

server/ and scheduler/ are packages of their own, built on kvps.wire and kvps.ps; each has a
__main__ module with main(argv). They install next to kvps (or sit next to it in a checkout),
so they are looked up there first: a user's server.py in the working directory cannot stand in.
"""
import importlib
import os
import sys

from kvps.errors import KVPSError

DAEMONS = {"server": "server.__main__", "scheduler": "scheduler.__main__"}
_HOME = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # where kvps/, server/, scheduler/ are


def daemon(role):
    """The main(argv) of a role's daemon, from the package installed beside kvps."""
    name = DAEMONS[role]
    package = name.partition(".")[0]
    loaded = sys.modules.get(package)
    if loaded is None:
        sys.path.insert(0, _HOME)
        try:
            module = importlib.import_module(name)
        finally:
            sys.path.remove(_HOME)
    else:
        module = importlib.import_module(name)
    where = os.path.dirname(os.path.abspath(getattr(sys.modules[package], "__file__", "") or ""))
    if where != os.path.join(_HOME, package):
        raise KVPSError(f"the {role} daemon is the package {package!r} beside kvps ({os.path.join(_HOME, package)}), "
                        f"but this process already imported another {package!r} from {where}; "
                        f"rename that module or start the {role} with `kvps {role}` in a fresh process")
    return module.main


def run(role, argv):
    """Run a role's daemon with its command-line arguments; returns its exit code."""
    return daemon(role)(list(argv))
