"""Bodies of the pooling endpoints: ``/v1/embeddings`` (OpenAI's), ``/v1/score``
(vLLM's) and ``/v1/rerank`` (Jina's and Cohere's shape, as vLLM serves it)."""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Field, StrictBool, StrictInt

from minivllm.entrypoints.openai.protocol.common import RequestModel, ResponseModel

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request
# A text must have a token: the schema says so (the engine's 400 explains).
Text = Annotated[str, Field(json_schema_extra={"minLength": 1})]
Texts = Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]


class EmbeddingRequest(RequestModel):
    model: Optional[str] = None
    # One input (text or token IDs) or a batch of them.
    input: Union[Text, Texts, Annotated[list[StrictInt], Field(min_length=1)],
                 Annotated[list[Annotated[list[StrictInt], Field(min_length=1)]],
                           Field(min_length=1, max_length=MAX_INPUTS)]]
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka models only (config.json's is_matryoshka); others answer 400.
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None
    # vLLM's extra: unit length (the default) or the raw pooled hidden state.
    normalize: Optional[StrictBool] = None

    def inputs(self) -> list[Union[str, list[int]]]:
        x = self.input
        if isinstance(x, str) or (x and isinstance(x[0], int)):
            return [x]
        return list(x)


class ScoreRequest(RequestModel):
    """vLLM's ``/v1/score``: ``text_1`` against each of ``text_2``, or pairwise."""

    model: Optional[str] = None
    text_1: Union[Text, Texts]
    text_2: Union[Text, Texts]
    user: Optional[str] = None


class RerankRequest(RequestModel):
    """Jina's / Cohere's ``/v1/rerank``: the documents, most relevant to ``query`` first."""

    model: Optional[str] = None
    query: Text
    documents: Texts
    top_n: Optional[int] = Field(None, ge=0)  # None or 0: all of them
    return_documents: StrictBool = True
    user: Optional[str] = None


class PoolingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]  # base64: little-endian float32 bytes


class EmbeddingResponse(ResponseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: PoolingUsage


class ScoreData(ResponseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(ResponseModel):
    text: str


class RerankResult(ResponseModel):
    index: int
    relevance_score: float
    document: Optional[RerankDocument] = None


class RerankResponse(ResponseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: PoolingUsage


__all__ = ["EmbeddingRequest", "ScoreRequest", "RerankRequest", "EmbeddingResponse",
           "EmbeddingData", "ScoreResponse", "ScoreData", "RerankResponse", "RerankResult",
           "RerankDocument", "PoolingUsage", "MAX_INPUTS"]
