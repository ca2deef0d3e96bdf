"""The packages of minivllm depend one way.

Every import of every module is counted — top-level, function-level and under
``TYPE_CHECKING`` alike — and mapped to the subpackage (or top-level module) it
comes from and goes to. No two of them may import each other, and ``model/``
and ``core/`` (the reference path and the engine-core process) never reach
``cpu/``. Adding a package that depends one way on others needs no change here.
"""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "minivllm"
NEVER = {"model": {"cpu"}, "core": {"cpu", "engine", "entrypoints", "worker"}}


def _unit(module: str) -> str | None:
    """minivllm.core.scheduler -> "core"; minivllm.envs -> "envs"; minivllm -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "minivllm" and len(parts) > 1 else None


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


def test_no_two_packages_import_each_other():
    edges = import_edges()
    both_ways = sorted(f"{a} <-> {b}: {edges[(a, b)][:3]} / {edges[(b, a)][:3]}"
                       for a, b in edges if a < b and (b, a) in edges)
    assert both_ways == []


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
