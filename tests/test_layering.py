"""The packages of minivllm depend one way.

Every import of every module is counted — top-level, function-level and under
``TYPE_CHECKING`` alike — and mapped to the subpackage (or top-level module) it
comes from and goes to; the instruments in ``lab/`` count as one unit each
(``lab.sim``, ``lab.bench``, ``lab.viz``). The graph of units has no cycle of
any length (its strongly connected components are single units), no engine
unit reaches ``lab/``, and ``model/`` and ``core/`` (the reference path and the
engine-core process) never reach ``cpu/``. Adding a package that depends one
way on others needs no change here.
"""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "minivllm"
NEVER = {"model": {"cpu"}, "core": {"cpu", "engine", "entrypoints", "worker"}}


def _unit(module: str) -> str | None:
    """minivllm.core.scheduler -> "core"; minivllm.envs -> "envs"; minivllm -> None;
    minivllm.lab.sim.cost_model -> "lab.sim"."""
    parts = module.split(".")
    if parts[0] != "minivllm" or len(parts) < 2:
        return None
    return ".".join(parts[1:3]) if parts[1] == "lab" and len(parts) > 2 else parts[1]


def _is_lab(unit: str) -> bool:
    return unit == "lab" or unit.startswith("lab.")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _root_exports() -> dict[str, str]:
    """``from minivllm import LLM``: the name -> the module minivllm/__init__ takes it from."""
    out = {}
    for node in ast.walk(ast.parse((ROOT / "__init__.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.update({a.asname or a.name: node.module for a in node.names})
    return out


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(from unit, to unit) -> the files (with line numbers) that make the import."""
    exports = _root_exports()
    edges = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        source = _unit(module)
        if source is None:
            continue
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module
                if target == "minivllm":
                    targets = [exports.get(a.name, f"minivllm.{a.name}") for a in node.names]
                else:
                    targets = [target]
            for target in targets:
                unit = _unit(target)
                if unit is not None and unit != source:
                    edges[(source, unit)].append(
                        f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return edges


def strongly_connected_components(edges) -> list[list[str]]:
    """Tarjan's algorithm over the unit graph: the components, each sorted."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        graph[b]
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_the_units_form_no_cycle():
    edges = import_edges()
    cycles = [c for c in strongly_connected_components(edges) if len(c) > 1]
    assert cycles == [], [
        {f"{a} -> {b}": edges[(a, b)][:2] for a in c for b in c if (a, b) in edges}
        for c in cycles]


def test_the_cycle_finder_sees_a_long_cycle():
    """Three units in a ring (no two import each other) are one component."""
    ring = {("a", "b"): [], ("b", "c"): [], ("c", "a"): [], ("c", "d"): []}
    assert sorted(strongly_connected_components(ring)) == [["a", "b", "c"], ["d"]]


def test_no_engine_module_imports_the_lab():
    edges = import_edges()
    reached = sorted(f"{a} -> {b}: {sites[:3]}" for (a, b), sites in edges.items()
                     if _is_lab(b) and not _is_lab(a))
    assert reached == []


def test_only_the_cli_names_lab_modules():
    """``minivllm bench`` / ``minivllm simulate`` dispatch by module name, in one table."""
    named = []
    for path in sorted(ROOT.rglob("*.py")):
        unit = _unit(_module_name(path))
        if unit is None or _is_lab(unit):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value.startswith("minivllm.lab")):
                named.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert named and all(site.startswith("minivllm/entrypoints/cli.py:") for site in named), named


def test_reference_path_and_engine_core_stay_below():
    edges = import_edges()
    reached = sorted(f"{a} -> {b}: {edges[(a, b)][:3]}" for a, targets in NEVER.items()
                     for b in targets if (a, b) in edges)
    assert reached == []


def test_the_walk_sees_every_kind_of_import():
    """The walk itself: a function-level and a TYPE_CHECKING import are both edges."""
    edges = import_edges()
    assert ("engine", "core") in edges  # top level
    assert any("core_builder.py" in site for site in edges[("engine", "worker")])  # in a function
    assert ("core", "config") in edges  # under TYPE_CHECKING in places, top level in others


def private_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """``from minivllm.x import _name`` where ``_name`` is not a module: a private name
    used outside the module that defines it. Relative imports are resolved first."""
    package = module if is_package else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        if origin != "minivllm" and not origin.startswith("minivllm."):
            continue
        for alias in node.names:
            name = alias.name
            if not name.startswith("_") or name.startswith("__"):
                continue
            as_path = ROOT.parent.joinpath(*f"{origin}.{name}".split("."))
            if as_path.with_suffix(".py").exists() or (as_path / "__init__.py").exists():
                continue  # a module (vLLM's ``_custom_ops``): its name is its own
            found.append(f"{module}:{node.lineno}: from {origin} import {name}")
    return found


def test_no_private_name_is_imported_from_another_module():
    """A name shared between modules is public (no leading underscore) where it lives."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        found += private_imports(path.read_text(), _module_name(path),
                                 path.name == "__init__.py")
    assert found == []


def test_the_private_import_walk_tells_names_from_modules():
    src = ("from minivllm.cpu.attention import CPUAttentionBackend, _hidden\n"
           "from minivllm.cpu import _custom_ops\n"
           "from .ggml_types import _f16\n"
           "from os import _exit\n")
    assert private_imports(src, "minivllm.model.layers.quantization.x") == [
        "minivllm.model.layers.quantization.x:1: from minivllm.cpu.attention import _hidden",
        "minivllm.model.layers.quantization.x:3: "
        "from minivllm.model.layers.quantization.ggml_types import _f16"]
