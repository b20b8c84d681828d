"""A user's model in a pipeline run: ``[model] factory = "package.module:function"``.

The contract (docs/pipelines.md, "Your own model"):

* ``function()`` takes no arguments and returns an ``nn.Sequential``, an ``nn.ModuleList``, or
  a module whose ``layers`` attribute is one of those (or a list of modules); running the
  layers one after the other is the model's forward.
* The first layer takes int64 byte ids of shape (B, T), the last returns (B, T, 256) logits
  (the next byte); the data is the standard library corpus's byte windows, T the run's
  ``training.sequence_length`` (``swarmtrain local``: 32).
* Every server of a stage must start from the same parameters: the factory is called with
  torch's global RNG seeded from the run's seed (``torch.manual_seed(seed)`` inside
  ``torch.random.fork_rng``), so a factory that draws its initial parameters from torch's RNG
  (as ``nn.Linear`` and friends do) builds the same model on every server of a run. A factory
  that uses another RNG must seed it itself.

The layers are cut into S contiguous groups balanced by parameter count (``balanced_cut``: the
largest group is as small as it can be). Safety: a spec names code, so a volunteer imports a
factory only when it named it itself (``swarmtrain node --allow-model MODULE:FUNCTION``;
``check_allowed``). ``factory_error`` (the format check) imports nothing, so
``swarmtrain.runspec`` uses it; everything else imports torch inside the functions.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from typing import Any

from swarmtrain.config import FACTORY_PATTERN
from swarmtrain.runspec import SpecRefused

VOCAB = 256  # byte-level logits


class ModelRefused(SpecRefused):
    """The spec names a model factory this node was not told to allow (``--allow-model``)."""


class ModelContractError(ValueError):
    """A factory cannot be imported, or its model breaks the contract; the message says how."""


def check_allowed(factory: str, allowed: Sequence[str], *, run_id: str = "") -> None:
    """Nothing when ``factory`` is empty (the default model) or listed in ``allowed``.

    Raises ModelRefused with the flag to pass: a spec alone never makes a volunteer import code."""
    if not factory or factory in allowed:
        return
    run = f"run {run_id}" if run_id else "the run"
    raise ModelRefused(
        f"{run} names model factory {factory}, code this node imports only when you allow it: "
        f"check that module, then pass --allow-model {factory}"
    )


def load_factory(factory: str) -> Any:
    """The callable ``factory`` names. Raises ModelContractError."""
    if not re.fullmatch(FACTORY_PATTERN, factory):
        raise ModelContractError(f"model factory {factory!r} is not MODULE:FUNCTION")
    module_name, _, name = factory.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ModelContractError(
            f"model factory {factory}: cannot import {module_name} ({type(exc).__name__}: "
            f"{exc}); is it on this machine's PYTHONPATH?"
        ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ModelContractError(f"model factory {factory}: {module_name} has no function {name}")
    return function


def build_model(factory: str, seed: int) -> Any:
    """Call the factory with torch's RNG seeded by ``seed`` (the caller's RNG state is kept):
    the same parameters on every server. Raises ModelContractError."""
    import torch

    function = load_factory(factory)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return function()
        except Exception as exc:
            # One line, whatever the message holds: the node's error is one line.
            said = str(exc).strip().splitlines()
            raise ModelContractError(
                f"model factory {factory} raised {type(exc).__name__}"
                + (f": {said[0]}" if said else "")
            ) from None


def layers_of(model: Any, factory: str = "the model factory") -> list[Any]:
    """The ordered layers of a factory's model. Raises ModelContractError."""
    from torch import nn

    found = model.layers if hasattr(model, "layers") and isinstance(model, nn.Module) else model
    if isinstance(found, nn.Sequential | nn.ModuleList):
        found = list(found)
    if (
        not isinstance(found, list)
        or not found
        or not all(isinstance(layer, nn.Module) for layer in found)
    ):
        raise ModelContractError(
            f"{factory} returned a {type(model).__name__}: expected an nn.Sequential, an "
            "nn.ModuleList or a module with a `layers` list, of at least one layer"
        )
    return found


def balanced_cut(sizes: Sequence[int], num_stages: int) -> list[tuple[int, int]]:
    """``num_stages`` contiguous, non-empty ``[start, end)`` ranges covering ``sizes`` (layer
    parameter counts) in order, whose largest sum is as small as possible. Layers go to the
    earliest stage the bound allows (a parameter-free layer stays with the layer before it).
    Raises ValueError when there are fewer layers than stages, or for a negative size."""
    n = len(sizes)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} stages: at most {n} stages")
    if any(size < 0 for size in sizes):
        raise ValueError("layer sizes must be non-negative")

    def groups_needed(cap: int) -> int:
        groups, total = 1, 0
        for size in sizes:
            if total + size > cap:
                groups, total = groups + 1, 0
            total += size
        return groups

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:  # the smallest cap that needs at most num_stages groups
        mid = (lo + hi) // 2
        if groups_needed(mid) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    starts, total = [0], sizes[0]
    for i in range(1, n):
        # Open a new group when this layer would pass the cap, or when every layer left must
        # start a group of its own for there to be num_stages groups.
        if total + sizes[i] > lo or n - i == num_stages - len(starts):
            starts.append(i)
            total = 0
        total += sizes[i]
    ends = [*starts[1:], n]
    return list(zip(starts, ends, strict=True))


def cut_model(
    factory: str, seed: int, num_stages: int, *, batch_size: int, context: int
) -> tuple[list[Any], list[Any]]:
    """The factory's model as ``num_stages`` ``nn.Sequential`` stages, and for each stage an
    example input (what a trainer sends it: byte ids for stage 0, the previous stage's output
    after that). Checks the contract on those examples. Raises ModelContractError."""
    import torch
    from torch import nn

    layers = layers_of(build_model(factory, seed), factory)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    try:
        bounds = balanced_cut(sizes, num_stages)
    except ValueError as exc:
        raise ModelContractError(f"model factory {factory}: {exc}") from None
    stages = [nn.Sequential(*layers[a:b]) for a, b in bounds]
    for k, (a, b) in enumerate(bounds):
        if sum(sizes[a:b]) == 0:
            raise ModelContractError(
                f"model factory {factory}: stage {k} (layers {a}..{b - 1}) would hold no "
                "parameters; use fewer stages"
            )
    x = torch.zeros(batch_size, context, dtype=torch.int64)
    examples = []
    with torch.no_grad():
        for k, stage in enumerate(stages):
            examples.append(x)
            try:
                x = stage(x)
            except Exception as exc:
                raise ModelContractError(
                    f"model factory {factory}: stage {k} fails on a {tuple(x.shape)} input "
                    f"({type(exc).__name__}: {exc}); the first layer takes int64 byte ids "
                    "(batch, sequence)"
                ) from None
    want = (batch_size, context, VOCAB)
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ModelContractError(
            f"model factory {factory}: the model returns {shape}, not {want} logits "
            "(batch, sequence, 256 byte values)"
        )
    return stages, examples
