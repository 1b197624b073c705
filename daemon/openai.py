"""OpenAI's API over the lane core: request bodies -> lane `Request`s, lane events ->
chunks, responses and both logprobs shapes.

Nothing here touches HTTP or the engine thread: `Front` turns a decoded body into a
`Job` (or a 400 naming the field), and a `Reply` turns one request's events into the
bytes of its SSE stream or its one JSON response.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from tokenizers import decoders

from lanes.lane import Completion, FinishReason, LaneEvent, Request
from lanes.logprobs import TokenLogprob
from lanes.sampling import SamplingParams

from .schemas import (
    ApiError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ErrorBody,
    ErrorResponse,
    GenerationFields,
    PromptTokensDetails,
    TextCompletion,
    TextCompletionChunk,
    Timings,
    TopLogprob,
    Usage,
    bad_request,
    encode,
)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# OpenAI reports tokens too unlikely to represent as this floor rather than -inf.
LOGPROB_FLOOR = -9999.0

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE writes for
    each byte -> that byte. Printable bytes stand for themselves; the rest are shifted
    past 255."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}


BYTE_OF_CHAR = _byte_level_alphabet()


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for, which may be part of a UTF-8 character (OpenAI's
    logprobs `bytes`). Byte-level BPE pieces map back through the alphabet; special
    tokens and other vocabularies stand for their decoded text."""
    bpe = tokenizer.tokenizer  # the `tokenizers` object behind the checkpoint's ChatTokenizer
    piece = bpe.id_to_token(token_id)
    if piece is None:
        return b""
    if isinstance(bpe.decoder, decoders.ByteLevel) and token_id not in bpe.get_added_tokens_decoder() \
            and all(c in BYTE_OF_CHAR for c in piece):
        return bytes(BYTE_OF_CHAR[c] for c in piece)
    return bpe.decode([token_id], skip_special_tokens=False).encode()


def sse(body) -> bytes:
    return b"data: " + encode(body) + b"\n\n"


@dataclass
class Job:
    """One accepted request: the lane it becomes and how its reply is shaped."""

    chat: bool  # chat.completion vs text_completion shapes
    request: Request
    stream: bool
    include_usage: bool
    logprobs: bool
    continuous_usage: bool = False  # usage so far on every chunk (stream_options.continuous_usage_stats)


class Front:
    def __init__(self, tokenizer, model_name: str, max_model_len: int, vocab_size: int, sampling_defaults: dict):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.sampling_defaults = dict(sampling_defaults)
        self._token_texts: dict[int, tuple[str, bytes]] = {}

    # ---- requests -> jobs --------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """The model id is a name; a request may leave it out."""
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")

    def chat_job(self, body: ChatCompletionRequest) -> Job:
        self._check_common(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        prompt = self.chat_prompt(body.messages)
        asked, field = (body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens is not None \
            else (body.max_tokens, "max_tokens")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return self._job(body, True, prompt, self.max_tokens(len(prompt), asked, field), logprobs)

    def completion_job(self, body: CompletionRequest) -> Job:
        self._check_common(body)
        if body.echo:
            raise bad_request("echo is not supported", param="echo")
        prompt = self.completion_prompt(body.prompt)
        return self._job(body, False, prompt, self.max_tokens(len(prompt), body.max_tokens, "max_tokens"), body.logprobs)

    def _check_common(self, body: GenerationFields) -> None:
        self.check_model(body.model)
        if body.n != 1:
            raise bad_request(f"n must be 1, got {body.n}: each request is one lane; send n requests for n choices",
                              param="n")

    def _job(self, body: GenerationFields, chat: bool, prompt: list[int], max_tokens: int, logprobs: int | None) -> Job:
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        request = Request(prompt, max_tokens, self.sampling(body), stop, draft=body.draft, cache=body.cache_prompt,
                          id=("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), logprobs=logprobs)
        options = body.stream_options if body.stream else None
        include_usage = options is not None and options.include_usage
        continuous = options is not None and options.continuous_usage_stats
        return Job(chat, request, body.stream, include_usage, logprobs is not None, continuous)

    def sampling(self, body: GenerationFields) -> SamplingParams:
        """A request field wins over the checkpoint's generation_config.json, which wins
        over SamplingParams' own defaults (greedy, no filters)."""
        chosen = dict(self.sampling_defaults)
        for field in SAMPLING_FIELDS:
            if getattr(body, field) is not None:
                chosen[field] = getattr(body, field)
        try:
            return SamplingParams(**chosen, seed=body.seed)
        except ValueError as e:  # its messages start with the field's name
            raise bad_request(str(e), param=str(e).split()[0]) from None

    def max_tokens(self, prompt_tokens: int, asked: int | None, field: str) -> int:
        """The tokens to generate: as asked, or what the context has left (as vLLM does)."""
        limit = self.max_model_len
        if asked is None:
            asked = max(limit - prompt_tokens, 1)
        if asked < 1:
            raise bad_request(f"{field} must be at least 1, got {asked}", param=field)
        if prompt_tokens + asked > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; the prompt has {prompt_tokens} and "
                f"{field} asks for {asked}", param=field, code="context_length_exceeded")
        return asked

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        """Messages rendered with the checkpoint's own chat template. Text parts are
        joined, so a template that expects string content still works."""
        plain = []
        for i, message in enumerate(messages):
            content = message.content
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise bad_request(f"only text content parts are supported, got type {part.type!r}",
                                          param=f"messages[{i}].content[{j}]")
                content = "".join(part.text for part in content)
            plain.append({"role": message.role, "content": content or ""})
        try:
            return self.tokenizer.encode_chat(plain)
        except (ValueError, TypeError) as e:  # the template is the checkpoint's: it may refuse what a client sent
            raise bad_request(str(e), param="messages") from None

    def completion_prompt(self, prompt) -> list[int]:
        """A string, token ids, or a list of one of either."""
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            if len(prompt) != 1:
                raise bad_request(f"send one prompt per request, got a list of {len(prompt)}", param="prompt")
            prompt = prompt[0]
        ids = self.encode(prompt, "prompt") if isinstance(prompt, str) else prompt
        if not ids:
            raise bad_request("the prompt is empty", param="prompt")
        self.check_token_ids(ids, "prompt")
        return ids

    def encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except ValueError as e:  # text the tokenizer cannot read (a lone surrogate)
            raise bad_request(str(e), param=field) from None

    def check_token_ids(self, ids: list[int], field: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"{field} holds token ids outside the vocabulary (0..{self.vocab_size - 1}): {bad[:8]}",
                              param=field)

    # ---- token texts for logprobs ------------------------------------------------------

    def token(self, token_id: int) -> tuple[str, bytes]:
        """A token's text and raw bytes (a byte-level token may hold part of a character)."""
        found = self._token_texts.get(token_id)
        if found is None:
            raw = token_bytes(self.tokenizer, token_id)
            found = self._token_texts[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return found

    def reply(self, job: Job) -> Reply:
        return Reply(self, job)


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _finish(reason: FinishReason | None) -> str | None:
    return reason.value if reason in (FinishReason.STOP, FinishReason.LENGTH) else None


def usage_of(completion: Completion) -> Usage:
    generated = len(completion.token_ids)
    return Usage(completion.prompt_tokens, generated, completion.prompt_tokens + generated,
                 PromptTokensDetails(completion.cached_tokens))


def timings_of(completion: Completion) -> Timings:
    t, draft = completion.timings, completion.draft
    return Timings(t.queue_seconds, t.prefill_seconds, t.decode_seconds, draft.drafted_rounds, draft.proposed,
                   draft.accepted)


def error_event(message: str, code: str = "engine_error") -> bytes:
    return sse(ErrorResponse(ErrorBody(message, "server_error", None, code)))


class Reply:
    """One response: a fixed id and `created`, and the shapes of its job."""

    def __init__(self, front: Front, job: Job):
        self.front = front
        self.job = job
        self.id = job.request.id
        self.created = int(time.time())
        self._text_offset = 0  # completions' text_offset runs over the whole reply
        self._generated = 0  # tokens streamed so far

    # ---- logprobs ----------------------------------------------------------------------

    def chat_logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs:
        def top(token_id: int, value: float) -> TopLogprob:
            text, raw = self.front.token(token_id)
            return TopLogprob(text, _logprob(value), list(raw))

        content = []
        for entry in entries:
            chosen = top(entry.token_id, entry.logprob)
            content.append(ChatTokenLogprob(chosen.token, chosen.logprob, chosen.bytes, [top(*t) for t in entry.top]))
        return ChatLogprobs(content)

    def completion_logprobs(self, entries: list[TokenLogprob]) -> CompletionLogprobs:
        out = CompletionLogprobs([], [], [], [])
        for entry in entries:
            text = self.front.token(entry.token_id)[0]
            out.tokens.append(text)
            out.token_logprobs.append(_logprob(entry.logprob))
            # As OpenAI's: the alternatives, and always the chosen token itself.
            alternatives = {self.front.token(t)[0]: _logprob(v) for t, v in entry.top}
            alternatives.setdefault(text, _logprob(entry.logprob))
            out.top_logprobs.append(alternatives)
            out.text_offset.append(self._text_offset)
            self._text_offset += len(text)
        return out

    # ---- streaming ---------------------------------------------------------------------

    def opening(self) -> bytes:
        """Chat streams open with the assistant's role; text completions send nothing."""
        if not self.job.chat:
            return b""
        return sse(ChatCompletionChunk(self.id, self.created, self.front.model_name,
                                       [ChatChunkChoice(0, ChatDelta(role="assistant", content=""))]))

    def chunk(self, event: LaneEvent) -> bytes:
        """The SSE event for one lane event (text, logprobs, and on the last one the
        finish_reason and timings); nothing when it carries none of these."""
        entries = event.logprobs if self.job.logprobs and event.logprobs else None
        self._generated += len(event.token_ids)
        final = event.completion
        if not event.text and entries is None and final is None:
            return b""
        finish = _finish(event.finish_reason)
        timings = timings_of(final) if final is not None else None
        if self.job.chat:
            delta = ChatDelta(content=event.text) if event.text else ChatDelta()
            logprobs = self.chat_logprobs(entries) if entries else None
            body = ChatCompletionChunk(self.id, self.created, self.front.model_name,
                                       [ChatChunkChoice(0, delta, finish, logprobs)])
        else:
            logprobs = self.completion_logprobs(entries) if entries else None
            body = TextCompletionChunk(self.id, self.created, self.front.model_name,
                                       [CompletionChoice(0, event.text, finish, logprobs)])
        if timings is not None:
            body.timings = timings
        if self.job.continuous_usage:
            prompt = len(self.job.request.prompt)
            body.usage = Usage(prompt, self._generated, prompt + self._generated)
        return sse(body)

    def usage_chunk(self, completion: Completion) -> bytes:
        shape = ChatCompletionChunk if self.job.chat else TextCompletionChunk
        return sse(shape(self.id, self.created, self.front.model_name, [], usage=usage_of(completion)))

    # ---- one response ------------------------------------------------------------------

    def response(self, completion: Completion, entries: list[TokenLogprob]):
        finish = _finish(completion.finish_reason)
        usage, timings = usage_of(completion), timings_of(completion)
        if self.job.chat:
            logprobs = self.chat_logprobs(entries) if self.job.logprobs else None
            choice = ChatChoice(0, AssistantMessage(completion.text), finish, logprobs)
            return ChatCompletion(self.id, self.created, self.front.model_name, [choice], usage, timings)
        logprobs = self.completion_logprobs(entries) if self.job.logprobs else None
        choice = CompletionChoice(0, completion.text, finish, logprobs)
        return TextCompletion(self.id, self.created, self.front.model_name, [choice], usage, timings)
