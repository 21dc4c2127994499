"""The tree follows the dependency order (docs/design.md): every import, at module level or inside a
function, points to a lower layer or within its own package; there are no cycles; the library never
imports the daemons (server/, scheduler/) or the tools (kvps.tools)."""
import ast
import collections
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[2]
PACKAGES = ("kvps", "server", "scheduler")

# lowest first; a module belongs to the longest prefix that names it
LAYERS = (
    ("kvps.lr_scheduler",),
    ("kvps.errors", "kvps.optimizer"),
    ("kvps.dtypes", "kvps.straggler", "kvps.roles"),
    ("kvps.config",),
    ("kvps.metrics",),
    ("kvps.kernels",),
    ("kvps.arrays", "kvps.wire", "kvps.ps"),
    ("kvps.collective",),
    ("kvps.kvstore",),
    ("kvps.supervisor",),
    ("kvps", "kvps.launch"),
    ("kvps.ray",),
    ("kvps.torch",),
    ("server", "scheduler"),
    ("kvps.tools",),
    ("kvps.cli",),
)
RANK = {prefix: i for i, layer in enumerate(LAYERS) for prefix in layer}


def _modules():
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(path, modules):
    """The modules of ours that `path` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def _home(module):
    """(layer prefix, its rank) of a module."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in RANK and (prefix != "kvps" or module == "kvps"):     # "kvps": the package's __init__ only
            return prefix, RANK[prefix]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


MODULES = _modules()
GRAPH = {m: _imports(p, MODULES) - {m} for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    for module in MODULES:
        _home(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module):
    home, rank = _home(module)
    for target in sorted(GRAPH[module]):
        there, other = _home(target)
        assert there == home or other < rank, (
            f"{module} ({home}, layer {rank}) imports {target} ({there}, layer {other}): imports must point "
            f"down the layers of docs/design.md, or stay within one package")


def test_no_cycles():
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_library_never_imports_daemons_or_tools():
    library = [m for m in MODULES if m.split(".")[0] == "kvps" and not m.startswith(("kvps.tools", "kvps.cli"))]
    for m in library:
        bad = sorted(t for t in GRAPH[m] if t.split(".")[0] in ("server", "scheduler") or t.startswith("kvps.tools"))
        assert not bad, f"{m} imports {bad}: the library runs the daemons by name (kvps.roles) and never uses the tools"


def test_daemons_never_import_the_worker_api():
    for m in (m for m in MODULES if m.split(".")[0] in ("server", "scheduler")):
        bad = sorted(t for t in GRAPH[m] if t.startswith(("kvps.kvstore", "kvps.torch", "kvps.collective", "kvps.tools")))
        assert not bad, f"{m} imports {bad}: daemons are built on kvps.wire and kvps.ps only"


def test_the_checker_sees_a_violation():
    """The rules above really reject an upward import and a cycle (so a passing run means something)."""
    saved = {m: set(t) for m, t in GRAPH.items()}
    GRAPH["kvps.wire.protocol"].add("kvps.kvstore.base")
    try:
        with pytest.raises(AssertionError, match="must point down"):
            test_imports_point_down_the_layers("kvps.wire.protocol")
    finally:
        GRAPH.clear()
        GRAPH.update(saved)
    graph = collections.defaultdict(set, {"a": {"b"}, "b": {"a"}})
    with pytest.raises(AssertionError, match="cycle"):
        saved = dict(GRAPH)
        GRAPH.clear()
        GRAPH.update(graph)
        try:
            test_no_cycles()
        finally:
            GRAPH.clear()
            GRAPH.update(saved)
