"""A ``transformers`` causal LM from its config (``diloco.causal_lm``): the same round-0 state on
every build from one seed, nothing downloaded, DiLoCo trains it, and bad configs in one line."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from diloco import (
    Corpus,
    DiLoCo,
    LocalAverage,
    ModelError,
    build_causal_lm,
    check_fits,
    eval_batches,
    evaluate,
    inner_batches,
)

LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}


def state_hash(model: torch.nn.Module) -> str:
    digest = __import__("hashlib").sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_two_builds_from_one_seed_are_bit_identical_and_leave_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    first = build_causal_lm(LLAMA, seed=7)
    assert torch.rand(3).equal(expected_draw)  # the build drew from a forked RNG
    assert state_hash(first) == state_hash(build_causal_lm(LLAMA, seed=7))
    assert state_hash(first) != state_hash(build_causal_lm(LLAMA, seed=8))
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert type(first.lm).__name__ == "LlamaForCausalLM"
    assert first.context == 32 and first.vocab_size == 64
    assert all(p.dtype == torch.float32 for p in first.parameters())


def test_forward_gives_logits_and_loss_is_the_shifted_cross_entropy() -> None:
    gpt2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 1, "n_head": 2,
            "n_positions": 16, "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip
    model = build_causal_lm(gpt2, seed=0)
    assert model.context == 16
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(idx)
    assert logits.shape == (2, 16, 64)
    # Our loss on the shifted targets the data gives is the model's own causal LM loss (which
    # shifts inside); eval mode, so that dropout draws nothing.
    model.eval()
    ours = model.loss(idx[:, :-1], idx[:, 1:])
    own = model.lm(input_ids=idx, labels=idx).loss
    assert torch.allclose(ours, own, atol=1e-5)
    with pytest.raises(ValueError, match="exceeds context 16"):
        model(torch.zeros(1, 17, dtype=torch.int64))


def test_diloco_trains_it_and_two_peers_agree_on_the_state() -> None:
    rng = np.random.default_rng(0)
    # A learnable stream: a repeated random phrase of 12 tokens.
    tokens = np.tile(rng.integers(0, 64, 12), 400).astype(np.uint16)
    corpus = Corpus(tokens[:4400], tokens[4400:], (), (), "test", vocab_size=64)
    group = LocalAverage(2)
    peers = []
    for name in ("a", "b"):
        model = build_causal_lm(LLAMA, seed=1)
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
        peers.append((name, model, DiLoCo(model, inner, group.member(name), inner_steps=5)))
    held_out = eval_batches(corpus, batches=1, batch_size=4, context=16)
    before = evaluate(peers[0][1], held_out)
    import threading

    def run(name: str, model: torch.nn.Module, diloco: DiLoCo) -> None:
        for _ in range(3):
            for x, y in inner_batches(corpus, run_seed=0, round=diloco.round,
                                      peer_id=name.encode(), steps=5, batch_size=4,
                                      context=16):  # fmt: skip
                model.loss(x, y).backward()  # type: ignore[operator]
                diloco.step(samples=x.numel())
                diloco.zero_grad()

    threads = [threading.Thread(target=run, args=peer) for peer in peers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=100)
    assert not any(thread.is_alive() for thread in threads)
    hashes = {diloco.state_hash() for _, _, diloco in peers}
    assert len(hashes) == 1 and peers[0][2].round == 3
    assert evaluate(peers[0][1], held_out) < before - 0.5
    for _, _, diloco in peers:
        diloco.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**LLAMA, "model_type": "no_such_arch"}, "model_type 'no_such_arch' is not an"),
        ({k: v for k, v in LLAMA.items() if k != "model_type"}, "needs a model_type"),
        ({"model_type": "bert"}, None),  # an encoder: transformers builds it as a decoder
    ],
)
def test_bad_configs_are_refused_in_one_line(
    config: dict[str, object], message: str | None
) -> None:
    if message is None:
        build_causal_lm({**config, "num_hidden_layers": 1, "hidden_size": 16,
                         "num_attention_heads": 2, "intermediate_size": 16}, seed=0)  # fmt: skip
        return
    with pytest.raises(ModelError, match=message) as caught:
        build_causal_lm(config, seed=0)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 200


def test_data_that_does_not_fit_the_model_is_refused() -> None:
    model = build_causal_lm(LLAMA, seed=0)
    check_fits(model, sequence_length=32, vocab_size=64)
    with pytest.raises(ModelError, match=r"sequence_length \(33\) is longer than .* \(32"):
        check_fits(model, sequence_length=33, vocab_size=64)
    with pytest.raises(ModelError, match=r"vocab_size \(64\) is smaller than .* \(65"):
        check_fits(model, sequence_length=8, vocab_size=65)
