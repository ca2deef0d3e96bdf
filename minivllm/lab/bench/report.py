"""A benchmark table from the JSON files ``bench throughput`` wrote (figures/bench_table*.md,
shown in figures/RESULTS.md).

    python -m minivllm.lab.bench.report figures/bench_throughput_*.json

One row per file (workload): output tokens/s per backend as median (range)
over the repeats, minivllm's ratios to vLLM, to Hugging Face ``generate`` and to
llama.cpp (medians of the per-repeat ratios, so each pairs runs made side by side), and
minivllm's fraction of the roofline the same run measured. A last line names
the machine(s) the rows ran on, as each run recorded it, so the table never
claims more than it measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ("minivllm", "vllm", "hf", "hf-cb", "llama.cpp")
# Shown only where a run has it: llama.cpp's decode loop without Python sampling.
OPTIONAL_COLUMNS = ("llama.cpp-decode",)
RATIOS = (("vllm", "vLLM"), ("hf", "HF"), ("llama.cpp", "llama.cpp"))


def _rate(stats: dict) -> str:
    return f"{stats['median']:.0f} ({stats['min']:.0f}–{stats['max']:.0f})"


def _workload(w: dict) -> str:
    n = w["num_prompts"]
    tokens = w["output_tokens"] // n
    return f"{n} request{'s' if n > 1 else ''} × {tokens} tokens, {w['dtype']}"


def _weights(result: dict) -> str:
    """The workload's label: its dtype, or minivllm's quantization (``gguf``: the
    file's blocks as they ship)."""
    label = _workload(result["workload"])
    info = result["backends"].get("minivllm", {}).get("info", {})
    if info.get("quantization"):
        label = label.rsplit(", ", 1)[0] + f", {info['quantization']}"
    if info.get("activation_dtype", "auto") != "auto":
        label += f" x {info['activation_dtype']}"
    return label


def columns(results: list[dict]) -> tuple[str, ...]:
    return COLUMNS + tuple(c for c in OPTIONAL_COLUMNS
                           if any(c in r["backends"] for r in results))


def row(result: dict, shown: tuple[str, ...] = COLUMNS) -> str:
    backends, ratios = result["backends"], result["ratios_output_tokens_per_s"]
    cells = [_weights(result)]
    cells += [_rate(backends[b]["output_tokens_per_s"]) if b in backends else "—"
              for b in shown]
    cells += [f"{ratios[p]['median']:.2f}×" if p in ratios else "—" for p, _ in RATIOS]
    fraction = backends["minivllm"].get("roofline_fraction")
    cells.append(f"{fraction['median']:.0%}".replace("%", " %") if fraction else "—")
    return "| " + " | ".join(cells) + " |"


def machines(results: list[dict]) -> str:
    """One line naming every distinct CPU (with the kernels' ISA) the rows ran on."""
    seen: list[str] = []
    for result in results:
        m = result.get("roofline", {}).get("machine", {})
        name = (f"{m.get('cpu_features', m.get('cpu', 'unknown CPU'))}, "
                f"{m.get('logical_cpus', '?')} logical CPUs, torch {m.get('torch', '?')}")
        if name not in seen:
            seen.append(name)
    return "Measured on: " + "; ".join(seen) + "."


def table(paths: list[str]) -> str:
    results = [json.loads(Path(p).read_text()) for p in paths]
    shown = columns(results)
    head = ("| workload | " + " | ".join(shown) + " | "
            + " | ".join(f"minivllm / {name}" for _, name in RATIOS)
            + " | minivllm, % of roofline |")
    lines = [head, "|" + "---|" * (len(shown) + len(RATIOS) + 2)]
    lines += [row(result, shown) for result in results]
    return "\n".join(lines) + "\n\n" + machines(results)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m minivllm.lab.bench.report FILE.json [FILE.json ...]")
    print(table(sys.argv[1:]))
