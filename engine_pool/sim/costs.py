"""The step cost model: how long one forward step of the simulated engine takes. Pure.

    duration = step_overhead
             + sum over prefill chunks of  n * (a + b * mean context the chunk attends to)
             + sum over decoding sequences of  (decode_s_per_seq + kv * min(context, cap))

- A prefill chunk of ``n`` tokens starting at context ``c`` attends on average to ``c + n/2``
  tokens, so a whole prefill of ``N`` tokens costs about ``a*N + b*N^2/2``: quadratic, which is
  why a 359k-token prompt holds the prefill seat for minutes while a 3k prompt takes 0.2 s.
- Decode reads at most ``decode_kv_read_cap_tokens`` KV entries per sequence (sparse attention),
  so an isolated request decodes at nearly the same rate at 3k and at 512k context; the cost
  still grows with the batch size and with the total (capped) context of the batch.
- Every decoding sequence shares the step with whatever prefill chunk runs in it: one token per
  step each, however long the step is. A 6-second chunk step is a 6-second token for everyone.
  That is the collapse shapegate exists to prevent.

All times are simulated seconds.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine_pool.sim.profile import CostParams


def prefill_chunk_cost(params: CostParams, start_context: int, tokens: int) -> float:
    """Cost of prefilling ``tokens`` prompt tokens on top of ``start_context`` already cached."""
    if tokens <= 0:
        return 0.0
    mean_context = start_context + tokens / 2
    return tokens * (
        params.prefill_s_per_token + params.prefill_s_per_token_per_context_token * mean_context
    )


def decode_cost(params: CostParams, contexts: Iterable[int]) -> float:
    """Cost of one decode token for each sequence whose current context length is given."""
    cap = params.decode_kv_read_cap_tokens
    total = 0.0
    for context in contexts:
        total += params.decode_s_per_seq + params.decode_s_per_kv_token * min(context, cap)
    return total


def step_cost(
    params: CostParams,
    chunks: Iterable[tuple[int, int]],
    decode_contexts: Iterable[int],
) -> float:
    """Duration of one step: ``chunks`` are (start_context, tokens) prefill pieces."""
    prefill = sum(prefill_chunk_cost(params, start, n) for start, n in chunks)
    return params.step_overhead_s + prefill + decode_cost(params, decode_contexts)


def isolated_prefill_seconds(params: CostParams, prompt_tokens: int, chunk_tokens: int) -> float:
    """Time an engine with nothing else to do spends prefilling one prompt (step by step)."""
    done = 0
    total = 0.0
    while done < prompt_tokens:
        n = min(chunk_tokens, prompt_tokens - done)
        total += params.step_overhead_s + prefill_chunk_cost(params, done, n)
        done += n
    return total
