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
    err = _fails(capsys, "coordinator", "--config", str(missing))
    assert err == (
        f"swarmtrain coordinator: {missing}: no such file (swarmtrain init {missing} writes a "
        "commented one)"
    )


def test_init_and_id_name_the_path_they_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("")
    err = _fails(capsys, "init", str(tmp_path / "afile" / "run.toml"))
    assert err.endswith("afile/run.toml: a folder on the path is a file"), err
    err = _fails(capsys, "id", "--identity", str(tmp_path / "afile" / "identity.key"))
    assert err.startswith("swarmtrain id: --identity: cannot create identity "), err
    assert err.endswith("afile/identity.key: a folder on the path is a file"), err
    if os.geteuid() != 0:  # root writes through a mode of 0555
        folder = tmp_path / "ro"
        folder.mkdir(mode=0o555)
        assert "permission denied" in _fails(capsys, "init", str(folder / "run.toml"))


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
        (f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER[:20]}", f"'{PEER[:20]}' is not a peer id (cut short"),
        (f"/ip4/127.0.0.1/tcp/70000/p2p/{PEER}", "port 70000 is not a port (1..65535)"),
        (f"/ip4/10.0.0.256/tcp/4001/p2p/{PEER}", "10.0.0.256 is not an IPv4 address"),
        (f"/ip4/10.0.0.1/udp/4001/quic-v1/p2p/{PEER}", "/quic-v1 addresses are not supported"),
    ],
)
def test_node_names_what_is_wrong_with_its_join_address(
    join: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _fails(capsys, "node", "--join", join, "--state-dir", str(tmp_path / "n"))
    assert err.startswith(f"swarmtrain node: --join {join}: {problem}"), err
    assert not (tmp_path / "n").exists()  # refused before anything was written or dialed
