"""``swarmtrain export``: the trained model out of a node's state directory, in files other tools
load.

A DiLoCo node keeps the run spec it verified (``run.spec``, written when it starts) beside its
checkpoints. Export rebuilds the spec's model, takes the newest checkpoint that verifies (its
checksum, then its parameter layout against the model's), puts the checkpoint's global parameters
into the model (the state every peer of the run holds bit for bit after that round) and writes:

* ``[model] kind = "transformers"``: a ``save_pretrained`` folder (``config.json``,
  ``model.safetensors``) that ``AutoModelForCausalLM.from_pretrained`` loads, plus the data's
  tokenizer as ``tokenizer.json`` when the spec names one that this machine has;
* ``kind = "default"``: ``model.safetensors`` (the byte transformer's parameters by name);
* always ``swarmtrain-export.json``: run id, round, state hash, model kind and parameter count.

Nothing is half-written: the files go to a temporary folder beside ``--out``, which is renamed
into place at the end; an ``--out`` that exists and is not empty is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from diloco import layout_digest, load_latest
from swarmtrain.config import with_base
from swarmtrain.runspec import RunSpec
from swarmtrain.training.workload import build_model

SPEC_FILE = "run.spec"
REPORT_FILE = "swarmtrain-export.json"


class ExportError(ValueError):
    """The state directory cannot be exported; the message names the file or the folder."""


@dataclass(frozen=True)
class Exported:
    out: Path
    run_id: str
    round: int  # rounds completed: the state after round ``round - 1``
    state_hash: str
    kind: str
    parameters: int
    files: tuple[str, ...]

    def line(self) -> str:
        return (
            f"exported run {self.run_id} after round {self.round - 1} (state "
            f"{self.state_hash[:12]}): {self.kind} model, {self.parameters:,} parameters -> "
            f"{self.out} ({', '.join(self.files)})"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "out": str(self.out),
            "run_id": self.run_id,
            "round": self.round,
            "state_hash": self.state_hash,
            "kind": self.kind,
            "parameters": self.parameters,
            "files": list(self.files),
        }


def save_spec(state_dir: Path, spec: RunSpec) -> None:
    """Keep the verified spec beside the checkpoints (atomically), for ``export``."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=state_dir, prefix=".run.spec.")
    with os.fdopen(fd, "wb") as file:
        file.write(spec.to_bytes())
    os.replace(temporary, state_dir / SPEC_FILE)


def export(state_dir: Path, out: Path, data_dir: Path = Path(".")) -> Exported:
    """Write the model of ``state_dir``'s newest good checkpoint to ``out`` (see the module
    docstring); the spec's relative tokenizer path is read from ``data_dir`` (the node's
    ``--data-dir``). Raises ExportError naming what is missing or wrong."""
    spec_path = state_dir / SPEC_FILE
    try:
        spec = RunSpec.from_bytes(spec_path.read_bytes())
    except FileNotFoundError:
        raise ExportError(
            f"{spec_path}: no run spec (a DiLoCo node writes it into its --state-dir)"
        ) from None
    config = spec.config
    if config.is_pipeline:
        raise ExportError(f"{spec_path}: run {config.run.id} is a pipeline run (its stages live "
                          "on the servers); export takes a DiLoCo node's state")  # fmt: skip
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out}: exists and is not an empty folder")
    saved = load_latest(state_dir)
    if saved is None:
        raise ExportError(f"{state_dir}: no checkpoint that verifies (diloco-*.ckpt)")
    model = _model_of(spec)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if saved.state.layout != layout_digest([(n, tuple(p.shape)) for n, p in named]):
        raise ExportError(f"{state_dir}: the checkpoint's parameter layout is not the model's "
                          f"that {SPEC_FILE} names")  # fmt: skip
    with torch.no_grad():
        flat = saved.state.params
        offset = 0
        for _, param in named:
            param.copy_(flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        files = _write(spec, model, staging, data_dir)
        report = Exported(
            out,
            config.run.id,
            saved.state.round,
            saved.state.state_hash(),
            config.model.kind,
            sum(p.numel() for _, p in named),
            tuple(sorted([*files, REPORT_FILE])),
        )
        (staging / REPORT_FILE).write_text(json.dumps(report.to_json(), indent=1) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def _model_of(spec: RunSpec) -> nn.Module:
    config = spec.config
    if config.model.kind == "transformers":
        assert isinstance(config.model.config, dict)
        vocab = int(config.model.config.get("vocab_size", 0))
        return build_model(config, vocab_size=vocab, weights=False)  # the checkpoint's replace them
    return build_model(config)


def _write(spec: RunSpec, model: nn.Module, folder: Path, data_dir: Path) -> list[str]:
    from safetensors.torch import save_model

    if spec.config.model.kind != "transformers":
        # A user's module by its own parameter names (``FactoryLM`` holds it as ``inner``).
        own = model.inner if spec.config.model.factory else model
        save_model(own, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    lm = model.lm  # type: ignore[attr-defined]  # diloco.causal_lm.CausalLM
    lm.save_pretrained(folder, safe_serialization=True)
    tokenizer = with_base(spec.config, data_dir).data.tokenizer
    if tokenizer:
        source = Path(tokenizer)
        source = source / "tokenizer.json" if source.is_dir() else source
        if source.is_file():
            shutil.copyfile(source, folder / "tokenizer.json")
    return sorted(p.name for p in folder.iterdir())
