"""A store read from another host, through a running proxy: ``open_store("http://HOST:PORT",
token=T)``.

The proxy serves its store on read routes of its control API (docs/contract.md); `RemoteSource`
reads them with the standard library's HTTP client, and the wire form (`_wire`) is shared with
the server, which encodes with it. It lives among the sinks, not in ``read/``, because it is a
store kind like the others (the registry opens it by URL, so ``open_store``, ``inspect`` and
``export`` take a proxy's address as they take a file), and because the server, which may not
import ``read/``, encodes what it decodes.
"""

from ._replicas import ReplicaStatus
from ._source import RemoteSource, StoreAccessDenied
from ._wire import (
    CONTENT_TYPE,
    WIRE_VERSION,
    RecordDecoder,
    RecordEncoder,
    WireError,
    end_frame,
    error_frame,
    iter_frames,
    keys_frame,
)

__all__ = [
    "CONTENT_TYPE",
    "WIRE_VERSION",
    "RecordDecoder",
    "RecordEncoder",
    "RemoteSource",
    "ReplicaStatus",
    "StoreAccessDenied",
    "WireError",
    "end_frame",
    "error_frame",
    "iter_frames",
    "keys_frame",
]
