"""DESIGN's one-way data flow: the learner package (`spopp_jax`) never imports the bridge
(`rollout_bridge`) and holds no application layer, no module imports another that imports
it back."""

import ast
import pkgutil
import subprocess
import sys

from pathlib import Path

import spopp_jax

REPO = Path(__file__).resolve().parent.parent
LEARNER_MODULES = sorted(m.name for m in pkgutil.walk_packages(spopp_jax.__path__, "spopp_jax."))


def test_learner_modules_import_nothing_from_the_bridge():
    # a fresh interpreter: this test process has the bridge loaded already
    script = (
        "import importlib, sys\n"
        f"for name in {LEARNER_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "leaked = sorted(m for m in sys.modules if m.split('.')[0] == 'rollout_bridge')\n"
        "print(','.join(leaked))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    leaked = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert leaked == "", f"importing spopp_jax loaded bridge modules: {leaked}"
    assert "spopp_jax.learner" in LEARNER_MODULES and "spopp_jax.tracker" in LEARNER_MODULES


def test_the_learner_package_holds_no_application_layer():
    """The run config, its env sections, the CLI aliases and the run's user errors live on
    the application side; the learner package is what a user imports for the pure core."""
    application = {f"spopp_jax.{name}" for name in ("config", "env_sections", "verl_aliases", "run_errors")}
    assert not application & set(LEARNER_MODULES)


def _project_modules() -> dict[str, Path]:
    modules = {}
    for package in ("spopp_jax", "rollout_bridge"):
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(path: Path, modules) -> set[str]:
    """Project modules ``path`` imports anywhere in its body (function-level imports too),
    with the packages each passes through (importing ``a.b.c`` runs ``a.b``'s ``__init__``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
    out |= {".".join(name.split(".")[:k]) for name in set(out) for k in range(2, name.count(".") + 1)}
    return out & set(modules)


def test_no_import_circles():
    """No module imports (even inside a function) one that imports it back, directly or
    through others; a submodule importing its own package does not count."""
    modules = _project_modules()
    graph = {name: {t for t in _imports(path, modules) if t != name and not name.startswith(t + ".")}
             for name, path in modules.items()}
    circles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v):   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    assert circles == []
