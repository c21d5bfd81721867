"""Load testing an OpenAI-compatible server with a job queue that loses nothing (notebook 06).

Why: one request at a time leaves a vLLM server mostly idle -- it batches every request it holds into
each forward pass, so a second request in flight costs it little.  A job queue of N worker threads keeps N
requests in flight: as one finishes, the next is sent.  ``run()`` does that and measures every request
the way the field does (and the way ``vllm bench serve`` does, so the two can be compared):

- **TTFT**, time to first token: sending the request → the first streamed chunk that carries a token;
- **ITL**, inter-token latencies: the gaps between the chunks that follow;
- **TPOT**, time per output token: (latency − TTFT) / (output tokens − 1);
- **latency**, end to end: sending → the last token;
- throughput: output tokens (and requests) of the successful requests per second of wall time.

A load test must also check the load it *got*: a client connection pool smaller than the concurrency caps
it silently.  ``max_concurrency_seen`` counts the requests the server was answering at once (from its HTTP
answer to the last token), ``max_outstanding`` the ones the client had sent; ``connection_limit()`` reads
the client's pool and ``run()`` warns before it starts when the pool is too small.

A load test that silently drops the requests that failed reports a server better than it is.  So every
prompt ends as exactly one record -- ``ok``, ``error`` or ``timeout`` -- with the error in words; records
can be appended to a JSONL file as they finish, and a run that stopped half-way is resumed from it.

``run_async()`` is the same measurement with asyncio instead of threads; ``sweep()`` repeats a workload at
growing concurrency and ``plot_sweep()`` draws the throughput-vs-latency trade-off.  **Goodput** (``slo=``):
the requests per second that met the TTFT/TPOT objectives a learner sets, as ``vllm bench serve --goodput``
counts them -- the throughput users would accept.  ``synthetic_workload()``
makes prompts of an exact token length from a seed, like ``vllm bench serve --dataset-name random``.
``repeat()`` runs a level several times: each figure the median of the runs, with an interval, and a percentile
that rests on too few samples says so (``sweep(repeats=N)`` does it at every level).

All of that is a *closed* loop: the next request waits for a free worker.  ``run_rate()``, ``run_open()`` and
``run_sessions()`` are *open* loops (``openloop``): requests arrive at a Poisson rate, in a burst (everyone runs the
cell at once), or as multi-turn conversations with think time, on ``/v1/completions`` or ``/v1/chat/completions``,
whether or not the server keeps up.  ``find_max()`` (``search``) finds the largest rate -- or replayed room --
that meets an SLO written as ``"ttft_p99<2s,failed=0"``, with repeats, intervals and an early stop.
"""

# The parts, in reading order; every name stays reachable as llmlab.loadtest.<name>.
from llmlab.loadtest.driver import (  # noqa: F401
    _check_pool,
    _codec,
    _finish,
    _prepare,
    _start_threads,
    in_a_loop,
    plot_sweep,
    random_prompt,
    repeat,
    run,
    run_async,
    sweep,
    synthetic_workload,
)
from llmlab.loadtest.openloop import (  # noqa: F401
    Session,
    burst,
    poisson_arrivals,
    run_open,
    run_rate,
    run_sessions,
    synthetic_sessions,
)
from llmlab.loadtest.records import (  # noqa: F401
    PERCENTILES,
    SLO_NAMES,
    STATUSES,
    TINY_TOKENIZER,
    Job,
    Record,
    _missing,
    as_jobs,
    check_slo,
    connection_limit,
    duration_of,
    max_in_flight,
    meets_slo,
    percentile,
    series,
    summarize,
)
from llmlab.loadtest.repeats import (  # noqa: F401
    MIN_TAIL,
    Figure,
    Repeated,
    bootstrap_interval,
    needed_for_tail,
    tail_samples,
)
from llmlab.loadtest.request import (  # noqa: F401
    _chain,
    _Deadline,
    _event,
    _find,
    _send_async,
    _ServerError,
    _Settings,
    _Timer,
    describe_failure,
)
from llmlab.loadtest.results import (  # noqa: F401
    LoadResult,
    _Appender,
    load,
    save_records,
)
from llmlab.loadtest.search import (  # noqa: F401
    Objective,
    Search,
    Slo,
    SloError,
    Step,
    find_max,
    find_max_rate,
    judge,
    next_level,
    parse_slo,
)
