"""The house rules of the package layout, checked on the source (docs: WORKSPACE.md):

- no import cycle anywhere in pjit_ppo/ (imports inside functions count too);
- a stage (pjit_ppo/sft, reward, dpo, ppo) never imports another stage;
- nothing imports a stage except its own modules, the entry points (pjit_ppo/cli), the
  demo that runs every stage, and for PPO the planner and evaluation of a PPO checkpoint;
- checkpoint.py imports no stage.
"""
import ast
import pathlib
from typing import Dict, Set

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pjit_ppo"
STAGES = ("sft", "reward", "dpo", "ppo")
#: Modules outside a stage that may import it (besides pjit_ppo.cli.* and pjit_ppo.demo.*).
MAY_IMPORT_STAGE = {"ppo": ("pjit_ppo.planning", "pjit_ppo.evaluation")}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> Dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _runtime_nodes(tree):
    """Every node except those under `if TYPE_CHECKING:` (annotations only, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(name: str, path: pathlib.Path, modules) -> Set[str]:
    """The pjit_ppo modules `name` imports: `from a.b import c` counts as a.b.c when that
    is a module (a submodule import), else as a.b."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules
                       else module for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t.split(".")[0] == "pjit_ppo" and t in modules)
    out.discard(name)
    return out


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _stage(module: str):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def test_the_graph_is_read(graph):
    # The checks below mean something only if the graph has the edges we know exist.
    assert "pjit_ppo.ppo.trainer" in graph["pjit_ppo.ppo.run"]
    assert "pjit_ppo.models.scoring" in graph["pjit_ppo.ppo.collect"]
    assert len(graph) > 60


def test_no_import_cycle(graph):
    state: Dict[str, int] = {}  # 1 = on the current path, 2 = done
    path = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_stages_import_no_other_stage(graph):
    bad = [f"{m} imports {t}" for m, targets in graph.items() for t in targets
           if _stage(m) and _stage(t) and _stage(m) != _stage(t)]
    assert not bad, "\n".join(bad)


def test_only_entry_points_demo_planner_and_evaluation_import_a_stage(graph):
    bad = []
    for module, targets in graph.items():
        if _stage(module) or module.startswith(("pjit_ppo.cli.", "pjit_ppo.demo.")):
            continue
        for target in targets:
            stage = _stage(target)
            if stage and module not in MAY_IMPORT_STAGE.get(stage, ()):
                bad.append(f"{module} imports {target}")
    assert not bad, "\n".join(bad)


def test_checkpointing_imports_no_stage(graph):
    assert not [t for t in graph["pjit_ppo.checkpoint"] if _stage(t)]


def test_the_rules_catch_a_violation(tmp_path):
    """The reader resolves the import forms the rules depend on (a check that cannot
    fail would say nothing)."""
    modules = {"pjit_ppo.sft.train": None, "pjit_ppo.ppo.run": None, "pjit_ppo.ppo": None,
               "pjit_ppo.sft": None, "pjit_ppo.loading": None}
    source = tmp_path / "train.py"
    source.write_text("from pjit_ppo.ppo import run\nfrom ..loading import load_lm\n"
                      "def f():\n    import pjit_ppo.ppo\n"
                      "if TYPE_CHECKING:\n    from pjit_ppo.sft import train\n")
    found = _imports("pjit_ppo.sft.train", source, modules)
    assert found == {"pjit_ppo.ppo.run", "pjit_ppo.loading", "pjit_ppo.ppo"}
