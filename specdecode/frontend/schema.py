"""The OpenAI wire schema of a generation request, shared by the server and the batch job: the
pydantic models of /v1/completions and /v1/chat/completions bodies and their validation.

Errors are `ApiError(status, message, param)`, answered as {"error": {"message", "type", "param",
"code"}} (by the server as HTTP, by the batch job inside the output line). Fields the engine
cannot honour exactly yet (tools, suffix, ...) are refused with a 400 naming the field rather than
silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from specdecode.frontend.options import MAX_CHOICES, MAX_LOGPROBS

MAX_GAMMA = 64
MAX_ROWS = 256                         # prompts × n of one request
# JSON numbers only: "0.5" and true are refused, and so are NaN and ±Infinity (Python's json reads them)
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class ApiError(Exception):
    """An error answered to the client: HTTP status, one-line message, the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error"}.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored, as OpenAI's servers do, except
    those that would change the output (refused in refuse_unsupported)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=0)   # 0 only with echo (score the prompt)
    temperature: Number | None = Field(default=None, le=2)       # OpenAI's limit; SamplingParams checks the rest
    top_p: Number | None = None
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(default=1, ge=1, le=MAX_CHOICES)
    best_of: StrictInt | None = None                                # only n (the choices are all returned)
    logit_bias: dict[StrictStr, Number] | None = None               # {"token id": bias in [-100, 100]}
    min_tokens: StrictInt | None = 0                                # vLLM's extension: EOS masked until then
    ignore_eos: StrictBool | None = False                           # vLLM's extension: EOS does not end it
    presence_penalty: Number | None = 0.0
    frequency_penalty: Number | None = 0.0
    repetition_penalty: Number | None = None                        # vLLM's extension; transformers' semantics
    response_format: dict | None = None
    grammar: StrictStr | None = None                                 # EBNF, or "regex:PATTERN"
    num_speculative_tokens: StrictInt | None = Field(default=None, ge=0, le=MAX_GAMMA)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: StrictStr | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(_Common):
    # one prompt (text or token ids) or, as OpenAI's API takes, a list of them (choices prompt-major)
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool | None = False


# Fields that change what a request returns: refused until they are done exactly, never ignored.
# Each with the values that mean the same as leaving it out.
UNSUPPORTED = {"suffix": ((None, ""), "suffix is not supported"),
               "tools": ((None, []), "tools are not supported"),
               "tool_choice": ((None, "none"), "tool_choice is not supported"),
               "functions": ((None, []), "functions are not supported")}


def _same(value, neutral) -> bool:
    """Equal and of the same type (in Python 0 == False == 0.0, which JSON tells apart)."""
    return value is neutral or (type(value) is type(neutral) and value == neutral)


def parse(kind: type[BaseModel], body) -> BaseModel:
    """Validate a JSON body (already decoded).

    Raises:
        ApiError: 400 naming the first bad field.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        request = kind.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = _param(first["loc"])
        raise ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param) from None
    refuse_unsupported(request, body)
    return request


def _param(loc) -> str | None:
    """pydantic's error location as the field's name: list indices kept, union branch names
    ("str", "list[int]", ...) dropped; a map's keys are the client's data, not fields
    (logit_bias's token ids)."""
    if loc and loc[0] == "logit_bias":
        return "logit_bias"
    parts = [str(p) for p in loc if isinstance(p, int) or ("[" not in str(p) and str(p) not in
                                                           ("str", "int", "float", "bool", "list", "dict"))]
    return ".".join(parts) or None


def refuse_unsupported(request, body: dict) -> None:
    """What the engine does not do exactly yet gets a clear 400, never a silent change of output."""
    n = request.n or 1
    prompts = prompt_list(request) if isinstance(request, CompletionRequest) else [None]
    if not prompts:
        raise ApiError(400, "prompt is empty; give a string, token ids, or a list of either", "prompt")
    if len(prompts) * n > MAX_ROWS:
        raise ApiError(400, f"{len(prompts)} prompts × n={n} is more than {MAX_ROWS} completions in one request",
                       "prompt" if len(prompts) > 1 else "n")
    if request.best_of is not None and request.best_of != n:
        raise ApiError(400, f"best_of must equal n ({n}): every choice made is returned", "best_of")
    if not isinstance(request, CompletionRequest) and not _same(body.get("echo"), False) and body.get("echo") is not None:
        raise ApiError(400, "echo is a /v1/completions field", "echo")
    if request.max_tokens == 0 and not getattr(request, "echo", False):
        raise ApiError(400, "max_tokens must be >= 1 (0 only with echo: score the prompt)", "max_tokens")
    for key, bias in (request.logit_bias or {}).items():
        if not key.isascii() or not key.isdigit() or len(key) > 9 or key != str(int(key)):  # "05": say 5
            raise ApiError(400, f"logit_bias keys must be token ids as strings, got {key[:20]!r}", "logit_bias")
        if not -100 <= bias <= 100:
            raise ApiError(400, f"logit_bias values must be in [-100, 100], got {bias} for token {key}", "logit_bias")
    if getattr(request, "top_logprobs", None) is not None and not getattr(request, "logprobs", False):
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    for name, (neutral, message) in UNSUPPORTED.items():
        if not any(_same(body.get(name), v) for v in neutral):
            raise ApiError(400, message, name)
    if isinstance(request.stop, list) and (len(request.stop) > 16 or not all(request.stop)):
        raise ApiError(400, "stop must be at most 16 non-empty strings", "stop")
    if request.stop == "":
        raise ApiError(400, "stop must be a non-empty string", "stop")


def prompt_list(request: CompletionRequest) -> list:
    """A completions body's prompts: one (a string or token ids) or a list of them."""
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def stops(request) -> list[str]:
    return [request.stop] if isinstance(request.stop, str) else list(request.stop or [])


def num_logprobs(request) -> int | None:
    """The alternatives per token the request wants (None: no logprobs)."""
    if isinstance(request.logprobs, bool):  # chat
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def max_tokens(request, default: int) -> int:
    value = getattr(request, "max_completion_tokens", None) or request.max_tokens
    return value if value is not None else default


def check_model(request, served: str) -> None:
    """Raises ApiError 404 when the body names another model than the one served."""
    if request.model != served:
        raise ApiError(404, f"model {request.model!r} does not exist; this server has {served!r}", "model",
                       "model_not_found")
