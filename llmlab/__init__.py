"""llmlab: a Jupyter-first course on distributed LLM inference with vLLM.

``client, model = llmlab.connect()`` is the one way a notebook reaches a server (see
``llmlab.connection``); the topic modules (memory, kvcache, sampling, ...) hold the course's code.
"""

from llmlab import check
from llmlab.connection import AuthenticationFailed, Connection, ServerError, ServerUnavailable, connect

__version__ = "0.1.0"
__all__ = ["connect", "doctor", "Connection", "ServerError", "ServerUnavailable", "AuthenticationFailed", "check",
           "__version__"]


def doctor() -> dict[str, str]:
    """What this environment has (Python, llmlab, the vLLM engine, torch, the openai client, CPU cores) and which
    server ``connect()`` would use: ``llmlab doctor`` in a terminal prints the same."""
    from llmlab.ops import doctor as _doctor

    return _doctor.report()
