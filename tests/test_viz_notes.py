"""timing_note: the one boxed caveat about measured times."""

from minivllm.lab.viz.notes import TIMING_RULES, timing_note


def test_timing_note_shows_every_rule_as_text_and_html():
    note = timing_note("Chunk sizes are exact; their times are not.")
    text, box = str(note), note._repr_html_()
    assert text.startswith("[About the timings in this chapter]")
    for line in (*TIMING_RULES, "Chunk sizes are exact; their times are not."):
        assert f"- {line}" in text
    assert box.count("<li>") == len(TIMING_RULES) + 1 and "border" in box
    assert timing_note().lines == TIMING_RULES


def test_timing_note_escapes_html():
    assert "&lt;b&gt; &amp;" in timing_note("<b> &")._repr_html_()
