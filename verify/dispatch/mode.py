"""``RepOpsMode``: a ``TorchDispatchMode`` that runs any model's training step with RepOps.

Inside the mode every aten operator is routed by ``verify.dispatch.aten``: a mapped operator runs
its reproducible definition, an exact one (views, copies, selections, integer arithmetic) runs
natively, and any other operator raises ``UnmappedOperator`` naming it: before it runs when it
has floating-point inputs, and before its result is used when only its output is floating
point. Attention goes through torch's math path (``sdpa_kernel(MATH)`` is entered with the mode),
which decomposes ``scaled_dot_product_attention`` into matmuls and a softmax the mode maps; the
fused CPU and CUDA attention kernels are not mapped. Modes run per thread (a dispatch mode is
thread-local), and the math path stays on while any thread is in one (its flags are global).

``survey(fn)`` lists the operators ``fn`` uses and the unmapped ones among them, running
everything natively: what a run's spec check calls to refuse a model before training starts.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from verify.dispatch.aten import EXACT, HANDLERS, UnmappedOperator
from verify.dispatch.calls import tensor_outputs

if TYPE_CHECKING:
    from verify.dispatch.record import Recorder

# Operators outside aten that carry no data (the profiler's record_function markers).
PASSIVE_NAMESPACES = frozenset({"profiler"})
aten = torch.ops.aten
# Outputs of these hold whatever memory held: ``route`` zero-fills them, so that a traced step
# (whose records hash them) and an untraced one compute the same bits, and the hashes of
# outputs a correct program never reads before writing are the same everywhere.
UNINITIALISED = frozenset(
    {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}
)


def _floating_leaf(leaf: Any) -> bool:
    if isinstance(leaf, torch.Tensor):
        return leaf.is_floating_point() or leaf.is_complex()
    if isinstance(leaf, (float, complex)):
        return True
    if isinstance(leaf, (list, tuple)):
        return any(_floating_leaf(item) for item in leaf)
    if isinstance(leaf, dict):
        return any(_floating_leaf(item) for item in leaf.values())
    return False


def _floating(values: Any) -> bool:
    """Whether any leaf is a floating-point (or complex) tensor or a Python float. Walked by hand
    over the containers aten arguments use (tuples, lists, dicts): ``tree_leaves`` cost more
    than most of the step's small operators themselves (measured: about a third of the mode's
    own time a call)."""
    return _floating_leaf(values)


# How ``route`` treats an operator, decided once per overload (these sets never change).
_UNINITIALISED, _EXACT, _OTHER = 0, 1, 2
_KINDS: dict[torch._ops.OpOverload, int] = {}
_NAMES: dict[torch._ops.OpOverload, str] = {}


def _kind(func: torch._ops.OpOverload) -> int:
    kind = _KINDS.get(func)
    if kind is None:
        if func.overloadpacket in UNINITIALISED:
            kind = _UNINITIALISED
        elif func.overloadpacket in EXACT or func.namespace in PASSIVE_NAMESPACES:
            kind = _EXACT
        else:
            kind = _OTHER
        _KINDS[func] = kind
    return kind


def op_name(func: torch._ops.OpOverload) -> str:
    """``str(func)`` (``aten.mm.default``), built once per overload."""
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = str(func)
    return name


def route(func: torch._ops.OpOverload, args: Any, kwargs: Any) -> Any:
    """Run one aten operator the RepOps way (see the module docstring; uninitialised outputs
    zero-filled); raise ``UnmappedOperator`` for an operator with no mapping."""
    kind = _kind(func)
    if kind == _EXACT:
        return func(*args, **kwargs)
    if kind == _UNINITIALISED:
        out = func(*args, **kwargs)
        for tensor in tensor_outputs(out):
            tensor.zero_()
        return out
    handler = HANDLERS.get(func)
    if _floating(args) or _floating(kwargs):
        if handler is None:
            raise UnmappedOperator(op_name(func))
        return handler(*args, **kwargs)
    # Integer and boolean arithmetic is exact; an integer operator with a floating result
    # (true division, a float arange) takes the mapped definition, or is refused.
    out = func(*args, **kwargs)
    if _floating(out):
        if handler is None:
            raise UnmappedOperator(op_name(func), "floating-point result from integer inputs")
        return handler(*args, **kwargs)
    return out


class _MathAttention:
    """``sdpa_kernel(MATH)`` shared by every thread in a RepOpsMode: torch's attention backend
    flags are process-global while dispatch modes are per thread, so a mode leaving in one
    thread (a provider answering a dispute) must not turn the fused kernels back on under a
    mode still running in another (a node's next task): the last one out restores them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._context: Any = None

    def enter(self) -> None:
        with self._lock:
            if self._users == 0:
                context = sdpa_kernel([SDPBackend.MATH])
                context.__enter__()
                self._context = context
            self._users += 1

    def exit(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                context, self._context = self._context, None
                context.__exit__(None, None, None)


_MATH_ATTENTION = _MathAttention()


class RepOpsMode(TorchDispatchMode):
    """Run the block's torch operators reproducibly (see the module docstring).

    ``ops`` counts the aten operators the block used, by name (``aten.mm.default``): the listing
    of a step. A model whose step raises ``UnmappedOperator`` cannot be verified. With a
    ``recorder`` (``verify.dispatch.record.Recorder``) every operator is also recorded: the
    step's dispatch trace, which the dispute game bisects.
    """

    def __init__(self, recorder: Recorder | None = None) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.recorder = recorder

    def __enter__(self) -> RepOpsMode:
        # A second RepOpsMode would see the first one's kernels as operators to route.
        if any(isinstance(m, RepOpsMode) for m in _get_current_dispatch_mode_stack()):
            raise RuntimeError("RepOpsMode is already active; enter it once")
        _MATH_ATTENTION.enter()
        try:
            super().__enter__()
        except BaseException:
            _MATH_ATTENTION.exit()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _MATH_ATTENTION.exit()

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.ops[op_name(func)] += 1
        if self.recorder is not None:
            return self.recorder.call(func, args, kwargs or {})
        return route(func, args, kwargs or {})


@dataclass
class Survey:
    """The aten operators a function used (name -> calls) and those RepOps cannot run."""

    ops: Counter[str] = field(default_factory=Counter)
    unmapped: set[str] = field(default_factory=set)


class _SurveyMode(TorchDispatchMode):
    def __init__(self, survey: Survey) -> None:
        super().__init__()
        self.survey = survey

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        self.survey.ops[name] += 1
        out = func(*args, **kwargs)
        mapped = (
            func.overloadpacket in EXACT
            or func.namespace in PASSIVE_NAMESPACES
            or func in HANDLERS
            or not _floating((args, kwargs, out))
        )
        if not mapped:
            self.survey.unmapped.add(name)
        return out


def survey(fn: Callable[[], Any]) -> Survey:
    """Run ``fn`` natively (attention on the math path, as ``RepOpsMode`` runs it) and list the
    operators it used and the unmapped ones. Handlers that refuse some arguments (a GELU's
    tanh approximation, a pow's exponent) are only refused when ``RepOpsMode`` runs them."""
    result = Survey()
    with sdpa_kernel([SDPBackend.MATH]), _SurveyMode(result):
        fn()
    return result
