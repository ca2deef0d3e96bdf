"""Beam search: the best beams equal Hugging Face's ``generate(num_beams=...)``, with
and without prefix caching; each step's one-token requests find their beam's full
blocks in the prefix cache (their common full blocks shared, each beam's partly
filled last block its own), and every block is back in the pool after a search,
a finished one or an interrupted one (counted in the block pool)."""

from __future__ import annotations

import functools
import time

import pytest
import torch

from minivllm import LLM, BeamSearchParams, CompletionOutput, Logprob, RequestOutput
from minivllm.entrypoints.beam_search import BeamSearch

WIDTH, STEPS = 3, 6


@functools.lru_cache(maxsize=1)
def hf_model(folder: str):
    """The Hugging Face model of ``folder``, loaded once for all its prompts."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_beams(folder: str, prompt: list[int], width: int, steps: int, length_penalty: float):
    """HF's beams (generated tokens, score), best first; None when one ended early."""
    hf = hf_model(str(folder))
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                          max_new_tokens=steps, do_sample=False, length_penalty=length_penalty,
                          early_stopping=False, output_scores=True,
                          return_dict_in_generate=True, pad_token_id=0)
    seqs = out.sequences[:, len(prompt):].tolist()
    if any(len(s) != steps or hf.generation_config.eos_token_id in s for s in seqs):
        return None
    return list(zip(seqs, out.sequences_scores.tolist()))


def check_same_as_hf(llm, folder, prompts, length_penalty) -> int:
    """How many prompts were compared (those where no HF beam ended early)."""
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS,
                              length_penalty=length_penalty)
    compared = 0
    for prompt, got in zip(prompts, llm.beam_search(
            [{"prompt_token_ids": p} for p in prompts], params)):
        want = hf_beams(folder, prompt, WIDTH, STEPS, length_penalty)
        if want is None:
            continue
        compared += 1
        beams = got.sequences
        assert [b.tokens[len(prompt):] for b in beams] == [w[0] for w in want]
        assert all(b.tokens[:len(prompt)] == prompt for b in beams)
        for b, (_, score) in zip(beams, want):
            assert b.cum_logprob / STEPS ** length_penalty == pytest.approx(score, abs=1e-3)
            assert b.finish_reason == "length"
    return compared


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_best_beams_equal_hugging_face_tiny(tiny_model, length_penalty):
    folder = tiny_model()
    prompts = [[1, 5 + i, 40 + 3 * i, 7, 99 - i] for i in range(6)]
    with LLM(folder, num_kv_blocks=256, block_size=4) as llm:
        assert check_same_as_hf(llm, folder, prompts, length_penalty) >= 3


def record_steps(llm) -> list[list[RequestOutput]]:
    """Every ``llm.generate`` call's outputs from now on (a beam search's steps);
    the real method runs, the list only watches."""
    steps, generate = [], llm.generate

    def recorded(*args, **kwargs):
        outs = generate(*args, **kwargs)
        steps.append(outs)
        return outs

    llm.generate = recorded
    return steps


def test_each_step_finds_its_beams_full_blocks_in_the_prefix_cache(tiny_model):
    BS = 4
    with LLM(tiny_model(), num_kv_blocks=128, block_size=BS) as llm:
        sched = llm.engine_core.scheduler
        kv = sched.kv_cache_manager
        schedule, tables = sched.schedule, []

        def observed():  # after each schedule: the running requests' tokens and blocks
            so = schedule()
            tables.append([(list(r.prompt_token_ids), kv.get_blocks(r.request_id),
                            [b.ref_cnt for b in kv.get_blocks(r.request_id)],
                            so.num_scheduled_tokens.get(r.request_id)) for r in sched.running])
            return so

        sched.schedule = observed
        steps = record_steps(llm)
        prompt = [1, 9, 17, 33, 65, 129]  # a block and a half
        out = llm.beam_search({"prompt_token_ids": prompt},
                              BeamSearchParams(beam_width=WIDTH, max_tokens=8, ignore_eos=True))
        sched.schedule = schedule
        assert len(steps) == 8 and [len(s) for s in steps] == [1] + [WIDTH] * 7
        for i, outs in enumerate(steps):
            for o in outs:
                # Its beam's tokens but the newest were its parent's, computed last step:
                # every full block of them is a hit (none for the first, new, prompt).
                n = len(o.prompt_token_ids)
                assert o.num_cached_tokens == (0 if i == 0 else (n - 1) // BS * BS)
        computed = shared = 0
        for step in tables:
            for tokens, blocks, refs, scheduled in step:
                cached = (len(tokens) - 1) // BS * BS if len(tokens) > len(prompt) else 0
                assert scheduled == len(tokens) - cached  # the rest of it, in one go
                computed += scheduled
                for j, block in enumerate(blocks[:len(tokens) // BS]):
                    # A full block: one physical block for every beam whose tokens agree
                    # up to its end, its reference count one per such beam.
                    same = [o for o in step if o[0][:BS * (j + 1)] == tokens[:BS * (j + 1)]]
                    assert all(o[1][j] is block for o in same) and refs[j] == len(same)
                    shared += len(same) > 1
                if len(tokens) % BS:  # the partly filled block: this beam's own
                    own = blocks[len(tokens) // BS]
                    assert refs[len(tokens) // BS] == 1
                    assert sum(any(b is own for b in o[1]) for o in step) == 1
        assert shared and computed < sum(len(o.prompt_token_ids) for s in steps for o in s)
        # Every block back in the pool (the full ones stay cached, evictable).
        assert kv.num_free_blocks == kv.num_blocks
        assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
        assert len(out[0].sequences) == WIDTH
        assert all(len(b.tokens) == len(prompt) + 8 for b in out[0].sequences)


def test_the_same_beams_without_prefix_caching(tiny_model):
    folder = tiny_model()
    prompts = [{"prompt_token_ids": [1, 5 + i, 40 + 3 * i, 7, 99 - i, 13]} for i in range(3)]
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS, ignore_eos=True)
    got = {}
    for caching in (True, False):
        with LLM(folder, num_kv_blocks=256, block_size=4, enable_prefix_caching=caching) as llm:
            steps = record_steps(llm)
            got[caching] = llm.beam_search(prompts, params)
            hits = sum(o.num_cached_tokens for s in steps for o in s)
            assert (hits > 0) == caching  # without the cache every step recomputes it all
            kv = llm.engine_core.scheduler.kv_cache_manager
            assert kv.num_free_blocks == kv.num_blocks
    for with_cache, without in zip(got[True], got[False]):
        assert [b.tokens for b in with_cache.sequences] == [b.tokens for b in without.sequences]
        assert [b.cum_logprob for b in with_cache.sequences] == pytest.approx(
            [b.cum_logprob for b in without.sequences], abs=1e-4)


def test_an_interrupted_search_gives_every_block_back(tiny_model):
    # Prefill chunks of 2 tokens: a beam's request runs over several engine steps,
    # holding blocks in between.
    with LLM(tiny_model(), num_kv_blocks=128, block_size=4,
             long_prefill_token_threshold=2) as llm:
        kv = llm.engine_core.scheduler.kv_cache_manager
        engine, real_step, in_use = llm.llm_engine, llm.llm_engine.step, []

        def step():  # Ctrl-C after an engine step that left beams mid-prefill, step 3 on
            outs = real_step()
            in_use.append(kv.num_blocks - kv.num_free_blocks)
            if len(in_use) > 6 and in_use[-1] and engine.has_unfinished_requests():
                raise KeyboardInterrupt
            return outs

        engine.step = step
        params = BeamSearchParams(beam_width=WIDTH, max_tokens=8, ignore_eos=True)
        with pytest.raises(KeyboardInterrupt):
            llm.beam_search({"prompt_token_ids": [1, 9, 17, 33, 65, 129]}, params)
        engine.step = real_step
        assert in_use[-1] > 0  # blocks were in use when it stopped ...
        assert not engine.has_unfinished_requests()  # ... and its requests were aborted,
        assert kv.num_free_blocks == kv.num_blocks  # their blocks back in the pool
        assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def _step(ranked: dict[int, float]) -> RequestOutput:
    """One beam's one-token step as the engine reports it: the top tokens' logprobs."""
    logprobs = {t: Logprob(lp, rank=i + 1) for i, (t, lp) in enumerate(
        sorted(ranked.items(), key=lambda kv: -kv[1]))}
    first = next(iter(logprobs))
    return RequestOutput("r", None, [], [CompletionOutput(0, "", [first], logprobs=[logprobs])],
                         True)


def test_eos_as_hugging_face_treats_it():
    EOS = 2
    search = BeamSearch([1, 5], BeamSearchParams(beam_width=2, max_tokens=5), {EOS})
    # Step 1: EOS ranks first of the candidates: a finished beam; two running beams remain.
    search.advance([_step({EOS: -0.1, 7: -1.0, 8: -2.0, 9: -3.0})])
    assert [b.tokens for b in search.finished] == [[1, 5, EOS]]
    assert [b.tokens for b in search.beams] == [[1, 5, 7], [1, 5, 8]]
    # Step 2: EOS ranks third (below beam_width): dropped, not finished.
    search.advance([_step({7: -0.1, EOS: -5.0, 3: -6.0, 4: -7.0}),
                    _step({8: -0.1, EOS: -4.0, 5: -8.0, 6: -9.0})])
    assert len(search.finished) == 1
    assert [b.tokens for b in search.beams] == [[1, 5, 7, 7], [1, 5, 8, 8]]
    out = search.result(None)
    # Ranked by cum_logprob / generated_len ** 1.0: the EOS beam (-0.1 / 1) first.
    assert [s.tokens for s in out.sequences] == [[1, 5, EOS], [1, 5, 7, 7]]
    assert out.sequences[0].finish_reason == "stop" and out.sequences[1].finish_reason == "length"
    # With ignore_eos, EOS is a token like any other.
    kept = BeamSearch([1, 5], BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True),
                      {EOS})
    kept.advance([_step({EOS: -0.1, 7: -1.0, 8: -2.0, 9: -3.0})])
    assert not kept.finished and [b.tokens[-1] for b in kept.beams] == [EOS, 7]


def test_params_are_checked():
    for bad, field in (({"beam_width": 0}, "beam_width"), ({"beam_width": 11}, "beam_width"),
                       ({"max_tokens": 0}, "max_tokens"),
                       ({"length_penalty": float("nan")}, "length_penalty")):
        with pytest.raises(ValueError, match=field):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 3, **bad})


def test_server_use_beam_search_returns_the_offline_beams(tmp_path, tiny_chat_model):
    import httpx

    from tests.helpers import ServerProcess, wait_for

    prompts = [[1, 5, 40, 7, 99], [1, 8, 300, 12]]
    with LLM(tiny_chat_model, num_kv_blocks=256) as llm:
        want = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                               BeamSearchParams(beam_width=WIDTH, max_tokens=5))
    srv = ServerProcess(tmp_path, tiny_chat_model, "--inprocess", "--num-kv-blocks", "256")
    try:
        body = {"prompt": prompts, "use_beam_search": True, "n": WIDTH, "max_tokens": 5,
                "temperature": 0}
        r = srv.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == list(range(2 * WIDTH))
        assert [c["text"] for c in choices] == [b.text for w in want for b in w.sequences]
        assert r.json()["usage"]["completion_tokens"] == sum(
            len(b.tokens) - len(p) for p, w in zip(prompts, want) for b in w.sequences)
        for bad, param in (({"n": 11}, "n"), ({"stream": True}, "stream"),
                           ({"logprobs": 2}, "logprobs")):
            r = srv.http.post("/v1/completions", json={**body, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        # No block in use once the searches are done (the stats are the core's last
        # step's: wait for the one after the last beams finished).
        all_free = (lambda: (s := srv.stats())["num_free_blocks"] == s["num_blocks"]
                    and s["num_requests_running"] + s["num_requests_waiting"] == 0)
        wait_for(all_free, "every block back after the searches")
        # A client that gives up mid-search: the search stops and every block comes
        # back. (Whether its last step's beams count as aborted depends on whether
        # they finished before the cancel reached them: a race, so not asserted.)
        def finished_requests():
            return sum(v for (name, _), v in srv.metrics().items()
                       if name == "minivllm:request_success_total")

        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", timeout=1, json={
                **body, "max_tokens": 1000, "ignore_eos": True})
        # Blocks are all free for a moment between two steps of a running search, so
        # the search has stopped when, free, no request finished for 2 s (a running
        # search finishes one per beam per step); a search that goes on fails here.
        def stopped():
            settled = finished_requests()
            time.sleep(2)
            return all_free() and finished_requests() == settled

        wait_for(stopped, "the search to stop after the client left", deadline_s=60)
    finally:
        srv.stop()


@pytest.mark.slow
def test_best_beams_equal_hugging_face_default_model(default_model_path, default_tokenizer):
    from tests.conftest import chat_ids

    # Two prompts, both compared (no Hugging Face beam ends in EOS within STEPS):
    # Hugging Face's beam search on this model is most of the test's time.
    prompts = [chat_ids(default_tokenizer, q) for q in (
        "What is the capital of France?", "Write a haiku about rain.")]
    with LLM() as llm:
        assert check_same_as_hf(llm, default_model_path, prompts, 1.0) == 2
