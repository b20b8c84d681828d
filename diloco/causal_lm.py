"""A causal language model of the ``transformers`` library, built from its config alone and
initialised from a seed, behind the same face as ``ByteTransformer``.

Why from a config and a seed: every peer must start round 0 from the same parameters without
downloading any; ``transformers`` initialises a model from the global torch RNG, so the build runs
under a forked RNG seeded with the run seed (the process' own RNG is left as it was). Nothing is
fetched: ``HF_HUB_OFFLINE`` is set before ``transformers`` is imported, and a config names its
architecture by ``model_type`` (``AutoConfig.for_model``), never by a hub id.

``CausalLM.forward(idx)`` returns the logits and ``loss(idx, targets)`` the mean cross entropy
against the already shifted targets the data gives (``diloco.data``), the same loss as the default
model's, so the node's loop, ``evaluate`` and DiLoCo treat both alike.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

# The config keys that give a causal LM's longest sequence, by model family (Llama, GPT-2, ...).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")


class ModelError(ValueError):
    """A model config cannot be built into a causal LM; the message names the key."""


class CausalLM(nn.Module):
    """A ``transformers`` causal LM as ``forward(idx) -> logits`` and ``loss(idx, targets)``.

    ``idx`` is int64 ``(B, T)`` with ``T <= context``; logits are ``(B, T, vocab_size)``.
    Raises ValueError when ``T`` exceeds the context.
    """

    def __init__(self, lm: nn.Module, *, context: int, vocab_size: int) -> None:
        super().__init__()
        self.lm = lm
        self.context = context
        self.vocab_size = vocab_size

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.context:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds context {self.context}")
        # use_cache=False: training never decodes, and a cache object per call is waste.
        return self.lm(input_ids=idx, use_cache=False).logits

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def build_causal_lm(config: Mapping[str, Any], *, seed: int) -> CausalLM:
    """The causal LM ``config`` describes (``model_type`` picks the architecture, the other keys
    are its config's), in float32 on the CPU, its parameters drawn from ``seed`` alone: equal
    arguments give bit-identical parameters. Raises ModelError naming ``model.config``."""
    # Building from a config fetches nothing; this makes sure nothing transformers does on the
    # way (a tokenizer or template lookup in some release) reaches the network either.
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers  # imported here: seconds to import, and only these runs need it

    settings = dict(config)
    model_type = settings.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ModelError('model.config needs a model_type (e.g. "llama")')
    try:
        lm_config = transformers.AutoConfig.for_model(model_type, **settings)
    except (ValueError, KeyError):
        raise ModelError(
            f"model.config.model_type {model_type!r} is not an architecture of transformers "
            f"{transformers.__version__}"
        ) from None
    except TypeError as exc:
        raise ModelError(f"model.config: {exc}") from None
    context = next(
        (v for v in (getattr(lm_config, k, None) for k in CONTEXT_KEYS) if isinstance(v, int)),
        None,
    )
    if context is None:
        raise ModelError(f"model.config: {model_type} names no context length ({CONTEXT_KEYS})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            lm = transformers.AutoModelForCausalLM.from_config(lm_config, dtype=torch.float32)
        except ValueError:
            raise ModelError(
                f"model.config.model_type {model_type!r} has no causal LM in transformers"
            ) from None
    lm.train()
    return CausalLM(lm, context=context, vocab_size=int(lm_config.vocab_size))


def check_fits(model: CausalLM, *, sequence_length: int, vocab_size: int) -> None:
    """Raise ModelError when the data does not fit the model: sequences longer than its context,
    or token ids (below ``vocab_size``) beyond its vocabulary."""
    if sequence_length > model.context:
        raise ModelError(
            f"training.sequence_length ({sequence_length}) is longer than the model's context "
            f"({model.context}, model.config)"
        )
    if vocab_size > model.vocab_size:
        raise ModelError(
            f"model.config.vocab_size ({model.vocab_size}) is smaller than the data's "
            f"vocabulary ({vocab_size}: data.tokenizer, or bytes)"
        )


def pretrained_files(path: Path) -> list[Path]:
    """The weight files ``model.pretrained`` names: the file itself (``.safetensors``) or a
    folder's ``*.safetensors`` (a ``save_pretrained`` folder, sharded or not), sorted by name.
    Raises ModelError naming the key and the path."""
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(path.glob("*.safetensors"))
    else:
        raise ModelError(f"model.pretrained: {path} does not exist on this machine")
    if not files or any(f.suffix != ".safetensors" for f in files):
        raise ModelError(
            f"model.pretrained: {path} is not a .safetensors file or a folder holding some"
        )
    return files


def pretrained_sha256(path: Path) -> str:
    """SHA-256 over the weight files of ``path`` in order, each as its name, its size and its
    bytes (read in 1 MiB blocks: a model of many GiB is never in memory for this)."""
    hasher = hashlib.sha256(b"swarmtrain/pretrained/1\0")
    for file in pretrained_files(path):
        hasher.update(file.name.encode() + b"\0" + file.stat().st_size.to_bytes(8, "little"))
        with file.open("rb") as reader:
            while block := reader.read(1 << 20):
                hasher.update(block)
    return hasher.hexdigest()


def load_pretrained(model: CausalLM, path: Path) -> None:
    """Put the weights of ``path`` into ``model`` (built from the same config). Every parameter
    must come from the files, except the tied ones ``save_pretrained`` leaves out (an output
    embedding that is the input embedding). Raises ModelError naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in pretrained_files(path):
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError) as exc:
            raise ModelError(f"model.pretrained: {file} is not safetensors: {exc}") from None
    lm = model.lm
    tied = set(dict(lm.named_parameters(remove_duplicate=False))) - set(dict(lm.named_parameters()))
    try:
        missing, unexpected = lm.load_state_dict(tensors, strict=False)
    except RuntimeError as exc:  # a shape that is not the config's
        first = str(exc).strip().splitlines()[-1].strip()
        raise ModelError(f"model.pretrained: {path} does not fit model.config: {first}") from None
    absent = sorted(set(missing) - tied)
    if absent or unexpected:
        what = f"lacks {absent[:3]}" if absent else f"has unknown {sorted(unexpected)[:3]}"
        raise ModelError(f"model.pretrained: {path} {what} (another architecture?)")
