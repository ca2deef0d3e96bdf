"""figures/RESULTS.md is generated (minivllm.lab.results) and cannot drift from its sources."""

from minivllm.lab import results


def test_committed_results_page_is_the_generators_output():
    assert results.PAGE.read_text() == results.render(), \
        "figures/RESULTS.md is stale: run `make results` (python -m minivllm.lab.results)"


def test_every_record_and_bench_table_is_on_the_page():
    page = results.render()
    for source in [*results.FIGURES.glob("records/*.md"), *results.FIGURES.glob("bench_table*.md")]:
        body = source.read_text().strip().splitlines()
        # a line from the middle of each source (headings are demoted, links rewritten)
        line = next(l for l in body[len(body) // 2:] if l.strip() and "](" not in l
                    and not l.startswith("#"))
        assert line in page, f"{source.name}: {line!r} is not on the page"


def test_every_relative_link_on_the_page_resolves():
    page = results.render()
    for target in results.LINK.findall(page):
        path = target[1]
        if ":" in path:
            continue
        assert (results.PAGE.parent / path).exists(), path


def test_relink_moves_a_records_link_to_the_pages_folder():
    record = results.FIGURES / "records" / "x.md"
    assert results._relink("[c](../../book/01_request_to_first_token.py#top)", record) == \
        "[c](../book/01_request_to_first_token.py#top)"
    assert results._relink("[s](simulator.md)", record) == "[s](records/simulator.md)"
    assert results._relink("[w](https://example.com/a.md)", record) == "[w](https://example.com/a.md)"
