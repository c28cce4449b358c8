"""A policy checked as ``serve`` would check it at boot, with errors that point into the file.

Contract:
- ``load_policy(path)`` / ``parse_policy(text, source)`` read the YAML keeping each key's line,
  merge the ``SHAPEGATE_*`` overrides, validate the settings tree, then run ``policy_problems``.
  They return a ``CheckedPolicy`` (the frozen ``Settings`` and where each key sits) or raise one
  ``ConfigError`` listing every problem, one line each: ``FILE:LINE: KEY: what is wrong``. An
  unknown key names the closest known one ("did you mean ..."). A key set from the environment is
  named by its variable instead of a line.
- ``boot_problems(settings, environ)`` is pure: the rules between keys
  (``settings.policy_problems``: lane ranges from 0 with no gap or overlap,
  ``per_endpoint <= lane``, emergency clusters able to serve the lane's models, names that
  resolve), then every environment variable the policy names
  (``auth.api_keys_env``, ``clusters[].api_key_env``) set and non-empty, and the ``[otel]``
  extra installed when ``tracing.enabled``.
- ``CheckedPolicy.load_counter()`` loads and warms the tokenizers and chat templates (what boot
  does); a failure is a ``ConfigError`` at the model's ``tokenizer`` line.
- ``serve``, ``check-config``, ``POST /admin/reload`` and SIGHUP all go through these, so a policy
  check-config accepts is one serve and reload accept, and the reverse.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ValidationError

from gateway.observe.tracing import missing_extra
from gateway.settings import (
    ENV_PREFIX,
    ConfigError,
    Key,
    Problem,
    Settings,
    _env_overrides,
    _merge,
    policy_problems,
)

if TYPE_CHECKING:
    from gateway.count.tokens import TokenCounter
    from gateway.observe.metrics import Metrics


@dataclass(frozen=True, slots=True)
class Marks:
    """Where each key of a policy came from: a line of ``source``, or an environment variable."""

    source: str
    lines: Mapping[Key, int] = field(default_factory=dict)
    env: Mapping[Key, str] = field(default_factory=dict)

    def where(self, key: Key) -> str:
        for end in range(len(key), -1, -1):
            prefix = key[:end]
            if prefix in self.env:
                return f"{self.source}: environment {self.env[prefix]}"
            if prefix in self.lines:
                return f"{self.source}:{self.lines[prefix]}"
        return self.source

    def error(self, problems: Iterable[Problem]) -> ConfigError:
        lines = [
            f"{self.where(p.key)}: {_dotted(p.key) or '(top level)'}: {p.message}" for p in problems
        ]
        noun = "problem" if len(lines) == 1 else "problems"
        return ConfigError(f"invalid policy ({len(lines)} {noun}):\n  " + "\n  ".join(lines))


@dataclass(frozen=True, slots=True)
class CheckedPolicy:
    settings: Settings
    marks: Marks

    def load_counter(self, metrics: Metrics | None = None) -> TokenCounter:
        """The tokenizers and templates, loaded and warmed as at boot."""
        from gateway.count.tokens import TokenCounter  # the tokenizer libraries: only when asked

        try:
            return TokenCounter.from_settings(self.settings, metrics)
        except ConfigError as exc:
            raise self.located(exc) from exc

    def located(self, exc: ConfigError) -> ConfigError:
        """A boot error (tokenizer, template) pointed at its key's line."""
        return self.marks.error([Problem(exc.key, str(exc))])


def _dotted(key: Key) -> str:
    return ".".join(str(part) for part in key)


def _line_marks(node: yaml.Node, key: Key, out: dict[Key, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value in node.value:
            child = (*key, key_node.value)
            out[child] = key_node.start_mark.line + 1
            _line_marks(value, child, out)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = (*key, index)
            out[child] = item.start_mark.line + 1
            _line_marks(item, child, out)


def _env_marks(tree: Mapping[str, Any], key: Key, out: dict[Key, str]) -> None:
    for name, value in tree.items():
        child = (*key, name)
        if isinstance(value, Mapping):
            _env_marks(value, child, out)
        else:
            out[child] = ENV_PREFIX + "__".join(str(p).upper() for p in child)


def _model_at(key: Key) -> type[BaseModel] | None:
    """The settings model a key path leads to (``lanes.0.slots`` -> SlotSettings)."""
    model: type[BaseModel] | None = Settings
    annotation: Any = Settings
    for part in key:
        if isinstance(part, int):
            args = typing.get_args(annotation)
            annotation = args[0] if args else annotation
        else:
            if model is None or part not in model.model_fields:
                return None
            annotation = model.model_fields[part].annotation
        model = _a_model(annotation)
    return model


def _a_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, tuple):
        for arg in typing.get_args(annotation):
            found = _a_model(arg)
            if found is not None:
                return found
    return None


def _suggestion(error: Mapping[str, Any]) -> str | None:
    """The known key closest to an unknown one, if any is close."""
    *parent, unknown = error["loc"]
    model = _model_at(tuple(parent))
    known = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(str(unknown), known, n=1, cutoff=0.6)
    return close[0] if close else None


def _message(error: Mapping[str, Any]) -> str:
    if error["type"] != "extra_forbidden":
        return str(error["msg"]).removeprefix("Value error, ")
    suggestion = _suggestion(error)
    if suggestion:
        return f"unknown key (did you mean {suggestion!r}?)"
    model = _model_at(tuple(error["loc"][:-1]))
    return "unknown key" + (f"; known keys: {', '.join(model.model_fields)}" if model else "")


def _problems(exc: ValidationError) -> list[Problem]:
    """One problem per key, and one per mistake:
    - a union reports once per member it tried (``str``, ``int``...): keep one;
    - a misspelt required key also reports the key as missing: the "did you mean" says it;
    - a tuple with a bad item also reports itself too short (the bad item dropped)."""
    errors = exc.errors()
    misspelt = {
        (*error["loc"][:-1], suggestion)
        for error in errors
        if error["type"] == "extra_forbidden" and (suggestion := _suggestion(error))
    }
    seen: dict[Key, Problem] = {}
    too_short: set[Key] = set()
    for error in errors:
        key: Key = tuple(error["loc"])
        while key and _is_tag(key):
            key = key[:-1]
        if error["type"] == "missing" and key in misspelt:
            continue
        seen.setdefault(key, Problem(key, _message(error)))
        if error["type"] == "too_short":
            too_short.add(key)
    return [
        problem
        for key, problem in seen.items()
        if key not in too_short or not any(k[: len(key)] == key and k != key for k in seen)
    ]


def _is_tag(key: Key) -> bool:
    """pydantic appends the union member it tried: ``str``, ``int``, ``function-after[...]``."""
    last = key[-1]
    if not isinstance(last, str) or _model_at(key) is not None:
        return False
    return last in {"str", "int", "float", "bool", "none"} or "[" in last


def boot_problems(settings: Settings, environ: Mapping[str, str] | None) -> list[Problem]:
    """The rules between keys, then what the environment must hold (unless ``environ`` is None,
    for tools that never contact an engine); pure."""
    environment = _environment(settings, environ) if environ is not None else ()
    return [*policy_problems(settings), *environment]


def _environment(settings: Settings, environ: Mapping[str, str]) -> Iterable[Problem]:
    if settings.auth.api_keys_env and not environ.get(settings.auth.api_keys_env):
        yield Problem(
            ("auth", "api_keys_env"),
            f"environment variable {settings.auth.api_keys_env} is not set (or empty)",
        )
    for index, cluster in enumerate(settings.clusters):
        if cluster.api_key_env and not environ.get(cluster.api_key_env):
            yield Problem(
                ("clusters", index, "api_key_env"),
                f"environment variable {cluster.api_key_env} is not set (or empty)",
            )
    sentinel = settings.state.sentinel
    for key in ("password_env", "sentinel_password_env"):
        name = getattr(sentinel, key) if sentinel is not None else None
        if name and not environ.get(name):
            yield Problem(
                ("state", "sentinel", key), f"environment variable {name} is not set (or empty)"
            )
    missing = missing_extra(settings.tracing) if settings.tracing.enabled else None
    if missing is not None:
        yield Problem(("tracing", "enabled"), missing)


def parse_policy(
    text: str,
    source: str,
    environ: Mapping[str, str] | None = None,
    *,
    secrets_from_environ: bool = True,
) -> CheckedPolicy:
    """Validate a policy's YAML text; ``source`` names it in every message.
    ``secrets_from_environ=False`` leaves out the check that the variables the policy names for
    keys are set (what ``load_settings`` does, for tools that never contact an engine)."""
    environ = os.environ if environ is None else environ
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must hold a mapping at the top level")
    lines: dict[Key, int] = {}
    if node is not None:
        _line_marks(node, (), lines)
    overrides = _env_overrides(environ)
    env: dict[Key, str] = {}
    _env_marks(overrides, (), env)
    marks = Marks(source, lines, env)
    try:
        settings = Settings.model_validate(_merge(data, overrides), context={"rules": "caller"})
    except ValidationError as exc:
        raise marks.error(_problems(exc)) from exc
    problems = boot_problems(settings, environ if secrets_from_environ else None)
    if problems:
        raise marks.error(problems)
    return CheckedPolicy(settings, marks)


def load_policy(
    path: str | Path,
    environ: Mapping[str, str] | None = None,
    *,
    secrets_from_environ: bool = True,
) -> CheckedPolicy:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    return parse_policy(text, str(path), environ, secrets_from_environ=secrets_from_environ)


def load_settings(path: str | Path, environ: Mapping[str, str] | None = None) -> Settings:
    """Read, merge and validate a YAML config file; raise ConfigError (each problem at its
    FILE:LINE) on any problem. The environment variables a policy names for secrets are not
    required here; ``load_policy``, which serve uses, requires them too."""
    return load_policy(path, environ, secrets_from_environ=False).settings
