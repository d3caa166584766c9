"""Reading a settings class from the environment, with errors that never echo a value."""

from __future__ import annotations

from typing import TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

__all__ = ["SettingsError", "load_settings"]

_S = TypeVar("_S", bound=BaseSettings)


class SettingsError(Exception):
    """Settings from the environment are missing or invalid; the message names the variables."""


def load_settings(cls: type[_S]) -> _S:
    """Read ``cls`` from the environment, with errors that never echo a value.

    pydantic's own message repeats the offending input — for ``SDCGUARD_WEBHOOK_SECRET`` that is
    the secret itself — so the error is rebuilt from locations and messages only, and the
    original is deliberately not chained (its traceback would print the input again).
    """
    try:
        return cls()
    except ValidationError as err:
        prefix = str(cls.model_config.get("env_prefix", ""))
        problems = "; ".join(
            f"{prefix}{'_'.join(str(part) for part in problem['loc']).upper()}: {problem['msg']}"
            for problem in err.errors(include_input=False, include_url=False)
        )
        raise SettingsError(f"invalid {cls.__name__}: {problems}") from None
