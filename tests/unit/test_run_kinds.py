"""``[model] kind`` and ``[data] kind`` in run.toml and the signed spec, and the node's checks
before training (``swarmtrain.training.workload``): the data fingerprint, sizes, the model."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID as PeerID

from diloco import ByteTransformer, CausalLM, DataError, ModelError, load_stdlib_corpus
from swarmtrain.config import ConfigError, RunConfig, config_from_mapping, default_toml, load_config
from swarmtrain.runspec import RunSpec, sign_spec, verify_spec
from swarmtrain.training.workload import (
    WorkloadError,
    build_model,
    check_data,
    load_data,
    with_data_fingerprint,
)

LLAMA = {
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def transformers_toml(data_dir: Path, *, config_line: str) -> str:
    return f"""
[run]
id = "kinds"
[model]
kind = "transformers"
{config_line}
[data]
kind = "text"
paths = ["{data_dir}/*.txt"]
[training]
sequence_length = 32
batch_size = 4
"""


def test_the_defaults_are_the_embedded_model_on_the_stdlib_and_init_documents_the_keys() -> None:
    config = RunConfig()
    assert (config.model.kind, config.data.kind, config.data.fingerprint) == (
        "default", "stdlib", ""
    )  # fmt: skip
    text = default_toml()
    for key in ("[data]", 'kind = "stdlib"', "paths = []", 'tokenizer = ""', 'dtype = "uint16"',
                'kind = "default"', 'config = ""', "fingerprint"):  # fmt: skip
        assert key in text
    assert config_from_mapping(tomllib.loads(text)) == config


def test_a_config_json_path_becomes_the_signed_table_and_round_trips(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({**LLAMA, "rope_scaling": None}))
    (tmp_path / "run.toml").write_text(
        transformers_toml(tmp_path, config_line='config = "model/config.json"')
    )
    config = load_config(tmp_path / "run.toml")
    assert config.model.config == LLAMA  # read relative to run.toml, nulls dropped
    assert config.data.paths == (f"{tmp_path}/*.txt",)
    # The table and the paths travel in the signed spec and come back equal.
    key_pair = create_new_key_pair()
    coordinator = PeerID.from_pubkey(key_pair.public_key)
    data, signature = sign_spec(RunSpec(config, str(coordinator), 1.0), key_pair)
    assert verify_spec(data, signature, coordinator).config == config
    # swarmtrain init's writer gives TOML that reads back to the same config.
    assert config_from_mapping(tomllib.loads(default_toml(config))) == config
    # An inline [model.config] table is the same run.
    inline = "\n".join(f"{k} = {json.dumps(v)}" for k, v in LLAMA.items())
    (tmp_path / "inline.toml").write_text(
        transformers_toml(tmp_path, config_line="").replace(
            "[data]", f"[model.config]\n{inline}\n[data]"
        )
    )
    assert load_config(tmp_path / "inline.toml") == config


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[model]\nkind = "keras"', "model.kind must be one of default, transformers"),
        ('[model]\nkind = "transformers"', 'model.kind "transformers" needs model.config'),
        ('[model]\nkind = "transformers"\n[model.config]\nvocab_size = 3',
         "model.config needs a model_type"),
        ('[model]\nconfig = "x.json"', "model.config: cannot read .*x.json"),
        ('[model.config]\nmodel_type = "llama"', 'model.config needs model.kind = "transformers"'),
        ('[model]\nkind = "transformers"\n[model.config]\nmodel_type = "llama"\n'
         "max_position_embeddings = 16", r"sequence_length \(64\) is longer than "
         r"model.config.max_position_embeddings \(16\)"),
        ('[model]\nkind = "transformers"\n[model.config]\nmodel_type = "llama"\n'
         "[pipeline]\nstages = 2", "DiLoCo runs only"),
        ('[data]\nkind = "csv"', "data.kind must be one of stdlib, text, tokens"),
        ('[data]\nkind = "text"', 'data.kind "text" needs data.paths'),
        ('[data]\npaths = ["a.txt"]', 'data.paths and data.tokenizer need data.kind "text"'),
        ('[data]\nkind = "tokens"\npaths = ["a.bin"]\ntokenizer = "t.json"',
         'data.tokenizer needs data.kind "text"'),
        ('[data]\nkind = "tokens"\npaths = ["a.bin"]\ndtype = "int8"',
         "data.dtype must be one of uint16, uint32"),
        ('[data]\nkind = "text"\npaths = "a.txt"', "data.paths must be a list"),
        ('[data]\nfingerprint = "abc"', "data.fingerprint must be"),
        ('[data]\nkind = "text"\npaths = ["a.txt"]\n[verify]\nrate = 0.5', "DiLoCo runs only"),
    ],
)  # fmt: skip
def test_bad_kinds_are_refused_naming_the_key(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(path)
    assert "\n" not in str(caught.value)


def write_text_data(folder: Path, size: int = 20000) -> None:
    words = " ".join(f"word{i % 97}" for i in range(size // 6))
    (folder / "a.txt").write_text(words[: size // 2])
    (folder / "b.txt").write_text(words[size // 2 :])


def test_the_coordinator_fills_the_fingerprint_and_a_node_with_other_data_refuses(
    tmp_path: Path,
) -> None:
    write_text_data(tmp_path)
    (tmp_path / "run.toml").write_text(
        transformers_toml(tmp_path, config_line="").replace('kind = "transformers"\n', "")
    )
    config = load_config(tmp_path / "run.toml")
    signed = with_data_fingerprint(config)
    corpus = load_data(signed)
    assert signed.data.fingerprint == corpus.fingerprint
    check_data(signed, corpus)  # the coordinator's copy is this node's: fine
    # A set fingerprint is kept: a coordinator without the data signs what the user wrote.
    preset = signed.replace(data={"fingerprint": "0" * 64})
    assert with_data_fingerprint(preset).data.fingerprint == "0" * 64
    with pytest.raises(WorkloadError, match="the run spec carries none"):
        check_data(config, corpus)
    (tmp_path / "b.txt").write_text("another text " * 800)
    other = load_data(signed)
    with pytest.raises(WorkloadError) as caught:
        check_data(signed, other)
    message = str(caught.value)
    assert message.startswith("data.fingerprint: ") and "\n" not in message
    assert f"{tmp_path}/*.txt" in message
    assert other.fingerprint[:16] in message and corpus.fingerprint[:16] in message


def test_stdlib_data_carries_the_corpus_fingerprint_and_a_too_small_dataset_is_refused(
    tmp_path: Path,
) -> None:
    signed = with_data_fingerprint(RunConfig())
    assert signed.data.fingerprint == load_stdlib_corpus().fingerprint
    (tmp_path / "a.txt").write_text("tiny " * 40)
    small = RunConfig().replace(
        data={"kind": "text", "paths": (str(tmp_path / "a.txt"),)},
    )
    small = with_data_fingerprint(small)
    with pytest.raises(DataError, match="fewer than one batch"):
        check_data(small, load_data(small))
    with pytest.raises(DataError, match=r"data.paths: .*absent.txt matches no file"):
        load_data(small.replace(data={"paths": (str(tmp_path / "absent.txt"),)}))


def test_build_model_follows_the_kind_from_the_run_seed(tmp_path: Path) -> None:
    default = build_model(RunConfig().replace(run={"id": "r"}))
    assert isinstance(default, ByteTransformer)
    with pytest.raises(WorkloadError, match=r'model.kind "default" reads bytes'):
        build_model(RunConfig(), vocab_size=300)
    config = RunConfig().replace(
        run={"id": "r"}, model={"kind": "transformers", "config": LLAMA},
        training={"sequence_length": 32},
    )  # fmt: skip
    first, second = build_model(config, 300), build_model(config, 300)
    assert isinstance(first, CausalLM)
    assert all(a.equal(b) for a, b in zip(first.parameters(), second.parameters(), strict=True))
    other_run = build_model(config.replace(run={"id": "s"}), 300)
    assert not next(other_run.parameters()).equal(next(first.parameters()))
    with pytest.raises(ModelError, match="vocab_size"):
        build_model(config, 301)
    # A context the table names is checked on load; one it leaves to the architecture's
    # default (GPT-2: 1024 positions) when the model is built.
    no_context = {k: v for k, v in LLAMA.items() if k != "max_position_embeddings"}
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        config.replace(model={"config": {**no_context, "max_position_embeddings": 16}})
    gpt2 = {"model_type": "gpt2", "vocab_size": 300, "n_embd": 16, "n_layer": 1, "n_head": 2}
    long = config.replace(model={"config": gpt2}, training={"sequence_length": 1025})
    with pytest.raises(ModelError, match=r"sequence_length \(1025\) is longer than .* \(1024"):
        build_model(long, 300)


def test_local_runs_a_given_config_with_its_rounds_and_h_replaced(tmp_path: Path) -> None:
    from swarmtrain.cli import build_parser
    from swarmtrain.commands.local import LocalOptions

    config = RunConfig().replace(data={"kind": "text", "paths": ("a.txt",)})
    options = LocalOptions(rounds=2, inner_steps=3, config=config)
    signed = options.run_config("mine")
    assert (signed.run.id, signed.run.rounds, signed.training.inner_steps) == ("mine", 2, 3)
    assert signed.data == config.data
    assert LocalOptions(rounds=4).run_config("x").data.kind == "stdlib"
    args = build_parser().parse_args(["local", "--config", "run.toml", "--peers", "2"])
    assert args.config == Path("run.toml") and args.rounds is None and args.inner_steps is None
