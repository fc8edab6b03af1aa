"""Error types. Every message names the problem: which field, tensor or limit, and what was expected."""


class WmtpError(ValueError):
    """Base class: bad input or configuration that the caller can fix."""


class ConfigError(WmtpError):
    """An unsupported or inconsistent config.json / preset / engine setting."""


class CheckpointError(WmtpError):
    """A checkpoint that cannot be loaded: missing tensor, wrong shape, unreadable file."""
