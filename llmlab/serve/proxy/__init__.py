"""The key-checking reverse proxy in front of every llmlab vLLM server (a package; the map is at the end).

Why: vLLM's ``--api-key`` guards only some path prefixes (``/v1``, ``/v2``, ``/inference``, ``/cohere`` in
0.32: ``vllm/entrypoints/serve/middleware/authenticate.py``); ``/invocations``, ``/tokenize``, ``/pause``,
``/abort_requests``, ``/update_weights``, ``/docs`` ... answer anyone who reaches the port.  On a shared
cluster that is everyone.  So vLLM listens on a Unix socket in a 0700 directory (only its user can connect),
and the one listener others can reach is this proxy, which

- checks the key on **every** request: the owner's key (a 0600 file) or any key whose sha256 is registered
  in a keys file or directory (a workshop's learners: each learner makes a key of their own and hands in
  only its hash; deleting the hash revokes that learner within a second, without restarting the server).
  Comparisons are ``hmac.compare_digest`` over sha256 digests, against every registered digest;
- forwards only an allow-list: ``/v1/...`` (but never the LoRA loading routes, :data:`policy.CLOSED`), ``/health`` and
  ``/metrics`` (for ``llmlab status``/``metrics``),
  after refusing paths that are not already normal (``..``, ``.``, ``//``, backslashes, percent-encoded
  separators or dots, double encoding): the path that was checked is the path vLLM gets;
- streams the answer chunk by chunk as it arrives (server-sent events unbuffered), and cancels the upstream
  request when the client goes away, so that vLLM aborts the generation instead of finishing it for nobody.

Why this and not nginx: nginx would be a second server to install (Debian or conda-forge) on laptops, OOD
nodes and clusters where learners have neither root nor conda, and it cannot read a directory of key hashes
that changes while it runs without a reload or a Lua/njs module.  This is a few hundred lines on two C-backed
libraries vLLM already depends on and installs everywhere it runs: ``httptools`` (llhttp, the HTTP parser of
vLLM's own uvicorn and of Node.js) and ``uvloop``.  It is written at the protocol level, not as an ASGI app:
parse, judge, then relay vLLM's answer piece by piece with one write each.  A first version on uvicorn + aiohttp
spent about twice the CPU per streamed token on a 2-core machine (81 against 38-70 us at 32 streams, 264 against
78-156 us at 1), and a 2-core laptop takes that from vLLM (``benchmarks/proxy_overhead.py``; docs/security.md).

Run: ``python -m llmlab.serve.proxy --listen HOST:PORT --upstream unix:/run/dir/vllm.sock --key-file FILE
[--keys DIR_OR_FILE] [--watch-pid PID] [--ready-file FILE]``.  Secrets only through files (never the command
line): ``--key-file`` holds the owner's key; an older vLLM without ``--uds`` is reached as ``--upstream
http://127.0.0.1:PORT`` with its internal key in ``--upstream-key-file``.  ``--listen HOST:0`` lets the system pick
a free port; ``--ready-file`` is written (0600, ``{"host", "port", "pid"}``) once the proxy listens, and is what a
caller waits for (:func:`command.wait_bound`) before it publishes the port or sends the key there (bind, then publish).
``--upstream`` given several times makes the proxy a router between replicas of one model (``--route``,
:meth:`router.Routing.pick`; notebook 15): the key check and the allow-list are the same for every replica.

Several models, one endpoint (issue 41): ``--upstream MODEL=URL`` names the model an upstream serves (given again
for a replica of it), and ``--upstream-key-file MODEL=FILE`` the key that upstream wants (another job's own proxy,
``http://node:port``). The proxy then reads each request body's ``"model"`` (:func:`router.model_of`, bounded like
prefix routing) and sends it to that model's replicas only; a model it does not serve gets a 404 that names those it
does. ``GET /v1/models`` is answered by the proxy itself, the lists of all models in one
(:func:`router.merge_models`), and ``/health`` is 200 only when every model answers. Everything above holds for
every upstream: a key on every route, the one allow-list, the memory bounds; an upstream's key goes only to that
upstream, never to a client.

Under load from others (docs/security.md, tests/cluster/test_security.py): the soft open-file limit is raised to the
hard one, and near it idle connections are closed, oldest first, those that never showed a key before keyed ones
(:meth:`limits.Shedding.admit`); a connection that has shown no key is closed after its first refusal; a client that
pipelines without reading is held back by TCP, not by the proxy's memory (:meth:`relay.Client._reading`); the bodies
of all connections together are held to ``MAX_BODIES`` (:meth:`limits.Shedding.make_room`), a learner's key to
``KEY_BODIES`` of them and ``KEY_REQUESTS`` requests in progress (429 beyond); a room's ``keys/`` is re-read in a
worker thread (:meth:`keys.KeyRing.watch`), and a revoked key's connections are closed then
(:meth:`limits.Shedding.drop_revoked`); the log has a budget (:class:`limits.LogBudget`).

The package, bottom floor first (``tests/unit/test_imports.py`` keeps it so):

- ``answers``: the bytes the proxy answers itself (errors in the OpenAI shape) and :class:`ProxyError`;
- ``keys``: the owner's key and the registered digests (``KeyRing``), the identity proof asked of an upstream;
- ``policy``: **who may reach vLLM, with what** -- paths, methods, headers, sizes, and ``judge``, the one function a
  request's head goes through.  With ``keys``, ``limits`` and ``llmlab.serve.keyring`` (which files in a shared
  folder count), the whole security perimeter (docs/security.md);
- ``limits``: file descriptors, bodies and requests held (``Shedding``), timeouts, the log's budget;
- ``router``: replicas and models behind one endpoint (``Routing``; what lesson 15 imports);
- ``relay``: the connections (``Client``, ``Upstream``) and ``Proxy``, what they share;
- ``command``: the process (``python -m llmlab.serve.proxy``), its argv (``proxy_command``), the wait for it to listen.
"""
