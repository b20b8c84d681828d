"""``PeerRuntime``: a p2p node and its trio loop in a background thread, for torch code.

``p2p.NodeThread`` holds the thread, the loop and ``call``/``poll``; ``swarm.BlockingAverager``
uses it for the averager alone. A volunteer needs more on the same loop: fetch the run spec
before it knows the run id (the averager's config needs it), serve its state to joiners, download
state, and read and write progress records. So the runtime adds the DHT conveniences those need,
each in a blocking form for the torch thread and an async one (``read_async``) for probes that
``poll`` awaits in the loop. Services are started in the loop's nursery (``start``); ``close``
cancels it: shutdown is cancellation.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from p2p import NodeConfig, NodeThread, PeerID, subkey_values


class PeerRuntime(NodeThread):
    """``with PeerRuntime(node_config) as runtime: runtime.call(async_fn, *args)``.

    Raises whatever ``open_node`` raised (P2PError when the node cannot join) from the
    constructor, or TimeoutError when it does not start within ``start_timeout_s``."""

    def __init__(self, node_config: NodeConfig, *, start_timeout_s: float = 60.0) -> None:
        super().__init__(node_config, name="swarmtrain-p2p", start_timeout_s=start_timeout_s)
        # A permissioned run's members (``swarmtrain.admission``): reads keep only their
        # entries; None: everyone's.
        self.admits: Callable[[str], bool] | None = None

    @property
    def peer_id(self) -> PeerID:
        assert self.node is not None
        return self.node.host.peer_id

    # -- DHT conveniences ----------------------------------------------------------------------

    def store(
        self, key: str, value: bytes, ttl_s: float, *, version: int = 0, tag: bytes = b""
    ) -> int:
        """Store ``value`` as our signed subkey of ``key`` (``tag``: one of several subkeys of
        ours, ``peer_id/tag``); returns how many peers hold it."""
        assert self.node is not None
        dht = self.node.dht

        async def store() -> int:
            return await dht.store(key, value, time.time() + ttl_s, version=version, tag=tag)

        return self.call(store)

    def read(self, key: str) -> dict[str, bytes]:
        """``{owner peer id: value}`` of the unexpired signed entries of ``key`` (every replica
        asked, so a store that is still spreading is seen); one per owner (its last subkey)."""
        return dict(self.read_all(key))

    def read_all(self, key: str) -> list[tuple[str, bytes]]:
        """``(owner peer id, value)`` of every unexpired signed entry of ``key``: all of an
        owner's tagged subkeys, where ``read`` keeps one per owner."""
        return self.call(self.read_all_async, key)

    async def read_async(self, key: str) -> dict[str, bytes]:
        """``read`` for code already in the loop (a ``poll`` probe)."""
        return dict(await self.read_all_async(key))

    async def read_all_async(self, key: str) -> list[tuple[str, bytes]]:
        """``read_all`` for code already in the loop."""
        assert self.node is not None
        records = await self.node.dht.get_records(key, latest=True)
        values = subkey_values(records, now=time.time())
        found = [(str(PeerID(records[s].owner)), v) for s, v in sorted(values.items())]
        admits = self.admits
        return found if admits is None else [(o, v) for o, v in found if admits(o)]
