"""The kvps exception hierarchy: every error a user can see derives from KVPSError.

Errors that describe a bad argument also derive from the builtin a Python user
would catch (ValueError, KeyError, TimeoutError), so ``except ValueError`` works.
"""


class KVPSError(Exception):
    """Base class of every kvps error."""


class ConfigError(KVPSError, ValueError):
    """A KVPS_* / DMLC_* variable or a command-line option has a bad value."""


class ProtocolError(KVPSError):
    """A message could not be decoded, or broke the wire protocol."""


class VersionMismatch(ProtocolError):
    """A peer speaks another version of the kvps protocol."""


class KVTimeoutError(KVPSError, TimeoutError):
    """A blocking call passed its deadline; the message names what it waited for."""


class NodeFailure(KVPSError):
    """A peer (scheduler, server or worker) died or left; the message names it."""


class RemoteError(KVPSError):
    """A peer answered a request with an error."""


class KVValueError(RemoteError, ValueError):
    """A peer refused a value: wrong shape, dtype or size."""


class KVKeyError(RemoteError, KeyError):
    """A peer does not know the key (never initialised) or already has it."""

    def __str__(self):  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class KernelUnavailable(KVPSError):
    """A compute-kernel backend was asked for but cannot be used here."""


class PerformanceWarning(UserWarning):
    """A script calls kvps in a way that works but is much slower than another that does the same
    (the warning says which); kvps says it once per kvstore."""


# Error kinds as they travel in ERROR replies (protocol.Op.ERROR meta["kind"]).
REMOTE_KINDS = {
    "value": KVValueError,
    "key": KVKeyError,
    "protocol": ProtocolError,
    "node": NodeFailure,
    "error": RemoteError,
}


def remote_error(kind, message):
    """The exception for an ERROR reply of the given kind."""
    return REMOTE_KINDS.get(kind, RemoteError)(message)


def error_kind(exc):
    """The wire kind of a local exception (the inverse of remote_error)."""
    if isinstance(exc, KeyError):
        return "key"
    if isinstance(exc, (ValueError, TypeError)):
        return "value"
    if isinstance(exc, ProtocolError):
        return "protocol"
    if isinstance(exc, NodeFailure):
        return "node"
    return "error"


def describe(exc):
    """The message of an exception without KeyError's quoting."""
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc)
