"""The CLI's one-line errors for what a user mistypes or a machine refuses (issue 22), run in
process: the message names the flag or file and the fix, and the exit status is 1."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from swarmtrain.cli import _run


def _fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert _run(list(argv)) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Errno" not in err and "Traceback" not in err, err
    return err


def test_a_missing_config_says_how_to_write_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "cfg" / "nope.toml"
    for command in ("coordinator", "local"):
        err = _fails(capsys, command, "--config", str(missing))
        assert err == (
            f"swarmtrain {command}: --config {missing}: no such file (swarmtrain init {missing} "
            "writes one)"
        )
    assert _fails(capsys, "coordinator", "--config", str(tmp_path)) == (
        f"swarmtrain coordinator: --config {tmp_path}: a folder, not a file; give a run.toml"
    )


JOIN = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRiHhC2akhj4ztNdh9sAEKzZrN87JfzokqDmDZzZiYVZb"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Issue 22: "[Errno 17] File exists: 'run.toml'", meaning "not a folder".
        (("local", "--workdir", "F"), "--workdir F: a file, not a folder; give a folder's path "
         "(it is made if absent)"),
        (("node", "--join", JOIN, "--state-dir", "F"), "--state-dir F: a file, not a folder; "
         "give a folder's path (it is made if absent)"),
        # "[Errno 20] Not a directory" (a file as a parent folder).
        (("node", "--join", JOIN, "--state-dir", "F/x"), "--state-dir F/x: F is a file, not a "
         "folder; give a path under a folder"),
        (("node", "--join", JOIN, "--state-dir", "D", "--json", "F/x/s.json"), "--json "
         "F/x/s.json: F is a file, not a folder; give a path under a folder"),
        (("node", "--join", JOIN, "--state-dir", "D", "--log-to", "tensorboard:F"), "--log-to "
         "tensorboard:F: a file, not a folder; give a folder's path (it is made if absent)"),
        (("node", "--join", JOIN, "--identity", "D"), "--identity D: a folder, not a file; give "
         "a file's path"),
        (("local", "--json", "D"), "--json D: a folder, not a file; give a file's path"),
        (("init", "D"), "D: a folder, not a file; give a file's path"),
        (("init", "F/run.toml"), "F/run.toml: F is a file, not a folder; give a path under a "
         "folder"),
        (("export", "--state-dir", "nope", "--out", "o"), "--state-dir nope: no such folder; "
         "give the node's --state-dir"),
        (("export", "--state-dir", "F", "--out", "o"), "--state-dir F: a file, not a folder; "
         "give the node's --state-dir"),
        (("export", "--state-dir", "D", "--out", "D"), "--out D: a folder that is not empty; "
         "give a new or an empty one"),
        (("export", "--state-dir", "D", "--out", "F"), "--out F: a file, not a folder; give a "
         "folder's path (it is made if absent)"),
        (("export", "--state-dir", "D", "--out", "o", "--json", "F/r.json"), "--json F/r.json: "
         "F is a file, not a folder; give a path under a folder"),
        # --data-dir is read, never made: refused before torch, the metrics port or a tracker.
        (("node", "--join", JOIN, "--state-dir", "D", "--data-dir", "nope", "--metrics-port",
          "0", "--log-to", "tensorboard:tb"), "--data-dir nope: no such folder; give the folder "
         "the run's data and weights lie under (as they lie beside the coordinator's run.toml)"),
        (("node", "--join", JOIN, "--state-dir", "D", "--data-dir", "F"), "--data-dir F: a "
         "file, not a folder; give the folder the run's data and weights lie under (as they lie "
         "beside the coordinator's run.toml)"),
        (("export", "--state-dir", "D", "--data-dir", "nope", "--out", "o"), "--data-dir nope: "
         "no such folder; give the node's --data-dir"),
        (("export", "--state-dir", "D", "--data-dir", "F", "--out", "o"), "--data-dir F: a "
         "file, not a folder; give the node's --data-dir"),
    ]
    + [
        ((command, "--identity", "F/k"), "--identity F/k: F is a file, not a folder; give a "
         "path under a folder")
        for command in ("id", "relay", "doctor", "coordinator")
    ],
)  # fmt: skip
def test_a_path_option_that_cannot_be_used_is_one_line_and_nothing_is_written(
    argv: tuple[str, ...],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # F: a file, D: a folder with a file in it
    Path("F").write_text("")
    Path("D").mkdir()
    Path("D", "a").write_text("")
    assert _fails(capsys, *argv) == f"swarmtrain {argv[0]}: {message}"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["D", "F", "a"]


def test_an_identity_where_nothing_can_be_made_is_one_line_as_root_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # /proc takes no new files, for root too (mkdir there says "no such file"), where a
    # read-only mode only stops other users.
    key = "/proc/swarmtrain-test/identity.key"
    for command in ("id", "relay"):
        err = _fails(capsys, command, "--identity", key)
        if os.geteuid() == 0:  # seen only when it is made
            assert err == (
                f"swarmtrain {command}: --identity: cannot create identity {key}: nothing can "
                "be made there"
            )
        else:  # seen before
            assert err == (
                f"swarmtrain {command}: --identity {key}: cannot make a file in /proc: "
                "permission denied; give a folder you can write"
            )
    assert not Path(key).parent.exists()


def test_a_folder_that_cannot_be_made_names_its_flag(tmp_path: Path) -> None:
    from swarmtrain.paths import PathError, make_folder

    (tmp_path / "F").write_text("")
    with pytest.raises(PathError) as raised:
        make_folder(tmp_path / "F", "--workdir")
    assert str(raised.value) == (
        f"--workdir {tmp_path / 'F'}: cannot make it: a folder on the path is a file"
    )
    with pytest.raises(PathError) as raised:
        make_folder(Path("/proc/swarmtrain-test"), "--state-dir")
    assert str(raised.value).startswith("--state-dir /proc/swarmtrain-test: cannot make it: ")
    assert str(raised.value).endswith(
        "nothing can be made there" if os.geteuid() == 0 else "permission denied"
    )


def test_init_and_id_name_the_path_they_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("")
    assert _fails(capsys, "init", str(tmp_path / "afile" / "run.toml")) == (
        f"swarmtrain init: {tmp_path}/afile/run.toml: {tmp_path}/afile is a file, not a folder; "
        "give a path under a folder"
    )
    assert _fails(capsys, "id", "--identity", str(tmp_path / "afile" / "identity.key")) == (
        f"swarmtrain id: --identity {tmp_path}/afile/identity.key: {tmp_path}/afile is a file, "
        "not a folder; give a path under a folder"
    )
    (tmp_path / "run.toml").write_text("")
    assert _fails(capsys, "init", str(tmp_path / "run.toml")) == (
        f"swarmtrain init: {tmp_path}/run.toml exists (--force overwrites it)"
    )
    if os.geteuid() != 0:  # root writes through a mode of 0555
        folder = tmp_path / "ro"
        folder.mkdir(mode=0o555)
        assert _fails(capsys, "init", str(folder / "run.toml")) == (
            f"swarmtrain init: {folder}/run.toml: cannot make a file in {folder}: permission "
            "denied; give a folder you can write"
        )


def test_a_coordinator_restarted_on_a_config_without_an_id_warns_that_the_run_changed(
    tmp_path: Path,
) -> None:
    from swarmtrain.commands.coordinator import pick_run_id
    from swarmtrain.config import RunConfig

    config_path, memory = tmp_path / "run.toml", tmp_path / "identity.key.runs.json"
    first, warning = pick_run_id(RunConfig(), config_path, memory)
    assert first.run.id.startswith("run-") and warning == ""
    second, warning = pick_run_id(RunConfig(), config_path, memory)
    assert second.run.id != first.run.id
    assert f"the last start on it was {first.run.id}" in warning
    assert f'set id = "{first.run.id}" under [run] in {config_path}' in warning
    # A run that names itself keeps its name and needs no warning.
    named, warning = pick_run_id(RunConfig().replace(run={"id": "mine"}), config_path, memory)
    assert named.run.id == "mine" and warning == ""
    memory.write_text("not json")  # a damaged memory is forgotten, not fatal
    assert pick_run_id(RunConfig(), config_path, memory)[1] == ""


def test_the_cli_starts_without_importing_torch() -> None:
    # id, init, relay, doctor and status answer in a fraction of a second; torch costs seconds
    # (an import of the dashboard's package once pulled it in through the verified-run plan).
    import subprocess
    import sys

    probe = "import sys, swarmtrain.cli; print(sorted({'torch', 'hypercorn'} & set(sys.modules)))"
    found = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert found.stdout.strip() == "[]", found.stdout


def test_every_option_with_a_default_shows_it_in_its_help() -> None:
    import argparse

    from swarmtrain.cli import build_parser

    def commands(parser: argparse.ArgumentParser, name: str = "swarmtrain"):
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    yield from commands(child, f"{name} {sub}")

    missing = [
        f"{name} {action.option_strings[0]}"
        for name, parser in commands(build_parser())
        for action in parser._actions
        if action.option_strings
        and action.help not in (None, argparse.SUPPRESS)
        and action.default not in (None, False, [], (), argparse.SUPPRESS)
        and "[" not in action.help
    ]
    assert not missing, missing


PEER = "12D3KooWRiHhC2akhj4ztNdh9sAEKzZrN87JfzokqDmDZzZiYVZb"


@pytest.mark.parametrize(
    ("join", "problem"),
    [
        (f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER[:20]}", f"'{PEER[:20]}' is not a peer id (cut short "
         "or mistyped? copy it whole)"),
        (f"/ip4/127.0.0.1/tcp/70000/p2p/{PEER}", "port 70000 is not a port (1..65535)"),
        (f"/ip4/10.0.0.256/tcp/4001/p2p/{PEER}", "10.0.0.256 is not an IPv4 address"),
        (f"/ip4/10.0.0.1/udp/4001/quic-v1/p2p/{PEER}", "/quic-v1 addresses are not supported "
         "here: use the peer's /tcp/ address"),
    ],
)  # fmt: skip
def test_node_names_what_is_wrong_with_its_join_address(
    join: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _fails(capsys, "node", "--join", join, "--state-dir", str(tmp_path / "n"))
    assert err == f"swarmtrain node: --join {join}: {problem}"
    assert not (tmp_path / "n").exists()  # refused before anything was written or dialed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Issue 22: a 40-line multiaddr traceback, or the parser's words without the flag.
        (("node", "--join", JOIN, "--listen", "127.0.0.1:0"), "--listen 127.0.0.1:0: a "
         "multiaddr is written /ip4/127.0.0.1/tcp/0, not host:port"),
        (("node", "--join", JOIN, "--listen", "/ip4/1.2.3/tcp/1"), "--listen /ip4/1.2.3/tcp/1: "
         "1.2.3 is not an IPv4 address"),
        (("relay", "--listen", "127.0.0.1:0"), "--listen 127.0.0.1:0: a multiaddr is written "
         "/ip4/127.0.0.1/tcp/0, not host:port"),
        (("relay", "--listen", "nonsense"), "--listen nonsense: not a multiaddr (for example "
         "/ip4/0.0.0.0/tcp/4001)"),
        (("coordinator", "--listen", "127.0.0.1:4001"), "--listen 127.0.0.1:4001: a multiaddr "
         "is written /ip4/127.0.0.1/tcp/4001, not host:port"),
        (("coordinator", "--announce", "1.2.3.4:4001"), "--announce 1.2.3.4:4001: a multiaddr "
         "is written /ip4/1.2.3.4/tcp/4001, not host:port"),
        (("doctor", "--join", "not-an-address"), "--join not-an-address: not a multiaddr (for "
         "example /ip4/203.0.113.7/tcp/4001/p2p/12D3KooW…)"),
        (("doctor", "--join", JOIN[:-6]), f"--join {JOIN[:-6]}: '{PEER[:-6]}' is not a peer id "
         "(cut short or mistyped? copy it whole)"),
        (("doctor", "--ping", "notapeer"), "--ping notapeer: 'notapeer' is not a peer id (cut "
         "short or mistyped? copy it whole)"),
    ],
)  # fmt: skip
def test_an_address_that_is_not_a_multiaddr_is_one_line_naming_the_flag_and_the_fix(
    argv: tuple[str, ...], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _fails(capsys, *argv, *(["--identity", str(tmp_path / "k")] if argv[0] != "node" else []))
    assert err == f"swarmtrain {argv[0]}: {message}"
    assert not list(tmp_path.iterdir())  # no identity made: refused before anything


def test_every_command_says_what_it_does_and_its_exit_statuses() -> None:
    """Issue 22: no command said what it does beyond one line; exit status 3 (banned) was
    written only in docs/verification.md."""
    import argparse

    from swarmtrain.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(sub.choices) == 10, sorted(sub.choices)
    helps = {action.dest: action.help for action in sub._choices_actions}
    for name, parser in sub.choices.items():
        # argparse rewraps both, breaking lines at spaces and after hyphens.
        text = "".join(parser.format_help().split())
        assert parser.description and parser.description != helps[name], name
        assert "".join(parser.description.split()) in text, name
        epilog = parser.epilog or ""
        assert epilog.startswith("exit status: ") and "".join(epilog.split()) in text, name
        assert epilog.endswith(
            "130 stopped by Ctrl+C (a node keeps its last finished round's checkpoint); 143 "
            "stopped by SIGTERM (systemd, docker stop), cleanly as Ctrl+C"
        ), name
        # 3 (banned by a verified run's referee) is a node's alone.
        assert ("; 3 banned by the run's referee;" in epilog) == (name == "node"), name


def test_a_bad_run_config_or_flag_names_the_key_or_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from swarmtrain.config import default_toml

    config, key = tmp_path / "run.toml", str(tmp_path / "k")
    default = default_toml()

    def coordinator(*edits: tuple[str, str]) -> str:
        text = default
        for old, new in edits:
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        config.write_text(text)
        return _fails(capsys, "coordinator", "--identity", key, "--config", str(config))

    assert coordinator(("inner_steps = 20", "inner_step = 20")).startswith(
        f"swarmtrain coordinator: {config}: unknown key training.inner_step (known: "
        "training.inner_steps, training.batch_size, "
    )  # ... and every other key of [training]
    assert coordinator(("\nrounds = 5", "\nrounds = -2")) == (
        f"swarmtrain coordinator: {config}: run.rounds must be a positive integer, got -2"
    )
    assert coordinator(("rate = 0.0", "rate = 0.5"), ("stages = 0", "stages = 2")) == (
        f"swarmtrain coordinator: {config}: verify.rate (0.5) needs a DiLoCo run "
        "(pipeline.stages = 0): pipeline stages are not verified"
    )
    assert coordinator(("rate = 0.0", "rate = 2")) == (
        f"swarmtrain coordinator: {config}: verify.rate must be a number in [0, 1], got 2.0"
    )
    assert _fails(capsys, "coordinator", "--identity", key, "--rounds", "0") == (
        "swarmtrain coordinator: --rounds 0: run.rounds must be a positive integer, got 0"
    )
    assert _fails(capsys, "local", "--verify-rate", "1.5", "--workdir", str(tmp_path / "a")) == (
        "swarmtrain local: --verify-rate must be in [0, 1], got 1.5"
    )
    assert _run(["local", "--verify-rate", "0.5", "--pipeline-stages", "2"]) == 2
    assert capsys.readouterr().err == (
        "swarmtrain local: --verify-rate needs a DiLoCo run (no --pipeline-stages)\n"
    )
    assert not (tmp_path / "a").exists()


def test_version_and_the_help_of_identities_and_listen_addresses_say_what_is_used(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 22: no ``--version``; ``node --help`` gave ~/.local/share/... as the identity
    default while a node uses <state-dir>/identity.key; ``id --identity`` and ``status
    --listen`` had no help."""
    import argparse

    from swarmtrain.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        _run(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("swarmtrain ")
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]

    def shown(command: str) -> str:  # argparse wraps at spaces and after hyphens
        return "".join(sub.choices[command].format_help().split())

    assert "[<state-dir>/identity.key]" in shown("node")
    assert "theEd25519keyfile" in shown("id")
    assert "short-livedpeerlistenson" in shown("status")


def test_verify_names_a_model_config_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.json"
    assert _run(["verify", "--model-config", str(missing)]) == 2  # verify's bad-flag status
    assert capsys.readouterr().err == (
        f"swarmtrain verify: --model-config {missing}: cannot read it: no such file or directory\n"
    )
