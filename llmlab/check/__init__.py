"""Check cells for the exercises: ``llmlab.check.<exercise>(answer)`` says right or wrong.

Each function prints one line starting with "Right:" when the answer is correct, and otherwise raises
``NotYet`` whose message says what is still wrong and why -- so an unsolved exercise fails loudly in nbval,
and a learner sees a hint instead of a bare assertion.

Every check's verdict is recorded (``progress``: ``~/.llmlab/progress.jsonl``, shown by ``llmlab progress``).

One module per topic, named after its lesson module: ``check.memory`` checks notebook 01's answers with
``llmlab.memory``, and ``check.online`` the completions of notebooks 00, 03 and 08.  ``verdict`` holds what
they all say (``NotYet``, ``require``, ``right``) and the small tests of a number they share.  A check imports
its lesson module inside the function, so ``import llmlab`` stays light.
"""

# The parts, one per topic; every check stays reachable as llmlab.check.<name>.
from llmlab.check import progress

# course:checks (rendered from llmlab/course.toml by `llmlab course`)
from llmlab.check.batching import (  # noqa: F401
    best_static_steps,
    busy_share,
    recomputed_tokens,
    requests_before_preemption,
)
from llmlab.check.cluster import load_eta_minutes, pp_boundary, tp8_allreduce_bytes, tp_link_times  # noqa: F401
from llmlab.check.determinism import first_varying_batch, seeded_choice  # noqa: F401
from llmlab.check.disagg import kv_per_gpu_405b, prefill_gpu_link_gbs, ttft_apart_ms  # noqa: F401
from llmlab.check.kvcache import (  # noqa: F401
    cache_matches_arithmetic,
    prefix_hits,
    request_blocks,
    tiny_kv_without_gqa,
)
from llmlab.check.loadtest import goodput, job_queue, knee, resumed, tpot_by_hand  # noqa: F401
from llmlab.check.logprobs import best_choice, prompt_rank  # noqa: F401
from llmlab.check.lora import adapter_params_70b, adapter_steps, lora_slot_cost  # noqa: F401
from llmlab.check.memory import (  # noqa: F401
    a100s_for_405b,
    embedded_kv_tokens,
    h100s_for_405b,
    kv_405b,
    kv_2026,
    layout_405b,
    weights_405b_fp16,
)
from llmlab.check.offline import chat_prompt_ids, offline_batch, offline_sampling  # noqa: F401
from llmlab.check.online import ended_by_model, first_completion, stopped_at  # noqa: F401
from llmlab.check.prefixcache import room_blocks, room_hit_rate  # noqa: F401
from llmlab.check.quantization import fp8_kv_tokens, h100s_for_405b_fp8, step_overhead  # noqa: F401
from llmlab.check.rehearse import rehearsal_kv_tokens, rehearsal_roofline, rehearsal_tp_per_gpu  # noqa: F401
from llmlab.check.replicas import cold_prefills, replica_crossover, replica_kv  # noqa: F401
from llmlab.check.sampling import same_text, survivors  # noqa: F401
from llmlab.check.speculative import draft_length, spec_savings  # noqa: F401
from llmlab.check.structured import parsed_reference, verse_regex  # noqa: F401
from llmlab.check.troubleshoot import cut_off, longest_context, never_starts, oom_at_start  # noqa: F401

# /course:checks
from llmlab.check.verdict import NotYet, _number, _whole, require, right  # noqa: F401

# Each exercise check, as notebooks call it (llmlab.check.<name>), records its verdict.
for _name, _check in list(globals().items()):
    if callable(_check) and getattr(_check, "__module__", "").startswith("llmlab.check.") and \
            _check.__module__ not in ("llmlab.check.verdict", "llmlab.check.progress"):
        globals()[_name] = progress.recorded(_check)
