"""Beam search on top of the engine and its prefix cache (vLLM's ``LLM.beam_search``).

Each step every live beam is one engine request: its tokens so far as the
prompt, ``max_tokens=1``, the top ``2 * beam_width`` logprobs back. The
candidates (a beam plus one of its tokens, scored by the summed logprob)
are ranked together, and the best ``beam_width`` that do not end in EOS are
the next beams. As in vLLM V1, the engine core knows nothing of beams: the
requests are ordinary ones, and the prefix cache is what makes the beams'
common prefix free. A step's request finds the full blocks of its beam's
tokens (all but the new one: its parent's, computed last step) cached, so it
computes only the tokens of its partly filled last block, at most
``block_size`` of them. (vLLM's first engine instead forked a beam's blocks
with copy on write, one token a step, at the price of beam state in the core.)
Without prefix caching every step recomputes every beam's tokens.

What that recomputing costs: a beam of ``n`` tokens computes the ``n -
(n - 1) // block_size * block_size`` of its partly filled last block, about
``block_size / 2`` a step where a fork computed one. With a 38-token chat
prompt and block size 16, 4 beams x 16 tokens compute 558 tokens, the forks
98. On a GPU a step that small costs the same with 4 or 40 tokens (its weights
are read once either way); on a CPU the step's products grow with its tokens,
and each step computes its beams' partial blocks. Such steps (at most 16 new
tokens a sequence, after cached context) are one C++ call on the CPU path, as
decode steps are (``cpu/fused_decode.py``; each new token a decode row of
its own). The search takes 2.06x the forked version's time on a quiet 2-core
Sapphire Rapids (``python -m minivllm.lab.bench.beam_search --against
<checkout of 443e012>``, 4 beams x 16 tokens, the same beams; about 4x on a
shared AVX2 machine while those steps still ran layer by layer). The time
spent here and in the engine's Python around the model is a few per cent of it.

EOS, as in Hugging Face's ``generate(num_beams=...)``: a candidate that
ends in EOS and ranks among the first ``beam_width`` is a finished beam (a
lower one is dropped); the step still keeps ``beam_width`` running beams.
Finished and running beams are ranked by ``cum_logprob / generated_len **
length_penalty`` (the generated length counts the EOS; vLLM counts the prompt
too). The search stops after ``max_tokens`` steps or, as HF's default
``early_stopping=False``, once ``beam_width`` beams have finished and no running
one scores better than the worst of them now.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from minivllm.outputs import Logprob, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

MAX_CANDIDATES = 20  # the engine's most logprobs per token


@dataclass
class BeamSearchParams:
    """``LLM.beam_search``'s parameters (vLLM's names).

    ``beam_width`` beams are kept each step, for ``max_tokens`` steps; a beam
    that ends in EOS is finished (unless ``ignore_eos``). Finished beams rank
    by ``cum_logprob / generated_len ** length_penalty`` (Hugging Face's
    score; > 0 favours longer answers). ``temperature`` 0 scores the top
    ``2 * beam_width`` tokens of each beam; above 0 the token the sampler
    draws joins them.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def _bad_beam(name, value, allowed):
            return ValueError(f"BeamSearchParams.{name}={value!r} is invalid: {allowed}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        # 2 * beam_width candidates per beam: within the engine's 20 logprobs.
        if not (is_int(self.beam_width) and 1 <= self.beam_width <= 10):
            raise _bad_beam("beam_width", self.beam_width, "must be an integer in [1, 10]")
        if not (is_int(self.max_tokens) and self.max_tokens >= 1):
            raise _bad_beam("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 2):
            raise _bad_beam("temperature", self.temperature, "must be in [0, 2]")
        if not (isinstance(self.length_penalty, (int, float)) and
                math.isfinite(self.length_penalty)):
            raise _bad_beam("length_penalty", self.length_penalty, "must be a finite number")


@dataclass
class BeamSearchSequence:  # vLLM's name and fields
    tokens: list[int]  # the prompt's and the generated ones
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None  # "stop" (EOS) | "length"
    stop_reason: Optional[int] = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the beams, best first


def beam_score(cum_logprob: float, generated_len: int, length_penalty: float) -> float:
    return cum_logprob / (max(generated_len, 1) ** length_penalty)


class BeamSearch:
    """One prompt's search; any engine runs its steps (``requests``, then ``advance``)."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: set[int], cache_salt: Optional[str] = None) -> None:
        self.params = params
        self.cache_salt = cache_salt  # every step's requests carry the prompt's salt
        self.prompt_len = len(prompt_token_ids)
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.steps = 0
        self._step_params: Optional[SamplingParams] = None

    def step_params(self) -> SamplingParams:
        """Every step's requests' parameters (built once: each build validates them)."""
        if self._step_params is None:
            width = self.params.beam_width
            self._step_params = SamplingParams(
                max_tokens=1, ignore_eos=True, temperature=self.params.temperature,
                logprobs=min(MAX_CANDIDATES, max(2, 1 + len(self.eos)) * width),
                output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
        return self._step_params

    def step_prompt(self, tokens: list[int]) -> dict:
        """One beam's one-token request (its prefix cached under the prompt's salt)."""
        prompt = {"prompt_token_ids": tokens}
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        return prompt

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def advance(self, outputs: list[RequestOutput]) -> None:
        """One step: ``outputs[i]`` is the one-token request of ``self.beams[i]``."""
        width = self.params.beam_width
        candidates = []
        for beam, out in zip(self.beams, outputs):
            ranked = out.outputs[0].logprobs[0]
            candidates += [(beam.cum_logprob + lp.logprob, beam, token, ranked)
                           for token, lp in ranked.items()]
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam, then rank order
        running = []
        for rank, (cum, beam, token, ranked) in enumerate(candidates):
            eos = token in self.eos
            if eos and rank >= width:
                continue  # a lower-ranked EOS is dropped: no sequence built for it
            seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [ranked], cum)
            if eos:
                seq.finish_reason, seq.stop_reason = "stop", token
                self.finished.append(seq)
                continue
            running.append(seq)
            if len(running) == width:
                break
        self.beams = running
        self.steps += 1
        if self._no_better_to_come():
            self.beams = []

    def _score(self, seq: BeamSearchSequence) -> float:
        return beam_score(seq.cum_logprob, len(seq.tokens) - self.prompt_len,
                          self.params.length_penalty)

    def _no_better_to_come(self) -> bool:
        width = self.params.beam_width
        if len(self.finished) < width or not self.beams:
            return False
        worst = sorted(map(self._score, self.finished), reverse=True)[width - 1]
        return max(map(self._score, self.beams)) <= worst

    def result(self, tokenizer) -> BeamSearchOutput:
        for seq in self.beams:
            seq.finish_reason = "length"
        best = sorted(self.finished + self.beams, key=self._score,
                      reverse=True)[:self.params.beam_width]
        for seq in best:
            generated = seq.tokens[self.prompt_len:]
            if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                generated = generated[:-1]  # the EOS is not text
            seq.text = tokenizer.decode(generated) if tokenizer is not None else None
        return BeamSearchOutput(best)


def _search(processor, prompt, params: BeamSearchParams) -> BeamSearch:
    """A prompt's search (a dict prompt may carry a ``cache_salt``)."""
    salt = None
    if isinstance(prompt, dict):
        from minivllm.inputs.prompt_dict import split_prompt

        prompt, salt = split_prompt(prompt)
    return BeamSearch(processor.tokenize(prompt)[1], params, set(processor.eos_token_ids), salt)


def run_beam_search(llm, prompts: list, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """``LLM.beam_search``: every live beam of every prompt in one batch per step.

    (``LLM.generate`` aborts a step's requests if the search is interrupted.)
    """
    engine = llm.llm_engine
    searches = [_search(engine.input_processor, p, params) for p in prompts]
    while not all(s.done for s in searches):
        live = [s for s in searches if not s.done]
        beams = [s.step_prompt(b.tokens) for s in live for b in s.beams]
        outs = llm.generate(beams, live[0].step_params(), use_tqdm=False)
        for s in live:
            mine, outs = outs[:len(s.beams)], outs[len(s.beams):]
            s.advance(mine)
    return [s.result(engine.tokenizer) for s in searches]


async def run_beam_search_async(engine, prompts: list, params: BeamSearchParams,
                                request_id: str) -> list[tuple[BeamSearchOutput, int]]:
    """The same over ``AsyncLLM`` (the server): (output, prompt length) per prompt."""
    import asyncio

    processor = engine.input_processor
    searches = [_search(processor, p, params) for p in prompts]

    async def one(prompt: dict, sp: SamplingParams, rid: str) -> RequestOutput:
        async for out in engine.generate(prompt, sp, rid):
            last = out
        return last

    step_ids: list[str] = []
    try:
        step = 0
        while not all(s.done for s in searches):
            live = [s for s in searches if not s.done]
            beams = [s.step_prompt(b.tokens) for s in live for b in s.beams]
            step_ids = [f"{request_id}-{step}-{i}" for i in range(len(beams))]
            sp = live[0].step_params()
            outs = list(await asyncio.gather(*(one(t, sp, rid)
                                               for t, rid in zip(beams, step_ids))))
            step_ids = []
            for s in live:
                mine, outs = outs[:len(s.beams)], outs[len(s.beams):]
                s.advance(mine)
            step += 1
    finally:
        # The client left (a cancelled gather stops each stream, which aborts its
        # request) or one beam failed (the others still run): stop them all here.
        for rid in step_ids:
            engine.abort(rid)  # (a no-op for a finished or unknown one)
    return [(s.result(engine.tokenizer), s.prompt_len) for s in searches]


__all__ = ["BeamSearchParams", "BeamSearch", "BeamSearchSequence", "BeamSearchOutput",
           "beam_score", "run_beam_search", "run_beam_search_async"]
