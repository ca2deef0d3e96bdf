"""``LLM``: the offline API. Give it prompts, get completions (vLLM's interface).

    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

from minivllm.config import engine_args_from_kwargs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.feature_method import FeatureMethod
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # optional features: loaded when used
    from minivllm.lora.request import LoRARequest

Prompt = Union[str, Sequence[int], dict]
ParamsArg = Union[None, SamplingParams, Sequence[SamplingParams]]
LoRAArg = Union[None, "LoRARequest", Sequence[Optional["LoRARequest"]]]  # (one, or per prompt)


def _rl() -> FeatureMethod:
    return FeatureMethod("minivllm.entrypoints.llm_rl", "RLMethods")


class LLM:
    """vLLM's offline API; all but ``generate`` load when first used."""

    collective_rpc, load_weights = _rl(), _rl()
    reset_prefix_cache, pause_generation = _rl(), _rl()
    resume_generation, is_paused = _rl(), _rl()
    sleep, wake_up, is_sleeping = _rl(), _rl(), _rl()
    init_weight_transfer_engine, start_weight_update = _rl(), _rl()
    update_weights, finish_weight_update = _rl(), _rl()
    # One embedding per prompt (``out.outputs.embedding``); a classifier's label
    # probabilities; scores of ``(data_1, data_2)`` pairs (``out.outputs.score``).
    embed = FeatureMethod("minivllm.pooling.offline")
    classify = FeatureMethod("minivllm.pooling.offline")
    score = FeatureMethod("minivllm.pooling.offline")
    # A conversation; one output per step with only the new text; vLLM's beam search.
    chat = FeatureMethod("minivllm.entrypoints.llm_more", "MoreMethods")
    stream = FeatureMethod("minivllm.entrypoints.llm_more", "MoreMethods")
    beam_search = FeatureMethod("minivllm.entrypoints.llm_more", "MoreMethods")

    def __init__(self, model: Optional[str] = None, **engine_args) -> None:
        args = engine_args_from_kwargs(model, engine_args)
        self.llm_engine = LLMEngine.from_engine_args(args)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def trace(self):
        """The step trace (``LLM(trace=True)``), or None."""
        return self.llm_engine.trace

    @property
    def engine_core(self):
        return self.llm_engine.engine_core

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]], sampling_params: ParamsArg = None,
                 use_tqdm: bool = True, priority: Union[None, int, Sequence[int]] = None,
                 lora_request: LoRAArg = None) -> list[RequestOutput]:
        """Complete every prompt; outputs in the prompts' order. ``sampling_params``,
        ``priority`` (lower first; ``scheduling_policy="priority"``) and ``lora_request``
        (``enable_lora=True``) are one for all prompts or a list of one per prompt."""
        items = as_prompt_list(prompts)
        params = _one_per_prompt("sampling_params", SamplingParams() if sampling_params is None
                                 else sampling_params, len(items))
        priority = _one_per_prompt("priority", 0 if priority is None else priority, len(items))
        loras = _one_per_prompt("lora_request", lora_request, len(items))
        ids: list[str] = []
        try:
            for p, sp, pr, lo in zip(items, params, priority, loras):
                ids.append(self.llm_engine.add_request(unwrap_prompt(p), sp.clone(
                    output_kind=RequestOutputKind.FINAL_ONLY), priority=pr, lora_request=lo))
        except BaseException:  # one bad request: none of them runs (as in vLLM)
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self.llm_engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def unwrap_prompt(prompt: Prompt):
    if not isinstance(prompt, dict):
        return prompt
    from minivllm.inputs.prompt_dict import unwrap_offline_prompt  # vLLM's dict form
    return unwrap_offline_prompt(prompt)


def as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token IDs
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    return prompts


def _one_per_prompt(name: str, value, n: int) -> list:
    """``value`` for each of ``n`` prompts: one for all (anything but a list or a
    tuple), or a list of one per prompt."""
    if not isinstance(value, (list, tuple)):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts: give one "
                         "for all, or one per prompt")
    return list(value)
