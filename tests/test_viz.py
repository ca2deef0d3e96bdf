"""The book's figure builders (timeline, tokens, heatmap, bars) and the figure export.

Every figure is checked through its data: the numbers drawn must be the
numbers given (or derived from them), in the order given.
"""

from __future__ import annotations

import math
import textwrap

import pytest

pytest.importorskip("plotly")

from minivllm.core.trace import StepRecord  # noqa: E402
from minivllm.lab.viz import export  # noqa: E402
from minivllm.lab.viz.bars import component_bars, line_chart, stacked_bars, topk_bars  # noqa: E402
from minivllm.lab.viz.heatmap import attention_heatmap  # noqa: E402
from minivllm.lab.viz.labels import unique_labels, visible  # noqa: E402
from minivllm.lab.viz.timeline import (Span, request_timeline, spans_from_steps,  # noqa: E402
                                   ttft_and_gaps)
from minivllm.lab.viz.tokens import (byte_level_alphabet, pieces_from_ids,  # noqa: E402
                                 split_tokens, token_boundaries, token_bytes)


def trace(fig, name):
    found = [t for t in fig.data if t.name == name]
    assert len(found) == 1, [t.name for t in fig.data]
    return found[0]


# -- labels ------------------------------------------------------------------------------
def test_visible_and_unique_labels():
    assert visible(" a\nb\t") == "␣a↵b⇥"
    labels = ["x", "y", "x", "x (2)", "x"]
    out = unique_labels(labels)
    assert len(set(out)) == len(labels)
    assert [o.split(" (")[0] for o in out] == [lab.split(" (")[0] for lab in labels]
    assert out[:3] == ["x", "y", "x (2)"]


# -- timeline ----------------------------------------------------------------------------
def test_request_timeline_draws_spans_marks_ttft_and_gaps():
    arrival = 100.0
    spans = [Span("API side", "tokenize", 100.0, 100.002), Span("scheduler", "queue", 100.002,
                                                                 100.005),
             Span("engine core", "prefill", 100.005, 100.050),
             Span("engine core", "decode", 100.051, 100.071),
             Span("engine core", "decode", 100.072, 100.090)]
    marks = [100.050, 100.071, 100.090]
    fig = request_timeline(spans, marks, origin=arrival)
    decode = trace(fig, "decode")
    assert list(decode.base) == pytest.approx([(s.start - arrival) * 1000 for s in spans[3:]])
    assert list(decode.x) == pytest.approx([s.duration * 1000 for s in spans[3:]])
    core_ms = sum(s.duration for s in spans[2:]) * 1000
    assert list(decode.y) == [f"engine core · {core_ms:.0f} ms"] * 2  # lane total in its label
    tokens = trace(fig, "tokens")
    assert list(tokens.x) == pytest.approx([(t - arrival) * 1000 for t in marks])
    ttft, gaps = ttft_and_gaps(marks, arrival)
    ttft_trace = trace(fig, f"TTFT {ttft * 1000:.0f} ms")
    assert list(ttft_trace.x) == pytest.approx([0.0, ttft * 1000])
    gap_trace = trace(fig, "inter-token gaps (ms)")
    assert list(gap_trace.text) == [f"{g * 1000:.0f}" for g in gaps]
    # lanes top to bottom in order of first appearance, then tokens and TTFT
    lanes = [name.split(" · ")[0] for name in fig.layout.yaxis.categoryarray]
    assert lanes == ["TTFT", "tokens", "engine core", "scheduler", "API side"]
    assert trace(fig, "tokenize").y[0] == f"API side · {spans[0].duration * 1000:.1f} ms"


def test_timeline_rejects_bad_input():
    with pytest.raises(ValueError, match="end="):
        Span("a", "b", 2.0, 1.0)
    with pytest.raises(ValueError, match="marks is empty"):
        request_timeline([Span("a", "b", 0.0, 1.0)], [])
    with pytest.raises(ValueError, match="time order"):
        ttft_and_gaps([2.0, 1.0], 0.0)


def test_spans_from_steps_follow_the_records():
    records = [StepRecord(step=0, start=10.0, duration=0.5, scheduled={"a": (7, "prefill")}),
               StepRecord(step=1, start=10.6, duration=0.1,
                          scheduled={"a": (1, "decode"), "b": (4, "prefill")}),
               StepRecord(step=2, start=10.8, duration=0.1, scheduled={"b": (1, "decode")})]
    ends = [10.55, 10.75, 10.95]
    spans = spans_from_steps(records, "a", ends)
    core = [s for s in spans if s.lane == "engine core"]
    detok = [s for s in spans if s.kind == "detokenize"]
    assert [(s.kind, s.start, s.end) for s in core] == [
        ("prefill", 10.0, 10.5), ("decode", 10.6, pytest.approx(10.7))]
    assert [(s.start, s.end) for s in detok] == [(10.5, 10.55),
                                                (pytest.approx(10.7), 10.75)]
    with pytest.raises(ValueError, match="step_ends has 2 entries for 3 records"):
        spans_from_steps(records, "a", ends[:2])
    # Without step_ends, the records' own detokenize timing places the API-side spans.
    records[0].timings["detokenize"] = 0.02
    from_timings = spans_from_steps(records, "a")
    assert [(s.kind, s.start, s.end) for s in from_timings if s.kind == "detokenize"] == [
        ("detokenize", 10.5, pytest.approx(10.52))]


@pytest.mark.slow
def test_spans_from_a_real_engine_trace(tiny_model):
    """A real (tiny) engine run: one prefill span, then one decode span per later token."""
    from minivllm import LLM, SamplingParams

    llm = LLM(str(tiny_model("llama")), trace=True, num_kv_blocks=16)
    prompt = list(range(3, 20))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    spans = spans_from_steps(llm.trace.records, out.request_id)
    core = [s for s in spans if s.lane == "engine core"]
    assert [s.kind for s in core] == ["prefill"] + ["decode"] * 4
    assert all(a.end <= b.start for a, b in zip(core, core[1:]))
    detok = [s for s in spans if s.kind == "detokenize"]
    if "detokenize" in llm.trace.records[0].timings:  # LLMEngine.step times it
        assert len(detok) == len(core)
    fig = request_timeline(spans, out.metrics.token_times, origin=out.metrics.arrival_time)
    assert len(trace(fig, "tokens").x) == len(out.outputs[0].token_ids)


# -- tokens ------------------------------------------------------------------------------
def test_byte_level_alphabet_is_the_tokenizers_one():
    from tokenizers.pre_tokenizers import ByteLevel

    table = byte_level_alphabet()
    assert set(table) == set(ByteLevel.alphabet())
    assert sorted(table.values()) == list(range(256))  # every byte exactly once


TEXTS = ["What is the capital of France?", "今天天气很好，我们去公园散步吧。",
         "mixed 中文 and emoji 🙂\nnew line"]


@pytest.mark.parametrize("text", TEXTS)
def test_split_tokens_covers_every_byte(default_tokenizer, text):
    pieces = split_tokens(default_tokenizer, text)
    assert [p.token_id for p in pieces] == default_tokenizer.encode(
        text, add_special_tokens=False)
    assert b"".join(p.data for p in pieces) == text.encode("utf-8")
    for p in pieces:
        assert p.text == text[p.start:p.end]
        if p.partial:  # a piece of a character lies inside that character's bytes
            assert len(p.text) == 1 and p.data in p.text.encode("utf-8")
            assert "\ufffd" in default_tokenizer.decode([p.token_id])
        else:
            assert p.data.decode("utf-8") == default_tokenizer.decode([p.token_id])


def test_chinese_characters_are_split(default_tokenizer):
    text = TEXTS[1]
    pieces = split_tokens(default_tokenizer, text)
    partial = [p for p in pieces if p.partial]
    assert partial and len(pieces) > len(text)
    for start in {p.start for p in partial}:
        group = [p for p in partial if p.start == start]
        assert len(group) >= 2
        assert b"".join(p.data for p in group) == text[start].encode("utf-8")


def test_special_tokens_are_marked(default_tokenizer):
    rendered = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    pieces = split_tokens(default_tokenizer, rendered)
    specials = set(default_tokenizer.all_special_ids)
    assert [p.special for p in pieces] == [p.token_id in specials for p in pieces]
    assert sum(p.special for p in pieces) == rendered.count("<|im_")
    for p in pieces:
        if p.special:
            assert p.data == token_bytes(default_tokenizer, p.token_id)
            assert p.data.decode() == default_tokenizer.convert_ids_to_tokens(p.token_id)


def test_pieces_from_ids_of_a_cut_off_character(default_tokenizer):
    """Generated IDs may stop inside a character; the pieces still cover every byte."""
    ids = default_tokenizer.encode("天气", add_special_tokens=False)
    cut = ids[:-1]
    pieces = pieces_from_ids(default_tokenizer, cut)
    assert b"".join(p.data for p in pieces) == b"".join(
        token_bytes(default_tokenizer, t) for t in cut)
    assert pieces[-1].partial


def test_token_boundaries_draws_one_box_per_token(default_tokenizer):
    text = "The weather is nice. " * 6 + "今天天气很好"
    pieces = split_tokens(default_tokenizer, text)
    fig = token_boundaries(pieces, row_width=40)
    drawn = sorted((t.customdata[i], t.text[i], t.name, t.y[i], t.base[i], t.x[i])
                   for t in fig.data for i in range(len(t.text)))
    assert len(drawn) == len(pieces)
    by_order = sorted(drawn, key=lambda d: (d[3], d[4]))  # reading order: row, then x
    assert [d[1] for d in by_order] == [p.label for p in pieces]
    assert [d[0] for d in by_order] == [p.token_id for p in pieces]
    assert {d[2] for d in drawn} == {p.kind for p in pieces}
    assert all(d[4] + d[5] <= 40 for d in drawn)  # no box runs past the row
    assert max(d[3] for d in drawn) >= 1  # it wrapped


def test_token_boundaries_colours_each_kind_in_its_own_hue(default_tokenizer):
    import colorsys

    def hue(color: str) -> float:
        r, g, b = (int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))
        return colorsys.rgb_to_hsv(r, g, b)[0]

    pieces = split_tokens(default_tokenizer, "<|im_start|>user\nThe weather 今天天气很好")
    fig = token_boundaries(pieces)
    hues = {t.name: {round(hue(c), 1) for c in t.marker.color} for t in fig.data}
    assert set(hues) == {"token", "byte piece", "special token"}
    # one hue per kind (shades may alternate), and no two kinds share one: the legend
    # swatch and every box of a kind agree, and "orange" means byte pieces only
    assert all(len(h) == 1 for h in hues.values())
    assert len(set.union(*hues.values())) == 3


def test_token_boundaries_rejects_nothing():
    with pytest.raises(ValueError, match="pieces is empty"):
        token_boundaries([])


# -- heatmap -----------------------------------------------------------------------------
def test_attention_heatmap_keeps_weights_and_labels():
    import torch

    w = torch.tensor([[1.0, 0.0, 0.0], [0.3, 0.7, 0.0], [0.2, 0.2, 0.6]])
    labels = ["<s>", " a", " a"]
    fig = attention_heatmap(w, labels)
    heat = fig.data[0]
    assert [list(r) for r in heat.z] == w.tolist()
    assert list(heat.x) == ["0 <s>", "1 ␣a", "2 ␣a"]  # repeated tokens keep their own column
    assert list(heat.y) == list(heat.x)
    last_row = attention_heatmap(w[-1:], labels)  # a decode step: one query, the last token
    assert list(last_row.data[0].y) == ["2 ␣a"]


def test_attention_heatmap_rejects_mismatched_labels():
    with pytest.raises(ValueError, match="key_labels has 2 entries for 3"):
        attention_heatmap([[1, 0, 0]], ["a", "b"])
    with pytest.raises(ValueError, match="2-D"):
        attention_heatmap([1, 2], ["a", "b"])


# -- bars and lines ----------------------------------------------------------------------
def test_topk_bars_sorted_with_chosen_highlighted():
    labels, probs = ["a", "b", "c"], [0.2, 0.5, 0.3]
    fig = topk_bars(labels, probs, chosen=2)
    bar = fig.data[0]
    order = sorted(range(3), key=lambda i: -probs[i])
    assert list(bar.y) == [labels[i] for i in order]
    assert list(bar.x) == [probs[i] for i in order]
    assert list(bar.text) == [f"{probs[i]:.1%}" for i in order]
    assert [c == "crimson" for c in bar.marker.color] == [i == 2 for i in order]
    with pytest.raises(ValueError, match="probabilities must be in"):
        topk_bars(["a"], [1.5])
    with pytest.raises(ValueError, match="chosen=3"):
        topk_bars(labels, probs, chosen=3)


def test_component_bars_values_and_shares():
    parts = {"mlp": 60.0, "embedding": 30.0, "norm": 10.0}
    fig = component_bars(parts, "params", fmt=lambda v: f"{v:.0f}")
    bar = fig.data[0]
    assert list(bar.y) == ["mlp", "embedding", "norm"]
    total = sum(parts.values())
    assert list(bar.text) == [f"{v:.0f} ({v / total:.1%})" for v in parts.values()]
    unsorted = component_bars({"b": 1.0, "a": 2.0}, "t", show_share=False, sort=False)
    assert list(unsorted.data[0].y) == ["b", "a"] and "%" not in unsorted.data[0].text[0]
    with pytest.raises(ValueError, match="negative"):
        component_bars({"a": -1.0}, "t")


def test_stacked_bars_lines_on_a_second_axis_markers_on_the_first():
    parts = {"cached": [0, 32, 48], "computed": [40, 12, 4]}
    total = [sum(v) for v in zip(*parts.values())]
    fig = stacked_bars(["t1", "t2", "t3"], parts, "t", "tokens", x_name="turns",
                       lines={"TTFT": [0.5, 0.2, 0.1]}, y2_title="s",
                       markers={"measured": total}, fmt=str)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [b.name for b in bars] == ["cached", "computed"] and fig.layout.barmode == "stack"
    assert list(bars[1].text) == ["40", "12", "4"]
    line, marker = [t for t in fig.data if t.type == "scatter"]
    assert line.yaxis == "y2" and fig.layout.yaxis2.overlaying == "y"
    assert marker.yaxis in (None, "y") and list(marker.y) == [40, 44, 52]
    with pytest.raises(ValueError, match="'TTFT' has 1 values for 3 turns"):
        stacked_bars(["t1", "t2", "t3"], parts, "t", "y", x_name="turns", lines={"TTFT": [1]})


def test_stacked_bars_second_axis_ticks_at_round_numbers():
    from minivllm.lab.viz.bars import nice_step

    for top in (0.9, 9.3, 888.0, 1234.0, 51.0):
        fig = stacked_bars(["a", "b"], {"n": [1, 2]}, "t", "y", lines={"ms": [top / 3, top]})
        axis = fig.layout.yaxis2
        mantissa = axis.dtick / 10 ** math.floor(math.log10(axis.dtick))
        assert round(mantissa, 9) in (1, 2, 5) and axis.tick0 == 0
        assert axis.range[0] == 0 and axis.range[1] >= top  # the line fits under the top
        assert 3 <= axis.range[1] / axis.dtick <= 11  # a handful of ticks
    assert nice_step(888.0) == 200 and nice_step(0) == 1.0


def test_line_chart_one_trace_per_series():
    x = [16, 64, 256]
    series = {"recompute": [1.0, 4.0, 16.0], "cached": [1.0, 1.1, 1.2]}
    fig = line_chart(x, series, "t", "context", "ms", log_y=True)
    assert [t.name for t in fig.data] == list(series)
    for t in fig.data:
        assert list(t.x) == x and list(t.y) == series[t.name]
    assert fig.layout.yaxis.type == "log"
    with pytest.raises(ValueError, match="has 2 points for 3"):
        line_chart(x, {"bad": [1.0, 2.0]}, "t", "x", "y")


# -- export ------------------------------------------------------------------------------
def small_figure():
    return line_chart([1, 2], {"a": [1.0, 2.0]}, "t", "x", "y")


def test_save_key_figure_is_a_no_op_without_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(export.FIGURES_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert export.save_key_figure(small_figure(), "01_demo") is None
    assert list(tmp_path.iterdir()) == []


def test_save_key_figure_names_must_be_chapter_slugs():
    with pytest.raises(ValueError, match="name='Figure 1' is invalid"):
        export.save_key_figure(small_figure(), "Figure 1")


def test_without_a_browser_it_writes_html_and_says_why(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(export.FIGURES_DIR_ENV, str(tmp_path / "figs"))
    monkeypatch.setenv(export.BROWSER_PATH_ENV, str(tmp_path / "no-such-chromium"))
    assert export.find_browser() is None
    problem = export.export_problem()
    assert problem is not None and "Chromium" in problem and "BROWSER_PATH" in problem
    written = export.save_key_figure(small_figure(), "07_demo")
    assert written == tmp_path / "figs" / "07_demo.html" and written.is_file()
    assert "plotly" in written.read_text()
    out = capsys.readouterr().out
    assert "instead of a PNG" in out and "chromium" in out


@pytest.mark.slow
def test_png_when_a_browser_is_there(monkeypatch, tmp_path):
    if export.export_problem() is not None:
        pytest.skip(export.export_problem())
    monkeypatch.setenv(export.FIGURES_DIR_ENV, str(tmp_path))
    written = export.save_key_figure(small_figure(), "01_demo")
    assert written == tmp_path / "01_demo.png"
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chapters_are_found_in_order(tmp_path):
    for name in ("02_b.py", "01_a.py", "conftest.py", "notes.py", "10_c.py"):
        (tmp_path / name).write_text("")
    assert [p.name for p in export.chapters(tmp_path)] == ["01_a.py", "02_b.py", "10_c.py"]
    assert [p.name for p in export.chapters(tmp_path, ["02", "10"])] == ["02_b.py", "10_c.py"]
    assert export.main(["figures", "--book", str(tmp_path / "missing")]) == 2


CHAPTER = textwrap.dedent('''\
    # %%
    from minivllm.lab.viz.bars import line_chart
    from minivllm.lab.viz.export import save_key_figure
    save_key_figure(line_chart([1, 2], {"a": [1.0, 2.0]}, "t", "x", "y"), "01_demo")
    ''')


@pytest.mark.slow
def test_figures_command_runs_chapters_and_reports(monkeypatch, tmp_path, capsys):
    pytest.importorskip("nbclient")
    book, out = tmp_path / "book", tmp_path / "figs"
    book.mkdir()
    (book / "01_demo.py").write_text(CHAPTER)
    (book / "02_broken.py").write_text("# %%\nraise RuntimeError('boom')\n")
    # HTML keeps this test fast and independent of a browser.
    monkeypatch.setenv(export.BROWSER_PATH_ENV, str(tmp_path / "no-such-chromium"))
    code = export.main(["figures", "--book", str(book), "--out", str(out)])
    report = capsys.readouterr().out
    assert code == 1  # one chapter failed
    assert (out / "01_demo.html").is_file()
    assert f"wrote {out / '01_demo.html'}" in report
    assert "02_broken.py" in report and "FAILED" in report and "boom" in report


# -- widgets -----------------------------------------------------------------------------
def test_show_in_replaces_what_an_output_widget_shows(monkeypatch):
    widgets = pytest.importorskip("ipywidgets")
    import plotly.io as pio

    from minivllm.lab.viz.widgets import show_in

    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")  # as in a kernel
    out = widgets.Output()
    fig = small_figure()
    show_in(out, "first", fig)
    assert [o["output_type"] for o in out.outputs] == ["stream", "display_data"]
    assert out.outputs[0]["text"] == "first\n"
    drawn = out.outputs[1]["data"]["application/vnd.plotly.v1+json"]
    assert [list(t["y"]) for t in drawn["data"]] == [list(t.y) for t in fig.data]
    show_in(out, "second")  # replaces, does not append
    assert [o.get("text") for o in out.outputs] == ["second\n"]
