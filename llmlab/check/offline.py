"""Checks of notebook 07, offline batch inference (``llmlab.offline``): a chat prompt's ids, sampling
parameters offline, one batch.
"""

from __future__ import annotations

from llmlab.check.verdict import require, right


def chat_prompt_ids(ids, messages) -> None:
    """07: the token ids of a chat prompt, from the tiny model's tokenizer and its own chat template."""
    from llmlab import offline

    require(not isinstance(ids, str), "that is text: vLLM tokenizes a text prompt again and adds a second <s>. "
            "Ask apply_chat_template for token ids (tokenize=True).")
    require(not hasattr(ids, "keys"), "apply_chat_template returned a BatchEncoding: take its ['input_ids'].")
    ids = list(ids)
    require(ids and all(isinstance(t, int) for t in ids), "pass a list of token ids (integers).")
    tok = offline.load_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    require(ids != tok(text)["input_ids"], "that is the template's text tokenized again: it starts with two <s> "
            f"({tok.bos_token_id}, {tok.bos_token_id}). Let apply_chat_template tokenize (tokenize=True).")
    require(ids != offline.chat_token_ids(tok, messages, add_generation_prompt=False),
            "the prompt stops after the last message: add_generation_prompt=True appends 'Assistant:', the cue "
            "for the model to answer.")
    require(ids == offline.chat_token_ids(tok, messages), "apply the tokenizer's own chat template to these "
            "messages (tokenize=True, add_generation_prompt=True); do not write the template by hand.")
    right(f"{len(ids)} tokens, one <s>, ending in 'Assistant:': the prompt the server's chat endpoint builds.")


def offline_sampling(online: dict, offline_kwargs: dict) -> None:
    """07: keyword arguments for ``vllm.SamplingParams`` carrying an online request's sampling parameters."""
    import dataclasses

    from llmlab import sampling

    require(isinstance(offline_kwargs, dict), "build a dict of keyword arguments for vllm.SamplingParams.")
    require("extra_body" not in offline_kwargs, "offline there is no HTTP body: what travels in extra_body online "
            "(top_k, repetition_penalty, ...) is a plain field of vllm.SamplingParams.")
    flat = {k: v for k, v in online.items() if k not in ("model", "prompt", "messages", "extra_body", "stream")}
    flat.update(online.get("extra_body") or {})
    for name, value in flat.items():
        require(name in offline_kwargs, f"{name} is missing: the online request sets it to {value!r}.")
        require(offline_kwargs[name] == value, f"{name} is {offline_kwargs[name]!r} offline but {value!r} online.")
    known = {f.name for f in dataclasses.fields(sampling.SamplingParams)}
    unknown = sorted(set(offline_kwargs) - known)
    require(not unknown, f"{', '.join(unknown)}: not a sampling parameter of vllm.SamplingParams.")
    right(f"the same {len(flat)} values: {', '.join(sorted(flat))}; only where they travel differs.")


def offline_batch(outputs, seconds, tokens_per_s) -> None:
    """07: 32 prompts of 32 tokens each in one ``llm.generate`` call, tokens/s by hand, the engine shut down."""
    from llmlab import offline

    require(isinstance(outputs, list) and all(hasattr(o, "outputs") for o in outputs),
            "pass the list that llm.generate(...) returned: one RequestOutput per prompt.")
    require(len(outputs) == 32, f"{len(outputs)} outputs: send all 32 prompts in one llm.generate call, so vLLM "
            "schedules them together.")
    counts = {len(o.outputs[0].token_ids) for o in outputs}
    require(counts == {32}, f"completions of {sorted(counts)} tokens: max_tokens=32 and ignore_eos=True make each "
            "one exactly 32, the same work for every prompt.")
    require(isinstance(seconds, int | float) and seconds > 0, "seconds: time the llm.generate call "
            "(time.perf_counter() before and after).")
    require(isinstance(tokens_per_s, int | float) and not isinstance(tokens_per_s, bool) and tokens_per_s > 0,
            "tokens_per_s should be a positive number.")
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = total / seconds
    require(abs(tokens_per_s - 32 / seconds) > 1e-9 * expected,
            "that counts one prompt's tokens: the batch's throughput adds up the tokens of all 32 outputs.")
    require(abs(tokens_per_s - expected) <= 1e-6 * expected,
            "divide the output tokens of all outputs (len(o.outputs[0].token_ids), summed) by the seconds.")
    alive = offline.engine_processes()
    require(not alive, f"vLLM's worker process(es) {alive} still run: shut the engine down with "
            "offline.shutdown(llm); until then it holds its memory.")
    right(f"{total:,} tokens in {seconds:.2f} s = {tokens_per_s:,.0f} tokens/s, and the engine's memory is back.")
