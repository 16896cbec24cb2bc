"""The one error hierarchy of kv-connectors; engines' errors are mapped onto it at the boundary.

KVConnectorError
├── ConfigError (ValueError)              a key or value at start-up, or a model we do not serve
├── TransferParamsError (ValueError)      a request's kv_transfer_params
├── HandshakeError                        the side channel: unreachable, timed out, a bad answer
│   ├── NoAnswerError                     no answer (it may still have reached the peer)
│   ├── IncompatiblePeerError             another compatibility hash or wire version
│   ├── UnauthenticatedPeerError          no valid MAC where a secret is configured
│   └── PeerProtocolError                 an answer of the wrong kind, or fields that contradict
├── SideChannelBindError                  our side-channel port cannot be bound
├── StaleReadError                        a read whose blocks may hold another prompt's KV now
└── TransportError                        what the transport engine reported
    ├── TransportUnavailableError (ImportError)
    ├── PeerDisconnectedError
    └── TransferTimeoutError              a transfer past its deadline (a frozen peer)
"""

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


class PeerProtocolError(HandshakeError):
    """A peer's side-channel answer is of the wrong kind, or its fields contradict each other."""


class StaleReadError(KVConnectorError):
    """A read not proved to hold the prompt's KV: the producer's hold on the blocks may have ended
    (lease gone, hold passed, producer restarted), so they may hold another prompt's KV now."""


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
