"""Who holds a key: the owner's (a 0600 file) and the registered digests of a room (``llmlab.serve.keyring`` says
which files count), compared in constant time; and the identity proof a router asks of an upstream before it sends
that upstream its key.  Part of the proxy's security perimeter (docs/security.md), with ``policy`` and ``limits``."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
import secrets
import time
from pathlib import Path

import httptools

from llmlab.serve.proxy.answers import ProxyError

log = logging.getLogger("llmlab.serve.proxy")  # one name for the whole package: its log lines are the proxy's

# A router sends an upstream's key only to a proxy that proves, on the same connection, that it holds that key: it
# asks IDENTITY_PATH with a fresh nonce, and the proxy answers HMAC(key, nonce), keyless (security-review-3, F1: a
# model job's port, once its job ended, is anyone's to bind, and the router kept sending that job's key and the
# learners' prompts there).  The proof is labelled (identity_proof), so it is no other use of the key.
IDENTITY_PATH = "/llmlab/identity"
NONCE_HEADER, PROOF_HEADER = b"x-llmlab-nonce", b"x-llmlab-proof"
NONCE = re.compile(rb"^[0-9a-f]{64}$")
IDENTITY_TIMEOUT = 10.0  # seconds an upstream may take to prove itself


def digest(key: str) -> bytes:
    return hashlib.sha256(key.strip().encode()).digest()


def key_digest_line(key: str, comment: str = "") -> str:
    """The line a learner registers for a key: ``sha256:<hex>  comment`` (the key itself never leaves them)."""
    return f"sha256:{digest(key).hex()}" + (f"  {comment}" if comment else "")



class KeyRing:
    """The keys the proxy accepts: the owner's (from a 0600 file, read once) and registered sha256 digests.

    The registered ones live in a file or a directory of files (``llmlab.serve.keyring`` says which files count).
    They are read again when something there changed, checked at most every ``recheck`` seconds, so that a
    revocation (deleting a line or a file) takes effect within about that time, while a request costs no
    file-system calls.  Where an event loop runs (the proxy), the reading is done in a worker thread by
    :meth:`watch`, never on the loop: a room's ``keys/`` is writable by every learner, and one who fills it with
    junk and changes it every few hundred ms made each re-read cost up to a second of the loop (security-review-2,
    finding 3).  Without a loop (``llmlab status``, tests) :meth:`accepts` reads it in place, as before.
    """

    REST = 4.0  # after a re-read of t seconds, rest REST * t or more: the thread takes at most a fifth of a core

    def __init__(self, owner_key_file: Path, registered: Path | None = None, recheck: float = 1.0):
        from llmlab.serve import keyring  # which files count, and how they are read: llmlab/serve/keyring.py

        try:
            owner = Path(owner_key_file).read_text().strip()
        except OSError as e:
            raise ProxyError(f"Cannot read the key file {owner_key_file} ({e.strerror}); it must exist and be "
                             "readable by the proxy's user (mode 0600).") from None
        if len(owner) < 16:
            raise ProxyError(f"The key in {owner_key_file} is shorter than 16 characters; write a random one, "
                             "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'.")
        self.owner = digest(owner)
        self._owner_key = owner  # for identity proofs only (prove); never logged or sent
        self.registered_path = Path(registered) if registered else None
        self.recheck = recheck
        self._reader = keyring.Reader()  # remembers user names and unchanged files between reads
        self._digests: tuple[bytes, ...] = ()
        self._denied: frozenset[bytes] = frozenset()
        self._signature: tuple = ()
        self._checked = float("-inf")
        self._watcher: asyncio.Task | None = None
        self.on_change = None  # called with the registered digests whenever they change (Shedding.drop_revoked)
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        """Re-read the registered digests here and now if the files changed (at most every ``recheck`` seconds)."""
        now = time.monotonic()
        if not force and now - self._checked < self.recheck:
            return
        self._checked = now
        self._install(self._read(force))

    def _read(self, force: bool = False):
        """What changed (a ``keyring.Ring``), or None; runs on the loop's worker thread under :meth:`watch`."""
        from llmlab.serve import keyring

        return keyring.load(self.registered_path, None if force else self._signature, self._reader)

    def _install(self, ring) -> None:
        if ring is None:  # nothing changed (or keys/ is unreadable just now: keep what was read)
            return
        changed = set(ring.digests) != set(self._digests)
        if changed:  # a folder that keeps changing logs only what changes who is in
            log.info("%d registered key(s) from %s", len(ring.digests), self.registered_path)
        self._digests, self._signature, self._denied = ring.digests, ring.signature, frozenset(ring.denied)
        if changed and self.on_change is not None:
            self.on_change(frozenset(ring.digests))

    def watch(self) -> asyncio.Task:
        """Start (once) re-reading the registered keys off the running event loop; the task that does it.

        One read at a time, in the loop's default executor; between two reads at least ``recheck`` seconds and
        ``REST`` times the last read's own duration (a folder of 100,000 junk names takes a few tenths of a
        second to list)."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch())
        return self._watcher

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while self.registered_path is not None:
            started = time.monotonic()
            try:
                self._install(await loop.run_in_executor(None, self._read))
            except Exception:  # a bug, not the folder's content (load never raises for that): keep the old keys
                log.exception("re-reading %s failed; the keys read before stay in force", self.registered_path)
            took = time.monotonic() - started
            await asyncio.sleep(max(self.recheck, self.REST * took))

    @property
    def registered(self) -> int:
        return len(self._digests)

    def accepts(self, authorization: str | None) -> bool:
        """True for ``Bearer <key>`` with a known key.  Compares the digest against every known one (no early
        exit), so the time taken says nothing about which, or how much of, a key matched."""
        if not authorization:
            return False
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return False
        if _loop_running():
            self.watch()  # re-read off the loop
        else:
            self.refresh()
        given = digest(key)
        ok = hmac.compare_digest(given, self.owner)
        for known in self._digests:
            ok |= hmac.compare_digest(given, known)
        return ok


    def learner(self, authorization: str | None) -> bytes | None:
        """The digest of an accepted key that is not the owner's (a learner's: what the per-key limits count by and
        what revocation closes); None for the owner's key."""
        key = (authorization or "").partition(" ")[2].strip()
        given = digest(key)
        return None if not key or hmac.compare_digest(given, self.owner) else given

    def salt_for(self, learner: bytes) -> str:
        """The ``cache_salt`` of a learner's requests (their key's digest, :meth:`learner`): HMAC of it under the
        owner's key, so that no learner can compute another's (the digests in ``keys/`` are readable by the room)."""
        return hmac.new(self._owner_key.encode(), b"llmlab-cache-salt\0" + learner, hashlib.sha256).hexdigest()[:32]

    def prove(self, nonce: bytes) -> bytes:
        """This proxy's answer to a router's identity challenge: the owner key's :func:`identity_proof`."""
        return identity_proof(self._owner_key, nonce)

    def revoked(self, authorization: str | None) -> bool:
        """True for ``Bearer <key>`` whose digest the owner revoked (``llmlab revoke``): the proxy then says so, so
        that a learner cut off mid-notebook is told why instead of "wrong key".  Only the key's holder can learn
        this, and they knew the key."""
        scheme, _, key = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and bool(key.strip()) and digest(key) in self._denied


def identity_proof(key: str, nonce: bytes) -> bytes:
    """HMAC-SHA256 of ``nonce`` under ``key``, hex, labelled: only a holder of the key can answer a fresh nonce."""
    return hmac.new(key.encode(), b"llmlab-identity\0" + nonce, hashlib.sha256).hexdigest().encode()


def identity_request(nonce: bytes) -> bytes:
    return b"GET %b HTTP/1.1\r\nhost: vllm\r\n%b: %b\r\n\r\n" % (IDENTITY_PATH.encode(), NONCE_HEADER, nonce)


class Identity:
    """One identity challenge: a fresh nonce, the request that asks it (:func:`identity_request`), and the
    upstream's answer, parsed (its status and proof; ``complete`` once whole)."""

    def __init__(self):
        self.nonce = secrets.token_hex(32).encode()
        self.request = identity_request(self.nonce)
        self.proof: bytes | None = None
        self.complete = False
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == PROOF_HEADER:
            self.proof = value

    def on_message_complete(self) -> None:
        self.complete = True

    def proves(self, key: str) -> bool:
        return (self.complete and self.parser.get_status_code() == 200 and self.proof is not None
                and hmac.compare_digest(self.proof, identity_proof(key, self.nonce)))


async def proven_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: str) -> bool:
    """:meth:`Upstream.proven` on a stream connection (the router's own GETs of ``GATHERED`` paths)."""
    identity = Identity()
    writer.write(identity.request)
    with contextlib.suppress(TimeoutError, httptools.HttpParserError):
        async with asyncio.timeout(IDENTITY_TIMEOUT):
            while not identity.complete and (data := await reader.read(4096)):
                identity.parser.feed_data(data)
    return identity.proves(key)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
