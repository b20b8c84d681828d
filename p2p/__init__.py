"""How peers talk: identity, the libp2p host, RPC, signed DHT records, NAT traversal.

This package imports nothing else of swarmtrain's; everything above builds on the names here.
"""

from p2p.dht import Dht, DhtConfig, DhtStatistics, dht_key
from p2p.errors import (
    IdentityError,
    LocalProtocolError,
    P2PError,
    PeerUnreachable,
    RemoteError,
    RemoteProtocolError,
)
from p2p.host import Host, HostConfig, open_host
from p2p.identity import default_identity_path, load_or_create_identity, peer_id_of
from p2p.records import (
    RecordRejected,
    RecordSigner,
    SignedRecord,
    merge_records,
    peer_id_from_public_key,
    subkey_values,
    validate_record,
)
from p2p.rpc import (
    RpcStream,
    RpcTimeout,
    call_stream,
    call_unary,
    serve_stream,
    serve_unary,
)
from p2p.wire import Message, decode, encode, message

__all__ = [
    "Dht",
    "DhtConfig",
    "DhtStatistics",
    "Host",
    "HostConfig",
    "IdentityError",
    "LocalProtocolError",
    "Message",
    "P2PError",
    "PeerUnreachable",
    "RecordRejected",
    "RecordSigner",
    "RemoteError",
    "RemoteProtocolError",
    "RpcStream",
    "RpcTimeout",
    "SignedRecord",
    "call_stream",
    "call_unary",
    "decode",
    "default_identity_path",
    "dht_key",
    "encode",
    "load_or_create_identity",
    "merge_records",
    "message",
    "open_host",
    "peer_id_from_public_key",
    "peer_id_of",
    "serve_stream",
    "serve_unary",
    "subkey_values",
    "validate_record",
]
