"""Rollout's OpenAI-compatible endpoint: your agent's ``openai`` client talks to the policy being trained.

:class:`Endpoint` serves, per episode, ``POST /episodes/<id>/v1/chat/completions`` and
``POST /episodes/<id>/v1/completions`` (and ``GET .../v1/models``) with Starlette on a uvicorn
server in a thread of rollout's process. An episode's agent gets ``base_url =
http://<host>:<port>/episodes/<id>/v1`` and the job's bearer token as ``api_key``; the calls it
makes there are the episode's turns (:mod:`asyncflow.agents.agent_env` drives them).

Security: bound to 127.0.0.1 by default (``env.host``); every request needs ``Authorization:
Bearer <token>`` (a fresh random token per endpoint, compared in constant time), else 401;
bodies over 1 MiB are refused (413); nothing from the wire names a file. A bad request is
answered with one line in the OpenAI error shape (``{"error": {"message": ..., "type": ...}}``):
400 for a malformed body, 404 for an unknown episode, 409 for a call whose history does not
extend the episode's (below), 504 when the turn did not come in time.

What a call may ask: ``messages`` (chat) or ``prompt`` (text), ``tools`` (OpenAI function
schemas, rendered by the chat template), ``n`` = 1, no ``stream``. Sampling is the run's
(``rollout.temperature``: the trainer recomputes log-probs at it; ``env.turn_tokens``): the
request's ``temperature``, ``top_p`` and ``max_tokens`` are ignored.

Token history (the rule of :func:`asyncflow.agents.chat.continuation`): the first call's
rendered prompt is tokenised; each later call must **extend** the conversation: the chat
template's rendering of its messages must begin with the text of the call before (its prompt and
the completion the endpoint returned, as the model wrote it). Then the earlier ids are reused as
they are and only the new text (the tool results, the user's reply) is tokenised, so the episode's
sample is exactly the ids the model saw and wrote. An assistant message sent back as it was
returned (``content`` and ``tool_calls``) always extends; an edited or dropped one does not (409).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asyncflow.agents.session import Call, HistoryError, Session

MAX_BODY = 1 << 20
TURN_DEADLINE_S = 600.0  # a turn waits for decode slots behind other episodes: generous, never forever


class BadRequest(Exception):
    """A request refused with one line: ``status`` and OpenAI's error ``kind``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


class Endpoint:
    """The HTTP server and its episodes' sessions (module doc). ``close()`` stops it."""

    def __init__(self, tokenizer: Any, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 30.0,
                 model_name: str = "asyncflow-policy"):
        self.tokenizer, self.model_name = tokenizer, model_name
        self.token = secrets.token_urlsafe(24)
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        routes = [Route("/episodes/{eid}/v1/chat/completions", self._wrap(self._chat), methods=["POST"]),
                  Route("/episodes/{eid}/v1/completions", self._wrap(self._completion), methods=["POST"]),
                  Route("/episodes/{eid}/v1/models", self._wrap(self._models), methods=["GET"])]
        config = uvicorn.Config(Starlette(routes=routes), host=host, port=port, log_level="warning",
                                lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="agent-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {host}:{port} within {start_timeout_s:.0f} s")
            time.sleep(0.01)
        self.host, self.port = host, self._server.servers[0].sockets[0].getsockname()[1]

    # ------------------------------------------------------------------ episodes
    def open(self) -> Session:
        """A new episode's session (its id is in its base URL)."""
        session = Session(secrets.token_hex(8), self.tokenizer)
        with self._lock:
            self.sessions[session.eid] = session
        return session

    def base_url(self, session: Session) -> str:
        return f"http://{self.host}:{self.port}/episodes/{session.eid}/v1"

    def forget(self, session: Session) -> None:
        with self._lock:
            self.sessions.pop(session.eid, None)
        session.close()

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ HTTP
    def _wrap(self, handler: Callable[[Session, dict[str, Any]], Awaitable[dict[str, Any]]]
              ) -> Callable[[Request], Awaitable[JSONResponse]]:
        """Authentication, the body, the session, and one line for every refusal."""

        async def endpoint(request: Request) -> JSONResponse:
            try:
                self._authenticate(request)
                with self._lock:
                    session = self.sessions.get(request.path_params["eid"])
                if session is None:
                    raise BadRequest(404, "unknown episode: it ended, or this is not its base_url", "not_found")
                body = await self._body(request) if request.method == "POST" else {}
                return JSONResponse(await handler(session, body))
            except BadRequest as e:
                return JSONResponse({"error": {"message": str(e), "type": e.kind, "code": e.status}}, e.status)

        return endpoint

    def _authenticate(self, request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            raise BadRequest(401, "missing or wrong bearer token: pass the api_key your agent was given",
                             "authentication_error")

    async def _body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise BadRequest(413, f"request body of {len(raw)} bytes: at most {MAX_BODY}")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(400, f"the body is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest(400, "the body must be a JSON object")
        if body.get("stream"):
            raise BadRequest(400, "stream=true is not supported: ask without streaming")
        if body.get("n", 1) != 1:
            raise BadRequest(400, f"n={body.get('n')}: one completion per call")
        return body

    async def _chat(self, session: Session, body: dict[str, Any]) -> dict[str, Any]:
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest(400, "'messages' must be a non-empty list of message objects")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest(400, "'tools' must be a list of function schemas")
        turn = await self._turn(session, lambda: session.chat(messages, tools))
        return {"id": f"chatcmpl-{session.eid}-{turn.index}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": [{"index": 0, "message": turn.message, "logprobs": None,
                                                       "finish_reason": turn.finish_reason}],
                "usage": turn.usage}

    async def _completion(self, session: Session, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest(400, "'prompt' must be one string")
        turn = await self._turn(session, lambda: session.text(prompt))
        return {"id": f"cmpl-{session.eid}-{turn.index}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [{"index": 0, "text": turn.message["content"] or "",
                                                       "logprobs": None, "finish_reason": turn.finish_reason}],
                "usage": turn.usage}

    async def _models(self, session: Session, body: dict[str, Any]) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "asyncflow"}]}

    async def _turn(self, session: Session, make: Callable[[], Call]) -> Any:
        """Hand the call to the episode and wait for the model's turn."""
        try:
            call = make()
        except HistoryError as e:
            raise BadRequest(409, str(e), "history_error") from None
        except ValueError as e:  # (a message the chat template cannot render)
            raise BadRequest(400, str(e)) from None
        try:
            return await asyncio.wait_for(asyncio.wrap_future(call.reply), TURN_DEADLINE_S)
        except asyncio.TimeoutError:
            raise BadRequest(504, f"no turn within {TURN_DEADLINE_S:.0f} s", "timeout") from None
        except Exception as e:  # (the episode ended meanwhile: the session was closed)
            raise BadRequest(409, f"the episode ended: {e}", "episode_ended") from None
