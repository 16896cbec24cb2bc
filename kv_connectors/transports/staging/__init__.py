"""CPU staging of KV transfers through a bounded host pool: re-exports of the package's public names."""

from kv_connectors.transports.staging.chunks import Chunks, chunk_plan
from kv_connectors.transports.staging.copier import Copier, CudaCopier, HostCopier, Pair
from kv_connectors.transports.staging.messages import MSG_MAGIC
from kv_connectors.transports.staging.transport import StagedTransport
from kv_connectors.transports.staging.xfer import StagedXfer

_MSG_MAGIC = MSG_MAGIC  # the name tests and older code use

__all__ = ["Chunks", "Copier", "CudaCopier", "HostCopier", "MSG_MAGIC", "Pair", "StagedTransport", "StagedXfer", "chunk_plan"]
