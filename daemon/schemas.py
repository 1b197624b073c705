"""Every HTTP body the daemon reads or writes, as msgspec Structs in OpenAI's shapes.

Request Structs ignore unknown fields (clients send vendor extensions freely) and check
types and sizes at decode time; `decode` turns a failure into an OpenAI-shaped 400 that
names the field. Value ranges of sampling parameters are checked once, by
`lanes.sampling.SamplingParams`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from lanes.logprobs import MAX_TOP_LOGPROBS

# Bounds on what one request may ask for; bodies as a whole are bounded by --max-body-bytes.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_DETOKENIZE_IDS = 1 << 20

TopLogprobCount = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
StopString = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)]


# ---- errors ----------------------------------------------------------------------------


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorBody


class ApiError(Exception):
    """A request answered with an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(ErrorBody(message, type, param, code))
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


_AT_PATH = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"missing required field `([^`]*)`")

T = TypeVar("T")


def decode(body: bytes, schema: type[T]) -> T:
    """JSON bytes -> a request Struct, or a 400 naming the offending field."""
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as e:
        message = str(e)
        at = _AT_PATH.search(message)
        path = at.group(1) if at else ""
        missing = _MISSING.search(message)
        if missing:
            path = f"{path}.{missing.group(1)}" if path else missing.group(1)
        raise bad_request(message, param=path or None) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None


# ---- requests --------------------------------------------------------------------------


class TextPart(Struct):
    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: str
    content: str | list[TextPart] | None = None


class StreamOptions(Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk


class GenerationFields(Struct, kw_only=True):
    """What chat and text completions share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    draft: bool = True  # laneserve's extension: false decodes this request plainly
    cache_prompt: bool = True  # llama.cpp's name: false reads the whole prompt, none of it from the prefix cache, and leaves none there


class ChatCompletionRequest(GenerationFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobCount | None = None


class CompletionRequest(GenerationFields, kw_only=True):
    # A string, token ids, or a list of one of either (a batch of prompts is refused by name).
    prompt: str | list[str | int | list[int]]
    logprobs: TopLogprobCount | None = None
    echo: bool = False


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: Annotated[list[int], Meta(max_length=MAX_DETOKENIZE_IDS)]


# ---- responses -------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int  # prompt tokens restored from the prefix cache rather than read


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Known once the request is done: continuous usage on earlier chunks leaves it out.
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET


class Timings(Struct):
    """laneserve's extension: where a request's time went, and what drafting did for it."""

    queue_seconds: float
    prompt_seconds: float
    decode_seconds: float
    draft_rounds: int  # rounds in which this request's lane verified drafts
    draft_proposed: int
    draft_accepted: int


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class AssistantMessage(Struct):
    content: str
    role: str = "assistant"


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings
    object: str = "chat.completion"


class ChatDelta(Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | UnsetType = UNSET
    timings: Timings | UnsetType = UNSET


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class TextCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timings: Timings
    object: str = "text_completion"


class TextCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | UnsetType = UNSET
    timings: Timings | UnsetType = UNSET


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "laneserve"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(Struct):
    prompt: str


class VersionResponse(Struct):
    version: str


class StatusResponse(Struct):
    status: str
    seconds_since_beat: float | UnsetType = UNSET
    error: str | UnsetType = UNSET


def encode(body: Any) -> bytes:
    return msgspec.json.encode(body)
