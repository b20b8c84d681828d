"""``DiLoCo``: wrap a torch model and its inner optimizer so that every H inner steps an outer round
averages the pseudo-gradients of all peers and applies Nesterov SGD to the shared global parameters.

Shape (torchft's ``DiLoCo``, hivemind.Optimizer's use): the user's loop stays a plain torch loop.
DiLoCo registers a post-step hook on the inner optimizer, so either ``diloco.step(samples)`` or the
inner optimizer's own ``step()`` counts an inner step; the H-th one runs the outer round inside that
call. ``close()`` (or leaving the ``with`` block) removes the hook.

A round, without overlap (the default):
  1. pseudo-gradient = global params - local params (one float32 subtraction, flat);
  2. ``average(round, flat pseudo-gradient, weight=samples since the last applied round)``: the
     vector goes to the averaging and comes back as one vector, never split per parameter;
  3. on success every peer applies the same Nesterov step to the same global state and copies the
     new global params into its model: global state and its hash are bit-identical across peers;
  4. on failure (``average`` raised, or returned a vector of the wrong shape) no outer update is
     applied, the round number still advances, and the local params and their sample count are
     kept, so this peer's work counts in the next round it makes (issue 4 point 2) instead of
     being thrown away. The inner optimizer's state is kept across rounds in either case.

With ``overlap=True`` (one-round-delayed outer update): at the end of inner phase r the peer hands
its progress of that phase, d_r = anchor - local, to ``average`` in a background thread and goes on
training from where it is. At the end of phase r+1 it waits for that result, applies
G_{r+1} = Nesterov(G_r, mean d_r), and rebases its model on the new global params keeping the
progress not yet averaged: local = G_{r+1} - d_{r+1}, which becomes the next anchor. So the global
sequence is the synchronous one, applied one round late, and the averaging hides behind a whole
inner phase. When round r failed, d_r is added to d_{r+1} and sent with it (weights added too),
matching the synchronous mode's rule that failed work counts in the next round.

The call that ran a round (the H-th ``step``, ``finish_inner_phase``) returns its
``RoundOutcome``: applied or not, the contributors, why it failed and the averaging's own report
(torchft's ``should_commit()`` answer), so the caller reads it there and not from a side channel.

Streaming fragments (``fragments=F``, Streaming DiLoCo): the trainable tensors are cut into F
contiguous fragments of about equal size (``diloco.fragments``, a pure function of the layout).
Round r averages and outer-steps fragment f = r mod F only: its slice of the global parameters
and momentum; ``average`` gets that slice's pseudo-gradient, so a round sends about 1/F of the
model. The other fragments' local parameters keep training untouched; each fragment's
pseudo-gradient is global - local over everything it trained since its last applied round, and
weighs the samples of those steps (a fragment syncs every F rounds, so F rounds' worth at steady
state). With ``overlap`` the fragment's averaging runs behind the next inner phase and is applied
one round late (the fragment is rebased on its new global parameters keeping the progress made
since it was sent). The global state (and its hash) covers every fragment; a restart or a
downloaded state sets the model to it, so a peer's unsynced progress is dropped, never mixed in.

Error feedback (``compress``, or ``error_feedback=True``): the pseudo-gradient sent is
progress + residual, compressed by ``compress`` when given, and the residual keeps what the codec
dropped, committed only when the round is applied. What was dropped is known exactly: either
``compress`` computed it here, or the averaging says how its peers decoded our contribution
(``AverageOutcome.sent``: the swarm's int8 round trip, whose blocks follow the round's parts,
known only once the round's group formed); a lossless averaging drops nothing.
``error_feedback_decay`` = beta < 1 (SparseLoCo's error-feedback momentum): the residual is
scaled by beta before it is added, so a coordinate that stays below a sparse codec's cut does not
pile up every round's progress in full: each phase restarts from a global model that did not move
there, retrains the same direction, and the undecayed residual would count it again each round.

Where the global state lives (``diloco.store``): on disk, two anonymous files in ``state_dir``
(else ``TMPDIR``), read and written a bounded slice at a time at the round (pseudo-gradient,
outer step, the model reset to the new parameters, the checkpoint and the state hash), so the
inner phase does not carry two model-sized vectors in memory. The bits are those of the
in-memory state.

Checkpoints (``state_dir``): after every round the global state and inner optimizer state are saved
atomically; a new ``DiLoCo`` on the same directory resumes at that round boundary. The store's
files are a working copy: what survives a crash is the checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from diloco import checkpoint
from diloco.averaging import Average, AverageOutcome, AveragingFailed
from diloco.fragments import Fragment, fragment_at, fragments_of
from diloco.outer import OuterConfig
from diloco.state import GlobalState, layout_digest
from diloco.store import StateStore

logger = logging.getLogger(__name__)

# The key of the float16 gradient scaler's state in a checkpoint's inner optimizer state.
GRAD_SCALER_KEY = "grad_scaler"


@dataclass(frozen=True)
class DiLoCoStatistics:
    round: int  # the round the current inner phase contributes to
    local_step: int  # inner steps taken in the current phase
    rounds_applied: int
    rounds_failed: int
    last_contributors: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundOutcome:
    """How round ``round`` went on this peer. ``ok``: averaged and applied; ``contributors``:
    peer id -> weight of the mean (empty when not ok); ``error``: why it failed (the
    averaging's ``AveragingFailed`` message, else ``ExceptionType: message``); ``detail``: the
    averaging's report of the round (``AverageOutcome.detail``; None when it raised);
    ``exposed_s``: the seconds training waited for the averaging (without overlap all of it,
    with overlap the wait for its result that the next inner phase did not hide)."""

    round: int
    ok: bool
    contributors: dict[str, float] = field(default_factory=dict)
    error: str = ""
    detail: Any = None
    exposed_s: float = field(default=0.0, compare=False)  # a timing, not part of what happened

    @property
    def peers(self) -> int:
        return len(self.contributors)


@dataclass
class _Pending:
    """An averaging running in the background (overlap mode)."""

    future: Future[AverageOutcome]
    fragment: Fragment  # the part of the parameters it averages (all of them when F = 1)
    anchor: torch.Tensor  # the fragment's local parameters when it was sent
    delta: torch.Tensor  # the progress sent, before compression: carried if the round fails
    weight: float
    sent: torch.Tensor  # what was handed to the averaging
    corrected: torch.Tensor | None  # with error feedback: delta + residual, before compression


class DiLoCo:
    """DiLoCo over ``model``'s trainable parameters with ``inner_optimizer`` (e.g. AdamW).

    ``average`` follows ``diloco.Average``. ``inner_steps`` is H. ``run_id`` goes into the config
    fingerprint that guards checkpoints. ``inner_steps`` may also be a list: H of round r is its
    r-th entry, the last one repeating (a sync-frequency schedule, e.g. shorter phases early).
    ``outer_momentum_warmup`` ramps the outer momentum from 0 over that many rounds
    (``OuterConfig.momentum_at``). ``compress``, when given, is the deterministic
    quantize-then-dequantize the averaging applies to a flat float32 pseudo-gradient (e.g. int8
    blockwise); DiLoCo then sends ``compress(pseudo-gradient + residual)`` and keeps what the
    quantization lost as the residual for the next round (error feedback, as in 1-bit SGD and
    PowerSGD). ``error_feedback=True`` without ``compress``: the averaging compresses
    (``AverageOutcome.sent`` says what it carried) and DiLoCo keeps what it dropped. The residual
    lives in memory only: a restart or ``load_state`` zeroes it. ``error_feedback_decay``: beta
    in [0, 1], the residual is scaled by beta before it is added (module docstring).
    ``grad_scaler``: an enabled ``torch.amp.GradScaler`` for float16 inner steps; ``step`` runs
    the optimizer through it, and a step it skips for non-finite gradients still counts toward H.
    Its state (scale, growth tracker) goes into every checkpoint beside the inner optimizer's
    (``GRAD_SCALER_KEY``), so a restart resumes at the scale it had reached (a checkpoint without
    it: the initial scale). ``fragments``: F > 1 averages one fragment of the parameters per
    round (module docstring; ``self.fragments`` holds the cut).

    Raises ValueError on bad settings, on a model without trainable parameters, or when
    ``state_dir`` holds a checkpoint of another config or layout.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        average: Average | Callable[[int, torch.Tensor, float], AverageOutcome],
        *,
        inner_steps: int | Sequence[int],
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_momentum_warmup: int = 0,
        overlap: bool = False,
        state_dir: str | os.PathLike[str] | None = None,
        run_id: str = "",
        compress: Callable[[torch.Tensor], torch.Tensor] | None = None,
        error_feedback: bool = False,
        error_feedback_decay: float = 1.0,
        grad_scaler: torch.amp.GradScaler | None = None,
        fragments: int = 1,
    ) -> None:
        schedule = (inner_steps,) if isinstance(inner_steps, int) else tuple(inner_steps)
        if not schedule or any(not isinstance(h, int) or h <= 0 for h in schedule):
            raise ValueError("inner_steps must be a positive int or a non-empty list of them")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self._average = average
        self.inner_steps_schedule = schedule
        self.inner_steps = schedule[0]
        self.outer = OuterConfig(outer_lr, outer_momentum, outer_momentum_warmup)
        self.overlap = overlap
        # fp16 inner steps: ``step`` goes through the scaler (the caller scales the loss and
        # unscales the gradients before clipping them, as torch.amp documents).
        self.grad_scaler = grad_scaler
        self._state_dir = state_dir
        self._compress = compress
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        self._params = [p for _, p in named]
        self._names = [n for n, _ in named]
        layout = layout_digest([(n, tuple(p.shape)) for n, p in named])
        self.fragments = fragments_of([p.numel() for p in self._params], fragments)
        self.fingerprint = _fingerprint(
            layout, schedule, self.outer, overlap, run_id, len(self.fragments)
        )

        self._offsets = [0, *itertools.accumulate(p.numel() for p in self._params)]
        # The global params start as the model's, the momentum at zero.
        self._store = StateStore(self._offsets[-1], layout, state_dir)
        self._store_model()
        feedback = compress is not None or error_feedback
        self._residual = torch.zeros(self._offsets[-1]) if feedback else None
        if not 0 <= error_feedback_decay <= 1:
            raise ValueError(f"error_feedback_decay {error_feedback_decay}: expected 0 to 1")
        # A float32 scalar: one correctly rounded multiply, the same bits on any machine.
        self._decay = (
            None
            if error_feedback_decay == 1
            else torch.tensor(error_feedback_decay, dtype=torch.float32)
        )
        self._local_step = 0
        # By fragment: samples of local progress not yet in an applied round of that fragment.
        self._samples = [0.0] * len(self.fragments)
        self._step_samples: float | None = None
        self._pending: _Pending | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._applied = self._failed = 0
        self._last_contributors: dict[str, float] = {}
        self._outcome: RoundOutcome | None = None  # of the round the running ``step`` ended
        self._saved: StateFile | None = None  # where the current state's checkpoint holds it
        # fp16: a round run inside ``scaler.step`` is checkpointed after ``scaler.update``, so
        # the checkpoint holds the scale the next step uses.
        self._defer_save = False
        self._save_due = False

        if state_dir is not None:
            # Straight from the file into the store: the state is never decoded into memory.
            found = checkpoint.resume(state_dir, self.fingerprint, self._store)
            if found is not None:
                self._reset_to_store()
                self._saved = StateFile(found.path, found.offset, found.length, found.round)
                if found.inner_state is not None:
                    inner = dict(found.inner_state)
                    scaler_state = inner.pop(GRAD_SCALER_KEY, None)
                    inner_optimizer.load_state_dict(inner)
                    if scaler_state and grad_scaler is not None and grad_scaler.is_enabled():
                        grad_scaler.load_state_dict(scaler_state)
                logger.info("resumed from %s at round %d", found.path, found.round)
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)

    # -- the user's loop ---------------------------------------------------------------------

    def step(self, samples: float = 1.0) -> RoundOutcome | None:
        """One inner optimizer step that processed ``samples`` samples (tokens, sequences: any
        unit, the same on all peers). Runs the outer round when this is the H-th step; in that case
        this call blocks for the averaging (without overlap) and may log a failed round, which it
        never raises. Returns the outcome of the round this call finished (with overlap: the
        previous round's, whose averaging it waited for), None when it finished none."""
        self._step_samples = samples
        self._outcome = None
        try:
            scaler = self.grad_scaler
            if scaler is None or not scaler.is_enabled():
                self.inner_optimizer.step()
            else:
                scale = scaler.get_scale()
                self._defer_save = True
                scaler.step(self.inner_optimizer)
                scaler.update()
                if scaler.get_scale() < scale:
                    # The scaler skipped the step (non-finite gradients) and backed off. The step
                    # still counts toward H: every peer's rounds stay on the same schedule.
                    self._after_inner_step(self.inner_optimizer)
                self._defer_save = False
                if self._save_due:
                    self._save_due = False
                    self._save_checkpoint()
        finally:
            self._step_samples = None
            self._defer_save = False
        # The hook ran the round inside ``inner_optimizer.step()``; it leaves the outcome here.
        outcome, self._outcome = self._outcome, None
        return outcome

    def finish_inner_phase(
        self, local: torch.Tensor, samples: float, *, from_model: bool = False
    ) -> RoundOutcome:
        """Run the round for an inner phase computed outside the inner optimizer, from the
        global parameters (a verified run's RepOps task): ``local`` is the flat float32 vector
        of parameters it ended at, ``samples`` what it processed. Progress an earlier failed
        round carried is dropped with its weight: the task started from the global state, not
        from it. ``from_model``: the phase started from the model's parameters instead (a node's
        sharded ranks, ``--fsdp``), which after a failed round still hold that round's progress,
        so its weight is kept as ``step`` keeps it. Blocks for the averaging and checkpoints,
        as the H-th ``step`` does. Raises ValueError for a vector of the wrong shape, or in
        overlap mode (no such phase there). Returns the round's outcome."""
        if self.overlap:
            raise ValueError("finish_inner_phase needs synchronous rounds (overlap=False)")
        if len(self.fragments) > 1:
            raise ValueError("finish_inner_phase needs the whole model each round (fragments=1)")
        if local.dtype != torch.float32 or local.shape != (self._store.numel,):
            raise ValueError("local must be a flat float32 vector of the parameters' size")
        self._write_model(local)
        self._samples = [float(samples) + (self._samples[0] if from_model else 0.0)]
        self._local_step = 0
        self._synchronous_round()
        self._save_checkpoint()
        outcome, self._outcome = self._outcome, None
        assert outcome is not None
        return outcome

    def finish_pending(self) -> RoundOutcome | None:
        """Overlap mode: wait for the round in flight, apply it (the model keeps the progress
        made since, on top of the new global parameters) and checkpoint. Returns its outcome;
        None when no round is in flight (always without overlap)."""
        if self._pending is None:
            return None
        self._outcome = None
        self._finish_pending(self._local_flat())
        self._save_checkpoint()
        outcome, self._outcome = self._outcome, None
        return outcome

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """Remove the hook; in overlap mode wait for the round in flight, apply it and save the
        checkpoint, so the last round's work is neither lost nor left running."""
        self._hook.remove()
        self.finish_pending()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- shared state ------------------------------------------------------------------------

    @property
    def round(self) -> int:
        """The round the current inner phase contributes to (use it to pick that phase's data)."""
        return self._store.round + (1 if self._pending is not None else 0)

    @property
    def global_state(self) -> GlobalState:
        """A copy of the global state (params, outer momentum, number of completed rounds), read
        from disk into memory: two model-sized vectors, for tests and tools."""
        return self._store.to_state()

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The global parameters by name (a copy, shaped like the model's): where a round's
        inner phase starts."""
        flat = self._store.vector("params")
        return dict(zip(self._names, self._split(flat), strict=True))

    def state_hash(self) -> str:
        return self._store.state_hash()

    def state_bytes(self) -> bytes:
        return self._store.to_bytes()

    def state_size(self) -> int:
        """Length of ``state_bytes()``, without encoding."""
        return self._store.encoded_size()

    def state_file(self) -> StateFile | None:
        """Where the current state's encoding lies on disk, byte for byte ``state_bytes()``:
        inside its checkpoint file (None without ``state_dir`` or before the first save), so it
        can be served from there instead of from a copy in memory."""
        saved = self._saved
        return saved if saved is not None and saved.round == self._store.round else None

    def load_state(self, data: bytes | bytearray | memoryview) -> None:
        """Adopt a global state downloaded from peers (a joiner, or a peer whose hash disagreed
        with the majority): verify it, copy it into the model, start a fresh inner phase. Local
        progress and a round in flight are dropped. The adopted state is checkpointed at once
        (when ``state_dir`` is set), so a restart resumes from it rather than from the stale
        state it replaced. Raises ValueError on malformed bytes or a different parameter
        layout."""
        self._store.load_bytes(data)  # verified first: nothing changes on bad bytes
        if self._pending is not None:
            self._pending.future.cancel()
            self._pending = None
        self._reset_to_store()
        self._save_checkpoint()

    def inner_steps_at(self, round: int) -> int:
        """H of ``round``'s inner phase: the schedule's entry, its last entry beyond its end."""
        return self.inner_steps_schedule[min(round, len(self.inner_steps_schedule) - 1)]

    def statistics(self) -> DiLoCoStatistics:
        return DiLoCoStatistics(
            self.round,
            self._local_step,
            self._applied,
            self._failed,
            dict(self._last_contributors),
        )

    # -- rounds ------------------------------------------------------------------------------

    def _after_inner_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        samples = 1.0 if self._step_samples is None else self._step_samples
        # The step trained every fragment: each counts it until a round of its own applies.
        self._samples = [s + samples for s in self._samples]
        self._local_step += 1
        if self._local_step == self.inner_steps_at(self.round):
            self._local_step = 0
            # The step's gradients are spent: free them before the round's own buffers exist
            # (a full float32 copy of the model less at the round's peak).
            optimizer.zero_grad(set_to_none=True)
            if self.overlap:
                self._overlapped_round()
            else:
                self._synchronous_round()
            if self._defer_save:
                self._save_due = True  # ``step`` saves once the scaler updated
            else:
                self._save_checkpoint()

    def _synchronous_round(self) -> None:
        fragment = fragment_at(self.fragments, self._store.round)
        local = self._local_flat(fragment)
        delta = self._global_minus(local, fragment.start, out=local)  # in place: one vector
        sent, corrected = self._contribution(delta, fragment)
        weight = self._samples[fragment.index]
        outcome = self._run_average(self._store.round, sent, fragment, weight)
        if outcome is None:
            self._store.skip_round()
            return
        self._store.outer_step(outcome.vector, self.outer, fragment.start)
        self._samples[fragment.index] = 0.0
        self._keep_dropped(corrected, sent, outcome, fragment)
        del outcome, delta, sent, corrected  # the mean goes back to the averager's pool
        self._model_from_store(fragment)

    def _overlapped_round(self) -> None:
        local = self._local_flat()
        rebased = self._finish_pending(local) if self._pending is not None else None
        fragment = fragment_at(self.fragments, self._store.round)
        span = slice(fragment.start, fragment.stop)
        if rebased is not None and rebased[0] == fragment:
            # One fragment (F = 1): the progress since the last send, exactly as measured.
            delta = rebased[1]
        else:
            # Everything this fragment trained since its last applied round.
            delta = self._global_minus(local[span], fragment.start, torch.empty(fragment.numel))
        # The whole vector when F = 1 (no copy); a fragment's slice alone otherwise.
        anchor = local[span] if len(self.fragments) == 1 else local[span].clone()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="diloco-average")
        weight, self._samples[fragment.index] = self._samples[fragment.index], 0.0
        sent, corrected = self._contribution(delta, fragment)
        future = self._executor.submit(self._average, self._store.round, sent, weight)
        self._pending = _Pending(future, fragment, anchor, delta, weight, sent, corrected)

    def _finish_pending(self, local: torch.Tensor) -> tuple[Fragment, torch.Tensor]:
        """Wait for the round in flight, apply it, and rebase its fragment on the new global
        params keeping the progress not yet averaged: in ``local`` (the flat local parameters,
        changed in place) and in the model. Returns the fragment and that progress: what it
        trained since it was sent, plus the pending round's own when that round failed."""
        pending, self._pending = self._pending, None
        assert pending is not None
        fragment = pending.fragment
        span = slice(fragment.start, fragment.stop)
        progress = torch.sub(pending.anchor, local[span])
        outcome = self._run_average(self._store.round, pending.sent, fragment, None, pending.future)
        if outcome is None:
            self._store.skip_round()
            progress = torch.add(pending.delta, progress)
            self._samples[fragment.index] += pending.weight
        else:
            self._store.outer_step(outcome.vector, self.outer, fragment.start)
            self._keep_dropped(pending.corrected, pending.sent, outcome, fragment)
        rebased = self._global_minus(progress, fragment.start, out=local[span])
        self._write_model(rebased, fragment)
        return fragment, progress

    def _contribution(
        self, delta: torch.Tensor, fragment: Fragment
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What to send for ``delta`` (``fragment``'s progress) and, with error feedback,
        ``delta`` + the fragment's residual (what the residual is computed from if the round
        succeeds; ``_keep_dropped``). A failed round keeps the old residual: its loss is already
        in the local progress carried on."""
        if self._residual is None:
            return delta, None
        residual = self._residual[fragment.start : fragment.stop]
        if self._decay is not None:
            residual = torch.mul(residual, self._decay)
        corrected = torch.add(delta, residual)
        if self._compress is None:
            return corrected, corrected
        sent = self._compress(corrected)
        if sent.dtype != torch.float32 or sent.shape != corrected.shape:
            raise ValueError("compress must return a float32 tensor of its input's shape")
        return sent, corrected

    def _keep_dropped(
        self,
        corrected: torch.Tensor | None,
        sent: torch.Tensor,
        outcome: AverageOutcome,
        fragment: Fragment,
    ) -> None:
        """After an applied round: the fragment's residual becomes what the codec dropped from
        ``corrected``, the values the peers received (``outcome.sent``) or else ``sent``."""
        if corrected is not None:
            assert self._residual is not None
            received = sent if outcome.sent is None else outcome.sent
            torch.sub(corrected, received, out=self._residual[fragment.start : fragment.stop])

    def _run_average(
        self,
        round: int,
        sent: torch.Tensor,
        fragment: Fragment,
        weight: float | None,
        future: Future[AverageOutcome] | None = None,
    ) -> AverageOutcome | None:
        """The averaging's outcome (its vector checked: ``fragment``'s averaged pseudo-gradient
        on the CPU), or None when the round failed (logged, counted). Either way the round's
        ``RoundOutcome`` is left for the call that ran it to return, with the seconds spent
        here waiting for the averaging (all of it, or the rest of a ``future``)."""
        started = time.perf_counter()
        try:
            if future is None:
                assert weight is not None
                outcome = self._average(round, sent, weight)
            else:
                outcome = future.result()
            exposed_s = time.perf_counter() - started
            averaged = self._check_outcome(outcome, fragment)
        except Exception as error:
            exposed_s = time.perf_counter() - started
            self._failed += 1
            why = str(error) if isinstance(error, AveragingFailed) else _describe(error)
            self._outcome = RoundOutcome(round, ok=False, error=why, exposed_s=exposed_s)
            logger.warning(
                "round %d: averaging failed (%s: %s); no outer update, local progress kept for "
                "the next round",
                round,
                type(error).__name__,
                error,
            )
            return None
        self._applied += 1
        self._last_contributors = dict(outcome.contributors)
        self._outcome = RoundOutcome(
            round,
            ok=True,
            contributors=dict(outcome.contributors),
            detail=outcome.detail,
            exposed_s=exposed_s,
        )
        return averaged

    def _check_outcome(self, outcome: AverageOutcome, fragment: Fragment) -> AverageOutcome:
        shape = torch.Size([fragment.numel])
        for name, vector in (("averaged", outcome.vector), ("sent", outcome.sent)):
            if vector is not None and (vector.shape != shape or vector.dtype != torch.float32):
                raise ValueError(
                    f"the {name} vector is {vector.dtype} of shape {tuple(vector.shape)}, the "
                    f"round's parameters float32 of {tuple(shape)}"
                )
        sent = None if outcome.sent is None else outcome.sent.detach().to("cpu")
        return dataclasses.replace(outcome, vector=outcome.vector.detach().to("cpu"), sent=sent)

    # -- helpers -----------------------------------------------------------------------------

    def _save_checkpoint(self) -> None:
        if self._state_dir is not None:
            inner = self.inner_optimizer.state_dict()
            scaler = self.grad_scaler
            if scaler is not None and scaler.is_enabled():
                # Beside the optimizer's own keys, which its ``load_state_dict`` reads alone.
                inner = {**inner, GRAD_SCALER_KEY: scaler.state_dict()}
            store = self._store
            path = checkpoint.save(self._state_dir, store, self.fingerprint, inner)
            offset = checkpoint.state_offset(self.fingerprint, store)
            self._saved = StateFile(path, offset, store.encoded_size(), store.round)

    def _reset_to_store(self) -> None:
        """The model set to the global parameters, a fresh inner phase."""
        self._model_from_store()
        self._local_step = 0
        self._samples = [0.0] * len(self.fragments)
        if self._residual is not None:
            self._residual.zero_()

    def _store_model(self) -> None:
        """The global parameters := the model's, a tensor slice at a time."""
        store = self._store
        with torch.no_grad(), store.update():
            for param, offset in zip(self._params, self._offsets, strict=False):
                flat = param.detach().reshape(-1)
                for a, b in store.ranges(offset, offset + flat.numel()):
                    store.write("params", a, flat[a - offset : b - offset].to("cpu", torch.float32))

    def _model_from_store(self, fragment: Fragment | None = None) -> None:
        """The model's parameters (of ``fragment``; all by default) := the global ones, read a
        slice at a time."""
        first = 0 if fragment is None else fragment.first
        store = self._store
        with torch.no_grad():
            for index, param in enumerate(self._tensors(fragment), start=first):
                offset = self._offsets[index]
                flat = param.detach().view(-1) if param.is_contiguous() else None
                if flat is None:  # a strided parameter: through one copy of itself
                    param.copy_(
                        store.vector("params", offset, offset + param.numel()).view_as(param)
                    )
                    continue
                for a, b in store.ranges(offset, offset + flat.numel()):
                    flat[a - offset : b - offset].copy_(store.read("params", a, b))

    def _global_minus(self, local: torch.Tensor, start: int, out: torch.Tensor) -> torch.Tensor:
        """``out`` := global params ``[start, start + len(local))`` - ``local``, a slice at a
        time (``out`` may be ``local``: elementwise, in place)."""
        store = self._store
        for a, b in store.ranges(start, start + local.numel()):
            torch.sub(store.read("params", a, b), local[a - start : b - start],
                      out=out[a - start : b - start])  # fmt: skip
        return out

    def _tensors(self, fragment: Fragment | None) -> list[torch.nn.Parameter]:
        return self._params if fragment is None else self._params[fragment.first : fragment.last]

    def _local_flat(self, fragment: Fragment | None = None) -> torch.Tensor:
        """The local parameters (of ``fragment``; all by default) as one flat float32 copy."""
        with torch.no_grad():
            return torch.cat(
                [p.detach().to("cpu", torch.float32).reshape(-1) for p in self._tensors(fragment)]
            )

    def _split(self, flat: torch.Tensor, fragment: Fragment | None = None) -> list[torch.Tensor]:
        params = self._tensors(fragment)
        sizes = [p.numel() for p in params]
        return [c.view(p.shape) for c, p in zip(flat.split(sizes), params, strict=True)]

    def _write_model(self, flat: torch.Tensor, fragment: Fragment | None = None) -> None:
        with torch.no_grad():
            params = self._tensors(fragment)
            for chunk, param in zip(self._split(flat, fragment), params, strict=True):
                param.copy_(chunk)


@dataclass(frozen=True)
class StateFile:
    """``length`` bytes at ``offset`` of ``path``: a state's encoding inside its checkpoint."""

    path: Path
    offset: int
    length: int
    round: int  # the state's


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def _fingerprint(
    layout: bytes,
    schedule: tuple[int, ...],
    outer: OuterConfig,
    overlap: bool,
    run_id: str,
    fragments: int = 1,
) -> str:
    """What must match for a checkpoint to be resumed: layout, H (schedule), outer settings, mode,
    fragments, run id."""
    hasher = hashlib.sha256(b"swarmtrain/diloco/config/1")
    hasher.update(layout)
    hasher.update(struct.pack("<Qdd?", schedule[0], outer.lr, outer.momentum, overlap))
    # The newer options are hashed only when set, so checkpoints written before they existed
    # still resume.
    if outer.momentum_warmup:
        hasher.update(struct.pack("<Q", outer.momentum_warmup))
    if len(schedule) > 1:
        hasher.update(struct.pack(f"<{len(schedule)}Q", *schedule))
    if fragments > 1:
        hasher.update(struct.pack("<8sQ", b"fragment", fragments))
    hasher.update(run_id.encode())
    return hasher.hexdigest()[:32]
