"""One request, streamed and timed (TTFT, ITL, TPOT), and its failure in words.

Part of ``llmlab.loadtest`` (its ``__init__`` says what a load test measures); read them in the order records,
results, request, repeats, driver.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from llmlab.loadtest.records import Job, Record

# One clock for every timestamp of a run: wall time is read once, here, and every ``start`` is this anchor
# plus ``perf_counter``.  Reading ``time.time()`` and ``perf_counter()`` one after the other for each
# request lets a thread switch between the two calls (milliseconds on a starved machine) shift that
# request's start against its own offsets, and two requests that followed each other seem to overlap.
_WALL0, _PERF0 = time.time(), time.perf_counter()

# --- one request --------------------------------------------------------------------------------------

class _Deadline(Exception):
    """The request ran past the run's ``timeout``."""


class _ServerError(Exception):
    """The server sent an error event in the middle of a stream."""


def _event(line: str):
    """One line of a server-sent-events stream: its JSON payload, ``None`` for the blank lines and comments
    between events, and ``"[DONE]"`` at the end."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    return payload if payload == "[DONE]" else json.loads(payload)


class _Timer:
    """Turns the streamed events of one completion into a ``Record``; shared by the thread and the asyncio
    variants so that both measure exactly the same thing.

    Why raw events and not the openai client's typed chunks: building a typed object costs ~0.3 ms of CPU
    per token, so at a thousand tokens per second the load generator itself would eat a third of a core --
    taken from the server it measures when both share a machine.  Each event is parsed with ``json.loads``,
    as ``vllm bench serve`` does.
    """

    def __init__(self, job: Job, max_tokens: int, timeout: float, session: str, base_url: str,
                 concurrency: int | None = None):
        self.rec = Record(id=job.id, max_tokens=max_tokens, session=session, concurrency=concurrency)
        self.timeout, self.base_url = timeout, base_url
        self.pieces: list[str] = []
        self.chunks = 0
        self.last: float | None = None
        self.t0 = 0.0
        self.t_end: float | None = None
        self.role_only = False  # the chat endpoint's first event: the role, no token yet

    def sent(self) -> None:
        self.t0 = time.perf_counter()
        self.rec.start = _WALL0 + (self.t0 - _PERF0)

    def answered(self) -> None:
        self.rec.t_response = time.perf_counter() - self.t0

    def line(self, line: str) -> None:
        """Take one line of the stream: a token, the usage, an error event, or nothing."""
        now = time.perf_counter() - self.t0
        data = _event(line)
        if data is not None:  # an event, read before the connection can go back to the pool (a blank
            self.t_end = now  # line the decoder flushes at the end of the body may come after it)
        if data is None or data == "[DONE]":
            return
        if "error" in data or data.get("object") == "error":
            error = data.get("error", data)
            raise _ServerError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
        usage = data.get("usage")
        if usage:
            self.rec.prompt_tokens = usage.get("prompt_tokens")
            self.rec.output_tokens = usage.get("completion_tokens") or 0
            self.rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        choices = data.get("choices")
        if choices:  # a token (its text may be empty: a special token, half a UTF-8 character)
            delta = choices[0].get("delta") or {}
            if self.rec.ttft is None:
                # The chat endpoint's first event carries the role and no text; vLLM sends it in the same step
                # as the first token, and ``vllm bench serve`` takes it as the first token: so does llmlab.
                self.rec.ttft = now
                self.role_only = "role" in delta and not delta.get("content")
            elif self.role_only:  # the first token itself, right behind the role: no gap of its own
                self.role_only = False
            else:
                self.rec.itl.append(now - self.last)
            self.last = now
            if not ("role" in delta and not delta.get("content")):
                self.chunks += 1
            self.pieces.append(choices[0].get("text") or delta.get("content") or "")
            if choices[0].get("finish_reason"):
                self.rec.finish_reason = choices[0]["finish_reason"]
        if now > self.timeout:
            raise _Deadline

    def done(self) -> Record:
        """The stream ended; its end is the last line read (the [DONE] event), before the connection went
        back to the pool -- on a starved machine a thread can wait long after that for the CPU, and another
        request would then seem to overlap it."""
        r = self._close(at=self.t_end)
        if r.ttft is None:
            r.status, r.error = "error", "the server answered but streamed no token."
        elif r.finish_reason is None:
            r.status, r.error = "error", (f"the stream ended after {r.output_tokens} tokens without a finish_reason: "
                                          "the server stopped sending mid-answer.")
        else:
            r.status = "ok"
            r.latency = self.last
            if r.output_tokens > 1:
                r.tpot = (r.latency - r.ttft) / (r.output_tokens - 1)
        return r

    def failed(self, exc: BaseException) -> Record:
        r = self._close(at=None)  # the failure happened now
        r.status, r.error = describe_failure(exc, r.output_tokens, self.timeout, self.base_url)
        return r  # ttft and itl stay: they say how far the request got

    def _close(self, at: float | None) -> Record:
        r = self.rec
        r.end = r.start + (at if at is not None else time.perf_counter() - self.t0)
        r.text = "".join(self.pieces)
        if not r.output_tokens:  # no usage chunk (it comes last): count the token chunks received
            r.output_tokens = self.chunks
        return r


def _chain(exc: BaseException | None) -> list[BaseException]:
    """The exception and what caused it: aiohttp wraps the socket's error, which names the problem."""
    out: list[BaseException] = []
    while exc is not None and all(exc is not e for e in out):
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _find(chain: list[BaseException], *names: str) -> BaseException | None:
    """The first exception in ``chain`` of a class named one of ``names`` (or derived from one)."""
    return next((e for e in chain if any(c.__name__ in names for c in type(e).__mro__)), None)


def describe_failure(exc: BaseException, tokens: int, timeout: float, base_url: str = "") -> tuple[str, str]:
    """(status, one sentence) for a request that failed: what happened, in words a learner can act on."""
    from llmlab.client import describe_error

    chain = _chain(exc)
    where = f" at {base_url}" if base_url else ""
    got = f"after {tokens} token{'s' * (tokens != 1)}"
    if isinstance(exc, _Deadline):
        return "timeout", (f"no complete answer within timeout={timeout:g} s ({got}): the server is overloaded or "
                           "stuck; lower the concurrency or raise timeout.")
    if isinstance(exc, TimeoutError):  # aiohttp's silence past sock_read / sock_connect
        return "timeout", (f"the server{where} sent nothing for {timeout:g} s ({got}): it is overloaded, stuck, "
                           "or the client's connection pool is full; lower the concurrency or raise timeout.")
    if isinstance(exc, _HTTPStatus):
        return "error", describe_error(exc)
    if isinstance(exc, _ServerError):
        return "error", f"the server reported an error {got} and ended the answer: {exc}"
    if isinstance(exc, json.JSONDecodeError):
        return "error", f"the server sent an event that is not JSON {got} ({exc}): is this an OpenAI-compatible API?"
    if (cause := _find(chain, "ClientConnectorError")) is not None:
        return "error", (f"could not connect to the server{where} ({cause}): nothing listens there -- the server "
                         "is down, restarting, or the address is wrong.")
    if (cause := _find(chain, "ServerDisconnectedError", "ClientPayloadError", "ClientOSError")) is not None:
        when, during = (got, "mid-answer") if tokens else ("before the first token", "before answering")
        return "error", (f"the connection broke {when} ({type(cause).__name__}: {cause}): the server closed it "
                         f"{during} -- it crashed, was stopped, or restarted.")
    return "error", f"{type(exc).__name__} {got}: {exc}"


@dataclass
class _Settings:
    """What every request of one run shares."""

    model: str
    max_tokens: int
    timeout: float
    params: dict
    session: str
    concurrency: int
    base_url: str = ""
    chat: bool = False  # /chat/completions (messages) instead of /completions (a prompt)

    def timer(self, job: Job) -> _Timer:
        return _Timer(job, job.max_tokens or self.max_tokens, self.timeout, self.session, self.base_url,
                      self.concurrency)

    @property
    def path(self) -> str:
        return "/chat/completions" if self.chat else "/completions"

    def request(self, job: Job) -> dict:
        """The body: a completion's ``prompt``, or for the chat endpoint ``messages`` (a job's prompt as one user
        message, or the job's own list of messages: a conversation so far)."""
        body = dict(model=self.model, max_tokens=job.max_tokens or self.max_tokens, stream=True,
                    stream_options={"include_usage": True}, **self.params)
        if not self.chat:
            return {**body, "prompt": job.prompt}
        is_messages = isinstance(job.prompt, list) and all(isinstance(m, dict) for m in job.prompt)
        return {**body, "messages": job.prompt if is_messages else [{"role": "user", "content": job.prompt}]}


class _HTTPStatus(Exception):
    """The server refused a request sent over aiohttp; shaped like the openai client's ``APIStatusError``
    (``status_code``, ``body``) so that one sentence describes both."""

    def __init__(self, status: int, text: str):
        super().__init__(text.strip() or f"HTTP {status}")
        self.status_code = status
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        self.body = body.get("error", body) if isinstance(body, dict) else None


async def _send_async(session, url: str, headers: dict, job: Job, cfg: _Settings,
                      timer: _Timer | None = None) -> Record:
    """One streamed request over aiohttp; never raises: a failure is a record.

    Why aiohttp and not the openai client's asyncio stack: on the course's 2-core machine the latter handed
    the streamed events over in bursts (median TPOT 0.004 of vLLM's tool's, TTFT 11x), while the same
    ``_Timer`` on aiohttp -- the HTTP stack of ``vllm bench serve`` -- measured what vLLM's tool measures
    (benchmarks/loadtest_vs_vllm_bench.py).  The lines are split here; each is parsed as before."""
    timer = timer or cfg.timer(job)  # a caller's own: it watches the request in flight (the open loop's stop)
    timer.sent()
    try:
        async with session.post(url, json=cfg.request(job), headers=headers) as response:
            timer.answered()
            if response.status >= 400:
                raise _HTTPStatus(response.status, await response.text())
            rest = b""
            async for piece in response.content.iter_any():
                *lines, rest = (rest + piece).split(b"\n")
                for line in lines:
                    timer.line(line.decode())
            if rest:
                timer.line(rest.decode())
        return timer.done()
    except Exception as e:  # noqa: BLE001
        return timer.failed(e)
