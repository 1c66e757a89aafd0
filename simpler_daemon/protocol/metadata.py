"""The gRPC metadata keys of the daemon's API, read and written by both ends.

The fast path carries the same values in its frames (``fastwire.py``), so a client
sees the same ``field`` and the daemon the same label on either transport.
"""

from __future__ import annotations

from typing import Final

__all__ = ["CLIENT_ID_METADATA", "FIELD_METADATA", "RETRY_AFTER_METADATA"]

#: Trailing metadata key carrying the request field a daemon refusal names.
FIELD_METADATA: Final = "x-simpler-field"
#: Trailing metadata key of a RESOURCE_EXHAUSTED refusal worth retrying (a run limit
#: reached for now): milliseconds the daemon suggests waiting. The details text ends with
#: the same hint (``retry after 500 ms``), which is what the fast path carries.
RETRY_AFTER_METADATA: Final = "retry-after-ms"
#: Request metadata key of the client's display label (never an identity: who a
#: client is comes from the socket or the TLS session, see ``server/peers.py``).
CLIENT_ID_METADATA: Final = "x-simpler-client"
