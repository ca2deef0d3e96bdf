"""``POST /v1/embeddings``, ``/v1/score`` and ``/v1/rerank``: pooling requests served.

Each input becomes one prefill-only engine request (``minivllm/pooling/``), all of
them started together so the scheduler batches them. An embedding model answers
``/v1/embeddings`` (and scores pairs by the cosine similarity of their embeddings);
a ``*ForSequenceClassification`` model scores each (query, document) pair read
together, the way rerankers are trained. The engine's errors (a prompt too long, a
``dimensions`` the model cannot give) are 400s that name the request's field.

    curl localhost:8000/v1/embeddings -d '{"input": ["a cat", "a dog"]}'
    curl localhost:8000/v1/rerank -d '{"query": "cats", "documents": ["a cat", "a car"]}'
"""

from __future__ import annotations

import asyncio
import base64
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from minivllm.config import InvalidRequestError
from minivllm.entrypoints.openai.protocol import BadRequestError, log_no_ops
from minivllm.entrypoints.openai.protocol.pooling import (EmbeddingData, EmbeddingRequest,
                                                          EmbeddingResponse, PoolingUsage,
                                                          RerankDocument, RerankRequest,
                                                          RerankResponse, RerankResult,
                                                          ScoreData, ScoreRequest, ScoreResponse)
from minivllm.entrypoints.openai.serving_engine import OpenAIServing, now, random_id
from minivllm.outputs import RequestOutput
from minivllm.pooling import offline
from minivllm.pooling_params import PoolingParams


class OpenAIServingPooling(OpenAIServing):
    # -- /v1/embeddings ---------------------------------------------------------------
    async def create_embedding(self, body: EmbeddingRequest) -> EmbeddingResponse:
        lora_request = self.check_model(body.model)
        log_no_ops(body)
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
        outs = await self._pool("embed", body.inputs(), params, {"prompt": "input"},
                                lora_request)
        data = [EmbeddingData(index=i, embedding=_encode(o.pooling_output, body.encoding_format))
                for i, o in enumerate(outs)]
        return EmbeddingResponse(data=data, model=body.model or self.model_name,
                                 usage=_usage(outs))

    # -- /v1/score and /v1/rerank -----------------------------------------------------
    async def create_score(self, body: ScoreRequest) -> ScoreResponse:
        self.check_model(body.model)
        log_no_ops(body)
        pairs = offline.score_pairs(body.text_1, body.text_2)
        scores, outs = await self._score(pairs, {"text_1": "text_1", "text_2": "text_2"})
        return ScoreResponse(id=random_id("score"), created=now(),
                             model=body.model or self.model_name,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=_usage(outs))

    async def create_rerank(self, body: RerankRequest) -> RerankResponse:
        self.check_model(body.model)
        log_no_ops(body)
        pairs = [(body.query, d) for d in body.documents]
        scores, outs = await self._score(pairs, {"text_1": "query", "text_2": "documents"})
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[:body.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=body.documents[i])
                                if body.return_documents else None) for i in order]
        return RerankResponse(id=random_id("rerank"), model=body.model or self.model_name,
                              results=results, usage=_usage(outs))

    async def _score(self, pairs: list[tuple], fields: dict) -> tuple[list[float], list]:
        """Each pair's score, and the engine outputs that made them."""
        fields = {"prompt": fields["text_2"], **fields}
        if offline.model_pooler_info(self.engine).is_classifier:
            tok = self.engine.tokenizer
            prompts = [offline.cross_encoder_prompt(tok, a, b) for a, b in pairs]
            outs = await self._pool("score", prompts, PoolingParams(), fields)
            return [float(o.pooling_output[0]) for o in outs], outs
        outs = await self._pool("embed", [t for p in pairs for t in p], PoolingParams(), fields)
        scores = [float(F.cosine_similarity(torch.tensor(a.pooling_output),
                                            torch.tensor(b.pooling_output), dim=0))
                  for a, b in zip(outs[0::2], outs[1::2])]
        return scores, outs

    async def _pool(self, task: str, prompts: Sequence, params: PoolingParams,
                    fields: dict, lora_request=None) -> list[RequestOutput]:
        """Run one pooling request per prompt together; their final outputs in order.
        ``fields`` turns the engine's names for a bad field into the request's."""
        try:
            sps = offline.pooling_requests(self.engine, task, params, len(prompts))
        except InvalidRequestError as e:
            raise BadRequestError(str(e), fields.get(e.param, e.param)) from None
        rid = random_id(task)
        tasks = [asyncio.ensure_future(self._final(p, sp, f"{rid}-{i}", lora_request))
                 for i, (p, sp) in enumerate(zip(prompts, sps))]
        try:
            return list(await asyncio.gather(*tasks))
        except InvalidRequestError as e:
            if isinstance(e, BadRequestError):
                raise
            raise BadRequestError(str(e), fields.get(e.param, e.param)) from None
        finally:  # one failed (or the client left): the others stop too
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _final(self, prompt, params, request_id: str, lora_request) -> RequestOutput:
        final = None
        async for out in self.engine.generate(prompt, params, request_id,
                                              lora_request=lora_request):
            final = out
        return final


def complete_pooling_schema(app, engine) -> None:
    """``/openapi.json`` says what ``dimensions`` this model takes: none (null only) unless
    it is a Matryoshka model, then its sizes (so a fuzzer or client sends what is served)."""
    build = app.openapi

    def openapi() -> dict:
        schema = build()
        props = schema.get("components", {}).get("schemas", {}).get(
            "EmbeddingRequest", {}).get("properties", {})
        info = offline.model_pooler_info(engine)
        if "dimensions" in props:
            dims = {"type": "integer", "minimum": 1, "maximum": info.hidden_size}
            if info.matryoshka_dimensions:
                dims = {"type": "integer", "enum": list(info.matryoshka_dimensions)}
            props["dimensions"] = {"anyOf": [dims, {"type": "null"}] if info.matryoshka
                                   else [{"type": "null"}], "title": "Dimensions",
                                   "description": "Matryoshka models only"}
        return schema

    app.openapi = openapi


def _encode(vector: list[float], encoding_format: str):
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def _usage(outs: list[RequestOutput]) -> PoolingUsage:
    n = sum(len(o.prompt_token_ids) for o in outs)
    return PoolingUsage(prompt_tokens=n, total_tokens=n)


__all__ = ["OpenAIServingPooling", "complete_pooling_schema"]
