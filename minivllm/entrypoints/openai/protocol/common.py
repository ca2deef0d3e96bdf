"""What every endpoint shares: the strict base models, the 400 error, the sampling
parameters of a request, usage and error bodies, the model list."""

from __future__ import annotations

import logging
import time
from typing import Annotated, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from minivllm.config import InvalidRequestError
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger("minivllm.server")
MAX_N = 128  # OpenAI's own limit on completions per request

# Fields OpenAI documents that change nothing here (no storage, no tiers, no
# audio, no reasoning models). They are accepted so clients that always send
# them work; the server names each in its log the first time it sees it.
NO_OP_FIELDS = {
    "store": "responses are not stored", "metadata": "only used with store",
    "service_tier": "there is one tier", "user": "no per-user tracking",
    "modalities": "text only", "audio": "text only", "prediction": "no predicted outputs",
    "reasoning_effort": "not a reasoning model", "verbosity": "not a reasoning model",
    "web_search_options": "no web search", "prompt_cache_key": "prefix caching is automatic",
    "safety_identifier": "no per-user tracking", "function_call": "use tool_choice",
    "functions": "use tools", "best_of": "one candidate per completion",
}
logged_no_ops: set[str] = set()  # fields warned about once (responses.py adds its own)


def log_no_ops(request: BaseModel) -> None:
    for name in NO_OP_FIELDS:
        if getattr(request, name, None) is not None and name not in logged_no_ops:
            logged_no_ops.add(name)
            logger.warning("request field %r is accepted and has no effect: %s", name,
                           NO_OP_FIELDS[name])
MAX_STOP = 16
INT64 = 2 ** 63


class BadRequestError(InvalidRequestError):
    """A request the server refuses (a 400); ``param`` names the field as the request
    spells it. The engine's own ``InvalidRequestError``s become 400s as they are."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message, param)


# -- requests ------------------------------------------------------------------------
class RequestModel(BaseModel):
    # Booleans are strict: "yes" or 1 for `stream` is an error, not a guess.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(RequestModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(RequestModel):
    name: str = Field(max_length=64)
    description: Optional[str] = None
    # `schema` would shadow pydantic's own attribute: stored as json_schema.
    json_schema: Optional[dict] = Field(None, alias="schema")
    strict: Optional[StrictBool] = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(RequestModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsRequest(RequestModel):
    """vLLM's ``structured_outputs`` extra body field (``StructuredOutputsParams``)."""

    json_: Union[str, dict, None] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[StrictBool] = None
    disable_any_whitespace: StrictBool = False

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def sets_a_kind(self) -> bool:
        """False when it only carries options for response_format or guided_*."""
        return any(v not in (None, False) for v in (self.json_, self.regex, self.choice,
                                                    self.grammar, self.json_object))


# vLLM's older fields -> the StructuredOutputsParams kind each one sets.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_params(field: str, **kwargs) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise BadRequestError(f"{field}: {e}", field) from None


class SamplingRequest(RequestModel):
    """The parameters chat and completions requests share."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Union[str, Annotated[list[str], Field(max_length=MAX_STOP)], None] = None
    seed: Optional[int] = Field(None, ge=-INT64, lt=INT64)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # OpenAI: {token id (as a string in JSON): bias in [-100, 100]}.
    logit_bias: Optional[dict[str, float]] = None
    store: Optional[StrictBool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    # vLLM's token-level extras.
    allowed_token_ids: Optional[list[StrictInt]] = Field(None, min_length=1)
    bad_words: Optional[list[str]] = None
    # vLLM's extras
    top_k: Optional[int] = Field(None, ge=-1, lt=2 ** 31)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=100)
    ignore_eos: StrictBool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: Optional[list[StrictInt]] = Field(None, max_length=MAX_STOP)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # Lower runs first; needs a server started with --scheduling-policy priority.
    priority: StrictInt = 0
    # vLLM's tenant isolation: prefix-cache hits only among requests with this salt.
    cache_salt: Optional[StrictStr] = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs,
    # and vLLM's older guided_* fields (aliases of structured_outputs' kinds).
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    guided_json: Union[str, dict, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    # vLLM's disaggregated prefill: {"do_remote_decode": true} to a prefill server,
    # the prefill response's kv_transfer_params to a decode server.
    kv_transfer_params: Optional[dict] = None
    # Keep this request's cached prefix for the session's next turn (vLLM's proposed
    # name; minivllm/inputs/retention.py): [{"start", "end", "priority", "ttl"}].
    retention_directives: Optional[list[dict]] = Field(None, max_length=16)

    # The request's field that carries the prompt.
    PROMPT_FIELD: ClassVar[str] = "prompt"

    def field_of(self, param: Optional[str]) -> Optional[str]:
        """The field of this request that an engine error's ``param`` is about (the
        engine names its own inputs: the prompt, SamplingParams' fields, ...)."""
        if param in ("prompt", "messages"):
            return self.PROMPT_FIELD
        if param == "structured_outputs":
            return (self._constraint_fields() or [param])[0]
        if param == "lora_request":  # the adapter is named by the model field
            return "model"
        return param

    def _constraint_fields(self) -> list[str]:
        """The fields that ask for an output constraint, in precedence order."""
        rf = self.response_format
        so = self.structured_outputs
        given = [name for name in _GUIDED if getattr(self, name) is not None]
        if so is not None and so.sets_a_kind():
            given.insert(0, "structured_outputs")
        if rf is not None and rf.type != "text":
            given.insert(0, "response_format")
        return given

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The one constraint asked for, from whichever field carries it (the input
        processor checks that it compiles)."""
        rf = self.response_format
        so = self.structured_outputs
        given = self._constraint_fields()
        if len(given) > 1:
            raise BadRequestError(f"{' and '.join(given)} are set together: give only one way "
                                  "to constrain the output", given[1])
        if not given:
            return None
        field = given[0]
        # structured_outputs may carry only options for the other fields (as in vLLM).
        options = {"disable_any_whitespace": bool(so and so.disable_any_whitespace)}
        if field == "response_format":
            if rf.type == "json_object":
                return structured_params(field, json_object=True, **options)
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise BadRequestError("response_format of type json_schema needs "
                                      "json_schema.schema", "response_format")
            return structured_params(field, json=rf.json_schema.json_schema, **options)
        if field == "structured_outputs":
            return structured_params(field, json=so.json_, regex=so.regex,
                                      choice=so.choice, grammar=so.grammar,
                                      json_object=so.json_object, **options)
        return structured_params(field, **{_GUIDED[field]: getattr(self, field)}, **options)

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def num_logprobs(self) -> Optional[int]:
        return None

    def num_prompt_logprobs(self) -> Optional[int]:
        return None

    def token_logit_bias(self) -> Optional[dict[int, float]]:
        if self.logit_bias is None:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.isdigit():
                raise BadRequestError(f"logit_bias has key {key!r}: keys must be token IDs "
                                      "(integers as strings)", "logit_bias")
            out[int(key)] = bias
        return out

    def check(self) -> None:
        """Checks that span several fields (pydantic checked each one alone; what
        needs the model, token IDs in its vocabulary, the engine's input processor)."""
        log_no_ops(self)
        if self.stream_options is not None and not self.stream:
            raise BadRequestError("stream_options is only allowed when stream is true",
                                  "stream_options")

    def to_sampling_params(self, output_kind: RequestOutputKind,
                           structured_outputs: Optional[StructuredOutputsParams] = None
                           ) -> SamplingParams:
        """``structured_outputs``: a constraint decided by the server (a forced tool
        call); by default the request's own response format."""
        if structured_outputs is None:
            structured_outputs = self.structured_outputs_params()
        try:
            return SamplingParams(
                n=self.n, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=(1.0 if self.repetition_penalty is None
                                    else self.repetition_penalty),
                # OpenAI's default is 1.0 (sampling), not greedy.
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, max_tokens=self.requested_max_tokens(),
                min_tokens=self.min_tokens, logprobs=self.num_logprobs(),
                prompt_logprobs=self.num_prompt_logprobs(),
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens, output_kind=output_kind,
                structured_outputs=structured_outputs,
                logit_bias=self.token_logit_bias(), allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words, retention_directives=self.retention_directives,
                extra_args=(None if self.kv_transfer_params is None
                            else {"kv_transfer_params": self.kv_transfer_params}))
        except InvalidRequestError as e:  # SamplingParams names the field: pass it on
            raise BadRequestError(str(e), e.param) from None


# -- responses ---------------------------------------------------------------------
class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minivllm"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model
    max_model_len: Optional[int] = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# chat
