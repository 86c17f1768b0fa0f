"""Pazuzu's error types (not re-exported from ``pazuzu``)."""


class PazuzuError(RuntimeError):
    """Base class: a remote operation failed (an ``ok: false`` reply, a failed sbatch)."""


class ConnectionUnavailable(PazuzuError):
    """No usable SSH master."""


class CommandTimedOut(PazuzuError):
    """The remote command ran past its timeout."""


class UncertainExecution(PazuzuError):
    """The transport failed after the command may have started."""


class ProtocolError(PazuzuError):
    """A malformed local request or response, or the gateway is unavailable."""
