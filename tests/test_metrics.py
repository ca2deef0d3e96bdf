"""Per-request metrics from known timestamps, the benchmarks' summary helpers, and
the metrics a real engine run puts in ``RequestOutput.metrics``."""

from __future__ import annotations

import random

import numpy as np
import pytest

from minivllm.metrics.request_metrics import RequestMetrics
from minivllm.metrics.summary import percentile, summarize


# -- RequestMetrics from known timestamps --------------------------------------------

def test_latencies_follow_their_definitions():
    arrival, scheduled, finished = 10.0, 10.5, 12.0
    token_times = [11.0, 11.25, 11.75, 12.0]
    m = RequestMetrics(arrival_time=arrival, first_scheduled_time=scheduled,
                       num_prompt_tokens=9)
    for t in token_times:
        m.record_tokens(1, t)
    m.finished_time = finished
    assert m.ttft == token_times[0] - arrival
    assert m.queue_time == scheduled - arrival
    assert m.prefill_time == token_times[0] - scheduled
    assert m.decode_time == token_times[-1] - token_times[0]
    assert m.itl == [b - a for a, b in zip(token_times, token_times[1:])]
    assert m.tpot == pytest.approx((token_times[-1] - token_times[0]) / 3)
    assert m.tpot == pytest.approx(sum(m.itl) / len(m.itl))  # TPOT is the mean ITL
    assert m.e2e_latency == finished - arrival
    assert m.num_generation_tokens == len(token_times)
    assert m.token_times == token_times
    # The stages add up: queue + prefill = TTFT; TTFT + decode = time of the last token.
    assert m.queue_time + m.prefill_time == pytest.approx(m.ttft)
    assert arrival + m.ttft + m.decode_time == pytest.approx(token_times[-1])


def test_several_tokens_in_one_step_share_its_timestamp():
    m = RequestMetrics(arrival_time=0.0)
    m.record_tokens(1, 1.0)
    m.record_tokens(3, 2.0)  # e.g. a speculative step accepting three tokens
    assert m.token_times == [1.0, 2.0, 2.0, 2.0]
    assert m.itl == [1.0, 0.0, 0.0]
    assert m.num_generation_tokens == 4
    assert m.tpot == pytest.approx((2.0 - 1.0) / 3)


def test_missing_stages_are_none():
    m = RequestMetrics(arrival_time=5.0)
    assert (m.ttft, m.queue_time, m.prefill_time, m.decode_time, m.tpot,
            m.e2e_latency) == (None,) * 6
    assert m.itl == []
    m.record_tokens(1, 6.0)  # one token: a TTFT but no time per output token
    assert m.ttft == 1.0 and m.tpot is None and m.itl == []


def test_n_completions_count_every_token_and_time_each_stream():
    a = [1.0, 1.5, 2.5]  # completion 0
    b = [1.2, 1.4, 1.6, 2.0]  # completion 1
    m = RequestMetrics(arrival_time=0.5, completion_token_times=[[], []])
    events = sorted([(t, 0) for t in a] + [(t, 1) for t in b])
    for t, index in events:
        m.record_tokens(1, t, index)
    assert m.num_generation_tokens == len(a) + len(b)
    assert m.first_token_time == min(a[0], b[0]) and m.last_token_time == max(a + b)
    assert m.ttft == min(a[0], b[0]) - 0.5
    # ITL: gaps inside each stream, never across streams.
    gaps = [y - x for x, y in zip(a, a[1:])] + [y - x for x, y in zip(b, b[1:])]
    assert sorted(m.itl) == pytest.approx(sorted(gaps))
    # TPOT: each stream's decode span over its own tokens after the first.
    expected = ((a[-1] - a[0]) + (b[-1] - b[0])) / ((len(a) - 1) + (len(b) - 1))
    assert m.tpot == pytest.approx(expected)
    assert m.token_times == a


def test_bad_record_arguments_name_themselves():
    m = RequestMetrics(arrival_time=0.0)
    with pytest.raises(ValueError, match="count"):
        m.record_tokens(-1, 1.0)
    with pytest.raises(ValueError, match="index"):
        m.record_tokens(1, 1.0, index=-2)


# -- percentile / summarize against numpy --------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy(n):
    rng = random.Random(n)
    values = [rng.expovariate(3.0) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_summarize_matches_numpy():
    rng = random.Random(0)
    values = [rng.gauss(5, 2) for _ in range(257)]
    s = summarize(values)
    assert s.count == len(values)
    assert s.mean == pytest.approx(float(np.mean(values)))
    assert s.median == pytest.approx(float(np.median(values)))
    assert s.p99 == pytest.approx(float(np.percentile(values, 99)))
    assert s.std == pytest.approx(float(np.std(values)))
    assert (s.min, s.max) == (min(values), max(values))
    ms = s.as_dict(1000)
    assert ms["count"] == len(values) and ms["p99"] == pytest.approx(s.p99 * 1000)


def test_summary_edge_cases():
    assert summarize([]).count == 0 and summarize([]).mean == 0.0
    assert summarize(iter([3.0])).p99 == 3.0
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q=101"):
        percentile([1.0], 101)


# -- a real engine run ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    from minivllm import LLM

    return LLM(tiny_model("llama"), trace=True)


def _check_consistent(m: RequestMetrics, num_prompt_tokens: int, num_tokens: int) -> None:
    assert m.num_prompt_tokens == num_prompt_tokens
    assert m.num_generation_tokens == num_tokens
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time <= m.last_token_time <= m.finished_time
    assert all(b >= a for a, b in zip(m.token_times, m.token_times[1:]))
    assert m.queue_time >= 0 and m.prefill_time >= 0 and m.decode_time >= 0
    assert m.ttft == pytest.approx(m.queue_time + m.prefill_time)
    if num_tokens > 1:
        assert m.tpot * (num_tokens - 1) == pytest.approx(m.decode_time)
    assert m.e2e_latency >= m.ttft


def test_engine_fills_metrics_consistently(tiny_llm):
    from minivllm import SamplingParams

    prompts = [[5, 6, 7, 8, 9], [10, 11], list(range(20, 53))]
    lengths = [1, 6, 11]
    outs = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts],
                             [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths],
                             use_tqdm=False)
    for out, prompt, n in zip(outs, prompts, lengths):
        m = out.metrics
        assert len(out.outputs[0].token_ids) == n
        _check_consistent(m, len(prompt), n)
        assert len(m.itl) == n - 1
    # The step trace times the output processing (detokenize) of each step with outputs.
    assert any("detokenize" in r.timings for r in tiny_llm.trace)


def test_engine_counts_tokens_of_all_n_completions(tiny_llm):
    from minivllm import SamplingParams

    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1, ignore_eos=True)
    out = tiny_llm.generate({"prompt_token_ids": [3, 4, 5, 6]}, params, use_tqdm=False)[0]
    m = out.metrics
    assert m.num_generation_tokens == sum(len(c.token_ids) for c in out.outputs) == 15
    assert [len(t) for t in m.completion_token_times] == [5, 5, 5]
    assert len(m.itl) == 3 * 4
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    expected = sum(t[-1] - t[0] for t in m.completion_token_times) / (3 * 4)
    assert m.tpot == pytest.approx(expected)


def test_prometheus_series_exist_before_any_request():
    from prometheus_client.parser import text_string_to_metric_families

    from minivllm.core.request import FINISH_REASONS
    from minivllm.metrics.prometheus import PrometheusStatLogger

    text = PrometheusStatLogger("m").render().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    for reason in FINISH_REASONS:
        key = ("minivllm:request_success_total",
               (("finished_reason", reason), ("model_name", "m")))
        assert samples[key] == 0, key
    assert samples[("minivllm:time_to_first_token_seconds_count", (("model_name", "m"),))] == 0
