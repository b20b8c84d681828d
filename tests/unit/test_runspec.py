"""Run config validation (errors name the key) and the coordinator-signed run spec."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import msgpack
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID as PeerID

from swarm import SparseCodec
from swarm.averaging.sparse_codec import SELECTIONS
from swarmtrain.config import (
    SPARSE_SELECTIONS,
    ConfigError,
    ModelSection,
    PipelineSection,
    RunConfig,
    RunSection,
    SwarmSection,
    TrainingSection,
    config_from_mapping,
    default_toml,
    load_config,
)
from swarmtrain.runspec import (
    MAX_SPEC_BYTES,
    SIGNING_DOMAIN,
    RunSpec,
    SpecRefused,
    sign_spec,
    verify_spec,
)


def _changed(data: bytes, key: str, value: object) -> bytes:
    """A signed spec's bytes with one setting's value replaced (its signature then no longer
    matches)."""
    obj = msgpack.unpackb(data, raw=False)
    changed = [[k, value if k == key else v] for k, v in obj[1]]
    return msgpack.packb([obj[0], changed, obj[2], obj[3]], use_bin_type=True)


def test_default_toml_round_trips_to_the_defaults() -> None:
    text = default_toml()
    assert text.count("# ") > 10  # commented
    assert config_from_mapping(tomllib.loads(text)) == RunConfig()


def test_a_key_name_means_one_setting_in_the_commented_config() -> None:
    # Scripts (and the integration tests' run.toml writers) set a key by its name on its own
    # line; a name in two sections would set both ([training] microbatches once collided with
    # [pipeline] microbatches). ``kind`` is the one name meant for several sections.
    names = re.findall(r"(?m)^([a-z_0-9]+) = ", default_toml())
    repeated = {n for n in names if names.count(n) > 1}
    assert repeated == {"kind"}, repeated


def test_outer_momentum_warmup_is_a_run_setting() -> None:
    config = config_from_mapping({"training": {"outer_momentum_warmup": 12}})
    assert config.training.outer_momentum_warmup == 12
    assert ("training.outer_momentum_warmup", 12) in config.items()  # signed with the spec


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[training]\ninner_step = 5\n", "unknown key training.inner_step"),
        ("[trainer]\nx = 1\n", "unknown section [trainer]"),
        ("[run]\nrounds = 0\n", "run.rounds must be a positive integer, got 0"),
        ("[run]\nrounds = true\n", "run.rounds must be a positive integer, got True"),
        ("[training]\nouter_momentum = 1.5\n", "training.outer_momentum must be a number in"),
        ("[training]\nouter_momentum_warmup = -2\n", "training.outer_momentum_warmup must be a"),
        ('[training]\ninner_lr = "fast"\n', "training.inner_lr must be a positive number"),
        ("[model]\nn_heads = 3\n", "model.n_heads (3) must divide model.d_model (128)"),
        ("[training]\nsequence_length = 500\n", "training.sequence_length (500) is longer"),
        ('[run]\nid = "a/b"\n', "run.id must be"),
        ("run = 3\n", "run must be a [run] table"),
        ("[pipeline]\nstages = -1\n", "pipeline.stages must be a non-negative integer, got -1"),
        ("[pipeline]\nstages = 1.5\n", "pipeline.stages must be a non-negative integer"),
        ("[pipeline]\nstages = 5\n", "pipeline.stages (5) is more than model.n_layers (4)"),
        ("[pipeline]\nstage = 2\n", "unknown key pipeline.stage"),
        ("[pipeline]\nmicrobatches = 0\n", "pipeline.microbatches must be a positive integer"),
        ("[pipeline]\naverage_every_s = 0\n", "pipeline.average_every_s must be a positive"),
        ("[pipeline]\nrebalance_every_s = -1\n", "pipeline.rebalance_every_s must be a non-neg"),
        ('[pipeline]\naverage_every_s = "5"\n', "pipeline.average_every_s must be a positive"),
        ('[model]\nfactory = "mymodel"\n', 'model.factory must be empty or "package.module:'),
        ('[model]\nfactory = "a.b:c.d"\n', "model.factory must be empty or"),
        ('[model]\nfactory = "a b:c"\n', "model.factory must be empty or"),
        ('[model]\nfactory = "1a:b"\n', "model.factory must be empty or"),
        ('[model]\nfactory = "a:b\\n"\n', "model.factory must be empty or"),
        ("[model]\nfactory = 3\n", "model.factory must be empty or"),
        (f'[model]\nfactory = "a:{"b" * 200}"\n', "at most 200 characters"),
        ('[swarm]\naggregation = "median"\n', "swarm.aggregation must be one of mean, centered"),
        (
            '[swarm]\nstate_quorum = "most"\n',
            "swarm.state_quorum must be a non-negative integer or \"majority\", got 'most'",
        ),
        ("[swarm]\nstate_quorum = -1\n", "swarm.state_quorum must be a non-negative integer or"),
        ("[swarm]\nstate_quorum = true\n", "swarm.state_quorum must be a non-negative integer or"),
        (
            '[swarm]\naggregation = "trimmed_mean"\n[verify]\nrate = 0.5\n',
            'swarm.aggregation = "trimmed_mean": verified runs',
        ),
        (
            '[swarm]\naggregation = "centered_clip"\n[pipeline]\nstages = 2\n',
            "pipeline runs average with",
        ),
        ('[swarm]\ncompression = "topk"\n', "swarm.compression must be one of auto, int8"),
        ("[swarm]\nsparse_density = 0\n", "swarm.sparse_density must be a number in (0, 1]"),
        ("[swarm]\nsparse_bits = 1\n", "swarm.sparse_bits must be an integer in [2, 8]"),
        ("[swarm]\nsparse_chunk = 70000\n", "swarm.sparse_chunk must be an integer in [2,"),
        ('[swarm]\nsparse_select = "tensor"\n', "swarm.sparse_select must be one of chunk, part"),
        (
            '[swarm]\ncompression = "sparse"\naggregation = "trimmed_mean"\n',
            'swarm.aggregation = "trimmed_mean": swarm.compression = "sparse" needs "mean"',
        ),
        (
            '[swarm]\ncompression = "sparse"\n[verify]\nrate = 0.5\n',
            'swarm.compression = "sparse": a verified run averages exactly',
        ),
        ("[training]\nfragments = 0\n", "training.fragments must be a positive integer"),
        ("[training]\nfragments = true\n", "training.fragments must be a positive integer"),
        (
            "[training]\nfragments = 2\n[verify]\nrate = 0.5\n",
            "training.fragments: a verified run",
        ),
    ],
)
def test_bad_configs_name_the_key(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[run\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)


def test_ints_are_accepted_for_float_keys() -> None:
    assert config_from_mapping({"training": {"outer_lr": 1}}).training.outer_lr == 1.0


def test_pipeline_keys_default_to_a_diloco_run_and_init_writes_them_commented() -> None:
    assert not RunConfig().is_pipeline and RunConfig().pipeline.stages == 0
    text = default_toml()
    assert "[pipeline]" in text and "\nstages = 0\n" in text and "--role trainer" in text
    body = text[text.index("[pipeline]") :]
    assert all(f"\n{k} = " in body for k in PIPELINE_KEYS)
    config = config_from_mapping(
        {"model": {"n_layers": 2}, "pipeline": {"stages": 2, "average_every_s": 3}}
    )
    assert config.is_pipeline and config.pipeline.average_every_s == 3.0


def test_a_model_factory_is_written_commented_and_frees_the_stage_count() -> None:
    text = default_toml()
    body = text[text.index("[model]") : text.index("[training]")]
    assert '\nfactory = ""\n' in body and "--allow-model" in body and "(batch," in body
    config = config_from_mapping(
        {"model": {"factory": "my_pkg.models:tiny_mlp", "n_layers": 2}, "pipeline": {"stages": 5}}
    )
    # The user's model has its own layers: stage servers check S against them when they cut it.
    assert config.model.factory == "my_pkg.models:tiny_mlp" and config.pipeline.stages == 5
    assert RunConfig().model.factory == ""


def test_the_model_factory_is_signed_and_swapping_it_is_refused() -> None:
    key_pair = create_new_key_pair()
    coordinator = PeerID.from_pubkey(key_pair.public_key)
    config = PIPELINE.replace(model={"factory": "my_pkg.models:tiny_mlp"})
    data, signature = sign_spec(RunSpec(config, str(coordinator), 2.0), key_pair)
    assert verify_spec(data, signature, coordinator).config == config
    obj = msgpack.unpackb(data, raw=False)
    assert dict(obj[1])["model.factory"] == "my_pkg.models:tiny_mlp"
    for value in ["os:system", ""]:  # another factory, or none (the default model)
        tampered = _changed(data, "model.factory", value)
        with pytest.raises(SpecRefused, match="tampered with"):
            verify_spec(tampered, signature, coordinator)
    # Validly signed but malformed: refused naming the key before anything imports it.
    bad = _changed(data, "model.factory", "os.system; rm")
    with pytest.raises(SpecRefused, match=r"model\.factory must be empty or"):
        verify_spec(bad, key_pair.private_key.sign(SIGNING_DOMAIN + bad), coordinator)


PIPELINE_KEYS = ("stages", "microbatches", "average_every_s", "rebalance_every_s")
PIPELINE = RunConfig(
    run=RunSection(id="p1", rounds=3),
    model=ModelSection(n_layers=3),
    pipeline=PipelineSection(stages=3, microbatches=6, average_every_s=2.5, rebalance_every_s=0.0),
)


def test_a_signed_pipeline_spec_round_trips_and_tampering_with_its_keys_is_refused() -> None:
    key_pair = create_new_key_pair()
    coordinator = PeerID.from_pubkey(key_pair.public_key)
    data, signature = sign_spec(RunSpec(PIPELINE, str(coordinator), 2.0), key_pair)
    assert verify_spec(data, signature, coordinator).config == PIPELINE
    obj = msgpack.unpackb(data, raw=False)
    settings = dict(obj[1])
    assert {f"pipeline.{k}" for k in PIPELINE_KEYS} <= set(settings)
    for key, value in [("pipeline.stages", 2), ("pipeline.average_every_s", 9.0)]:
        tampered = _changed(data, key, value)
        with pytest.raises(SpecRefused, match="tampered with"):
            verify_spec(tampered, signature, coordinator)
    # Dropping the pipeline keys (a DiLoCo spec in disguise) breaks the signature too.
    dropped = [[k, v] for k, v in obj[1] if not k.startswith("pipeline.")]
    stripped = msgpack.packb([obj[0], dropped, obj[2], obj[3]], use_bin_type=True)
    with pytest.raises(SpecRefused, match="tampered with"):
        verify_spec(stripped, signature, coordinator)


def test_a_validly_signed_spec_with_a_bad_pipeline_value_is_refused_naming_the_key() -> None:
    key_pair = create_new_key_pair()
    coordinator = PeerID.from_pubkey(key_pair.public_key)
    data, _ = sign_spec(RunSpec(PIPELINE, str(coordinator), 2.0), key_pair)
    for key, value, message in [
        ("pipeline.stages", 4, "pipeline.stages (4) is more than model.n_layers (3)"),
        ("pipeline.stages", -1, "pipeline.stages must be a non-negative integer"),
        ("pipeline.average_every_s", 0.0, "pipeline.average_every_s must be a positive number"),
    ]:
        bad = _changed(data, key, value)
        signature = key_pair.private_key.sign(SIGNING_DOMAIN + bad)
        with pytest.raises(SpecRefused, match=re.escape(message)):
            verify_spec(bad, signature, coordinator)


def _signed() -> tuple[bytes, bytes, PeerID]:
    key_pair = create_new_key_pair()
    coordinator = PeerID.from_pubkey(key_pair.public_key)
    spec = RunSpec(RunConfig(run=RunSection(id="r1", rounds=3)), str(coordinator), 1.5)
    data, signature = sign_spec(spec, key_pair)
    return data, signature, coordinator


def test_a_signed_spec_verifies_and_round_trips() -> None:
    data, signature, coordinator = _signed()
    spec = verify_spec(data, signature, coordinator)
    assert spec.config == RunConfig(run=RunSection(id="r1", rounds=3))
    assert spec.coordinator == str(coordinator) and spec.created_at == 1.5


def test_unsigned_tampered_and_foreign_specs_are_refused() -> None:
    data, signature, coordinator = _signed()
    with pytest.raises(SpecRefused, match="unsigned"):
        verify_spec(data, b"", coordinator)
    tampered = data.replace(b"\x03", b"\x09", 1)  # rounds 3 -> 9
    assert tampered != data
    with pytest.raises(SpecRefused, match="tampered with"):
        verify_spec(tampered, signature, coordinator)
    stranger = PeerID.from_pubkey(create_new_key_pair().public_key)
    with pytest.raises(SpecRefused, match="tampered with or issued by someone else"):
        verify_spec(data, signature, stranger)
    # A spec validly signed by its issuer but naming another coordinator is refused too.
    issuer = create_new_key_pair()
    obj = msgpack.unpackb(data, raw=False)
    obj[2] = str(stranger)
    relabelled = msgpack.packb(obj, use_bin_type=True)
    resigned = issuer.private_key.sign(SIGNING_DOMAIN + relabelled)
    with pytest.raises(SpecRefused, match="names coordinator"):
        verify_spec(relabelled, resigned, PeerID.from_pubkey(issuer.public_key))


def test_malformed_spec_bytes_are_refused() -> None:
    with pytest.raises(SpecRefused):
        RunSpec.from_bytes(b"\xc1garbage")
    with pytest.raises(SpecRefused, match="over"):
        RunSpec.from_bytes(b"x" * (MAX_SPEC_BYTES + 1))


SPARSE = RunConfig(
    run=RunSection(id="sparse"),
    swarm=SwarmSection(
        compression="sparse",
        sparse_density=0.01,
        sparse_bits=3,
        sparse_chunk=1024,
        sparse_select="part",
    ),
    training=TrainingSection(error_feedback_decay=0.5),
)


def test_a_sparse_spec_is_signed_and_tampering_with_its_keys_is_refused() -> None:
    key_pair = create_new_key_pair()
    coordinator = PeerID.from_pubkey(key_pair.public_key)
    data, signature = sign_spec(RunSpec(SPARSE, str(coordinator), 2.0), key_pair)
    assert verify_spec(data, signature, coordinator).config == SPARSE
    obj = msgpack.unpackb(data, raw=False)
    for key, value in [
        ("swarm.compression", "int8"),
        ("swarm.sparse_density", 0.02),
        ("swarm.sparse_bits", 2),
        ("swarm.sparse_chunk", 4096),
        ("swarm.sparse_select", "chunk"),
        ("training.error_feedback_decay", 1.0),
    ]:
        assert key in dict(obj[1])
        tampered = _changed(data, key, value)
        with pytest.raises(SpecRefused, match="tampered with"):
            verify_spec(tampered, signature, coordinator)


def test_sparse_keys_make_the_nodes_codec_and_turn_error_feedback_on() -> None:
    import torch

    from diloco import AverageOutcome, ByteTransformer
    from swarmtrain.training.loop import averager_config, build_diloco, compression

    assert compression(SPARSE) == SparseCodec(chunk=1024, keep=11, bits=3, select="part")
    assert averager_config(SPARSE).compression == compression(SPARSE)
    assert SPARSE_SELECTIONS == SELECTIONS  # the spec's choices are the codec's
    assert compression(RunConfig()) is None  # "auto": chosen per tensor
    # Error feedback is on although [training] leaves it off: what round 0's averaging reports
    # it did not carry (everything: sent = 0) comes back in round 1's contribution, scaled by
    # the spec's error_feedback_decay.
    config = dataclasses.replace(
        SPARSE, training=TrainingSection(inner_steps=1, error_feedback_decay=0.5)
    )
    model = ByteTransformer(seed=0)
    given: list[tuple[torch.Tensor, torch.Tensor]] = []  # (contribution, progress) per round

    def average(round: int, vector: torch.Tensor, weight: float) -> AverageOutcome:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        given.append((vector.clone(), diloco.global_state.params - flat))
        zero = torch.zeros_like(vector)
        return AverageOutcome(zero, {"me": weight}, sent=zero)

    with build_diloco(config, model, average) as diloco:
        for _ in range(2):
            batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
            model.loss(batch[:, :-1], batch[:, 1:]).backward()
            diloco.step(samples=2)
            diloco.zero_grad()
    (sent0, progress0), (sent1, progress1) = given
    assert torch.equal(sent0, progress0)  # nothing carried yet
    assert torch.allclose(sent1 - progress1, 0.5 * progress0, atol=1e-7)  # round 0's, decayed
    assert progress0.abs().max() > 1e-4


def test_fragments_are_signed_and_cut_the_nodes_rounds_as_diloco_does() -> None:
    from diloco import ByteTransformer
    from swarmtrain.training.loop import build_diloco, round_sizes, weight_bounds

    config = RunConfig(run=RunSection(id="streaming"), training=TrainingSection(fragments=3))
    key_pair = create_new_key_pair()
    coordinator = PeerID.from_pubkey(key_pair.public_key)
    data, signature = sign_spec(RunSpec(config, str(coordinator), 2.0), key_pair)
    assert verify_spec(data, signature, coordinator).config.training.fragments == 3
    tampered = _changed(data, "training.fragments", 1)
    with pytest.raises(SpecRefused, match="tampered with"):
        verify_spec(tampered, signature, coordinator)

    model = ByteTransformer(seed=0)
    sizes_at = round_sizes(config, model)
    with build_diloco(config, model, lambda *_: None) as diloco:  # type: ignore[arg-type,return-value]
        # The averaging's segments in round r are the parameters of DiLoCo's fragment r mod 3.
        assert [sizes_at(r) for r in range(6)] == [diloco.fragments[r % 3].sizes for r in range(6)]
    # A fragment weighs the tokens of the 3 rounds since it last synced: the bound follows.
    assert weight_bounds(config)[1] == 3 * weight_bounds(RunConfig())[1]
    too_many = config.replace(training={"fragments": 1000})
    with pytest.raises(ValueError, match=r"training\.fragments = 1000 is more than the model's"):
        round_sizes(too_many, model)


def test_a_verified_run_accepts_grad_clip_signed_with_the_spec(tmp_path: Path) -> None:
    """Verified runs clip inside the traced step (``verify.dispatch.DispatchStep``), so the
    spec takes ``grad_clip`` with ``verify.rate > 0``; other non-default training settings are
    still refused."""
    path = tmp_path / "run.toml"
    path.write_text('[run]\nid = "clipped"\n[training]\ngrad_clip = 0.5\n[verify]\nrate = 0.5\n')
    config = load_config(path)
    assert config.training.grad_clip == 0.5 and config.verify.rate == 0.5
    key_pair = create_new_key_pair()
    coordinator = PeerID.from_pubkey(key_pair.public_key)
    data, signature = sign_spec(RunSpec(config, str(coordinator), 2.0), key_pair)
    assert verify_spec(data, signature, coordinator).config == config
    tampered = _changed(data, "training.grad_clip", 5.0)
    with pytest.raises(SpecRefused, match="tampered with"):
        verify_spec(tampered, signature, coordinator)
    with pytest.raises(ConfigError, match=r"^training\.weight_decay: a verified run"):
        config.replace(training={"weight_decay": 0.1})


def test_expected_peers_makes_scheduled_sharded_rounds_signed_with_the_spec() -> None:
    from swarm import RoundSchedule
    from swarmtrain.training.loop import averager_config, matchmaking_wait_s

    small = averager_config(RunConfig(run=RunSection(id="small")))
    assert small.schedule is None and small.matchmaking_shards == 1
    assert matchmaking_wait_s(RunConfig()) == RunConfig().swarm.matchmaking_timeout_s
    large = RunConfig(run=RunSection(id="big"), swarm=SwarmSection(expected_peers=1000))
    made = averager_config(large)
    # 8 keys of about 125 declarations; each round's clock shard expects its share.
    assert made.matchmaking_shards == 8 and made.schedule == RoundSchedule(expected=125)
    assert matchmaking_wait_s(large) == made.schedule.long_window_s + made.schedule.grace_s
    key_pair = create_new_key_pair()
    coordinator = PeerID.from_pubkey(key_pair.public_key)
    data, signature = sign_spec(RunSpec(large, str(coordinator), 2.0), key_pair)
    assert verify_spec(data, signature, coordinator).config == large
    tampered = _changed(data, "swarm.expected_peers", 10)
    with pytest.raises(SpecRefused, match="tampered with"):
        verify_spec(tampered, signature, coordinator)


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"swarm": {"expected_peers": -1}}, "swarm.expected_peers must be a non-negative"),
        ({"swarm": {"expected_peers": 2.5}}, "swarm.expected_peers must be a non-negative"),
        (
            {"swarm": {"expected_peers": 50}, "verify": {"rate": 0.5}},
            "scheduled rounds are for DiLoCo runs without verification",
        ),
        (
            {"swarm": {"expected_peers": 50}, "pipeline": {"stages": 2}},
            "scheduled rounds are for DiLoCo runs without verification",
        ),
    ],
)
def test_bad_expected_peers_are_refused_in_one_line(mapping: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        config_from_mapping(mapping)
    assert "\n" not in str(info.value)


def test_the_state_quorum_is_signed_and_defaults_to_a_majority() -> None:
    assert RunConfig().swarm.state_quorum == "majority"
    assert 'state_quorum = "majority"' in default_toml()
    key_pair = create_new_key_pair()
    coordinator = PeerID.from_pubkey(key_pair.public_key)
    for quorum in ("majority", 0, 3):
        config = RunConfig(run=RunSection(id="q"), swarm=SwarmSection(state_quorum=quorum))
        data, signature = sign_spec(RunSpec(config, str(coordinator), 2.0), key_pair)
        assert verify_spec(data, signature, coordinator).config.swarm.state_quorum == quorum
    tampered = _changed(data, "swarm.state_quorum", 0)
    with pytest.raises(SpecRefused, match="tampered with"):
        verify_spec(tampered, signature, coordinator)


def test_the_row_size_is_a_signed_key_that_reaches_the_averager() -> None:
    from swarmtrain.training.loop import averager_config

    assert RunConfig().swarm.row_size == 32 and "row_size = 32" in default_toml()
    assert averager_config(RunConfig(run=RunSection(id="r"))).row_size == 32
    grid = RunConfig(run=RunSection(id="r"), swarm=SwarmSection(row_size=4))
    assert averager_config(grid).row_size == 4
    flat = RunConfig(run=RunSection(id="r"), swarm=SwarmSection(row_size=0))
    assert averager_config(flat).row_size is None
    key_pair = create_new_key_pair()
    coordinator = PeerID.from_pubkey(key_pair.public_key)
    data, signature = sign_spec(RunSpec(grid, str(coordinator), 2.0), key_pair)
    assert verify_spec(data, signature, coordinator).config.swarm.row_size == 4
    for bad in (1, -3, 2.5):
        with pytest.raises(ConfigError, match=r"swarm\.row_size must be 0 or an integer >= 2"):
            config_from_mapping({"swarm": {"row_size": bad}})
