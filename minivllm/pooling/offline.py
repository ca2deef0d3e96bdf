"""The pooling side of ``LLM``: ``LLM.embed``, ``LLM.classify``, ``LLM.score``.

    llm = LLM()
    [out] = llm.embed("What is the capital of France?")
    out.outputs.embedding                       # unit length, hidden_size numbers

``LLM.embed`` pools every prompt into a vector; ``LLM.classify`` runs a
``*ForSequenceClassification`` head; ``LLM.score(text_1, text_2)`` scores pairs, as
vLLM does: through the head on the pair encoded together (a cross-encoder, the
rerankers' way) when the model has one, else as the cosine similarity of the two
embeddings. ``text_1`` is one text (scored against each of ``text_2``) or as many texts
as ``text_2``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from minivllm.config.checks import InvalidRequestError
from minivllm.outputs import RequestOutput
from minivllm.pooling.model_info import PoolerInfo, pooler_info
from minivllm.pooling.outputs import (ClassificationOutput, EmbeddingOutput,
                                      PoolingRequestOutput, ScoringOutput)
from minivllm.pooling.params import pooling_sampling_params
from minivllm.pooling_params import PoolingParams


def model_pooler_info(engine) -> PoolerInfo:
    return pooler_info(engine.config.model)


def check_task(info: PoolerInfo, task: str) -> None:
    if task in ("classify",) and not info.is_classifier:
        raise InvalidRequestError(
            f"task={task!r} needs a *ForSequenceClassification model; this one embeds "
            "(use embed, or score for cosine similarity)", "model")
    if task == "embed" and info.is_classifier:
        raise InvalidRequestError("this model is a *ForSequenceClassification model: it "
                                  "scores (score, classify, rerank), it does not embed",
                                  "model")


def pooling_requests(engine, task: str, params: Union[None, PoolingParams,
                                                      Sequence[PoolingParams]], n: int) -> list:
    """The SamplingParams that carry each prompt's checked PoolingParams."""
    info = model_pooler_info(engine)
    check_task(info, task)
    if engine.config.parallel.tensor_parallel_size > 1:  # (the pooling forward is rank 0's)
        raise InvalidRequestError("pooling (embeddings, scores) runs on one rank: serve "
                                  "the model with tensor_parallel_size=1", "model")
    given = params if isinstance(params, (list, tuple)) else [params] * n
    if len(given) != n:
        raise ValueError(f"pooling_params has {len(given)} entries for {n} prompts: give "
                         "one for all, or one per prompt")
    out = []
    for p in given:
        p = PoolingParams() if p is None else PoolingParams(**vars(p))  # (own copy)
        p.verify(task, info.matryoshka)
        check_dimensions(info, p.dimensions)
        out.append(pooling_sampling_params(p))
    return out


def check_dimensions(info: PoolerInfo, dimensions: Optional[int]) -> None:
    if dimensions is None:
        return
    allowed = info.matryoshka_dimensions
    if dimensions > info.hidden_size or (allowed and dimensions not in allowed):
        raise InvalidRequestError(
            f"dimensions={dimensions} is invalid: must be "
            + (f"one of {list(allowed)}" if allowed else f"at most {info.hidden_size}"),
            "dimensions")


def as_embeddings(outputs: list[RequestOutput]) -> list[PoolingRequestOutput]:
    return [PoolingRequestOutput(o.request_id, EmbeddingOutput(o.pooling_output),
                                 o.prompt_token_ids) for o in outputs]


def as_classifications(outputs: list[RequestOutput]) -> list[PoolingRequestOutput]:
    return [PoolingRequestOutput(o.request_id, ClassificationOutput(o.pooling_output),
                                 o.prompt_token_ids) for o in outputs]


def score_pairs(text_1, text_2) -> list[tuple]:
    """(text_1, text_2) pairs: one against many, or one to one."""
    one = isinstance(text_1, (str, dict))
    firsts = [text_1] if one else list(text_1)
    seconds = [text_2] if isinstance(text_2, (str, dict)) else list(text_2)
    if not seconds or not firsts:
        raise InvalidRequestError("text_1 and text_2 must not be empty", "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise InvalidRequestError(f"text_1 has {len(firsts)} entries and text_2 "
                                  f"{len(seconds)}: give one text_1, or one per text_2",
                                  "text_1")
    return list(zip(firsts, seconds))


def cross_encoder_prompt(tokenizer, first: str, second: str) -> list[int]:
    """The pair as one prompt, encoded the way the tokenizer encodes a text pair."""
    return tokenizer(first, second)["input_ids"]


def cross_encoder_scores(outputs: list[RequestOutput]) -> list[PoolingRequestOutput]:
    """One head output per pair (a reranker has one label: its sigmoid is the score)."""
    return [PoolingRequestOutput(o.request_id, ScoringOutput(float(o.pooling_output[0])),
                                 o.prompt_token_ids) for o in outputs]


def cosine_scores(first: list[RequestOutput], second: list[RequestOutput]
                  ) -> list[PoolingRequestOutput]:
    scores = []
    for a, b in zip(first, second):
        cos = F.cosine_similarity(torch.tensor(a.pooling_output),
                                  torch.tensor(b.pooling_output), dim=0)
        scores.append(PoolingRequestOutput(f"{a.request_id}_{b.request_id}",
                                           ScoringOutput(float(cos)),
                                           a.prompt_token_ids + b.prompt_token_ids))
    return scores


def embed(llm, prompts, pooling_params=None, use_tqdm: bool = True, lora_request=None
          ) -> list[PoolingRequestOutput]:
    """One embedding per prompt (``out.outputs.embedding``): the final hidden state
    pooled as the model asks (last token, or mean), unit length unless
    ``PoolingParams(normalize=False)``. Prefill only: nothing is generated."""
    return as_embeddings(_pool(llm, "embed", prompts, pooling_params, use_tqdm, lora_request))


def classify(llm, prompts, pooling_params=None, use_tqdm: bool = True
             ) -> list[PoolingRequestOutput]:
    """A ``*ForSequenceClassification`` model's label probabilities per prompt
    (``out.outputs.probs``; the logits with ``PoolingParams(use_activation=False)``)."""
    return as_classifications(_pool(llm, "classify", prompts, pooling_params, use_tqdm))


def score(llm, data_1, data_2, pooling_params: Optional[PoolingParams] = None,
          use_tqdm: bool = True) -> list[PoolingRequestOutput]:
    """Scores of ``(data_1, data_2)`` pairs (``out.outputs.score``): one text against each
    of a list, or two lists pairwise. A ``*ForSequenceClassification`` model reads each
    pair encoded together (a reranker); an embedding model gives the cosine similarity."""
    pairs = score_pairs(data_1, data_2)
    if model_pooler_info(llm.llm_engine).is_classifier:
        tok = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": cross_encoder_prompt(tok, a, b)} for a, b in pairs]
        return cross_encoder_scores(_pool(llm, "score", prompts, pooling_params, use_tqdm))
    embedded = _pool(llm, "embed", [p for pair in pairs for p in pair], pooling_params,
                     use_tqdm)
    return cosine_scores(embedded[0::2], embedded[1::2])


def _pool(llm, task: str, prompts, pooling_params, use_tqdm: bool, lora_request=None
          ) -> list[RequestOutput]:
    """Pooling requests through ``LLM.generate`` (one prefill-only step each)."""
    n = 1 if isinstance(prompts, (str, dict)) or (
        prompts and all(isinstance(t, int) for t in prompts)) else len(prompts)
    params = pooling_requests(llm.llm_engine, task, pooling_params, n)
    return llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)


__all__ = ["embed", "classify", "score", "pooling_requests", "as_embeddings", "as_classifications", "score_pairs",
           "cross_encoder_prompt", "cross_encoder_scores", "cosine_scores",
           "model_pooler_info", "check_task", "check_dimensions"]
