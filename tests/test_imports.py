"""kvtier's import graph: every module imports on its own, and no two modules import each other.

Part (a) imports each module first thing in a fresh interpreter: a module that only works
when something else happened to be imported before it (an order-dependent cycle through a
package ``__init__``) fails there, whatever order the rest of the suite imports things in.

Part (b) reads every module's imports from its source and checks that the graph they form
has no cycle. It counts the imports inside functions as well as those at the top: a cycle
held apart by an import moved into a function breaks the day someone moves it back (the
reason issue #24 asked for no cycle "anywhere"), and such a function-level import is free to
move to the top once no cycle runs through it. It leaves out

* imports under ``if TYPE_CHECKING:``, which never run;
* a module's parent packages: importing ``kvtier.tiers.cpu.config`` runs ``kvtier/__init__``
  first, but counting that would make every re-exporting package a cycle; part (a) is what
  catches a package ``__init__`` that breaks an import order;
* classes named by string in a registry (``"kvtier.tiers.disk.lmdb:LMDBTier"``): late
  binding is the registry's job, and an out-of-tree class is found the same way.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "kvtier"

# One fresh interpreter (the "zygote") imports the third-party packages kvtier uses, and none
# of kvtier, then forks a child per kvtier module, a few at a time; each child imports its one
# module and exits. Forking spares every child the seconds torch takes to import, and what a
# child starts from is still an interpreter that has never imported kvtier.
_ABSENT = "absent "
_ZYGOTE = """
import importlib, importlib.util, json, os, sys
names, preload, jobs = json.loads(sys.stdin.read())
for top in preload:
    try:
        importlib.import_module(top)
    except Exception:
        pass  # a child that needs it reports the failure
assert not [m for m in sys.modules if m == "kvtier" or m.startswith("kvtier.")], "a preload imported kvtier"

def child(name):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        top = (error.name or "").partition(".")[0]
        if top and top != "kvtier" and importlib.util.find_spec(top) is None:
            return "absent " + top
        return f"{type(error).__name__}: {error}"
    except BaseException as error:
        return f"{type(error).__name__}: {error}"
    return ""

running, results = {}, {}
pending = list(names)
while pending or running:
    while pending and len(running) < jobs:
        name = pending.pop()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1); os.dup2(devnull, 2)
            try:
                text = child(name)
            except BaseException as error:
                text = repr(error)
            os.write(write, text.encode())
            os._exit(0)
        os.close(write)
        running[pid] = (name, read)
    pid, status = os.wait()
    name, read = running.pop(pid)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    text = b"".join(chunks).decode()
    results[name] = text if os.waitstatus_to_exitcode(status) == 0 else text or f"exit status {status}"
print(json.dumps(results))
"""


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module under src/kvtier: dotted name -> (file, whether it is a package)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _third_party() -> list[str]:
    """The top-level packages kvtier's modules import, other than kvtier and the stdlib."""
    tops = set()
    for path, _ in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                tops.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                tops.add(node.module.partition(".")[0])
    return sorted(tops - {"kvtier", "__future__"} - set(sys.stdlib_module_names))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a child per module")
@pytest.mark.slow
def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    request = json.dumps([sorted(MODULES), _third_party(), max(2, os.cpu_count() or 1)])
    done = subprocess.run(
        [sys.executable, "-c", _ZYGOTE],
        input=request,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    results: dict[str, str] = json.loads(done.stdout.splitlines()[-1])
    assert set(results) == set(MODULES)
    skipped = {name: text.removeprefix(_ABSENT) for name, text in results.items() if text.startswith(_ABSENT)}
    failed = {name: text for name, text in results.items() if text and name not in skipped}
    for name, missing in sorted(skipped.items()):  # shown with -rA or -s
        print(f"skipped {name}: needs {missing}, not installed here")
    assert not failed, "modules that fail to import on their own:\n" + "\n".join(
        f"  {name}: {text.strip().splitlines()[-1]}" for name, text in sorted(failed.items())
    )
    assert len(skipped) < len(MODULES) // 2, f"most modules skipped: {sorted(skipped)}"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, is_package: bool) -> dict[str, int]:
    """kvtier modules ``name`` imports (at the top or in a function) -> the line of the first."""
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target in MODULES and target != name:
            found.setdefault(target, line)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit_node(other)
                continue
            visit_node(child)

    def visit_node(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import sub` imports the submodule; `from pkg import name` the package
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                add(sub if sub in MODULES else module, node.lineno)
        visit(node)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return found


def _find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None if it has none (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            step = next(stack[-1], None)
            if step is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(step) == 1:
                return path[path.index(step) :] + [step]
            elif step not in state:
                state[step] = 1
                path.append(step)
                stack.append(iter(sorted(graph[step])))
    return None


@functools.cache
def _graph() -> dict[str, dict[str, int]]:
    return {name: _imports(name, path, is_package) for name, (path, is_package) in MODULES.items()}


def test_the_import_graph_has_no_cycle() -> None:
    graph = _graph()
    cycle = _find_cycle(graph)
    if cycle is not None:
        steps = "\n".join(
            f"  {a} imports {b} ({MODULES[a][0].relative_to(SRC)}:{graph[a][b]})"
            for a, b in zip(cycle, cycle[1:])
        )
        pytest.fail("kvtier's modules import each other in a cycle:\n" + steps)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 1}}) is None


def test_config_layers() -> None:
    """STYLE.md item 16: schema knows no kind; sections and the region use the layers only."""
    graph = _graph()
    kvtier_only = {"kvtier.errors", "kvtier.registry"}
    layers = {"kvtier.config.units", "kvtier.config.checks", "kvtier.config.schema"}
    assert set(graph["kvtier.config.checks"]) <= kvtier_only
    assert set(graph["kvtier.config.units"]) <= kvtier_only | {"kvtier.config.checks"}
    assert set(graph["kvtier.config.schema"]) <= kvtier_only | layers
    for section in ("kvtier.tiers.cpu.config", "kvtier.tiers.disk.config", "kvtier.tiers.valkey.config"):
        config_imports = {m for m in graph[section] if m.startswith("kvtier.config")}
        # valkey's parse() is the whole parser applied to one section, for code that builds one
        allowed = layers | ({"kvtier.config.parse"} if "valkey" in section else set())
        assert config_imports <= allowed, section
    assert {m for m in graph["kvtier.tiers.cpu.region"] if m.startswith("kvtier.config")} <= {
        "kvtier.config.units"
    }
