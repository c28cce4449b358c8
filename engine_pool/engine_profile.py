"""A cluster's engine profile: how its vLLM or SGLang engines are launched.

Part of the gateway's settings tree (``clusters[].engine``, gateway/settings.py imports these
models) but defined here, next to the renderer (launch.py) and the flag tables
(engine_flags.py) that give its fields their meaning: ``engine_pool`` never imports ``gateway``.
Frozen and ``extra="forbid"``, as every part of the settings tree.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpeculativeSettings(_Frozen):
    """Speculative decoding on one engine: it pays at low concurrency (the heavy lane) and costs
    throughput at high concurrency, where the batch already keeps the GPU busy."""

    enabled: bool = False
    # Engine-neutral: mtp (the model's own multi-token-prediction layers), eagle and eagle3 (a
    # draft head named in draft_model), ngram (prompt lookup; vLLM only).
    method: Literal["mtp", "eagle", "eagle3", "ngram"] = "mtp"
    num_speculative_tokens: int = Field(2, ge=1, le=16)
    draft_model: str | None = Field(None, min_length=1)
    prompt_lookup_min: int | None = Field(None, ge=1)
    prompt_lookup_max: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _method_fields(self) -> SpeculativeSettings:
        if self.method in ("eagle", "eagle3") and self.draft_model is None:
            raise ValueError(f"speculative method {self.method!r} needs 'draft_model'")
        if self.method in ("mtp", "ngram") and self.draft_model is not None:
            raise ValueError(f"speculative method {self.method!r} takes no 'draft_model'")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram" and (low, high) != (None, None):
            raise ValueError("prompt_lookup_min/max apply to the 'ngram' method only")
        if low is not None and high is not None and low > high:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self


class EngineProfileSettings(_Frozen):
    """How a cluster's engines are launched (``shapegate launch-command``); the engine kind is
    the cluster's ``kind``. Checked against the pinned version's flags (``profile_problems`` in
    engine_pool/launch.py, which gateway/settings.py calls for every cluster's ``engine``)."""

    # The exact engine release; its flags must be in engine_pool/engine_flags.py KNOWN_FLAGS.
    version: str = Field(pattern=r"^[0-9]+\.[0-9]+\.[0-9]+(\.post[0-9]+)?$")
    # The weights: a Hugging Face id or a path inside the engine's container.
    model: str = Field(min_length=1)
    # Names the engine answers to; empty means the gateway's name and aliases for the model.
    served_model_names: tuple[str, ...] = ()
    host: str = "0.0.0.0"  # noqa: S104 - an engine in a container listens on its pod address
    port: int = Field(8000, ge=1, le=65535)
    max_model_len: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    # vLLM V1 refuses anything but 1; kept so a config asking for more fails here, not on a GPU.
    max_num_partial_prefills: int = Field(1, ge=1)
    # Above ~0.9 nothing is left for activation spikes and the CUDA graphs: OOM under load.
    gpu_memory_utilization: float = Field(0.85, ge=0.1, le=0.95)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    # None leaves the engine's default.
    prefix_caching: bool | None = None
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = "auto"
    trust_remote_code: bool = False
    speculative: SpeculativeSettings = SpeculativeSettings()
    # More engine flags: name without "--" -> value (true for a bare flag); known flags only.
    extra_args: dict[str, str | int | float | bool] = Field(default_factory=dict)
