"""The models one server serves, by name: from ``--model [NAME=]SOURCE`` flags or a TOML file.

``infer serve --model SOURCE`` serves one model, as it always has: named by
``--served-model-name``, else by the model itself. Several ``--model`` flags, a ``NAME=``, or
a models file (``--models-file``) serve several; the first listed (or the file's
``default``) answers requests that name no model. A file gives each model its settings::

    default = "chat"

    [models.chat]
    source = "qwen2.5-coder-1.5b"      # what --model takes
    aliases = ["gpt-4o-mini"]
    kv_cache_gb = 1.0                   # any engine setting: max_seq_len, weights, draft_model...
    keep_alive = "30m"                  # how long it stays loaded once idle (-1: for ever)

    [models.complete]
    source = "qwen2.5-coder-0.5b"
    pinned = true                       # loaded at start, never unloaded

    [models.embed]
    source = "all-minilm-l6-v2"
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer.engine.config import EngineConfig

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
_MODEL_KEYS = ("source", "aliases", "pinned", "keep_alive")
_ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "model")
_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


@dataclass(frozen=True)
class ModelSpec:
    """One served model: its names, how to load it, and how long it stays loaded.

    Args:
        name: The name requests use and responses carry; ``None`` for the one model of a
            plain ``--model SOURCE`` (then ``--served-model-name``, else its own name).
        engine: Its engine settings, its source in ``engine.model``.
        aliases: Other names it answers to.
        pinned: Loaded at start and never unloaded.
        keep_alive_s: Seconds it stays loaded once idle (``inf``: for ever; ``None``: the
            server's ``--keep-alive``).
    """

    name: str | None
    engine: EngineConfig
    aliases: tuple[str, ...] = ()
    pinned: bool = False
    keep_alive_s: float | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """Every name it was given, its own first."""
        return (self.name, *self.aliases) if self.name else self.aliases

    @property
    def source(self) -> str:
        return self.engine.model


def parse_keep_alive(value: str | float) -> float:
    """Seconds from Ollama's ``keep_alive``: a number of seconds, or a duration (``"5m"``,
    ``"1h30m"``, ``"500ms"``); a negative one means for ever (``inf``).

    Raises:
        ValueError: It is neither.
    """
    if isinstance(value, bool):
        raise ValueError(f"keep_alive: not a duration: {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            body = text.lstrip("+-")
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"keep_alive: not a duration: {value!r}") from None
            sign = -1.0 if text.startswith("-") else 1.0
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    if math.isnan(seconds):
        raise ValueError(f"keep_alive: not a duration: {value!r}")
    return math.inf if seconds < 0 else seconds


def model_specs(
    entries: Sequence[str],
    models_file: str | None,
    engine: EngineConfig,
    served_names: Sequence[str] = (),
) -> list[ModelSpec]:
    """The served models, the default first.

    Args:
        entries: ``--model`` flags: ``NAME=SOURCE`` or ``SOURCE``.
        models_file: A TOML file of models (see the module).
        engine: The engine settings every model starts from (its ``model`` is the source
            when no model is listed).
        served_names: ``--served-model-name``: the default model's names.

    Raises:
        ValueError: A malformed entry or file, or a name given twice.
    """
    if not models_file and len(entries) <= 1 and "=" not in "".join(entries):
        source = entries[0] if entries else engine.model
        return [ModelSpec(None, dataclasses.replace(engine, model=source), tuple(served_names))]
    specs = [_entry(e, engine) for e in entries]
    default = None
    if models_file:
        default, listed = read_models_file(models_file, engine)
        specs += listed
    if not specs:
        raise ValueError(f"{models_file}: lists no models")
    if default is not None:
        specs.sort(key=lambda s: s.name != default)
        if specs[0].name != default:
            raise ValueError(f"{models_file}: default {default!r} is not one of its models")
    if served_names:
        first = specs[0]
        specs[0] = dataclasses.replace(first, aliases=(*first.aliases, *served_names))
    _check_unique(specs)
    return specs


def read_models_file(path: str, engine: EngineConfig) -> tuple[str | None, list[ModelSpec]]:
    """The ``default`` name and the models of a TOML models file.

    Raises:
        ValueError: It cannot be read, or a model's table is malformed (the message names
            the file and the model).
    """
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"cannot read the models file {path}: {e}") from None
    unknown = set(data) - {"default", "models"}
    models = data.get("models", {})
    if unknown or not isinstance(models, dict):
        raise ValueError(f"{path}: takes `default` and [models.NAME] tables, not {unknown}")
    default = data.get("default")
    specs = []
    for name, table in models.items():
        try:
            specs.append(_table(name, table, engine))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: [models.{name}]: {e}") from None
    return (str(default) if default is not None else None), specs


def _entry(entry: str, engine: EngineConfig) -> ModelSpec:
    """A ``--model`` flag: ``NAME=SOURCE`` or ``SOURCE`` (then named by its last part)."""
    name, sep, source = entry.partition("=")
    if not sep or not NAME.fullmatch(name):
        source, name = entry, Path(entry).name if "/" in entry else entry
    if not source or not NAME.fullmatch(name):
        raise ValueError(f"--model {entry!r}: expected NAME=SOURCE, NAME of [A-Za-z0-9._:-]")
    return ModelSpec(name, dataclasses.replace(engine, model=source))


def _table(name: str, table: Any, engine: EngineConfig) -> ModelSpec:
    if not NAME.fullmatch(name):
        raise ValueError("a model's name is made of [A-Za-z0-9._:-]")
    if not isinstance(table, dict) or not isinstance(table.get("source"), str):
        raise ValueError("needs source = '...' (what --model takes)")
    unknown = set(table) - {*_MODEL_KEYS, *_ENGINE_KEYS}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}")
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ValueError("aliases must be a list of names")
    pinned = table.get("pinned", False)
    if not isinstance(pinned, bool):
        raise ValueError("pinned must be true or false")
    settings = {k: v for k, v in table.items() if k in _ENGINE_KEYS}
    _check_types(settings)
    keep_alive = table.get("keep_alive")
    return ModelSpec(
        name,
        dataclasses.replace(engine, model=table["source"], **settings),
        tuple(aliases),
        pinned,
        parse_keep_alive(keep_alive) if keep_alive is not None else None,
    )


def _check_types(settings: Mapping[str, Any]) -> None:
    """Each engine setting has its field's type (TOML has no null: no ``None``)."""
    hints = typing.get_type_hints(EngineConfig)
    for key, value in settings.items():
        wanted = {t for t in typing.get_args(hints[key]) or (hints[key],) if t is not type(None)}
        if float in wanted:
            wanted.add(int)
        if type(value) not in wanted:
            names = " or ".join(sorted(t.__name__ for t in wanted))
            raise ValueError(f"{key} must be {names}, got {value!r}")


def _check_unique(specs: Sequence[ModelSpec]) -> None:
    seen: set[str] = set()
    for spec in specs:
        for name in spec.names:
            if name in seen:
                raise ValueError(f"model name {name!r} is given twice")
            seen.add(name)
