"""RepOps by dispatch on whole training steps: the default model, a tiny Llama and a tiny GPT-2
(built from configs, nothing downloaded), forward, loss, backward and ``torch.optim.AdamW``
under ``RepOpsMode``: bit-identical on one and two threads, close to native torch, and every
operator of the step listed and mapped; and a small regressor's step with an MSE head and
``clip_grad_norm_`` (both its foreach and its per-tensor path)."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from diloco.causal_lm import build_causal_lm
from diloco.model import ByteTransformer, ByteTransformerConfig
from verify.dispatch import RepOpsMode
from verify.trace import state_hash

LLAMA = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 32}  # fmt: skip
GPT2 = {"model_type": "gpt2", "vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 2,
        "n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], int]] = {
    "default": (
        lambda: ByteTransformer(
            ByteTransformerConfig(d_model=32, n_layers=2, n_heads=2, context=32)
        ),
        256,
    ),
    "llama-tiny": (lambda: build_causal_lm(LLAMA, seed=0), 96),
    "gpt2-tiny": (lambda: build_causal_lm(GPT2, seed=0), 96),
}
# Operators only that model's step uses: evidence that its own layers went through the mode.
CHARACTERISTIC = {
    "default": {"aten.gelu.default", "aten.native_layer_norm_backward.default"},
    "llama-tiny": {"aten.silu_backward.default", "aten.rsqrt.default", "aten.sin.default"},
    "gpt2-tiny": {"aten.tanh_backward.default", "aten.pow.Tensor_Scalar", "aten.addmm.default"},
}
COMMON = {
    "aten.mm.default", "aten.bmm.default", "aten._safe_softmax.default",
    "aten._softmax_backward_data.default", "aten._log_softmax.default",
    "aten.nll_loss_backward.default", "aten.embedding_dense_backward.default",
    "aten.sum.dim_IntList",
}  # fmt: skip
# The default model's RepOps step takes torch.optim.AdamW(fused=True) (RepOps' one-pass AdamW, as
# DispatchStep does), the others the single-tensor path's chain of elementwise operators.
FUSED = {"default"}
OPTIMIZER_OPS = {
    True: {"aten._fused_adamw_.default", "aten._foreach_add_.Scalar"},
    False: {"aten.lerp_.Scalar", "aten.addcmul_.default", "aten.addcdiv_.default",
            "aten.sqrt.default"},
}  # fmt: skip


CLIP = 0.05  # below the regressor's first gradient norm (asserted): the clip scales


class _Regressor(torch.nn.Module):
    """A user's small regressor: embedding, LayerNorm, an MLP, one output a position scored by
    mean squared error against a float target."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():  # its own initial weights, the process's stream untouched
            torch.manual_seed(3)
            self.embed = torch.nn.Embedding(96, 16)
            self.body = torch.nn.Sequential(
                torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.SiLU(),
                torch.nn.Linear(32, 1),
            )  # fmt: skip

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = self.body(self.embed(inputs)).squeeze(-1)
        return torch.nn.functional.mse_loss(out, targets.float() / 96)


@pytest.fixture(autouse=True)
def _threads_restored() -> Iterator[None]:
    # The tests switch torch's thread count; whatever they leave, the next test starts as before.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _step(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    repops: bool,
    fused: bool = False,
    clip: bool | None = None,
) -> tuple[dict[str, np.ndarray], float, list[torch.Tensor], Counter[str]]:
    """One AdamW step of a copy of ``model``: (parameters and moments, loss, grads, ops used);
    ``clip`` (the value is ``foreach``) clips the gradients to norm CLIP before the step."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    mode = RepOpsMode() if repops else contextlib.nullcontext()
    with mode:
        loss = model.loss(inputs, targets)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=clip)
        optimizer.step()
    state = {name: p.detach().numpy().copy() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{key}.{name}"] = optimizer.state[p][key].numpy().copy()
    grads = [p.grad for p in model.parameters()]
    return state, loss.item(), grads, (mode.ops if repops else Counter())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_step_is_bit_identical_on_one_and_two_threads(name: str) -> None:
    build, vocab = MODELS[name]
    model = build()
    generator = torch.Generator().manual_seed(7)
    inputs, targets = torch.randint(0, vocab, (2, 2, 24), generator=generator)
    fused = name in FUSED
    torch.set_num_threads(1)
    one, loss, grads, ops = _step(model, inputs, targets, repops=True, fused=fused)
    torch.set_num_threads(2)
    two, *_ = _step(model, inputs, targets, repops=True, fused=fused)
    torch.set_num_threads(1)
    assert state_hash(one) == state_hash(two)

    used = set(ops)
    missing = (CHARACTERISTIC[name] | COMMON | OPTIMIZER_OPS[fused]) - used
    assert not missing, missing
    assert sum(ops.values()) > 300  # the whole step went through the mode, not a part of it

    # RepOps is its own execution mode, but it trains as native torch does.
    native, native_loss, native_grads, _ = _step(model, inputs, targets, repops=False)
    assert abs(loss - native_loss) <= 1e-5 * abs(native_loss)
    for ours, theirs in zip(grads, native_grads, strict=True):
        cosine = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0)
        assert cosine > 0.9999 or torch.equal(ours, theirs)
    for key, value in native.items():
        assert np.max(np.abs(one[key] - value)) < 1e-4, key  # lr 1e-3 steps: 10% of one step


def test_a_clipped_mse_step_is_bit_identical_on_one_and_two_threads_and_both_clip_paths() -> None:
    model = _Regressor()
    generator = torch.Generator().manual_seed(11)
    inputs, targets = torch.randint(0, 96, (2, 4, 24), generator=generator)
    runs = {}
    for threads, foreach in ((1, True), (2, True), (1, False), (2, False)):
        torch.set_num_threads(threads)
        runs[threads, foreach] = _step(model, inputs, targets, repops=True, clip=foreach)
    torch.set_num_threads(1)
    # foreach: _foreach_norm and _foreach_mul_; per tensor: linalg_vector_norm and mul_; one
    # definition (the tree sum of squares, a correctly rounded sqrt, one multiply), one result.
    hashes = {key: state_hash(run[0]) for key, run in runs.items()}
    assert len(set(hashes.values())) == 1, hashes
    used = set(runs[1, True][3]) | set(runs[1, False][3])
    clipping = {"aten._foreach_norm.Scalar", "aten._foreach_mul_.Tensor", "aten.clamp.default",
                "aten.linalg_vector_norm.default", "aten.mul_.Tensor"}  # fmt: skip
    assert {"aten.mse_loss.default", "aten.mse_loss_backward.default"} | clipping <= used

    native, native_loss, _, _ = _step(model, inputs, targets, repops=False, clip=True)
    ours, loss, grads, _ = runs[1, True]
    assert abs(loss - native_loss) <= 1e-5 * abs(native_loss)
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert abs(float(clipped) - CLIP) < 1e-6  # the gradients were scaled down to the clip norm
    for key, value in native.items():
        assert np.max(np.abs(ours[key] - value)) < 1e-4, key
