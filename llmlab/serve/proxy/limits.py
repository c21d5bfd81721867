"""What bounds the proxy's use of the machine, so that nobody can take it from the owner: file descriptors (the
soft limit raised, idle connections shed near it), request bodies held (all together, and per learner key), requests
in progress per key, how long a client may sit idle or leave answers unread, and the log's own budget.  The numbers'
reasons are beside them; security-review-2/-3 give the attacks they answer (docs/security.md)."""

from __future__ import annotations

import collections
import logging
import os
import time

from llmlab.serve.proxy.policy import KEY_BODIES, MAX_BODIES, Request

log = logging.getLogger("llmlab.serve.proxy")  # one name for the whole package: its log lines are the proxy's

MAX_PIPELINE = 16  # requests waiting on one connection before the proxy stops reading it
# Connections the kernel may hold before we accept them.  asyncio's default of 100 is too few for a workshop's
# burst (30 learners x a threaded cell of 8-32 requests): the rest see SYN retries, a second or more each.
BACKLOG = 2048  # uvicorn's (vLLM's) default
HEAD_SLICE = 4096  # bytes of heads parsed at once: between two slices the pipeline's length is looked at again
# Seconds a client may leave its answers unread before it is dropped (nginx's send_timeout): between two requests and
# in the middle of a streamed answer alike (relay.Client.pause_writing).  LLMLAB_PROXY_SEND_TIMEOUT sets it for a
# server started with it in its environment (lesson 19 shows the drop in a few seconds; the tests too).
def _seconds(name: str, default: float) -> float:
    """A number of seconds from the environment; anything else stops the proxy with a sentence naming the variable."""
    text = os.environ.get(name) or str(default)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise SystemExit(f"{name}={text!r}: give a number of seconds above 0 (default {default:g}).")
    return value


SEND_TIMEOUT = _seconds("LLMLAB_PROXY_SEND_TIMEOUT", 60.0)
CLIENT_SNDBUF = 256 * 1024  # the kernel's send buffer per client socket (autotuned up to 4 MiB otherwise)
IDLE_TIMEOUT = 30.0  # seconds a connection may sit without a request (uvicorn's keep-alive is 5 s, nginx's 75 s)
LINGER = 2.0  # seconds a client refused part way may go on sending, read and dropped (nginx's lingering_close)
SENT_BELOW = 2**16  # bytes a body may still have in the proxy's buffer to vLLM and be taken as sent (F4)
PIPELINED_BODY = 2**20  # bytes of body read ahead on a connection while its previous request is answered


class LogBudget(logging.Filter):
    """At most ``burst`` log lines at once, then one every ``every`` seconds, each cut at ``width`` characters;
    the lines held back are counted.

    Why: proxy.log lands in the owner's home (and quota), and much of what the proxy logs can be provoked by
    others: file names and lines in a room's ``keys/``, clients near the open-file limit.  A budget bounds it
    whatever the cause: with the defaults, about 9,000 lines and 18 MB a day at most.
    """

    def __init__(self, burst: int = 50, every: float = 10.0, width: int = 2000):
        super().__init__()
        self.burst, self.every, self.width = burst, every, width
        self.tokens, self.last, self.held = float(burst), time.monotonic(), 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        self.tokens, self.last = min(self.burst, self.tokens + (now - self.last) / self.every), now
        if self.tokens < 1:
            self.held += 1
            return self.held == 1 and self._say_so(record)
        self.tokens -= 1
        message = record.getMessage()
        if len(message) > self.width:
            message = f"{message[:self.width]} ... ({len(message) - self.width} more characters cut)"
        if self.held:
            message = f"({self.held} log lines suppressed) {message}"
        record.msg, record.args, self.held = message, None, 0
        return True

    def _say_so(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = ("log budget spent (%d lines at once, then one per %g s): lines are suppressed "
                                   "and counted from here", (self.burst, self.every))
        return True


def fd_budget(limit: int | None) -> int | None:
    """The connections (clients' and vLLM's) the proxy holds before it sheds idle keyless ones: the limit, less
    the descriptors open now (standard streams, the event loop, the listener) and a reserve for the key files and
    for connections accepted in one burst before the proxy sees them."""
    if limit is None:
        return None
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc (macOS)
        open_now = 16
    return max(1, limit - open_now - max(8, limit // 32))


class Shedding:
    """The accounting :class:`llmlab.serve.proxy.relay.Proxy` keeps of what its connections hold, and what it sheds
    when they hold too much: ``clients`` (open, oldest first), ``upstreams`` (open to vLLM), ``fd_budget``, the
    bodies held (``body_bytes``, ``key_bodies``) and the requests in progress per key (``key_requests``)."""

    def __init__(self):
        self.clients: dict = {}  # open client connections (relay.Client), oldest first
        self.upstreams = 0  # open connections to vLLM
        self.fd_budget: int | None = None  # connections (both kinds) to hold before shedding; None: no limit
        self.body_bytes = 0  # request bodies held, all connections together (MAX_BODIES)
        self.key_bodies: collections.Counter[bytes] = collections.Counter()  # ... each learner key's (KEY_BODIES)
        self.key_requests: collections.Counter[bytes] = collections.Counter()  # in progress, per key (KEY_REQUESTS)

    def hold(self, r: Request, n: int) -> None:
        """Count ``n`` more bytes of ``r``'s body (negative: fewer) toward MAX_BODIES and its key's KEY_BODIES."""
        r.counted += n
        self.body_bytes += n
        if r.key:
            self.key_bodies[r.key] += n
            if not self.key_bodies[r.key]:
                del self.key_bodies[r.key]

    def begin(self, r: Request) -> None:
        """``r``, judged, is in progress until :meth:`end`: it counts toward its learner's KEY_REQUESTS."""
        if r.key and not r.over and not r.begun:
            r.begun = True
            self.key_requests[r.key] += 1

    def end(self, r: Request) -> None:
        if r.begun:
            r.begun = False
            self.key_requests[r.key] -= 1
            if not self.key_requests[r.key]:
                del self.key_requests[r.key]

    def drop_revoked(self, registered: frozenset[bytes]) -> None:
        """Close, at once, every connection that showed a learner's key no longer registered, whatever it is doing:
        an idle one, one whose answer is streaming (vLLM aborts it), one whose pipelined requests wait.  Why: a
        revoked learner kept the connections opened before, until their next request was refused, and could go
        on with what was already queued or streaming (security-review-3, F5b)."""
        revoked = [c for c in self.clients if c.learners - registered]
        for client in revoked:
            client.abort()
        if revoked:
            log.warning("closed %d connection(s) of a revoked key", len(revoked))

    def admit(self, new) -> bool:
        """Count a new connection (a ``relay.Client``); False if it must be closed at once.

        Why: every connection is a file descriptor, and at the process's limit the event loop accepts and drops
        (connection reset) whoever comes next, the owner included.  So near the limit the proxy closes idle
        connections (no request in progress), oldest first, down to 7/8 of the budget: first those that never
        showed a key, then keyed ones too -- a learner's key must not let them hold the owner out with idle
        keep-alive connections (security-review-2, finding 5).  A client whose idle connection was closed opens
        a new one.  Only when every other connection has a request in progress is the new one turned away."""
        self.clients[new] = None
        if self.fd_budget is None or len(self.clients) + self.upstreams <= self.fd_budget:
            return True
        target, shed = self.fd_budget - max(1, self.fd_budget // 8), [0, 0, 0]
        for client in [c for c in self.clients if c.lingering][:len(self.clients) + self.upstreams - target]:
            client.hang_up()  # refused already, only draining what their clients still send (Client.close)
            shed[0] += 1
        for keyed in (False, True):
            for client in list(self.clients):  # oldest first
                if len(self.clients) + self.upstreams <= target:
                    break
                if client is not new and client.keyed == keyed and client.between_requests:
                    client.close()
                    shed[1 + keyed] += 1
        admitted = len(self.clients) + self.upstreams <= self.fd_budget
        log.warning("near the open-file limit: closed %d refused connection(s) still sending, %d idle one(s) that "
                    "showed no key and %d that showed a key%s", *shed, "" if admitted else "; a new connection is "
                    "turned away (all others have a request in progress)")
        return admitted

    def make_room(self, key: bytes | None = None) -> None:
        """Refuse the largest bodies still arriving until the bodies held fit in MAX_BODIES again, or (``key``) those
        of that learner's key fit in its KEY_BODIES.

        Why: the body bound is per request, and a key holder can open many connections, each with a body one byte
        short of it, and never finish them: 12 of them took the proxy from 100 to 495 MB (security-review-2,
        finding 6).  The largest body still arriving is the one refused: an attacker's held bodies go before a
        learner's prompt of a few kilobytes, and whatever is complete goes on to vLLM.  A key's share comes first,
        so that one learner's many smaller bodies cannot fill the budget and leave a larger body of someone else's
        the largest (security-review-3, F4)."""
        limit, held = (KEY_BODIES, lambda: self.key_bodies[key]) if key else (MAX_BODIES, lambda: self.body_bytes)
        while held() > limit:
            arriving = [c for c in self.clients if key is None or c.current.key == key]
            largest = max(arriving, key=lambda c: c.receiving, default=None)
            if largest is None or largest.receiving == 0:  # what is held is complete: it is on its way out
                return
            log.warning("%s %d MiB of request bodies (its limit: %d MiB): refused the largest one still arriving "
                        "(%d MiB)", "a learner's key holds" if key else "the proxy holds", held() // 2**20,
                        limit // 2**20, largest.receiving // 2**20)
            largest.evict(share=key is not None)
