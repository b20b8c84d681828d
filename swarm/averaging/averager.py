"""Averaging tensors with the other peers of a run: the public API over matchmaking + all-reduce.

``Averager`` (trio) and ``BlockingAverager`` (a trio loop in a thread, for torch code) take one
flat float32 vector (``average_vector``, the round's own form: DiLoCo's pseudo-gradient goes to
the wire and back without a split or a concatenation) or a list of tensors (``average``, a thin
face over it that flattens and unflattens), and a weight, and return the weighted mean over the
peers of this round's group, with the set of peers whose contributions it holds. One call is one
round:

1. Matchmaking (``swarm.averaging.matchmaking_driver``): declare for round r in the DHT; the group
forms as soon as every expected peer declared (the previous round's survivors plus whoever had
declared when the round opened), else at the matchmaking deadline. The first round has no history,
so it waits for the deadline unless the caller names the expected peers.
2. All-reduce (``swarm.averaging.session``): butterfly over the group, bit-identical on every
   survivor, by the round's deadline; a group larger than ``AveragerConfig.row_size`` runs the
   hierarchical all-reduce instead (``swarm.averaging.grid_session``: the same bytes, each peer
   talking to its row and the rows above and below it; matchmaking then forms one group).

A failed or cancelled round raises; the next call starts a new round at once. Sessions outlive
the call that started them until every peer is done (they may still owe a forward).

State parity (issue 3, point 6): ``publish_state_hash(r, digest)`` stores the digest as our
subkey under ``run/<id>/state/<r>``; ``state_agreement(r)`` reads them back and says whether we
agree with the majority.

Auditable aggregation (issue 5, point 9; ``AveragerConfig.audit``): every slice travels signed by
its sender (a slice whose signature does not verify drops the sender); a lossless round's result
also lists what this peer reduced (``swarm.averaging.audit.PartAudit``: each input's hash,
weight and signature, the output's hash), and the peer keeps its contribution of the last rounds
to serve its slices (``/swarmtrain/slice/1``, to ``config.auditor`` only) to a referee
rechecking a part.

Committed contributions (issue 19, ``slice_root``; ``swarm.averaging.commitment``): a sender that
committed the leaf digests of its contribution before the round has every slice checked against
them by the reducer that receives it, so a slice other than the committed one never enters any
survivor's mean: its sender is dropped in the round.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import trio

from p2p import (
    BulkConfig,
    Message,
    Node,
    NodeConfig,
    NodeThread,
    PeerID,
    RemoteProtocolError,
    RpcStream,
    Stream,
    message,
    serve_stream,
)
from swarm.averaging.aggregation import AGGREGATIONS
from swarm.averaging.allreduce import all_finite
from swarm.averaging.audit import PartAudit, SliceDispute, audits_of
from swarm.averaging.bandwidth import BandwidthEstimate
from swarm.averaging.buffers import BufferPool
from swarm.averaging.channel_pool import ChannelPool, PoolStatistics
from swarm.averaging.codec import Compression
from swarm.averaging.commitment import contribution_leaves
from swarm.averaging.grid import uses_grid
from swarm.averaging.grid_session import GridSession
from swarm.averaging.matchmaking import (
    Declaration,
    Group,
    MatchmakingConfig,
    RoundSchedule,
    clock_shard,
    shard_of,
    state_key,
)
from swarm.averaging.matchmaking_driver import MatchmakingFailed, form_group, read_declarations
from swarm.averaging.payload import Layout
from swarm.averaging.session import Session, SessionConfig
from swarm.averaging.session_wire import PROTOCOL, Hello, hello_refusal
from swarm.averaging.sparse_codec import SparseCodec
from swarm.errors import AveragingFailed

log = logging.getLogger(__name__)

STATE_HASH_TTL_S = 3600.0
HELLO_TIMEOUT_S = 10.0
MAX_NUMEL = 1 << 30
SLICE_PROTOCOL = "/swarmtrain/slice/1"
KEEP_CONTRIBUTIONS = 2  # rounds whose contribution an auditing peer keeps


@message(120, max_bytes=256)
class SliceRequest(Message):
    """A referee asks a contributor for ``[start, stop)`` of what it sent in a round."""

    round: int
    group_id: bytes
    start: int
    stop: int


class AveragingFaults(Protocol):
    """Fault injection for tests and demos of the aggregation audit, handed to the ``Averager``
    once (``swarmtrain.faults.Faults`` is one): the config carries no test flags."""

    def tamper_reduced(self, round_number: int) -> Callable[[int, np.ndarray], np.ndarray] | None:
        """What every part we reduce in this round goes through (part index, reduced values ->
        values sent and claimed), or None for an honest round."""
        ...


@dataclass(frozen=True)
class AveragerConfig:
    """``compression``: one codec for every tensor (a ``SparseCodec`` too), or None to choose
    per tensor (int8 above 64K elements, none below). ``bandwidth_bps`` sizes our share of the
    reduction; None (the default) declares what our uploads achieved in earlier rounds
    (``swarm.averaging.bandwidth``).
    ``peer_timeout_s``: a peer that leaves a ping unanswered this long (with nothing in flight
    between us) is lost. 10 s, because 8 peers sharing 2 saturated cores answered pings in over
    2 s and lost whole rounds to false alarms at 2-3 s; a frozen peer costs that much time."""

    run_id: str
    max_group_size: int = 64
    matchmaking_timeout_s: float = 5.0
    allreduce_timeout_s: float = 60.0
    peer_timeout_s: float = 10.0
    heartbeat_s: float = 0.5
    compression: Compression | SparseCodec | None = Compression.NONE
    bandwidth_bps: float | None = None
    bulk: BulkConfig = field(default_factory=BulkConfig)
    # Report what we reduced and serve our slices to ``auditor`` (a peer id) for a referee's
    # recheck; needs lossless averaging (``compression`` NONE).
    audit: bool = False
    auditor: bytes | None = None
    # Pace each pair's data channel at its share of ``bandwidth_bps`` (only when that is set:
    # pacing below a link's real rate would waste it; ``session_links.PACING_SHARE``).
    pace: bool = True
    # Bytes of round buffers kept for the next round (``swarm.averaging.buffers``): reuse saves
    # the kernel's page zeroing, but a kept buffer is resident between rounds; a node training a
    # large model keeps less (``swarmtrain.training.loop.averager_config``).
    buffer_pool_bytes: int = 1 << 30
    # The weights a contribution may declare, (low, high): a peer declaring another is dropped
    # from the round by every reducer; ours outside is the caller's error (ValueError).
    weight_bounds: tuple[float, float] = (0.0, math.inf)
    # A permissioned run's members, by peer id bytes: others' declarations and state hashes
    # are ignored, so they never join a group (and no all-reduce stream of theirs is taken).
    admit: Callable[[bytes], bool] | None = None
    # How each part's reducer combines the slices (``swarm.averaging.aggregation``): "mean", or
    # a Byzantine-robust "centered_clip" / "trimmed_mean". Every peer of a run must use one rule.
    aggregation: str = "mean"
    # Scheduled rounds over sharded round keys (``MatchmakingConfig.schedule`` and ``.shards``,
    # ``matchmaking.shard_count``): every peer of a run must use the same two.
    schedule: RoundSchedule | None = None
    matchmaking_shards: int = 1
    # The hierarchical all-reduce (``swarm.averaging.grid``, ``hierarchical``): a round of
    # more members than this runs on a grid of rows of at most ``row_size`` peers (``O(row)``
    # streams per peer instead of ``O(n)``), and matchmaking forms one group of every declarer
    # (``MatchmakingConfig.one_group``): one round, one average. Only for a weighted mean under
    # a dense codec (``hierarchical`` says why: no sparse codec, robust aggregation or audit);
    # otherwise, or None, the flat butterfly over groups of at most ``max_group_size``. Every
    # peer of a run must use the same (Hellos carry it: ``hello_refusal``).
    row_size: int | None = 32

    def __post_init__(self) -> None:
        if not self.run_id or "/" in self.run_id:
            raise ValueError(f"run_id must be non-empty without '/': {self.run_id!r}")
        for name in ("matchmaking_timeout_s", "allreduce_timeout_s", "peer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.audit and self.compression is not Compression.NONE:
            raise ValueError("audit needs compression=Compression.NONE (a lossless sum)")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}: {self.aggregation!r}")
        if self.matchmaking_shards > 1 and self.schedule is None:
            raise ValueError("matchmaking_shards > 1 needs a schedule (RoundSchedule)")
        if self.row_size is not None and self.row_size < 2:
            raise ValueError(f"row_size must be >= 2 or None: {self.row_size}")
        if self.audit and self.aggregation != "mean":
            raise ValueError('audit needs aggregation="mean" (a referee recomputes the sum)')
        if isinstance(self.compression, SparseCodec) and self.aggregation != "mean":
            # Receivers recompute each part's mean from the slices (``payload.Layout.gathers``);
            # a robust rule's median of mostly-zero sparse coordinates would be zero anyway.
            raise ValueError(f'sparse compression needs aggregation="mean", not {self.aggregation}')


def hierarchical(config: AveragerConfig) -> bool:
    """Whether a run's rounds are one group of every declarer, laid out on a grid when larger
    than ``row_size``: the config's part of ``grid.uses_grid`` (a round's own part: no slice
    check, no tampering).

    Any dense codec (none, fp16, bf16, int8, or "auto" per tensor) runs on the grid: a head
    decodes its row's slices as a flat reducer does, and the reduced columns travel as the
    bytes encoded once where they were divided (``hierarchical``: "Codecs"). Three kinds of
    round stay flat, where the grid's float64 chain of partial sums cannot compute what they
    need: a sparse codec's reduced part is its contributors' slices, recombined by every
    receiver (a column would carry every member's slice, ``n`` times the bytes); a robust
    aggregation (median, trimmed mean) needs every slice of a part at one reducer, not a sum
    of row sums; and an audited round's referee recomputes one reducer's sum from the slices
    its senders signed, where on a grid each sum is split over a column's heads."""
    return (
        config.row_size is not None
        and not isinstance(config.compression, SparseCodec)
        and config.aggregation == "mean"
        and not config.audit
    )


@dataclass(frozen=True)
class AveragingResult:
    """One round's outcome on this peer. ``tensors`` match the inputs' types, shapes, dtypes
    (``average``; empty from ``average_vector``); ``vector`` is their flat float32 concatenation,
    the bytes every survivor holds. Float32 tensors are views of ``vector``, which the round may
    still serve to peers that lost a reducer until it closes: copy before changing them in place
    ahead of the next call."""

    tensors: list[Any]
    vector: np.ndarray
    contributors: dict[str, float]
    round: int
    group_id: str
    matchmaking_s: float
    allreduce_s: float
    bytes_sent: int
    bytes_received: int
    dropped: dict[str, str]
    upload_bps: float | None = None  # what our bulk sends achieved, None if too few to tell
    audits: tuple[PartAudit, ...] = ()  # with config.audit: the parts we reduced
    parts: tuple[tuple[int, int], ...] = ()  # every part's [start, stop) in the vector
    reducers: tuple[bytes, ...] = ()  # each part's reducer as the round ended here
    slice_hashes: tuple[bytes, ...] = ()  # with config.audit: our slice of each part, hashed
    # With config.audit: the slices our ``check_slice`` refused, with their senders' signatures.
    refused: tuple[SliceDispute, ...] = ()
    # Our contribution as the round's peers decoded it (a lossy codec's round trip of what we
    # gave): what error feedback subtracts. None when the codec was lossless (what we gave).
    sent: np.ndarray | None = None
    # The group as matchmaking formed it; more than ``contributors`` when members were lost, or
    # when peers with other expected sets formed other groups of the round (then the round ran
    # as sub-groups with different results: the caller's agreement check must hear from all).
    group_size: int = 0
    # Rows of the hierarchical layout the round ran on (``AveragerConfig.row_size``); 1: flat.
    rows: int = 1

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 (hex) of ``vector``: equal on every survivor of the round. Computed on first
        use, off the round's critical path (100 MB cost a third of a second here)."""
        return hashlib.sha256(memoryview(self.vector).cast("B")).hexdigest()


@dataclass(frozen=True)
class StateAgreement:
    """Digests peers published for a round: ``agrees`` is ours equal to the majority's.

    The round's key is run-wide: in an open run any identity can publish a digest there, so a
    decision that only a round's members may sway reads ``among(its contributors)``."""

    round: int
    ours: str | None
    majority: str | None
    peers: int
    agreeing: int
    digests: dict[bytes, str] = field(default_factory=dict, compare=False, repr=False)
    me: bytes = field(default=b"", compare=False, repr=False)

    @classmethod
    def of(cls, round_number: int, digests: dict[bytes, str], me: bytes) -> StateAgreement:
        """The agreement of ``digests`` (owner -> digest hex); ``me`` names ours."""
        counts = Counter(digests.values())
        majority = None
        if counts:
            # ties break on the digest itself, so every peer names the same majority
            majority = max(counts, key=lambda d: (counts[d], d))
        return cls(
            round_number,
            digests.get(me),
            majority,
            len(digests),
            counts[majority] if majority else 0,
            digests,
            me,
        )

    def among(self, peers: Iterable[bytes]) -> StateAgreement:
        """The agreement of only ``peers``' digests (a round's contributors)."""
        wanted = set(peers)
        return StateAgreement.of(
            self.round, {p: d for p, d in self.digests.items() if p in wanted}, self.me
        )

    @property
    def agrees(self) -> bool:
        return self.ours is not None and self.ours == self.majority


def _flatten(
    tensors: Sequence[Any], allocate: Callable[[int], np.ndarray] | None = None
) -> tuple[np.ndarray, list[tuple[tuple[int, ...], Any]]]:
    """Concatenate the tensors as float32 (into ``allocate(total)`` when given); remember each
    one's shape and type to undo it."""
    arrays, specs = [], []
    for tensor in tensors:
        if hasattr(tensor, "detach"):  # a torch tensor, without importing torch here
            import torch

            array = tensor.detach().to("cpu", torch.float32).numpy()
            specs.append((tuple(tensor.shape), tensor.dtype))
        else:
            array = np.asarray(tensor, dtype=np.float32)
            specs.append((array.shape, np.asarray(tensor).dtype))
        arrays.append(array.reshape(-1))
    total = sum(a.size for a in arrays)
    if total > MAX_NUMEL:
        raise ValueError(f"{total} elements is over the {MAX_NUMEL} limit")
    vector = np.empty(total, np.float32) if allocate is None else allocate(total)
    if arrays:
        np.concatenate(arrays, out=vector)
    if not all_finite(vector):
        raise ValueError("the tensors hold NaN or inf; refusing to send them")
    return vector, specs


def _given(vector: Any) -> np.ndarray | None:
    """A vector handed over (``average_vector(give=True)``) as the round's float32 array, its
    own memory; None when it is not a contiguous float32 CPU vector (then it is copied).
    ValueError when it holds NaN or inf, or is too long."""
    if hasattr(vector, "detach"):  # a torch tensor, without importing torch here
        if vector.device.type != "cpu":
            return None
        vector = vector.detach().numpy()
    if not isinstance(vector, np.ndarray) or vector.dtype != np.float32:
        return None
    if not vector.flags.c_contiguous:
        return None
    if len(vector) > MAX_NUMEL:
        raise ValueError(f"{len(vector)} elements is over the {MAX_NUMEL} limit")
    if not all_finite(vector):
        raise ValueError("the tensors hold NaN or inf; refusing to send them")
    return vector


def _unflatten(vector: np.ndarray, specs: list[tuple[tuple[int, ...], Any]]) -> list[Any]:
    out, offset = [], 0
    for shape, dtype in specs:
        size = int(np.prod(shape, dtype=np.int64))
        piece = vector[offset : offset + size].reshape(shape)
        offset += size
        # The vector is ours alone, so the outputs may be views of it (no copy for float32).
        if isinstance(dtype, np.dtype):
            out.append(piece.astype(dtype, copy=False))
        else:
            import torch

            out.append(torch.from_numpy(piece).to(dtype))
    return out


class Averager:
    """Averages with the peers of ``config.run_id``. Serve with ``await nursery.start(a.run)``."""

    def __init__(
        self, node: Node, config: AveragerConfig, *, faults: AveragingFaults | None = None
    ) -> None:
        self.node = node
        self.config = config
        self.faults = faults
        # A verified run's binding of slices to tasks (set by the volunteer once it exists):
        # (round, sender, start, values) -> why the slice is refused, or None.
        self.check_slice: Callable[[int, bytes, int, np.ndarray], str | None] | None = None
        # Committed contributions (issue 19): (round, sender) -> the root the sender committed
        # its contribution to before the round, or None. Set, every round's parts are cut on
        # the commitment's leaves, our Hellos carry our leaves, and every reducer refuses a
        # bound sender's slice that differs (every member of a group must set it alike).
        self.slice_root: Callable[[int, bytes], bytes | None] | None = None
        self.me = node.host.peer_id.to_bytes()
        self.next_round = 0
        self._bandwidth = BandwidthEstimate()
        self._matchmaking = MatchmakingConfig(
            max_group_size=config.max_group_size,
            run_seed=hashlib.sha256(b"swarmtrain/run/" + config.run_id.encode()).digest(),
            shards=config.matchmaking_shards,
            schedule=config.schedule,
            one_group=hierarchical(config),
        )
        self._sessions: dict[bytes, Session | GridSession] = {}
        # Each pair's data channel, kept between rounds (``swarm.averaging.channel_pool``).
        self._channels = ChannelPool()
        self._buffers = BufferPool(config.buffer_pool_bytes)
        self._ended: deque[bytes] = deque(maxlen=256)
        self._changed = trio.Event()
        self._survivors: frozenset[bytes] | None = None
        # A scheduled round's hint source: the last round's survivors, or the members of the
        # last group we formed when its all-reduce failed (most of them are still there, and
        # a hint of 0 would leave the round's quorum to the schedule's fixed guess).
        self._last_members: frozenset[bytes] = frozenset()
        self._nursery: trio.Nursery | None = None
        # (round, group id) -> the values we contributed (as the wire carried them), for audits
        self._contributed: dict[tuple[int, bytes], np.ndarray] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.node.host.set_handler(PROTOCOL, self._serve)
                if self.config.audit:
                    serve_stream(self.node.host, SLICE_PROTOCOL, SliceRequest, self._serve_slice)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._channels.close()

    async def average(
        self,
        tensors: Sequence[Any],
        weight: float = 1.0,
        *,
        round_number: int | None = None,
        expected_peers: Iterable[bytes] | None = None,
        exclude: Iterable[bytes] = (),
        admit: Callable[[bytes], bool] | None = None,
    ) -> AveragingResult:
        """Average ``tensors`` (torch tensors or numpy arrays) weighted by ``weight``: the list
        face of ``average_vector``, which flattens them in a worker thread (each tensor one
        segment) and gives ``tensors`` back shaped like the inputs.

        ``exclude``: peers whose declarations this round ignores (the run banned them, or their
        contribution failed verification); they are neither waited for nor grouped with us.
        ``admit``: when given, only peers it admits are (this round's rule, beside the
        config's): a verified run's members and the newcomers whose first task was verified.

        Raises ``AveragingFailed`` (matchmaking or the all-reduce failed: the message says
        why) and ``ValueError`` for bad local input (NaN/inf, non-positive weight).
        """
        r = self._begin(weight, round_number)
        vector, specs = await trio.to_thread.run_sync(_flatten, tensors, self._buffers.take)
        sizes = [int(np.prod(shape, dtype=np.int64)) for shape, _ in specs]
        result = await self._average(r, vector, sizes, weight, expected_peers, exclude, admit)
        averaged = await trio.to_thread.run_sync(_unflatten, result.vector, specs)
        return dataclasses.replace(result, tensors=averaged)

    async def average_vector(
        self,
        vector: Any,
        weight: float = 1.0,
        *,
        sizes: Sequence[int] | None = None,
        round_number: int | None = None,
        expected_peers: Iterable[bytes] | None = None,
        exclude: Iterable[bytes] = (),
        admit: Callable[[bytes], bool] | None = None,
        give: bool = False,
        overwrite: bool = False,
        want_sent: bool = True,
    ) -> AveragingResult:
        """Average one flat vector (a 1-D torch tensor or numpy array, taken as float32): the
        round's own form, so nothing is split or concatenated. ``sizes``: the segments (e.g.
        parameters) the vector is made of, which pick each one's codec when
        ``config.compression`` is None; one segment when not given. The result's ``vector`` is
        the mean (``tensors`` is empty). Arguments and errors otherwise as ``average``.

        Ownership. The round reads our contribution until its session closes, which may be
        after this call returns (it forwards our slices to a reducer that replaces a lost one).
        By default the vector is copied into a buffer of the round's own, so the caller may
        change it at once. ``give=True``: the caller hands the vector over instead (used as it
        is when it is a contiguous float32 CPU vector: a model-sized buffer less at the round)
        and must never write to it again; reading it stays safe, and its memory is freed when the
        caller and the round have both dropped it. ``overwrite=True`` (with ``give``): the round
        may also write to it: the mean lands there (the result's ``vector`` is then the given
        vector, or a copy of it when a late part was still being written), which with a lossy
        codec saves a model-sized buffer (``Session``'s ``result_in_local``); the caller must
        not read the vector after the call, not even when the round failed (it may hold parts
        of the mean). ``want_sent=False``: no ``sent`` in the result (a lossy codec's round
        trip of the whole vector, for error feedback only)."""
        r = self._begin(weight, round_number)
        if getattr(vector, "ndim", None) != 1:
            raise ValueError("average_vector takes a 1-D vector")
        sizes = [len(vector)] if sizes is None else [int(n) for n in sizes]
        if sum(sizes) != len(vector) or any(n < 0 for n in sizes):
            raise ValueError(f"sizes add up to {sum(sizes)}, the vector holds {len(vector)}")
        if overwrite and not give:
            raise ValueError("overwrite=True needs give=True")
        owned = await trio.to_thread.run_sync(_given, vector) if give else None
        if owned is None:
            owned, _ = await trio.to_thread.run_sync(_flatten, [vector], self._buffers.take)
        return await self._average(
            r, owned, sizes, weight, expected_peers, exclude, admit, overwrite, want_sent
        )

    def _begin(self, weight: float, round_number: int | None) -> int:
        """Check that we serve and ``weight`` is good; the round this call averages."""
        if self._nursery is None:
            raise RuntimeError("Averager.run is not running")
        if not (isinstance(weight, int | float) and np.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be positive and finite, got {weight!r}")
        low, high = self.config.weight_bounds
        if not low <= weight <= high:
            raise ValueError(f"weight {weight!r} is outside the run's bounds [{low}, {high}]")
        r = self.next_round if round_number is None else round_number
        self.next_round = r + 1
        return r

    async def _average(
        self,
        r: int,
        vector: np.ndarray,
        sizes: Sequence[int],
        weight: float,
        expected_peers: Iterable[bytes] | None,
        exclude: Iterable[bytes],
        admit: Callable[[bytes], bool] | None = None,
        overwrite: bool = False,
        want_sent: bool = True,
    ) -> AveragingResult:
        """Round ``r`` for ``vector`` (ours: a pooled buffer nobody else writes; ``overwrite``:
        the result may land in it)."""
        assert self._nursery is not None
        layout = Layout.for_sizes(sizes, self.config.compression)
        started = time.perf_counter()
        group = await self._form_group(r, weight, expected_peers, frozenset(exclude), admit)
        self._last_members = frozenset(group.peer_ids)
        matched = time.perf_counter()
        log.info("round %d: group of %d formed in %.2f s", r, len(group.members), matched - started)
        if len(group.members) < 2:
            # Our own vector back is no average; a peer cut off from the swarm must not take an
            # outer step alone and drift from everyone else's state.
            self._survivors = None
            raise AveragingFailed(f"round {r}: no other peer declared in time")
        leaves = b""
        if self.slice_root is not None:
            leaves = await trio.to_thread.run_sync(contribution_leaves, vector)
        session_config = SessionConfig(
            timeout_s=self.config.allreduce_timeout_s,
            peer_timeout_s=self.config.peer_timeout_s,
            heartbeat_s=self.config.heartbeat_s,
            bulk=self.config.bulk,
            tamper_reduced=self.faults.tamper_reduced(r) if self.faults else None,
            weight_bounds=self.config.weight_bounds,
            check_slice=None
            if self.check_slice is None
            else functools.partial(self.check_slice, r),
            pace_bps=self.config.bandwidth_bps if self.config.pace else None,
            sign=self.node.dht.signer.sign_message if self.config.audit else None,
            aggregation=self.config.aggregation,
            row_size=self.config.row_size,
            bound=None if self.slice_root is None else functools.partial(self.slice_root, r),
            leaves=leaves,
        )
        session: Session | GridSession
        tampered = session_config.tamper_reduced is not None
        plain_mean = (
            hierarchical(self.config)
            and self.check_slice is None
            and self.slice_root is None
            and not tampered
        )
        if uses_grid(len(group.members), self.config.row_size, plain_mean=plain_mean):
            session = GridSession(
                self.node,
                self.config.run_id,
                group,
                vector,
                layout,
                session_config,
                result_in_local=overwrite,
            )
        else:
            session = Session(
                self.node,
                self.config.run_id,
                group,
                vector,
                weight,
                layout,
                session_config,
                channels=self._channels,
                buffers=self._buffers,
                result_in_local=overwrite,
            )
        self._sessions[group.group_id] = session
        self._notify()
        self._nursery.start_soon(self._run_session, session)
        try:
            result = await session.result()
        except AveragingFailed:
            # No suspects from a failed round: a peer that lost everyone (it froze, or its link
            # went down) is the odd one out, and skipping the others in DHT lookups would cut it
            # off from the declarations they share (it then matched alone next round).
            self._survivors = None
            raise
        except BaseException:
            session.cancel()
            raise
        contributors = {peer for peer, _ in result.contributors}
        gone = set(result.dropped) | session.lost
        self._survivors = frozenset(contributors - gone) | {self.me}
        self._last_members = self._survivors
        self._suspect(gone)
        if self.config.bandwidth_bps is None:
            self._bandwidth.observe(session.upload_bps)
        audits: list[PartAudit] = []
        mine: list[bytes] = []
        refused: list[SliceDispute] = []
        if self.config.audit:
            assert isinstance(session, Session)  # an audited round is never a grid
            proofs, digests = await session.audit_evidence()
            audits = await trio.to_thread.run_sync(audits_of, session.machine, proofs, digests)
            mine = [digests[(p, self.me)] for p in range(len(session.parts))]
            for peer, (p, w) in sorted(session.machine.refused.items()):
                _, start, stop = session.parts[p]
                if (p, peer) in proofs:  # a refused slice's signature was checked on arrival
                    refused.append(
                        SliceDispute(p, start, stop, peer, w, digests[(p, peer)], proofs[(p, peer)])
                    )
            self._contributed[(r, group.group_id)] = session.machine.local
            for key in sorted(self._contributed)[:-KEEP_CONTRIBUTIONS]:
                del self._contributed[key]
        return AveragingResult(
            tensors=[],
            vector=result.vector,
            contributors={str(PeerID(p)): w for p, w in result.contributors},
            round=r,
            group_id=group.group_id.hex(),
            group_size=len(group.members),
            matchmaking_s=matched - started,
            allreduce_s=result.seconds,
            bytes_sent=session.bytes_sent,
            bytes_received=session.bytes_received,
            dropped={str(PeerID(p)): why for p, why in result.dropped.items()},
            upload_bps=session.upload_bps,
            audits=tuple(audits),
            parts=tuple((start, stop) for _, start, stop in session.parts),
            reducers=tuple(session.machine.reducer_of) if isinstance(session, Session) else (),
            slice_hashes=tuple(mine),
            refused=tuple(refused),
            sent=await trio.to_thread.run_sync(session.sent) if want_sent else None,
            rows=session.plan.rows if isinstance(session, GridSession) else 1,
        )

    async def _serve_slice(self, peer: PeerID, request: SliceRequest) -> AsyncIterator[np.ndarray]:
        """Our contribution's ``[start, stop)`` in a kept round, to the auditor only."""
        if self.config.auditor is None or peer.to_bytes() != self.config.auditor:
            raise RemoteProtocolError("only the run's auditor may fetch slices")
        vector = self._contributed.get((request.round, request.group_id))
        if vector is None:
            raise RemoteProtocolError("no contribution of that round and group is kept here")
        if not 0 <= request.start <= request.stop <= len(vector):
            raise RemoteProtocolError("slice out of range")
        yield vector[request.start : request.stop]

    async def _reach(self, peer: bytes) -> None:
        await self.node.reach(PeerID(peer))

    def _suspect(self, peers: Iterable[bytes]) -> None:
        """Peers the round lost (frozen, gone, lying) answer no DHT request for a while either:
        the next round's matchmaking should not wait a request timeout on each of them."""
        for peer in peers:
            self.node.dht.suspect(PeerID(peer))

    def channel_statistics(self) -> PoolStatistics:
        """Data channels opened and reused by our rounds so far, and how many are kept now."""
        return self._channels.statistics()

    @property
    def bandwidth_bps(self) -> float:
        """What we declare for the next round: the configured value, else the measured one."""
        if self.config.bandwidth_bps is not None:
            return float(self.config.bandwidth_bps)
        return self._bandwidth.declared

    async def publish_state_hash(self, round_number: int, digest: bytes) -> int:
        """Store our state digest for ``round_number``; returns how many DHT peers hold it."""
        return await self.node.dht.store(
            self._state_key(round_number), digest, time.time() + STATE_HASH_TTL_S
        )

    async def state_agreement(self, round_number: int) -> StateAgreement:
        records = await self.node.dht.get_records(self._state_key(round_number), latest=True)
        admit = self.config.admit or (lambda _: True)
        digests = {
            r.owner: r.value.hex()
            for r in records.values()
            if len(r.value) <= 64 and admit(r.owner)
        }
        return StateAgreement.of(round_number, digests, self.me)

    # -- internals -------------------------------------------------------------------------------

    def _state_key(self, round_number: int) -> str:
        return state_key(self.config.run_id, round_number)

    async def _form_group(
        self,
        r: int,
        weight: float,
        expected_peers: Iterable[bytes] | None,
        exclude: frozenset[bytes],
        admit_round: Callable[[bytes], bool] | None = None,
    ) -> Group:
        hint = -1
        if self.config.schedule is not None:
            # A scheduled round waits for no one by name: its close times it. Our hint: how
            # many of our last round's survivors (or last group's members) declare in this
            # round's clock shard.
            shards = self.config.matchmaking_shards
            timer = clock_shard(r, shards)
            hint = sum(shard_of(p, shards) == timer for p in self._last_members)
            expected = frozenset()
        elif expected_peers is not None:
            expected = frozenset(expected_peers) | {self.me}
        elif self._survivors is not None:
            opened = await read_declarations(self.node.dht, self.config.run_id, r)
            expected = self._survivors | {d.peer_id for d in opened}
        else:
            expected = frozenset()  # no history: decide at the deadline
        expected = frozenset(
            p for p in expected - exclude if admit_round is None or p == self.me or admit_round(p)
        )
        declaration = Declaration(
            self.me,
            r,
            float(weight),
            self.bandwidth_bps,
            time.time(),
            len(expected) if hint < 0 else hint,
        )
        try:
            finish = await form_group(
                self.node.dht,
                self.config.run_id,
                declaration,
                expected=expected,
                timeout_s=self.config.matchmaking_timeout_s,
                config=self._matchmaking,
                reach=self._reach,
                exclude=exclude,
                admit=_both(self.config.admit, admit_round),
            )
        except MatchmakingFailed as exc:
            self._survivors = None
            raise AveragingFailed(f"matchmaking for round {r}: {exc}") from exc
        return finish.group

    async def _run_session(self, session: Session) -> None:
        try:
            await session.run()
        finally:
            self._sessions.pop(session.group_id, None)
            self._ended.append(session.group_id)
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _session_for(self, group_id: bytes) -> Session | GridSession:
        """Our session for ``group_id``, waiting a while: a peer may form the group before us.
        Raises RemoteProtocolError saying why there is none."""
        waited = self.config.matchmaking_timeout_s + 5.0
        with trio.move_on_after(waited):
            while group_id not in self._ended:
                session = self._sessions.get(group_id)
                if session is not None:
                    if session.closed:
                        raise RemoteProtocolError("that round is over here")
                    return session
                await self._changed.wait()
            raise RemoteProtocolError("that round is over here")
        open_rounds = sorted(s.group.round for s in self._sessions.values())
        raise RemoteProtocolError(
            f"no such group here after {waited:.0f} s (our open rounds: {open_rounds})"
        )

    async def _serve(self, stream: Stream) -> None:
        rpc = RpcStream(stream)
        peer = rpc.peer_id.to_bytes()
        try:
            with trio.fail_after(HELLO_TIMEOUT_S):
                hello = await rpc.receive(Hello)
            session = await self._session_for(hello.group_id)
            if hello.run_id != self.config.run_id or peer not in session.peers:
                raise RemoteProtocolError("not a member of this round's group")
            why = hello_refusal(hello, session.layout.digest, self.config.row_size, session.align)
            if why is not None:
                # a run's config differing between peers: the result says why it lost this one
                session.dropped.setdefault(peer, f"refused its stream: {why}")
                raise RemoteProtocolError(why)
            await session.serve_incoming(peer, rpc, hello)
        except (RemoteProtocolError, trio.TooSlowError) as exc:
            log.info("refused an all-reduce stream from %s: %s", str(rpc.peer_id)[-8:], exc)
            await stream.reset()


class BlockingAverager:
    """``Averager`` for synchronous (torch) code: a node and its trio loop run in a thread
    (``p2p.NodeThread``).

    ``with BlockingAverager(node_config, config) as averager: averager.average(tensors, w)``.
    """

    def __init__(
        self, node_config: NodeConfig, config: AveragerConfig, *, start_timeout_s: float = 60.0
    ) -> None:
        self.averager: Averager | None = None

        async def setup(node: Node, nursery: trio.Nursery) -> None:
            self.averager = Averager(node, config)
            await nursery.start(self.averager.run)

        self._loop = NodeThread(
            node_config, name="swarm-averager", start_timeout_s=start_timeout_s, setup=setup
        )
        self.node: Node | None = self._loop.node

    def average(self, tensors: Sequence[Any], weight: float = 1.0, **kwargs: Any) -> Any:
        """Blocking ``Averager.average``; same arguments, same result and errors."""
        assert self.averager is not None
        return self._loop.call(functools.partial(self.averager.average, tensors, weight, **kwargs))

    def average_vector(self, vector: Any, weight: float = 1.0, **kwargs: Any) -> AveragingResult:
        """Blocking ``Averager.average_vector``; same arguments, same result and errors."""
        assert self.averager is not None
        averager = self.averager
        return self._loop.call(functools.partial(averager.average_vector, vector, weight, **kwargs))

    def publish_state_hash(self, round_number: int, digest: bytes) -> int:
        assert self.averager is not None
        return self._loop.call(self.averager.publish_state_hash, round_number, digest)

    def state_agreement(self, round_number: int) -> StateAgreement:
        assert self.averager is not None
        return self._loop.call(self.averager.state_agreement, round_number)

    def close(self) -> None:
        self._loop.close()

    def __enter__(self) -> BlockingAverager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _both(
    first: Callable[[bytes], bool] | None, second: Callable[[bytes], bool] | None
) -> Callable[[bytes], bool] | None:
    """A peer admitted by both rules (a rule that is None admits everyone)."""
    if first is None or second is None:
        return first or second
    return lambda peer: first(peer) and second(peer)
