"""``LLM``'s other ways to ask: a chat, a stream of deltas, a beam search. This module
loads when ``LLM`` first looks one of them up (``FeatureMethod``), so a
plain ``generate`` reads none of it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional, Sequence, Union

from minivllm.entrypoints.llm import (LoRAArg, ParamsArg, Prompt, as_prompt_list,
                                      unwrap_prompt)
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from minivllm.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams


class MoreMethods:
    """``LLM``'s chat, stream and beam search (``self`` is the ``LLM``)."""

    def chat(self, messages: Union[Sequence[dict], Sequence[Sequence[dict]]],
             sampling_params: ParamsArg = None,
             use_tqdm: bool = True,
             lora_request: LoRAArg = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) \
            else list(messages)
        return self.generate([list(c) for c in conversations], sampling_params, use_tqdm,
                             lora_request=lora_request)

    def beam_search(self, prompts: Union[Prompt, Sequence[Prompt]],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's beam search (entrypoints/beam_search.py): one ``BeamSearchOutput`` per
        prompt, its ``sequences`` the beams best first."""
        from minivllm.entrypoints.beam_search import BeamSearchParams, run_beam_search

        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params={params!r} is invalid: give a BeamSearchParams")
        return run_beam_search(self, [unwrap_prompt(p) for p in as_prompt_list(prompts)], params)

    def stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None
               ) -> Iterator[RequestOutput]:
        """Yield one output per engine step with only the new text and tokens."""
        sp = (sampling_params or SamplingParams()).clone(output_kind=RequestOutputKind.DELTA)
        rid = self.llm_engine.add_request(unwrap_prompt(prompt), sp)
        try:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:  # the caller stopped early: free the request's blocks
            if self.llm_engine.output_processor.child_ids(rid):
                self.llm_engine.abort_request(rid)


__all__ = ["MoreMethods"]
