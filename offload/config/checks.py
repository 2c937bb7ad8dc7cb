"""How a config value and a config section are checked, and the errors they raise.

A message is always "<key> <problem>; <fix>" (docs/config.md, Errors): `rule_error` and
`type_error` write the problem, `did_you_mean` and `valid_keys_fix` the hints of an unknown
key or value. `coerce` checks one value against a field's annotation, normalising only what
JSON and YAML force on us; `Section` is the base of every config dataclass, which runs
`coerce` on each field and then the section's own range checks. The sections themselves are
in sections.py, the DeepSpeed translation in deepspeed*.py; this module knows neither.
"""

from __future__ import annotations

import difflib
import math
import os
import sys
import types
import typing
from dataclasses import MISSING, Field, fields
from typing import Any, ClassVar, Iterable, Literal, Mapping, Optional, Self, Union

__all__ = [
    "ConfigError",
    "ConfigTypeError",
    "DeepSpeedConfigWarning",
    "rule_error",
    "type_error",
    "did_you_mean",
    "valid_keys_fix",
    "coerce",
    "positive_int",
    "require",
    "at_most",
    "MAX_INT",
    "join_key",
    "Section",
]


class ConfigError(ValueError):
    """A configuration value or combination offload cannot run with.

    `key` is the dotted path of the offending key (`offload.nvme_path`,
    `zero_optimization.offload_param.device`); the message is
    "<key> <problem>; <fix>".
    """

    def __init__(self, key: str, problem: str, fix: str) -> None:
        self.key = key
        self.problem = problem
        self.fix = fix
        super().__init__(f"{key} {problem}; {fix}")

    def __reduce__(self):  # picklable across processes (torchrun workers, spawn)
        return type(self), (self.key, self.problem, self.fix)

    def retarget(self, key: str) -> "ConfigError":
        """The same error reported under another key (a DeepSpeed key mapped onto ours)."""
        return type(self)(key, self.problem, self.fix)


class ConfigTypeError(ConfigError, TypeError):
    """A configuration value of the wrong type (also a `TypeError`)."""


# Libraries that call offload on their user's behalf (the Trainer creating its optimizer
# inside `trainer.train()`): a warning about the user's config names the user's line that
# led here, not a line of theirs.
_ON_BEHALF = frozenset({"offload", "transformers", "accelerate", "peft", "trl", "lightning", "pytorch_lightning",
                        "torch", "deepspeed"})


def caller_stacklevel() -> int:
    """warnings.warn's stacklevel that points at the user's call (to initialize, load_config,
    `trainer.train()`): the first frame outside this package and outside the libraries that
    call it for the user (`_ON_BEHALF`), however deep inside we are."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # offload/
    frame: Optional[types.FrameType] = sys._getframe(1)
    level = 1
    while frame is not None and (
        os.path.abspath(frame.f_code.co_filename).startswith(package)
        or str(frame.f_globals.get("__name__", "")).split(".")[0] in _ON_BEHALF
    ):
        frame, level = frame.f_back, level + 1
    return level


class DeepSpeedConfigWarning(UserWarning):
    """A DeepSpeed config had keys offload accepts but does not honour (listed by name)."""


def rule_error(key: str, value: Any, rule: str, fix: str) -> ConfigError:
    """"<key> = <value>, but <rule>; <fix>", to raise."""
    return ConfigError(key, f"= {value!r}, but {rule}", fix)


def type_error(key: str, value: Any, expected: str, fix: Optional[str] = None) -> ConfigTypeError:
    """"<key> = <value> (<type>), but it must be <expected>; <fix>", to raise."""
    return ConfigTypeError(key, f"= {value!r} ({type(value).__name__}), but it must be {expected}",
                           fix or f"set {key} to {expected}")


_SYNONYMS = {"gpu": "device", "cuda": "device", "learning_rate": "lr", "beta": "betas",
             "epsilon": "eps", "wd": "weight_decay", "host": "cpu", "disk": "nvme", "ssd": "nvme",
             # dtypes by torch's names (a `torch.` prefix is dropped first), and the mixes of
             # them users type (bfloat32: bfloat16 and fp32)
             "float32": "fp32", "float": "fp32", "single": "fp32", "f32": "fp32", "tf32": "fp32",
             "float16": "fp16", "half": "fp16", "f16": "fp16",
             "bfloat16": "bf16", "bfloat": "bf16", "bfloat32": "bf16", "brain_float16": "bf16"}
"""Words users reach for that spelling cannot lead to (a GPU tier is `device`, not `cpu`)."""


def did_you_mean(word: Any, choices: Iterable[str], what: str = "") -> str:
    """" (did you mean 'x'?)" for the closest choice, or "" when nothing is close."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    if isinstance(word, str) and word.lower() in lowered:
        return f" (did you mean {lowered[word.lower()]!r}{what}?)"
    plain = word.lower().removeprefix("torch.") if isinstance(word, str) else None
    if plain is not None and _SYNONYMS.get(plain) in choices:
        return f" (did you mean {_SYNONYMS[plain]!r}{what}?)"
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}{what}?)" if close else ""


def valid_keys_fix(where: str, names: list[str]) -> str:
    """The fix for an unknown key: the valid keys, or where to find them if they are many."""
    if len(names) > 15:
        return f"docs/config.md lists the {len(names)} valid keys {where}"
    return f"valid keys {where} are: {', '.join(names)}"


def join_key(prefix: str, key: str) -> str:
    """A dotted key path: `join_key("offload", "nvme_path")` -> "offload.nvme_path"."""
    return f"{prefix}.{key}" if prefix else key


def _section_in(hint: Any) -> Optional[type[Section]]:
    """The config section (a `Section` dataclass) a field annotation names (through
    Optional), if any."""
    if isinstance(hint, type) and issubclass(hint, Section):
        return hint
    if typing.get_origin(hint) is Union:
        for arg in typing.get_args(hint):
            if isinstance(arg, type) and issubclass(arg, Section):
                return arg
    return None


def _size(key: str, text: str) -> int:
    from offload.sizes import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise ConfigError(key, f"= {text!r}: {exc}", f"set {key} to a byte count or a size such as '1GiB'") from None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


MAX_INT = 2**53
"""The largest integer any config key takes (a count, or a byte count: 8 PiB): every integer
is checked against it at the door, so none reaches a native binding (C++ int, size_t) or a
timer it overflows. Keys with a tighter natural ceiling (threads, queue depths, block
sizes, timeouts) check their own in their section's `_check` (`at_most`)."""


def at_most(key: str, value: Any, ceiling: float, why: str, fix: str) -> None:
    """Raise `rule_error` when `value` exceeds `ceiling` (`why`: what the ceiling is)."""
    if value is not None and value > ceiling:
        raise rule_error(key, value, f"it must be <= {ceiling:g} ({why})", fix)


def coerce(key: str, value: Any, hint: Any) -> Any:
    """`value` checked against the annotation `hint`, lightly normalised.

    Normalisations are the ones JSON and YAML force on us: a list for a tuple, an integral
    float (`5e8`) for an int, an int for a float, a path-like for a str. Anything else of
    the wrong type is a `ConfigTypeError` naming the key. A nested section (a `Section`
    dataclass) is read from a mapping by its own class, so errors name its keys.
    """
    origin = typing.get_origin(hint)
    if isinstance(value, str) and value == "auto" and (hint in (bool, int, float) or origin is tuple):
        raise ConfigError(key, "= 'auto', which offload does not resolve",
                          "'auto' is filled in by the Hugging Face Trainer integration before "
                          "DeepSpeed reads the config; replace it with a concrete value")
    if hint is Any:
        return value
    if origin is Union:
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        assert len(members) == 1, f"unsupported annotation {hint!r}"
        return coerce(key, value, members[0])
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            choices = ", ".join(repr(a) for a in allowed)
            raise ConfigError(key, f"= {value!r}, which is not one of {choices}"
                              f"{did_you_mean(value, [str(a) for a in allowed])}",
                              f"set {key} to one of {choices}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise type_error(key, value, "true or false")
        return value
    if hint is int:
        if isinstance(value, bool):
            raise type_error(key, value, "an integer")
        if isinstance(value, str) and key.endswith("_bytes"):
            value = _size(key, value)  # "1GiB", "512MB", "1.2e9": as on the command line
        given = value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise type_error(key, value, "an integer")
        if abs(value) > MAX_INT:
            raise rule_error(key, given, f"it must be at most 2**53 in size ({MAX_INT:,}; as bytes, 8 PiB)",
                             f"set {key} to a count or a byte count a machine can hold")
        return value
    if hint is float:
        if isinstance(value, str) and _is_number(value):
            # YAML 1.1 reads 3e-4 (no dot before the e) as text: say so, and how to write it
            raise ConfigTypeError(key, f"= {value!r} (str), but it must be a number: YAML reads a number "
                                  "like 3e-4 without a dot as text", f"write it as {float(value)!r} "
                                  "(a dot before the e, e.g. 3.0e-4)")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise type_error(key, value, "a number")
        value = float(value)
        if not math.isfinite(value):
            raise rule_error(key, value, "it must be a finite number", f"set {key} to a finite number")
        return value
    if hint is str:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise type_error(key, value, "a string")
        return value
    if origin is tuple:
        args = typing.get_args(hint)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise type_error(key, value, "a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
        if len(value) != len(args):
            raise rule_error(key, value, f"it must have exactly {len(args)} entries",
                             f"give {key} as a list of {len(args)} values")
        return tuple(coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise type_error(key, value, "a mapping (a JSON object)")
        return dict(value)
    sub = _section_in(hint)
    if sub is not None:
        if isinstance(value, sub):
            return value
        if isinstance(value, Mapping):
            return sub._from_mapping(value, key)
        raise type_error(key, value, f"a mapping or an offload.{sub.__name__}")
    raise AssertionError(f"unsupported annotation {hint!r} for {key}")  # pragma: no cover


def positive_int(key: str, value: Any, fix: str) -> int:
    """`value` as an integer >= 1 (a count, a size in elements)."""
    value = coerce(key, value, int)
    if value < 1:
        raise rule_error(key, value, "it must be >= 1", fix)
    return value


def require(ok: bool, key: str, value: Any, rule: str, fix: str) -> None:
    """Raise `rule_error(key, value, rule, fix)` unless `ok`."""
    if not ok:
        raise rule_error(key, value, rule, fix)


_HINTS: dict[type, dict[str, Any]] = {}
"""Each section class's resolved annotations, computed once."""


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


class Section:
    """Shared behaviour of the config dataclasses (which are frozen and kw_only).

    `_SECTION` is the section's dotted place in offload's format, so errors name the full
    key. `__post_init__` type-checks every field against its annotation, then runs the
    section's own `_check` (ranges, combinations).
    """

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]
    """Set on each subclass by @dataclass (declared here so `fields(self)` type-checks)."""
    _SECTION: ClassVar[str] = ""
    _NOT_LOADED: ClassVar[frozenset[str]] = frozenset()
    """Fields that are provenance, not settings: not read by from_dict, not written by to_dict."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in fields(self):
            value = coerce(self._key(f.name), getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
        self._check()

    def _check(self) -> None:
        """Ranges and combinations; raise ConfigError naming the key."""

    @classmethod
    def _key(cls, name: str) -> str:
        return join_key(cls._SECTION, name)

    @classmethod
    def _from_mapping(cls, data: Any, prefix: str) -> Self:
        if not isinstance(data, Mapping):
            raise type_error(prefix or "config", data, "a mapping (a JSON object / YAML mapping)")
        names = [f.name for f in fields(cls) if f.init and f.name not in cls._NOT_LOADED]
        for key in data:
            if key not in names:
                raise cls._unknown_key(prefix, key, names)
        for f in fields(cls):
            if f.init and f.name not in data and f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(join_key(prefix, f.name), "is required and missing",
                                  f"set {join_key(prefix, f.name)} (docs/config.md lists each key)")
        return cls(**dict(data))

    @classmethod
    def _unknown_key(cls, prefix: str, key: Any, names: list[str]) -> ConfigError:
        where = f"under {prefix!r}" if prefix else "at the top level"
        hint = did_you_mean(key, names)
        if not prefix and not hint:
            hint = cls._top_level_hint(key)
        return ConfigError(join_key(prefix, str(key)), f"is not a known key {where}{hint}",
                           valid_keys_fix(where, names))

    @classmethod
    def _top_level_hint(cls, key: Any) -> str:
        """A hint for an unknown top-level key that is not close to any of ours ("" = none);
        `Config` suggests DeepSpeed's keys here."""
        return ""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-ready values (tuples as lists), nested by section."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in self._NOT_LOADED:
                continue
            out[f.name] = _plain(getattr(self, f.name))
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, Section):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value
