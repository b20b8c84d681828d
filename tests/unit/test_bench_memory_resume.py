"""bench.memory_resume's two halves at a tiny size: the round trained alone into a checkpoint,
and the resume in this process, measured, with the same state hash."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.memory import llama_config, llama_params
from bench.memory_resume import make, resume

torch.set_num_threads(1)


def test_a_checkpoint_made_alone_resumes_with_its_hash_and_a_measured_peak(tmp_path: Path) -> None:
    made = make(200_000, tmp_path)
    config = llama_config(200_000, 32)
    params = llama_params(
        config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    )
    # The global params and momentum, AdamW's two moments: 16 bytes a parameter, and headers.
    assert 16 * params < made["checkpoint_bytes"] < 17 * params
    resumed = resume(200_000, tmp_path)
    assert resumed["round"] == 1 and resumed["state_hash"] == made["state_hash"]
    assert resumed["peak_rss_bytes"] >= resumed["rss_before_bytes"] > 0
