"""The README stays a front door: short, and everything it names exists.

Its links resolve (to a file, and to a heading where they name an anchor in a Markdown
file), every ``make`` target it names is in the Makefile, every ``minivllm`` command it
shows parses with the CLI, every ``minivllm/...`` path exists, and every keyword argument
it passes to ``LLM(...)`` is an ``EngineArgs`` field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_LINES = 400


def code_text(markdown: str) -> str:
    """The README's code: fenced blocks and inline code spans, one per line."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", markdown, flags=re.S | re.M)
    return "\n".join(blocks + re.findall(r"`([^`\n]+)`", prose))


CODE = code_text(README)


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_fits_on_a_few_screens():
    assert len(README.splitlines()) <= MAX_LINES


def test_every_relative_link_resolves():
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    assert links, "no links found: the pattern is wrong"
    broken = []
    for link in links:
        if re.match(r"^[a-z]+:", link):  # http(s), mailto
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
            if anchor not in {github_anchor(h) for h in headings}:
                broken.append(link)
    assert broken == []


def test_every_make_target_exists():
    targets = set(re.findall(r"\bmake ([a-z][a-z-]*)", CODE))
    assert {"book", "test"} <= targets
    makefile = (ROOT / "Makefile").read_text()
    defined = set(re.findall(r"^([a-z][a-z-]*):", makefile, flags=re.M))
    assert targets - defined == set()


def readme_commands() -> list[list[str]]:
    """``minivllm <subcommand> [<subcommand>]`` as the README's code runs them."""
    found = set()
    for match in re.finditer(r"(?<![\w.])(?:\.venv/bin/)?minivllm((?: [a-z][a-z-]*){1,2})", CODE):
        start = CODE.rfind("\n", 0, match.start()) + 1
        if re.search(r"\b(from|import)\s+$", CODE[start:match.start()]):
            continue  # `from minivllm import LLM`
        found.add(tuple(match.group(1).split()))
    return [list(words) for words in sorted(found)]


def test_every_minivllm_command_parses():
    from minivllm.entrypoints.cli import build_parser

    commands = readme_commands()
    assert ["serve"] in [c[:1] for c in commands]
    parser = build_parser()
    failed = []
    for words in commands:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                parser.parse_args([*words, "--help"])
                code = None
            except SystemExit as e:
                code = e.code
        if code != 0:
            failed.append(" ".join(words))
    assert failed == []


def test_a_wrong_subcommand_is_caught():
    """The check above can fail: a subcommand the CLI does not have is an error."""
    from minivllm.entrypoints.cli import build_parser

    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "no-such-benchmark", "--help"])
    assert e.value.code != 0


def test_every_module_path_exists():
    paths = set(re.findall(r"\bminivllm/[\w/]*\w\.py\b", README))
    dirs = set(re.findall(r"\bminivllm/[\w/]*/(?=[`)\s,])", README))
    assert "minivllm/core/engine_core.py" in paths
    assert [p for p in sorted(paths | dirs) if not (ROOT / p).exists()] == []


def llm_keywords(code: str) -> set[str]:
    """Keyword names passed to ``LLM(...)`` at the call's own level (not inside a dict)."""
    names = set()
    for match in re.finditer(r"\bLLM\(", code):
        depth, i, arg_start = 1, match.end(), match.end()
        while i < len(code) and depth:
            ch = code[i]
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif depth == 1 and ch == ",":
                arg_start = i + 1
            if depth == 1:
                keyword = re.match(r"\s*([A-Za-z_]\w*)\s*=(?!=)", code[arg_start:i + 1])
                if keyword:
                    names.add(keyword.group(1))
            i += 1
    return names


def test_every_llm_argument_is_an_engine_argument():
    from minivllm.config.engine import EngineArgs

    used = llm_keywords(CODE)
    assert {"cpu_kernels", "tensor_parallel_size"} <= used
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert used - fields == set()


def test_the_keyword_reader_sees_only_the_calls_own_arguments():
    code = 'LLM("m.gguf", quantization=None, speculative_config={"a": dict(b=1)})'
    assert llm_keywords(code) == {"quantization", "speculative_config"}


def table_rows(markdown: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in markdown.splitlines() if line.startswith("|") and "---" not in line]


def test_the_results_table_quotes_the_bench_tables():
    """Each ratio in the README's results table is the one its machine's
    figures/bench_table*.md gives for that workload (vLLM, HF, llama.cpp, in order)."""
    section = README.split("## Results\n", 1)[1].split("\n## ", 1)[0]
    header, *rows = table_rows(section)
    checked = 0
    for column, title in enumerate(header[1:], start=1):
        table = re.search(r"\]\((figures/bench_table\w*\.md)\)", title).group(1)
        bench_header, *bench_rows = table_rows((ROOT / table).read_text())
        ratio_columns = [i for i, name in enumerate(bench_header) if name.startswith("minivllm / ")]
        bench = {r[0]: [r[i] for i in ratio_columns if r[i] != "—"] for r in bench_rows}
        for row in rows:
            if row[0] in bench and row[column] != "—":
                assert re.findall(r"[\d.]+×", row[column]) == bench[row[0]], (table, row[0])
                checked += 1
    assert checked >= 12
