"""Errors kiln raises for things a user can fix. Each message is a sentence that says what
was wrong, what is allowed and, where there is one, the command that fixes it."""

from __future__ import annotations

from collections.abc import Mapping


class KilnError(Exception):
    """Base class of every error kiln raises on purpose."""


class ConfigError(KilnError, ValueError):
    """A configuration value or request parameter is out of range or inconsistent."""


class CheckpointError(KilnError):
    """A checkpoint cannot be read (missing, unsafe format, incomplete, inconsistent).
    An unsupported architecture is a ``ConfigError``: the config names it."""


class EngineLoadError(KilnError):
    """An engine directory does not match this machine or is damaged."""


class EngineDeadError(KilnError):
    """The engine failed and could not recover; a new ``LLM`` is needed."""


def bad_value(field: str, value: object, allowed: str) -> ConfigError:
    """The one shape of every out-of-range message: field, value, what is allowed."""
    return ConfigError(f"{field}={value!r} is invalid: {allowed}.")


def env_int(env: Mapping[str, str], name: str, default: int, allowed: range) -> int:
    """An integer setting from the environment (``KILN_PDL``, ``KILN_WQ_MMA_ROWS``): the
    default where unset, else a value in ``allowed``, else a ``ConfigError`` naming it."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value not in allowed:
        raise bad_value(
            name, raw, f"it must be an integer from {allowed.start} to {allowed.stop - 1}"
        )
    return value


def env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """An on / off switch from the environment (``KILN_WQ_F16``, ``KILN_SIDE_COPIES``): 0 or
    1, the default where unset, anything else a ``ConfigError`` naming it (``env_int``)."""
    return env_int(env, name, int(default), range(2)) == 1
