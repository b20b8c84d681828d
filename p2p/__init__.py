"""How peers talk: identity, the libp2p host, RPC, signed DHT records, NAT traversal.

This package imports nothing else of swarmtrain's; everything above builds on the names here.
"""

from libp2p.abc import INetStream as Stream
from libp2p.peer.id import ID as PeerID

from p2p.addresses import join_address_problem, listen_address_problem, peer_id_problem
from p2p.blocking import NodeThread, poll
from p2p.bulk.channel import BulkChannel, accept_channel, open_channel
from p2p.bulk.control import PROTOCOL as BULK_PROTOCOL
from p2p.bulk.listener import BulkListener
from p2p.bulk.negotiate import DataMode
from p2p.bulk.payload import (
    BulkReceived,
    receive_array,
    receive_bulk,
    receive_tensor,
    send_array,
    send_bulk,
    send_tensor,
)
from p2p.bulk.transfer import BulkConfig, BulkTransferFailed
from p2p.dht.kademlia import Dht, DhtConfig, DhtStatistics, dht_key
from p2p.dht.records import (
    RecordRejected,
    RecordSigner,
    SignedRecord,
    merge_records,
    peer_id_from_public_key,
    subkey_values,
    validate_record,
    verify_peer_signature,
)
from p2p.errors import (
    AddressInUse,
    IdentityError,
    LocalProtocolError,
    P2PError,
    PeerUnreachable,
    RemoteError,
    RemoteProtocolError,
    StreamEnded,
)
from p2p.host import ConnectionKind, Host, HostConfig, connection_kind, is_direct_kind, open_host
from p2p.identity import (
    MAX_WORK_BITS,
    create_identity,
    default_identity_path,
    identity_work,
    load_or_create_identity,
    peer_id_of,
)
from p2p.nat.reachability import Reachability, ReachabilityVerdict
from p2p.nat.traversal import (
    NatConfig,
    NatService,
    RelayServiceLimits,
    stream_kind,
    upnp_status,
)
from p2p.node import Node, NodeConfig, PingResult, join_addr, open_node
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
    "BULK_PROTOCOL",
    "MAX_WORK_BITS",
    "AddressInUse",
    "BulkChannel",
    "BulkConfig",
    "BulkListener",
    "BulkReceived",
    "BulkTransferFailed",
    "ConnectionKind",
    "DataMode",
    "Dht",
    "DhtConfig",
    "DhtStatistics",
    "Host",
    "HostConfig",
    "IdentityError",
    "LocalProtocolError",
    "Message",
    "NatConfig",
    "NatService",
    "Node",
    "NodeConfig",
    "NodeThread",
    "P2PError",
    "PeerID",
    "PeerUnreachable",
    "PingResult",
    "Reachability",
    "ReachabilityVerdict",
    "RecordRejected",
    "RecordSigner",
    "RelayServiceLimits",
    "RemoteError",
    "RemoteProtocolError",
    "RpcStream",
    "RpcTimeout",
    "SignedRecord",
    "Stream",
    "StreamEnded",
    "accept_channel",
    "call_stream",
    "call_unary",
    "connection_kind",
    "create_identity",
    "decode",
    "default_identity_path",
    "dht_key",
    "encode",
    "identity_work",
    "is_direct_kind",
    "join_addr",
    "join_address_problem",
    "listen_address_problem",
    "load_or_create_identity",
    "merge_records",
    "message",
    "open_channel",
    "open_host",
    "open_node",
    "peer_id_from_public_key",
    "peer_id_of",
    "peer_id_problem",
    "poll",
    "receive_array",
    "receive_bulk",
    "receive_tensor",
    "send_array",
    "send_bulk",
    "send_tensor",
    "serve_stream",
    "serve_unary",
    "stream_kind",
    "subkey_values",
    "upnp_status",
    "validate_record",
    "verify_peer_signature",
]
