"""Engine profiles: what one simulated vLLM engine is (its model, its scheduler limits, its costs).

Contract:
- ``load_profile(name_or_path)`` reads a YAML file path, or the shipped profile
  ``configs/engines/<name>.yaml`` (package data beside this module; from any directory), and
  returns a frozen, validated ``EngineProfile``; it raises ``ProfileError`` naming the key at
  fault. Unknown keys are errors, as in the gateway's settings.
- ``max_num_partial_prefills`` other than 1 is refused, as the vLLM V1 releases that had the flag
  refused it at start-up (``NotImplementedError: Concurrent Partial Prefill is not supported``);
  0.32 and 0.33 have no such flag. ``scheduler.long_prefill_token_threshold`` is their
  ``--long-prefill-token-threshold`` (scheduler.py says what it does).
- The KV capacity must hold at least one ``max_model_len`` sequence (vLLM refuses to start
  otherwise), so no admissible request can wait forever.
- ``tasks`` are what the model serves, as vLLM derives them from the model (``generate`` for a
  causal LM; ``embed``, ``score``, ``transcription`` for pooling or speech models). vLLM only
  registers the routes of the tasks its model supports: any other route answers FastAPI's
  404 ``{"detail": "Not Found"}``. The default is a generate-only model, like the shipped ones.
- ``enable_force_include_usage`` is vLLM's ``--enable-force-include-usage`` (default off): every
  stream carries usage on every chunk, whatever the request's ``stream_options``.
- ``tokenizer.chat_template`` defaults to ``hf``: vLLM renders the model's own chat template.

Example::

    profile = load_profile("h100-shared")
    profile.scheduler.max_num_seqs  # 16
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# The shipped profiles: package data beside this module, so a wheel finds them from any directory
# (the repository's configs/engines/ is a link to this folder).
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
_DOCUMENTED = "configs/engines/"


class ProfileError(Exception):
    """The profile file is missing or invalid; the message says where and why."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SchedulerLimits(_Frozen):
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    max_num_partial_prefills: int = 1
    # vLLM's --long-prefill-token-threshold: while other requests are running or waiting, a
    # prompt computes at most this many tokens a step (0, vLLM's default: no cap).
    long_prefill_token_threshold: int = Field(0, ge=0)
    # Tokens of KV cache the engine can hold across all sequences.
    kv_capacity_tokens: int = Field(ge=1)

    @model_validator(mode="after")
    def _vllm_start_up_checks(self) -> SchedulerLimits:
        if self.max_num_partial_prefills != 1:
            raise ValueError(
                "max_num_partial_prefills must be 1: vLLM V1 raises "
                "NotImplementedError: Concurrent Partial Prefill is not supported"
            )
        # vLLM refuses this too: every running sequence needs a token of budget per step.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        return self


class CostParams(_Frozen):
    """The step cost model (see ``costs.py``); every time is in simulated seconds."""

    # Fixed cost of one forward step: kernel launches plus reading the weights once.
    step_overhead_s: float = Field(ge=0)
    # Prefill: each chunk token costs a + b * (context it attends to).
    prefill_s_per_token: float = Field(ge=0)
    prefill_s_per_token_per_context_token: float = Field(ge=0)
    # Decode: each running sequence costs a fixed amount plus its KV read.
    decode_s_per_seq: float = Field(ge=0)
    decode_s_per_kv_token: float = Field(ge=0)
    # Sparse attention reads at most this many KV entries per sequence and step.
    decode_kv_read_cap_tokens: int = Field(ge=1)


# What a model serves (vLLM's supported tasks, reduced to the route families they open).
Task = Literal["generate", "embed", "score", "transcription"]
ALL_TASKS: tuple[Task, ...] = ("generate", "embed", "score", "transcription")


class OutputSettings(_Frozen):
    # Tokens a chat request generates when it sets no max_tokens (the sim's stand-in for EOS).
    default_tokens: int = Field(37, ge=1)
    # vLLM's CompletionRequest.max_tokens default.
    completions_default_tokens: int = Field(16, ge=1)


class EngineProfile(_Frozen):
    name: str = Field(min_length=1)
    description: str = ""
    # The served model name; aliases are extra served names (vLLM's --served-model-name a b).
    model: str = Field(min_length=1)
    aliases: tuple[str, ...] = ()
    # A model's ``tokenizer`` as the gateway's config spells it (gateway/settings.py,
    # TokenizerSettings); the ``PromptCounter`` handed to the sim loads and validates it.
    tokenizer: dict[str, Any] = Field(
        default_factory=lambda: {"source": "builtin", "name": "qwen3.6", "chat_template": "hf"}
    )
    max_model_len: int = Field(ge=1)
    scheduler: SchedulerLimits
    costs: CostParams
    output: OutputSettings = OutputSettings()
    tasks: tuple[Task, ...] = Field(("generate",), min_length=1)
    enable_force_include_usage: bool = False

    @model_validator(mode="after")
    def _kv_holds_one_sequence(self) -> EngineProfile:
        if self.scheduler.kv_capacity_tokens < self.max_model_len:
            raise ValueError(
                f"kv_capacity_tokens ({self.scheduler.kv_capacity_tokens}) cannot hold one "
                f"max_model_len ({self.max_model_len}) sequence"
            )
        threshold = self.scheduler.long_prefill_token_threshold
        if threshold > self.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({threshold}) cannot be greater than the "
                f"max_model_len ({self.max_model_len})"
            )
        return self

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.model, *self.aliases)


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def parse_profile(data: Any, source: str = "<profile>") -> EngineProfile:
    """Validate a profile mapping (as read from YAML)."""
    if not isinstance(data, dict):
        raise ProfileError(f"profile {source} must hold a mapping at the top level")
    try:
        return EngineProfile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(f"invalid engine profile {source}:\n{_describe(exc)}") from exc


def profile_path(name_or_path: str | Path) -> Path:
    """An existing file, else a shipped profile by name (``h100-shared``), else the path given."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    return shipped_profile(str(name_or_path)) or path


def shipped_profile(ref: str) -> Path | None:
    """The shipped profile called ``ref`` (``h100-fast``, ``h100-fast.yaml`` or
    ``configs/engines/h100-fast.yaml``), if there is one."""
    name = ref.removeprefix("./").removeprefix(_DOCUMENTED).removesuffix(".yaml")
    if not name or "/" in name:
        return None
    candidate = PROFILES_DIR / f"{name}.yaml"
    return candidate if candidate.is_file() else None


def load_profile(name_or_path: str | Path) -> EngineProfile:
    path = profile_path(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"cannot read engine profile {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"engine profile {path} is not valid YAML: {exc}") from exc
    return parse_profile(data, str(path))


def available_profiles() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")))
