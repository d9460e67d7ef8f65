"""``ttt2la.json``: the versioned manifest beside a converted checkpoint's weights.

It records everything ``ttt2la.load`` needs to rebuild the converted model without the source
checkpoint or calibration data: how to build the module (the recipe), the conversion asked for
(level, backend, strict), the example-input spec, and the conversion report per layer — passes
with their status and any constants a lossy pass folded, schedule and runtime — so the same
conversion can be replayed and checked. Hashes tie it to the weights written beside it and to
the source weights they came from.
"""
from __future__ import annotations

import json

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..validation import MAX_LEVEL
from .errors import ManifestError, read_json
from .example_inputs import INPUT_KINDS

MANIFEST_NAME = "ttt2la.json"
#: Version of the manifest format; ``load`` refuses any other.
MANIFEST_VERSION = 1
FORMAT = "ttt2la-converted-checkpoint"


@dataclass
class Manifest:
    """The contents of ``ttt2la.json`` (see the module docstring)."""

    ttt2la_version: str
    torch_version: str
    level: int
    backend: str
    strict: bool
    recipe: dict                    # Recipe.to_dict()
    example_inputs: dict            # an example-input spec
    source: dict                    # {"path": ..., "sha256": ..., "files": {...}}
    weights: dict                   # {"file": ..., "sha256": ..., "tensors": {name: [dtype, shape]}}
    report: dict                    # ConversionReport.to_dict(): per layer passes, folds, schedule
    files: list[str] = field(default_factory=list)      # every file of the checkpoint
    format: str = FORMAT
    version: int = MANIFEST_VERSION

    def to_dict(self) -> dict:
        d = asdict(self)
        return {"format": d.pop("format"), "version": d.pop("version"), **d}

    @classmethod
    def from_dict(cls, d, where: Path) -> "Manifest":
        """Read a manifest dict, refusing other formats, unknown versions and missing fields."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ManifestError(f"{where}: not a ttt2la manifest (format "
                                f"{d.get('format') if isinstance(d, dict) else None!r})")
        if d.get("version") != MANIFEST_VERSION:
            raise ManifestError(f"{where}: unknown manifest version {d.get('version')!r} (this "
                                f"ttt2la reads version {MANIFEST_VERSION}); convert the source "
                                "checkpoint again with this version")
        try:
            manifest = cls(**d)
        except TypeError as e:
            raise ManifestError(f"{where}: malformed manifest ({e})") from e
        manifest.check_fields(where)
        return manifest

    def check_fields(self, where: Path) -> None:
        """Refuse fields of the wrong type, and files named outside the directory: a manifest
        from a file is read, never trusted to hold what ``to_dict`` wrote."""
        types = {"ttt2la_version": str, "torch_version": str,
                 "level": int, "backend": str, "strict": bool, "recipe": dict,
                 "example_inputs": dict, "source": dict, "weights": dict, "report": dict,
                 "files": list}
        for name, wanted in types.items():
            value = getattr(self, name)
            if not isinstance(value, wanted) or isinstance(value, bool) and wanted is not bool:
                raise ManifestError(f"{where}: malformed manifest: {name} is {value!r}, not a "
                                    f"{wanted.__name__}; convert the source checkpoint again")
        if not 0 <= self.level <= MAX_LEVEL:
            raise ManifestError(f"{where}: malformed manifest: level is {self.level}, and levels "
                                f"run from 0 to {MAX_LEVEL}; convert the source checkpoint again")
        self._check_report(where)
        _check_entries(self.weights, "weights", {"file": str, "sha256": str, "tensors": dict},
                       where)
        _check_entries(self.source, "source", _SOURCE_ENTRIES, where, required=False)
        kind = self.example_inputs.get("kind")
        if kind not in INPUT_KINDS:
            raise ManifestError(f"{where}: malformed manifest: example_inputs.kind is {kind!r:.80}, "
                                f"not one of {', '.join(INPUT_KINDS)}; convert the source "
                                "checkpoint again")
        if kind == "file":
            _check_entries(self.example_inputs, "example_inputs", {"file": str, "sha256": str},
                           where)
        for name in [*self.files, self.weights["file"]]:
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise ManifestError(f"{where}: malformed manifest: {name!r} is not the name of "
                                    "a file in the checkpoint directory")

    def _check_report(self, where: Path) -> None:
        """Refuse a recorded conversion report that does not read back as one, field by field
        (``ConversionReport.from_dict``), so what reads its layers and passes finds them."""
        from ..report import ConversionReport, ReportFormatError

        try:
            ConversionReport.from_dict(self.report)
        except ReportFormatError as e:
            raise ManifestError(f"{where}: malformed manifest: its report: {e}") from e

    def write(self, directory: Path) -> None:
        (Path(directory) / MANIFEST_NAME).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise ManifestError(f"{path}: missing; {directory} is not a converted checkpoint "
                                "written by ttt2la")
        return cls.from_dict(read_json(path, ManifestError), path)

    def folds(self) -> dict:
        """The constants lossy passes folded, per layer and pass: ``{module_path: {pass name:
        folded}}``, empty when no pass folded anything (levels 0–2)."""
        out: dict = {}
        for layer in self.report.get("layers", []):
            for p in layer.get("passes", []):
                if p.get("folded"):
                    out.setdefault(layer.get("module_path", ""), {})[p["name"]] = p["folded"]
        return out


#: What a manifest records of the weights it was converted from (each entry where it applies):
#: shown by the report written beside it, never read back to rebuild the model.
_SOURCE_ENTRIES = {"path": str, "sha256": str, "files": dict, "zoo": str, "seed": int,
                   "held_in_memory": bool}


def _check_entries(record: dict, name: str, types: dict, where: Path,
                   required: bool = True) -> None:
    """Refuse a manifest record (``weights``, ``example_inputs``) lacking an entry or holding
    one of the wrong type, naming it (``required=False``: its entries may be absent)."""
    for key, wanted in types.items():
        if key not in record:
            if not required:
                continue
            raise ManifestError(f"{where}: malformed manifest: {name} records no {key}; convert "
                                "the source checkpoint again")
        if not isinstance(record[key], wanted) or (isinstance(record[key], bool)
                                                   and wanted is not bool):
            raise ManifestError(f"{where}: malformed manifest: {name}.{key} is "
                                f"{record[key]!r:.80}, not a {wanted.__name__}; convert the "
                                "source checkpoint again")


def replay_differences(recorded: dict, replayed: dict) -> list[str]:
    """What differs between the recorded conversion report and the replayed one, layer by
    layer: what decides the function a layer computes (its loop, states and their update rules,
    streams, passes and their exactness, the runtime's op). Timings, drift numbers and the
    runtime's backend may differ by machine, so they are not compared."""
    before, after = _layer_summaries(recorded), _layer_summaries(replayed)
    diffs = [f"layer {k!r}: {'only recorded' if k not in after else 'only replayed'}"
             for k in sorted(set(before) ^ set(after), key=str)]
    for k in sorted(set(before) & set(after), key=str):
        for name in [*before[k], *(n for n in after[k] if n not in before[k])]:
            was, now = before[k].get(name, _ABSENT), after[k].get(name, _ABSENT)
            if was is not None and was != now:
                diffs.append(f"layer {k!r}: {name} {_shown(was)} recorded, {_shown(now)} replayed")
    return diffs


def _layer_summaries(report: dict) -> dict:
    """Per layer path, ``{what: value}`` for each recorded field that decides what the layer
    computes (a field an older writer did not record is None, and not compared)."""
    return {layer.get("module_path"): _layer_summary(layer) for layer in report.get("layers", [])}


def _layer_summary(layer: dict) -> dict:
    runtime = layer.get("runtime")
    out = {name.replace("_", " "): layer.get(name) for name in _LAYER_FIELDS}
    out["runtime op"] = runtime.split("[")[0].strip() if isinstance(runtime, str) else runtime
    for s in layer.get("states", []):
        out.update({f"state {s.get('name')} {f.replace('_', ' ')}": s.get(f) for f in _STATE_FIELDS})
    for p in layer.get("passes", []):
        out.update({f"pass {p.get('step')} {f}": p.get(f) for f in _PASS_FIELDS})
    return out


def _shown(value) -> str:
    return "nothing" if value is _ABSENT else repr(value) if isinstance(value, str) else str(value)


_ABSENT = object()
#: What a report records of the loop it converted, compared when a checkpoint is read back
_LOOP_FIELDS = ("chunk_size", "order", "last_chunk")
#: Of each state: its role, recovered update rule and dependences decide the layer's function
_STATE_FIELDS = ("role", "update_rule", "dependence")
#: Of each pass: which it is, whether it applied, and whether exactly
_PASS_FIELDS = ("name", "status", "exact")
#: Of each layer: the function traced, its loop, streams and schedule, and exactness
_LAYER_FIELDS = ("function", *_LOOP_FIELDS, "streams", "schedule", "reducible", "exact")


__all__ = ["Manifest", "MANIFEST_NAME", "MANIFEST_VERSION", "replay_differences"]
