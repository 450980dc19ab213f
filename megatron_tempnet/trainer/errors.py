"""The error of flags that cannot work together (every config module raises it)."""

from __future__ import annotations

from megatron_tempnet.utils.cli import UserError


class ConfigError(UserError, ValueError):
    """Flags that cannot work together; the message names them, their values and the fix."""
