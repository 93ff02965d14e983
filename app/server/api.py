"""The HTTP API (Starlette): OpenAI's /v1/models, /v1/chat/completions, /v1/completions and
Anthropic's /v1/messages, streamed (SSE) and not, over the Batcher.

Errors use OpenAI's JSON shape {"error": {"message", "type", "param", "code"}} (Anthropic's on
/v1/messages). A client that goes away cancels its request, which frees its batch slot.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from .batcher import Batcher, Completion, Delta, Done, Failed

DISCONNECT_POLL = 0.5  # seconds between checks that a non-streaming client is still there


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type_: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = (
            status,
            message,
            code,
            param,
            type_,
        )

    def openai(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)

    def anthropic(self) -> JSONResponse:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                503: "overloaded_error"}.get(self.status, "api_error")  # fmt: skip
        body = {"type": "error", "error": {"type": kind, "message": self.message}}
        return JSONResponse(body, status_code=self.status)


# -- request parsing -----------------------------------------------------------------------------
def _text(content) -> str:
    """OpenAI/Anthropic message content: a string or a list of parts; text parts are kept."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("text", "input_text"):
                raise ApiError(400, "only text content is supported", param="messages")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise ApiError(400, "message content must be a string or a list of parts", param="messages")


def _number(body: dict, name: str, default, lo=None, hi=None, kind=float):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
        raise ApiError(
            400, f"{name} must be a {'integer' if kind is int else 'number'}", param=name
        )
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ApiError(400, f"{name} must be between {lo} and {hi}, got {v}", param=name)
    return kind(v)


def _stops(v, name: str = "stop") -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v) and len(v) <= 4:
        return tuple(v)
    raise ApiError(400, f"{name} must be a string or a list of up to 4 strings", param=name)


class Api:
    def __init__(self, batcher: Batcher, api_key: str | None = None):
        self.batcher = batcher
        self.api_key = api_key or None
        self.created = int(time.time())

    # -- checks --------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            got = auth[7:].strip()
        if got != self.api_key:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    def _ready(self) -> None:
        b = self.batcher
        if b.state == "loading":
            raise ApiError(503, "the model is loading; try again shortly", code="model_loading",
                           type_="server_error")  # fmt: skip
        if b.state != "ready":
            raise ApiError(503, f"the model is not available: {b.error or b.state}",
                           code="model_unavailable", type_="server_error")  # fmt: skip

    def _model(self, body: dict) -> str:
        name = body.get("model")
        mid = self.batcher.model_id
        if not isinstance(name, str) or not name:
            raise ApiError(400, "you must provide a model parameter", param="model")
        if name != mid:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{mid}`.",
                           code="model_not_found", param="model")  # fmt: skip
        return mid

    async def _body(self, request: Request) -> dict:
        self._auth(request)
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        self._ready()
        return body

    def _completion(self, body: dict, prompt: list[int], *, max_name: str = "max_tokens",
                    stop_name: str = "stop", default_temp: float = 1.0) -> Completion:  # fmt: skip
        ctx = self.batcher.context
        if len(prompt) >= ctx:
            raise ApiError(
                400,
                f"This model's maximum context length is {ctx} tokens. However, your messages "
                f"resulted in {len(prompt)} tokens. Please reduce the length of the messages.",
                code="context_length_exceeded", param="messages",
            )  # fmt: skip
        room = ctx - len(prompt)
        if max_name == "max_tokens" and body.get("max_completion_tokens") is not None:
            max_name = "max_completion_tokens"  # OpenAI's newer name for the same limit
        mt = _number(body, max_name, room, lo=1, kind=int)
        if _number(body, "n", 1, lo=1, kind=int) != 1:
            raise ApiError(400, "only n = 1 is supported", param="n")
        tok = self.batcher.engine.loaded.tokenizer
        reasoning = False
        if getattr(tok, "has_thinking", False):
            reasoning = tok.rfind_think_start(prompt) > tok.rfind_think_end(prompt)
        return Completion(
            prompt=prompt, max_tokens=min(mt, room), emit=lambda ev: None,
            temperature=_number(body, "temperature", default_temp, lo=0, hi=2),
            top_p=_number(body, "top_p", 1.0, lo=0, hi=1) or 1.0,
            seed=_number(body, "seed", None, kind=int), stop=_stops(body.get(stop_name), stop_name),
            reasoning=reasoning,
        )  # fmt: skip

    # -- running a request -----------------------------------------------------------------
    async def _events(self, req: Completion, request: Request) -> AsyncIterator[object]:
        """The request's events as they come; cancels it if the consumer stops early."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        req.emit = lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev)
        self.batcher.submit(req)
        finished = False
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if isinstance(ev, (Done, Failed)):
                    finished = True
                yield ev
                if finished:
                    return
        finally:
            if not finished:
                self.batcher.cancel(req)

    async def _collect(self, req: Completion, request: Request):
        content, reasoning, done = [], [], None
        async for ev in self._events(req, request):
            if isinstance(ev, Delta):
                content.append(ev.content)
                reasoning.append(ev.reasoning)
            elif isinstance(ev, Failed):
                raise ApiError(ev.status, ev.message, code=ev.code, type_="server_error")
            elif isinstance(ev, Done):
                done = ev
        return "".join(content), "".join(reasoning), done

    # -- OpenAI ----------------------------------------------------------------------------
    async def models(self, request: Request):
        try:
            self._auth(request)
            self._ready()
        except ApiError as e:
            return e.openai()
        m = {"id": self.batcher.model_id, "object": "model", "created": self.created,
             "owned_by": "rotaryquant"}  # fmt: skip
        return JSONResponse({"object": "list", "data": [m]})

    async def chat(self, request: Request):
        try:
            body = await self._body(request)
            model = self._model(body)
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ApiError(400, "messages must be a non-empty list", param="messages")
            clean = []
            for m in msgs:
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise ApiError(400, "each message needs a role and content", param="messages")
                clean.append({"role": m["role"], "content": _text(m.get("content"))})
            prompt = self.batcher.engine.encode_chat(clean)
            req = self._completion(body, prompt)
        except ApiError as e:
            return e.openai()
        return await self._respond(request, req, body, model, chat=True)

    async def completions(self, request: Request):
        try:
            body = await self._body(request)
            model = self._model(body)
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
                p = p[0]
            if isinstance(p, str) and p:
                prompt = self.batcher.engine.encode_text(p)
            elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                prompt = list(p)
            else:
                raise ApiError(
                    400, "prompt must be a non-empty string or token ids", param="prompt"
                )
            req = self._completion(body, prompt)
        except ApiError as e:
            return e.openai()
        return await self._respond(request, req, body, model, chat=False)

    async def _respond(self, request, req: Completion, body: dict, model: str, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())

        def usage(d: Done) -> dict:
            return {"prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
                    "total_tokens": d.prompt_tokens + d.completion_tokens}  # fmt: skip

        if not body.get("stream"):
            try:
                content, reasoning, done = await self._collect(req, request)
            except ApiError as e:
                return e.openai()
            if done is None:  # the client went away
                return JSONResponse({}, status_code=499)
            if chat:
                msg = {"role": "assistant", "content": content}
                if reasoning:
                    msg["reasoning_content"] = reasoning
                choice = {"index": 0, "message": msg, "finish_reason": done.finish_reason}
            else:
                choice = {"index": 0, "text": content, "finish_reason": done.finish_reason,
                          "logprobs": None}  # fmt: skip
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": model,
                                 "choices": [choice], "usage": usage(done)})  # fmt: skip

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict | None, extra: dict | None = None) -> str:
            d = {"id": rid, "object": chunk_obj, "created": created, "model": model,
                 "choices": [] if choice is None else [choice]}  # fmt: skip
            d.update(extra or {})
            return f"data: {json.dumps(d)}\n\n"

        async def sse():
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                             "finish_reason": None})  # fmt: skip
            async for ev in self._events(req, request):
                if isinstance(ev, Delta):
                    if chat:
                        delta = {"content": ev.content} if ev.content else {}
                        if ev.reasoning:
                            delta["reasoning_content"] = ev.reasoning
                        yield chunk({"index": 0, "delta": delta, "finish_reason": None})
                    else:
                        yield chunk({"index": 0, "text": ev.content, "finish_reason": None,
                                     "logprobs": None})  # fmt: skip
                elif isinstance(ev, Failed):
                    err = {
                        "message": ev.message,
                        "type": "server_error",
                        "param": None,
                        "code": ev.code,
                    }
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    return
                elif isinstance(ev, Done):
                    last = {"index": 0, "finish_reason": ev.finish_reason}
                    last.update({"delta": {}} if chat else {"text": "", "logprobs": None})
                    yield chunk(last)
                    if include_usage:
                        yield chunk(None, {"usage": usage(ev)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # fmt: skip

    # -- Anthropic -------------------------------------------------------------------------
    async def messages(self, request: Request):
        try:
            body = await self._body(request)
            model = self._model(body)
            if body.get("max_tokens") is None:
                raise ApiError(400, "max_tokens: field required", param="max_tokens")
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ApiError(400, "messages must be a non-empty list", param="messages")
            chat = []
            if body.get("system"):
                chat.append({"role": "system", "content": _text(body["system"])})
            for m in msgs:
                if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
                    raise ApiError(
                        400, "each message needs role user or assistant", param="messages"
                    )
                chat.append({"role": m["role"], "content": _text(m.get("content"))})
            req = self._completion(body, self.batcher.engine.encode_chat(chat),
                                   stop_name="stop_sequences")  # fmt: skip
        except ApiError as e:
            return e.anthropic()
        mid = "msg_" + uuid.uuid4().hex[:24]
        reasons = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn"}

        if not body.get("stream"):
            try:
                content, reasoning, done = await self._collect(req, request)
            except ApiError as e:
                return e.anthropic()
            if done is None:
                return JSONResponse({}, status_code=499)
            blocks = [{"type": "thinking", "thinking": reasoning}] if reasoning else []
            blocks.append({"type": "text", "text": content})
            return JSONResponse({
                "id": mid, "type": "message", "role": "assistant", "model": model,
                "content": blocks, "stop_reason": reasons[done.finish_reason], "stop_sequence": None,
                "usage": {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens},
            })  # fmt: skip

        def event(name: str, data: dict) -> str:
            return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"

        async def sse():
            yield event("message_start", {"message": {
                "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(req.prompt), "output_tokens": 0}}})  # fmt: skip
            index, kind = -1, None
            async for ev in self._events(req, request):
                if isinstance(ev, Delta):
                    for k, text in (("thinking", ev.reasoning), ("text", ev.content)):
                        if not text:
                            continue
                        if kind != k:
                            if kind is not None:
                                yield event("content_block_stop", {"index": index})
                            index, kind = index + 1, k
                            yield event("content_block_start", {"index": index,
                                        "content_block": {"type": k, k: ""}})  # fmt: skip
                        yield event("content_block_delta", {"index": index,
                                    "delta": {"type": f"{k}_delta", k: text}})  # fmt: skip
                elif isinstance(ev, Failed):
                    yield event("error", {"error": {"type": "api_error", "message": ev.message}})
                    return
                elif isinstance(ev, Done):
                    if kind is not None:
                        yield event("content_block_stop", {"index": index})
                    yield event("message_delta", {
                        "delta": {"stop_reason": reasons[ev.finish_reason], "stop_sequence": None},
                        "usage": {"output_tokens": ev.completion_tokens}})  # fmt: skip
                    yield event("message_stop", {})

        return StreamingResponse(sse(), media_type="text/event-stream")


def create_app(batcher: Batcher, api_key: str | None = None) -> Starlette:
    api = Api(batcher, api_key)
    return Starlette(routes=[
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/messages", api.messages, methods=["POST"]),
    ])  # fmt: skip
