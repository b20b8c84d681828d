"""The console script's entry (``swarmtrain.launch``): a Ctrl+C while it still imports the CLI
(about a second of trio, libp2p and the project) stops the process as a later Ctrl+C does.

In process: the interrupt is raised by the import itself, at the moment a real Ctrl+C lands in
it, which a signal sent to a starting process hits only by timing."""

from __future__ import annotations

import builtins
from typing import Any

import pytest

from swarmtrain import launch


def test_ctrl_c_while_the_cli_imports_exits_130_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_import = builtins.__import__

    def interrupted(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "swarmtrain.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    with pytest.raises(SystemExit) as stopped:
        launch.run()
    assert stopped.value.code == 130
    assert stopped.value.__context__ is None or stopped.value.__suppress_context__
    assert capsys.readouterr().err == "swarmtrain: stopped\n"
