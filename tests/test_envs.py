"""minivllm/envs.py is the one reader of MINIVLLM_* variables, and the README says what it says."""

import ast
from pathlib import Path

import pytest

from minivllm import envs

ROOT = Path(__file__).resolve().parents[1]


def test_readme_environment_section_is_generated_from_envs():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Environment\n", 1)[1].split("\n## ", 1)[0]
    bullets = section[section.index("- `MINIVLLM_"):].rstrip() + "\n"
    assert bullets == envs.readme_section()


def test_no_module_but_envs_reads_a_minivllm_variable():
    """Every os.environ / os.getenv read of a MINIVLLM_* name is in envs.py (writes for a
    child process, as the figure exporter does, are not reads)."""
    readers = []
    for path in sorted((ROOT / "minivllm").rglob("*.py")):
        if path.name == "envs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("get", "getenv") and node.args and \
                    isinstance(node.args[0], ast.Constant) and \
                    str(node.args[0].value).startswith("MINIVLLM_"):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert readers == []


def test_values_are_parsed_and_bad_ones_name_the_variable(monkeypatch):
    monkeypatch.delenv("MINIVLLM_CPU_KERNELS", raising=False)
    assert envs.MINIVLLM_CPU_KERNELS is True  # the default
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "0")
    assert envs.MINIVLLM_CPU_KERNELS is False
    monkeypatch.setenv("MINIVLLM_TP_TIMEOUT", "12.5")
    assert envs.MINIVLLM_TP_TIMEOUT == 12.5
    monkeypatch.setenv("MINIVLLM_TP_TIMEOUT", "-1")
    with pytest.raises(ValueError, match=r"MINIVLLM_TP_TIMEOUT='-1' is invalid"):
        envs.MINIVLLM_TP_TIMEOUT
    monkeypatch.setenv("MINIVLLM_FUSED_DECODE", "yes")
    with pytest.raises(ValueError, match=r"MINIVLLM_FUSED_DECODE='yes' is invalid: must be 0"):
        envs.MINIVLLM_FUSED_DECODE
    with pytest.raises(AttributeError):
        envs.MINIVLLM_NO_SUCH_VARIABLE
