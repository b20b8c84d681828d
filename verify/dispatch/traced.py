"""``DispatchStep``: any model's traced training step, the provider backend of the dispute game
for models without a hand-written graph.

One step is the model's own ``loss(inputs, targets)``, ``backward()``, the gradient clip if
``AdamWSettings.grad_clip`` asks for one, and ``torch.optim.AdamW(fused=True)``'s step (its
operators mapped to RepOps' one-pass AdamW, ``verify.dispatch.optim``, and called once per
parameter), run under ``RepOpsMode`` with a
``Recorder``: its trace is the dispatch log (``verify.dispatch.record``) and the referee
recomputes a disputed record with ``verify.dispatch.record.recompute``. The state is plain
numpy (``verify.trace``'s contract): every parameter and buffer by its
``named_parameters``/``named_buffers`` name (a frozen parameter counts as a buffer: no
moments), and AdamW's ``adamw.exp_avg.<param>``, ``adamw.exp_avg_sq.<param>`` and
``adamw.step`` (a float32 count, as torch keeps it). Leaves come first, in a fixed order:
parameters, buffers, then each parameter's step count and moments (one ``leaf:adamw.step`` per
parameter: AdamW counts each one's steps apart), then ``leaf:inputs`` and ``leaf:targets``.

The fused AdamW's records carry no per-step scalars (its bias corrections come from the step
tensors, by ``pow_int``), so a model whose step does not branch on its data records the same
operator graph every step (a tiny Llama's does). A referee of a dispatch trace still does not
use ``RefereeConfig.same_program_every_step``: a user's model may branch on its data, and then
the previous step's graph is not the program (a commitment to the program would settle it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from verify.dispatch.mode import RepOpsMode
from verify.dispatch.record import Recorder, snapshot
from verify.trace import StepResult

STEP_KEY = "adamw.step"
Batch = Callable[[int], tuple[np.ndarray, np.ndarray]]
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class AdamWSettings:
    """``torch.optim.AdamW``'s arguments for a traced step (``fused=True`` always: its two aten
    operators are mapped the same on a CPU and a GPU); the defaults are
    ``verify.repops.AdamWConfig``'s."""

    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    # > 0: ``torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=False)`` between the
    # backward and the step, as the native inner step clips (0: no clip).
    grad_clip: float = 0.0

    def __post_init__(self) -> None:
        if not self.grad_clip >= 0:
            raise ValueError(f"grad_clip must be >= 0, got {self.grad_clip}")


def _model_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model.loss(inputs, targets)  # type: ignore[operator]


class DispatchStep:
    """The traced RepOps step of ``model`` (a ``verify.trace.TracedStep``).

    ``batch(step)`` gives that step's ``(inputs, targets)`` (what the referee's data oracle
    checks ``leaf:inputs``/``leaf:targets`` against); ``loss(model, inputs, targets)`` defaults
    to ``model.loss(inputs, targets)``. The model is reused: every call loads the state into it
    and leaves the state after the step there, so two threads must not run one ``DispatchStep``
    at once (give each its own model). ``advance`` is the same step untraced.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Batch,
        *,
        optimizer: AdamWSettings | None = None,
        loss: Loss = _model_loss,
    ) -> None:
        self.model = model.train()
        self.batch = batch
        self.optimizer = optimizer or AdamWSettings()
        self.loss = loss
        self.last_loss: float | None = None  # the loss of the last step run
        # Frozen parameters (requires_grad False) are state AdamW never changes: buffers here.
        named = list(model.named_parameters())
        self.params = {name: p for name, p in named if p.requires_grad}
        self.buffers = {
            **{name: p for name, p in named if not p.requires_grad},
            **dict(model.named_buffers()),
        }
        if not self.params:
            raise ValueError("the model has no parameters to train")
        self._initial = {name: snapshot(t) for name, t in self._tensors().items()}
        self._kinds = {
            name: (tuple(t.shape), torch.empty(0, dtype=t.dtype).numpy().dtype)
            for name, t in self._tensors().items()
        }
        for name, p in self.params.items():
            for moment in ("exp_avg", "exp_avg_sq"):
                self._kinds[f"adamw.{moment}.{name}"] = (tuple(p.shape), np.dtype(np.float32))
        self._kinds[STEP_KEY] = ((), np.dtype(np.float32))

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {**self.params, **self.buffers}

    def state_names(self) -> list[str]:
        return sorted(self._kinds)

    def initial_state(self) -> dict[str, np.ndarray]:
        """The parameters and buffers the model had when this step was made (calls load other
        states into it), zero moments, step count 0."""
        state = {name: value.copy() for name, value in self._initial.items()}
        for name, p in self.params.items():
            state[f"adamw.exp_avg.{name}"] = np.zeros(tuple(p.shape), np.float32)
            state[f"adamw.exp_avg_sq.{name}"] = np.zeros(tuple(p.shape), np.float32)
        state[STEP_KEY] = np.zeros((), np.float32)
        return state

    def _check(self, state: Mapping[str, np.ndarray]) -> None:
        """ValueError naming the first state entry that is missing, extra or of another
        shape or dtype than the model's."""
        if set(state) != set(self._kinds):
            odd = sorted(set(state) ^ set(self._kinds))
            raise ValueError(f"state keys do not match the model: {odd[:4]}")
        for name, (shape, dtype) in self._kinds.items():
            value = np.asarray(state[name])
            if value.shape != shape or value.dtype != dtype:
                raise ValueError(f"state {name} must be {dtype} {shape}")

    def __call__(
        self, state: Mapping[str, np.ndarray], step: int, tamper_op: int | None = None
    ) -> StepResult:
        recorder = Recorder(tamper_op)
        after = self._run(state, step, recorder)
        recorder.check_tampered()
        return StepResult(after, recorder.records, recorder.outputs)

    def advance(self, state: Mapping[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        """The state after ``step``, untraced: the same bits as ``self(state, step).state``
        (the same operators through the same ``route``) without hashing every output."""
        return self._run(state, step, None)

    def _run(
        self, state: Mapping[str, np.ndarray], step: int, recorder: Recorder | None
    ) -> dict[str, np.ndarray]:
        """One step from ``state``, recorded when ``recorder`` is given; the state after it.
        Sets ``last_loss``."""
        self._check(state)

        def load(name: str) -> torch.Tensor:
            return torch.from_numpy(np.array(state[name], order="C"))

        with torch.no_grad():
            for name, tensor in self._tensors().items():
                tensor.copy_(load(name))
                tensor.grad = None
        leaf = recorder.leaf if recorder is not None else lambda name, tensor: 0
        for name, tensor in self._tensors().items():
            leaf(name, tensor)
        slots: dict[str, dict[str, torch.Tensor]] = {}
        for name in self.params:
            slots[name] = {"step": load(STEP_KEY)}
            leaf(STEP_KEY, slots[name]["step"])
            for moment in ("exp_avg", "exp_avg_sq"):
                slots[name][moment] = load(f"adamw.{moment}.{name}")
                leaf(f"adamw.{moment}.{name}", slots[name][moment])
        inputs, targets = (torch.from_numpy(np.array(a, order="C")) for a in self.batch(step))
        leaf("inputs", inputs)
        leaf("targets", targets)
        with RepOpsMode(recorder):
            loss = self.loss(self.model, inputs, targets)
            loss.backward()
            self._clip()
            self._adamw(slots)
        self.last_loss = float(loss.detach())
        after = {name: snapshot(t) for name, t in self._tensors().items()}
        if recorder is not None:
            for tensor in self._tensors().values():
                recorder.release(tensor)  # the next call loads the next state into them
        for name in self.params:
            for moment in ("exp_avg", "exp_avg_sq"):
                after[f"adamw.{moment}.{name}"] = snapshot(slots[name][moment])
        after[STEP_KEY] = snapshot(slots[next(iter(self.params))]["step"])
        return after

    def _clip(self) -> None:
        """The gradients scaled to global norm ``grad_clip`` at most, inside the mode: each
        gradient's norm, their norm, the coefficient, its clamp and each gradient's multiply
        are records of the trace. The per-tensor path (``foreach=False``) rather than the
        foreach one: the same bits (``test_repops_dispatch_models``), but a disputed norm or
        multiply opens one parameter's gradient, not all of them."""
        if self.optimizer.grad_clip > 0:
            params = list(self.params.values())
            torch.nn.utils.clip_grad_norm_(params, self.optimizer.grad_clip, foreach=False)

    @torch.no_grad()
    def _adamw(self, slots: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """``torch.optim.AdamW(fused=True)``'s step, its two operators called once per parameter
        rather than once over the list: the same bits (the mapping updates each parameter on its
        own), but a disputed AdamW record then opens one parameter's tensors, not the model's
        (about 4x the model's size from each provider). A parameter without a gradient is left
        alone, its step count too, as torch's optimizer does."""
        settings = self.optimizer
        beta1, beta2 = settings.betas
        for name, p in self.params.items():
            if p.grad is None:
                continue
            state = slots[name]
            torch._foreach_add_([state["step"]], 1)
            torch._fused_adamw_(
                [p], [p.grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]],
                lr=settings.lr, beta1=beta1, beta2=beta2, weight_decay=settings.weight_decay,
                eps=settings.eps, amsgrad=False, maximize=False,
            )  # fmt: skip
