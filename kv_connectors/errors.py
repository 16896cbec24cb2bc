"""The one error hierarchy of kv-connectors; engines' errors are mapped onto it at the boundary."""

from __future__ import annotations


class KVConnectorError(Exception):
    """Base class of every error this package raises."""


class ConfigError(KVConnectorError, ValueError):
    """A configuration key or value is wrong; the message names the key and the valid values."""


class TransferParamsError(KVConnectorError, ValueError):
    """A request's kv_transfer_params are malformed (missing field, wrong type, bad value)."""


class HandshakeError(KVConnectorError):
    """The side-channel handshake with a peer failed (unreachable, timed out, bad answer)."""


class NoAnswerError(HandshakeError):
    """A side-channel request got no answer (timed out, connection failed): it may still have
    reached the peer and be acted on there."""


class IncompatiblePeerError(HandshakeError):
    """The peer's compatibility hash or wire version differs from ours."""


class UnauthenticatedPeerError(HandshakeError):
    """A side-channel message without a valid MAC where a shared secret is configured (or the reverse)."""


class SideChannelBindError(KVConnectorError):
    """The side-channel port could not be bound (typically: already in use)."""


class TransportError(KVConnectorError):
    """The transport engine reported an error (NIXL exception / state, Mooncake return code)."""


class TransportUnavailableError(TransportError, ImportError):
    """A transport engine is not installed; the message names the pip extra to install."""


class PeerDisconnectedError(TransportError):
    """The remote peer went away during a transfer."""


class TransferTimeoutError(TransportError):
    """A transfer did not finish before its deadline (e.g. a frozen peer)."""
