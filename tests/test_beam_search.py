"""Beam search: the best beams equal Hugging Face's ``generate(num_beams=...)``, and
each step's beams fork their parent's KV blocks: full ones shared, a shared partly
filled one copied on the first write (counted in the block pool while the engine
runs them; tests/test_kv_fork.py has the scheduler-level cases)."""

from __future__ import annotations

import time

import pytest
import torch

from minivllm import LLM, BeamSearchParams, CompletionOutput, Logprob, RequestOutput
from minivllm.entrypoints.beam_search import BeamSearch

WIDTH, STEPS = 3, 6


def hf_beams(folder: str, prompt: list[int], width: int, steps: int, length_penalty: float):
    """HF's beams (generated tokens, score), best first; None when one ended early."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
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


def test_beams_fork_blocks_and_copy_a_shared_partial_block_on_write(tiny_model):
    from tests.test_kv_fork import check_books

    with LLM(tiny_model(), num_kv_blocks=128, block_size=4) as llm:
        sched = llm.engine_core.scheduler
        kv = sched.kv_cache_manager
        schedule, steps = sched.schedule, []

        def observed():  # after each schedule: the running beams' tables and the copies
            so = schedule()
            check_books(kv)  # ref counts = holders (running beams and held parents)
            steps.append((so, [(list(r.all_token_ids), r.kv_fork_of, kv.get_blocks(r.request_id))
                               for r in sched.running]))
            return so

        sched.schedule = observed
        prompt = [1, 9, 17, 33, 65, 129]  # a block and a half
        out = llm.beam_search({"prompt_token_ids": prompt},
                              BeamSearchParams(beam_width=WIDTH, max_tokens=8, ignore_eos=True))
        sched.schedule = schedule
        num_copies = 0
        for so, beams in steps:
            forks: dict[str, list] = {}
            for tokens, parent, blocks in beams:
                if parent is not None:
                    forks.setdefault(parent, []).append((tokens, blocks))
            want = []
            for children in forks.values():
                n = len(children[0][0]) - 1  # the parent's tokens
                for j in range(n // 4):  # its full blocks: shared by all its children
                    assert all(c[1][j] is children[0][1][j] for c in children)
                if n % 4:  # its partial block: the last child's, copied for the others
                    src = children[-1][1][n // 4].block_id
                    want += [(src, c[1][n // 4].block_id) for c in children[:-1]]
            assert sorted(so.blocks_to_copy) == sorted(want)
            num_copies += len(want)
            if forks:  # a forked beam computes only its new token
                assert set(so.num_scheduled_tokens.values()) == {1}
        assert num_copies > 0 and sum(bool(s[1]) for s in steps) == 8
        # Dropped and finished beams gave every block back (full ones stay cached).
        assert kv.held == {} and kv.num_free_blocks == kv.num_blocks
        assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
        assert len(out[0].sequences) == WIDTH
        assert all(len(b.tokens) == len(prompt) + 8 for b in out[0].sequences)


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
    from tests.helpers import ServerProcess

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
        # Every beam's hold released: no block in use once the searches are done (the
        # core frees the last holds after the answer left: wait for its next stats).
        deadline = time.monotonic() + 30
        while (stats := srv.stats())["num_free_blocks"] != stats["num_blocks"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)
        assert stats["num_requests_running"] == 0
    finally:
        srv.stop()


@pytest.mark.slow
def test_best_beams_equal_hugging_face_default_model(default_model_path, default_tokenizer):
    from tests.conftest import chat_ids

    prompts = [chat_ids(default_tokenizer, q) for q in (
        "What is the capital of France?", "Name three colours.", "Write a haiku about rain.")]
    with LLM() as llm:
        assert check_same_as_hf(llm, default_model_path, prompts, 1.0) >= 2
