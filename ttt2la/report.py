"""What a conversion or an inspection found, per layer and per pass: the user's proof the rewrite is right.

``ConversionReport`` is attached to every converted model as ``converted.ttt2la_report``;
``InspectionReport`` is what ``ttt2la.inspect`` returns. Both render three ways: a rich table per
layer (``print(report)`` or ``rich.print(report)``), Markdown (``to_markdown()``) and a versioned,
JSON-serialisable dict (``to_dict()`` / ``from_dict()``) for tools and CI logs.
"""
from __future__ import annotations

import io
import math

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .errors import ConversionError

#: The runtime a report names for a layer not reducible at its level and kept as the user wrote
#: it (``strict=False``): the user's own code runs.
KEPT_AS_WRITTEN = "kept as written (recurrent)"

#: Version of the dict / JSON schema written by ``to_dict``; bump it when a field changes meaning.
SCHEMA_VERSION = 1

#: Levels a report can speak about: 0 (as written) to 6 (standard linear attention), paper Table 2.
LEVELS = range(7)


class ReportFormatError(ConversionError, ValueError):
    """A serialised report could not be read: wrong schema version, wrong kind or a missing field."""


@dataclass
class PassRecord:
    """One pass of the level's pipeline on one layer: what it did and whether the function is unchanged.

    ``status`` is ``applied``, ``already_satisfied`` (nothing to change, still exact) or
    ``not_applicable``; ``drift`` holds what a lossy pass measured (e.g. ``rel_rms_error``,
    with and without its fold); ``folded`` the constants it folded into the remaining weights.
    """

    step: int
    name: str
    status: str
    exact: bool
    reason: str
    drift: dict | None = None
    folded: dict | None = None


@dataclass
class StateRecord:
    """One loop-carried state and the update rule the associativity checker recovered for it."""

    name: str
    role: str
    update_rule: str
    dependence: str


@dataclass
class LayerReport:
    """Everything found about one recognized TTT loop and what was done to it."""

    module_path: str
    function: str
    loop_src: str
    chunk_size: int
    order: str
    last_chunk: str
    states: list[StateRecord]
    streams: list[str]
    passes: list[PassRecord]
    schedule: str
    runtime: str
    reducible: bool
    exact: bool
    notes: list[str] = field(default_factory=list)
    levels: dict[int, str] | None = None
    check: dict | None = None
    #: per batch size the converted layer has run at: what ran (filled as shapes run)
    runs: dict[str, str] = field(default_factory=dict)
    #: per batch size where the chosen plan could not run (``strict=False``): what ran instead
    fallbacks: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """A JSON-serialisable dict (level keys become strings, as JSON requires)."""
        d = asdict(self)
        if self.levels is not None:
            d["levels"] = {str(k): v for k, v in self.levels.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "layer") -> "LayerReport":
        """Rebuild a layer report from ``to_dict``'s output (or the same dict after a JSON round
        trip). Every field is checked, nested ones too, so a report read from a file renders or
        is refused with a ``ReportFormatError`` naming the field (``where``: how the caller
        names this entry, e.g. ``layers[0]``)."""
        where = f"{where} {d.get('module_path')!r}" \
            if isinstance(d, dict) and isinstance(d.get("module_path"), str) else where
        fields = _record(d, _LAYER_FIELDS, where)
        fields["states"] = [StateRecord(**_record(s, _STATE_FIELDS, f"{where}: states[{i}]"))
                            for i, s in enumerate(fields["states"])]
        fields["passes"] = [PassRecord(**_record(p, _PASS_FIELDS, f"{where}: passes[{i}]"))
                            for i, p in enumerate(fields["passes"])]
        for i, p in enumerate(fields["passes"]):
            _measurements(p.drift, f"{where}: passes[{i}]", "drift")
            _measurements(p.folded, f"{where}: passes[{i}]", "folded")
        _measurements(fields["check"], where, "check")
        for name in ("streams", "notes"):
            _items(fields, name, str, where)
        for name in ("runs", "fallbacks"):
            _items(fields, name, str, where, mapping=True)
        if fields.get("levels") is not None:
            _items(fields, "levels", str, where, mapping=True)
            try:
                fields["levels"] = {int(k): v for k, v in fields["levels"].items()}
            except ValueError as e:
                raise _malformed(where, "levels", fields["levels"],
                                 "a mapping from level numbers") from e
        return cls(**fields)

    # -- renderings -----------------------------------------------------------------------
    @property
    def title(self) -> str:
        return f"{self.module_path or '<model>'}: loop in {self.function} ({self.loop_src})"

    def to_markdown(self, heading: str = "##") -> str:
        """This layer as a Markdown section: facts, passes, states, levels, check and notes."""
        lines = [f"{heading} `{self.module_path or '<model>'}`", ""]
        lines += [
            f"- loop: `{self.function}` at `{self.loop_src}`",
            f"- chunk size {self.chunk_size}, order {self.order}, last chunk {self.last_chunk}",
            f"- streams: {', '.join(f'`{s}`' for s in self.streams) or 'none'}",
            f"- schedule: **{self.schedule}** on runtime `{self.runtime}`",
            f"- reducible: {_yes_no(self.reducible)}; exact: {_yes_no(self.exact)}",
        ]
        if self.passes:
            lines += ["", "| step | pass | status | exact | reason | drift | folded |",
                      "|---:|---|---|---|---|---|---|"]
            lines += [f"| {p.step} | `{p.name}` | {p.status} | {_yes_no(p.exact)} | "
                      f"{_md_cell(p.reason)} | {_md_cell(_format_mapping(p.drift))} | "
                      f"{_md_cell(_format_mapping(p.folded))} |" for p in self.passes]
        if self.states:
            lines += ["", "| state | role | update rule | dependence |", "|---|---|---|---|"]
            lines += [f"| `{s.name}` | {s.role} | `{_md_cell(s.update_rule)}` | "
                      f"{_md_cell(s.dependence)} |" for s in self.states]
        if self.levels:
            lines += ["", "| level | verdict |", "|---:|---|"]
            lines += [f"| {k} | {_md_cell(v)} |" for k, v in sorted(self.levels.items())]
        if self.check:
            lines += ["", f"Check: {_format_mapping(self.check)}"]
        if self.runs:
            lines += ["", "Ran:"] + [f"- {shape}: {what}" for shape, what in self.runs.items()]
        if self.fallbacks:
            lines += [""] + [f"> fallback at {k}: {v}" for k, v in self.fallbacks.items()]
        if self.notes:
            lines += [""] + [f"> {n}" for n in self.notes]
        return "\n".join(lines)

    def __rich__(self) -> Group:
        facts = Text.assemble(
            ("loop ", "dim"), f"{self.function} at {self.loop_src}",
            ("  chunk ", "dim"), str(self.chunk_size),
            ("  order ", "dim"), self.order,
            ("  last chunk ", "dim"), self.last_chunk,
            ("\nstreams ", "dim"), ", ".join(self.streams) or "none",
            ("\nschedule ", "dim"), (self.schedule, "bold"),
            ("  runtime ", "dim"), self.runtime,
            ("  reducible ", "dim"), _yes_no(self.reducible),
            ("  exact ", "dim"), (_yes_no(self.exact), "green" if self.exact else "yellow"),
        )
        parts: list[Any] = [Text(self.title, style="bold"), facts]
        if self.passes:
            passes = Table("step", "pass", "status", "exact", "reason", "drift", "folded",
                           box=box.SIMPLE_HEAD, title="passes", title_justify="left")
            for p in self.passes:
                passes.add_row(str(p.step), p.name, p.status,
                               Text(_yes_no(p.exact), style="green" if p.exact else "yellow"),
                               p.reason, _format_mapping(p.drift), _format_mapping(p.folded))
            parts.append(passes)
        if self.states:
            states = Table("state", "role", "update rule", "dependence",
                           box=box.SIMPLE_HEAD, title="states", title_justify="left")
            for s in self.states:
                states.add_row(s.name, s.role, s.update_rule, s.dependence)
            parts.append(states)
        if self.levels:
            levels = Table("level", "verdict", box=box.SIMPLE_HEAD, title="levels",
                           title_justify="left")
            for k, v in sorted(self.levels.items()):
                levels.add_row(str(k), v)
            parts.append(levels)
        if self.check:
            parts.append(Text.assemble(("check ", "dim"), _format_mapping(self.check)))
        parts += [Text.assemble(("ran at ", "dim"), f"{shape}: {what}")
                  for shape, what in self.runs.items()]
        parts += [Text(f"fallback at {k}: {v}", style="bold yellow")
                  for k, v in self.fallbacks.items()]
        parts += [Text(f"note: {n}", style="italic") for n in self.notes]
        return Group(*parts)


@dataclass
class ConversionReport:
    """The report of one ``ttt2la.convert`` call: the level asked for and one ``LayerReport`` per loop."""

    level: int
    layers: list[LayerReport]
    backend: str
    strict: bool
    notes: list[str] = field(default_factory=list)
    #: for a language model: next-token cross-entropy of the original and the converted model
    loss: dict | None = None

    kind = "conversion"

    @property
    def exact(self) -> bool:
        """True when every converted layer computes the same function as the original."""
        return all(layer.exact for layer in self.layers)

    def folds(self) -> dict:
        """Every constant the lossy passes folded, as ``convert(..., folds=)`` replays them:
        ``{layer path: {pass name: constants}}`` (layers that folded nothing left out)."""
        out = {}
        for layer in self.layers:
            done = {p.name: p.folded for p in layer.passes if p.folded}
            if done:
                out[layer.module_path] = done
        return out

    @property
    def summary(self) -> str:
        """One line in the tone of a dry-run report: how many layers converted exactly, and how
        (a layer kept as written, not reducible at the level with ``strict=False``, said so)."""
        n, n_exact = len(self.layers), sum(layer.exact for layer in self.layers)
        kept = sum(layer.runtime == KEPT_AS_WRITTEN for layer in self.layers)
        layers = f"{n} TTT layer{'s' if n != 1 else ''}"
        if kept == n:
            line = (f"{layers} kept as written at level {self.level}: not reducible there, the "
                    "user's own code runs")
        elif n_exact == n:
            line = f"{layers} converted exactly at level {self.level}"
            if kept:
                line += f", {kept} of them kept as written (not reducible there)"
        else:
            steps = sorted({p.step for layer in self.layers for p in layer.passes
                            if p.status == "applied" and not p.exact})
            which = (f"step {steps[0]} changes" if len(steps) == 1 else
                     f"steps {', '.join(map(str, steps))} change")
            exact = f"{n_exact} exactly, {n - n_exact} " if n_exact else ""
            line = (f"{layers} converted at level {self.level}: {exact}lossy by design "
                    f"({which} the function)")
            if self.loss and self.loss.get("change") is not None:
                line += (f", loss {self.loss['change']:+.3g} nats on the "
                         f"{self.loss.get('inputs', 'calibration')} inputs")
        line += f" (backend {self.backend}, strict={self.strict})"
        schedules = _count(layer.schedule for layer in self.layers)
        return line + (f"; schedules: {schedules}" if schedules else "")

    def to_dict(self) -> dict:
        """A JSON-serialisable dict with a ``version`` field (see ``SCHEMA_VERSION``)."""
        return {"version": SCHEMA_VERSION, "kind": self.kind, "level": self.level,
                "backend": self.backend, "strict": self.strict, "exact": self.exact,
                "notes": list(self.notes), "loss": self.loss,
                "layers": [layer.to_dict() for layer in self.layers]}

    @classmethod
    def from_dict(cls, d: dict) -> "ConversionReport":
        """Rebuild a report from ``to_dict``'s output; refuses other schema versions and kinds."""
        _check_header(d, cls.kind)
        if _typed(d, "level", int, cls.kind, 0) not in LEVELS:
            raise ReportFormatError(f"the conversion report's level is {d['level']!r}, not one of "
                                    f"{LEVELS.start}..{LEVELS.stop - 1}; re-create it with this "
                                    "version of ttt2la")
        _typed(d, "exact", bool, cls.kind, False)
        try:
            return cls(level=_typed(d, "level", int, cls.kind),
                       backend=_typed(d, "backend", str, cls.kind),
                       strict=_typed(d, "strict", bool, cls.kind),
                       notes=_notes(d, cls.kind),
                       loss=_loss(d, cls.kind),
                       layers=_layers(d, cls.kind))
        except KeyError as e:
            raise ReportFormatError(f"the conversion report has no {e} field; re-create it "
                                    "with this version of ttt2la") from e

    def to_markdown(self) -> str:
        """The whole report as a Markdown document (a summary line, then one section per layer)."""
        return _markdown("ttt2la conversion report", self.summary, self.notes, self.layers)

    def __rich__(self) -> Group:
        return _rich("ttt2la conversion report", self.summary, self.notes, self.layers)

    def __str__(self) -> str:
        return render_text(self)


@dataclass
class InspectionReport:
    """What ``ttt2la.inspect`` found: every recognized TTT loop and what each level would give it."""

    layers: list[LayerReport]
    notes: list[str] = field(default_factory=list)

    kind = "inspection"

    @property
    def summary(self) -> str:
        """One line: how many TTT loops were found and the lowest level at which each runs in parallel."""
        n = len(self.layers)
        line = f"{n} TTT layer{'s' if n != 1 else ''} found"
        first = _count(_first_parallel_level(layer) for layer in self.layers)
        return line + (f"; parallel from: {first}" if first else "")

    def to_dict(self) -> dict:
        """A JSON-serialisable dict with a ``version`` field (see ``SCHEMA_VERSION``)."""
        return {"version": SCHEMA_VERSION, "kind": self.kind, "notes": list(self.notes),
                "layers": [layer.to_dict() for layer in self.layers]}

    @classmethod
    def from_dict(cls, d: dict) -> "InspectionReport":
        """Rebuild a report from ``to_dict``'s output; refuses other schema versions and kinds."""
        _check_header(d, cls.kind)
        try:
            return cls(layers=_layers(d, cls.kind),
                       notes=_notes(d, cls.kind))
        except KeyError as e:
            raise ReportFormatError(f"the inspection report has no {e} field; re-create it "
                                    "with this version of ttt2la") from e

    def to_markdown(self) -> str:
        """The whole report as a Markdown document (a summary line, then one section per layer)."""
        return _markdown("ttt2la inspection report", self.summary, self.notes, self.layers)

    def __rich__(self) -> Group:
        return _rich("ttt2la inspection report", self.summary, self.notes, self.layers)

    def __str__(self) -> str:
        return render_text(self)


def load_report(d: dict) -> ConversionReport | InspectionReport:
    """Rebuild whichever report ``d`` holds (its ``kind`` field says which)."""
    kinds = {cls.kind: cls for cls in (ConversionReport, InspectionReport)}
    kind = d.get("kind") if isinstance(d, dict) else None
    if not isinstance(kind, str) or kind not in kinds:
        raise ReportFormatError(f"not a ttt2la report: its kind is {kind!r}, expected one of "
                                f"{sorted(kinds)}")
    return kinds[kind].from_dict(d)


def render_text(renderable: Any, width: int = 120) -> str:
    """Render a rich renderable to plain text (no colours, no terminal needed)."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False,
            legacy_windows=False, soft_wrap=False).print(renderable)
    return buffer.getvalue()


# -- shared rendering helpers ---------------------------------------------------------------
_MISSING = object()


def _typed(d: dict, name: str, types, kind: str, default: Any = _MISSING) -> Any:
    """Field ``name`` of a serialised report, refused (``ReportFormatError``) when it is not of
    ``types``: a report from a file is read, never trusted to hold what ``to_dict`` wrote. A
    missing field without a ``default`` raises ``KeyError``, said by the caller."""
    value = d[name] if default is _MISSING else d.get(name, default)
    wanted = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in wanted or not isinstance(value, wanted):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in wanted)
        raise ReportFormatError(f"the {kind} report's {name} is {value!r}, not {names}; "
                                "re-create it with this version of ttt2la")
    return value


#: The fields of a serialised layer, pass and state: ``(types, default)``, ``_MISSING`` for a
#: required field.
_LAYER_FIELDS = {
    "module_path": (str, _MISSING), "function": (str, _MISSING), "loop_src": (str, _MISSING),
    "chunk_size": (int, _MISSING), "order": (str, _MISSING), "last_chunk": (str, _MISSING),
    "states": (list, _MISSING), "streams": (list, _MISSING), "passes": (list, _MISSING),
    "schedule": (str, _MISSING), "runtime": (str, _MISSING), "reducible": (bool, _MISSING),
    "exact": (bool, _MISSING), "notes": (list, []), "levels": ((dict, type(None)), None),
    "check": ((dict, type(None)), None), "runs": (dict, {}), "fallbacks": (dict, {})}
_PASS_FIELDS = {
    "step": (int, _MISSING), "name": (str, _MISSING), "status": (str, _MISSING),
    "exact": (bool, _MISSING), "reason": (str, _MISSING),
    "drift": ((dict, type(None)), None), "folded": ((dict, type(None)), None)}
_STATE_FIELDS = {name: (str, _MISSING) for name in ("name", "role", "update_rule", "dependence")}


def _malformed(where: str, name: str, value: Any, wanted: str) -> "ReportFormatError":
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ReportFormatError(f"the report entry for {where} is malformed: {name} is {shown}, "
                             f"not {wanted}; re-create the report with this version of ttt2la")


def _record(d: Any, spec: dict, where: str) -> dict:
    """The fields of the serialised record ``d`` checked against ``spec`` (defaults filled in);
    a record that is not an object, a missing, unknown or mistyped field is refused."""
    if not isinstance(d, dict):
        raise ReportFormatError(f"the report entry for {where} is {type(d).__name__} "
                                f"{d!r:.60}, not an object; re-create the report with this "
                                "version of ttt2la")
    unknown = sorted(set(d) - set(spec), key=str)
    if unknown:
        raise ReportFormatError(f"the report entry for {where} has unknown field(s) "
                                f"{', '.join(map(str, unknown))}; re-create the report with "
                                "this version of ttt2la")
    fields = {}
    for name, (types, default) in spec.items():
        if name not in d and default is _MISSING:
            raise ReportFormatError(f"the report entry for {where} has no {name} field; "
                                    "re-create the report with this version of ttt2la")
        value = d.get(name, default)
        wanted = types if isinstance(types, tuple) else (types,)
        if isinstance(value, bool) and bool not in wanted or not isinstance(value, wanted):
            names = " or ".join("null" if t is type(None) else
                                {"dict": "an object", "list": "a list"}.get(t.__name__, t.__name__)
                                for t in wanted)
            raise _malformed(where, name, value, names)
        fields[name] = value
    return fields


#: Keys of a report's measurement mappings (drift, folds, checks) and the type each must hold.
_MEASURED = {**dict.fromkeys(("rel_rms_error", "unfolded_rel_rms_error", "loss_change",
                              "error_vs_float64", "reference_error_vs_float64", "bound",
                              "tolerance", "residual", "identity_residual"), "a number"),
             **dict.fromkeys(("ok", "exact"), "true or false"),
             **dict.fromkeys(("inputs", "criterion", "plan"), "text")}


def _measurements(value: Any, where: str, name: str, depth: int = 0) -> None:
    """Refuse a measurement mapping (``drift``, ``folded``, ``check``) holding other than JSON
    scalars, or a known measurement of another type: a report from a file is never trusted."""
    if depth > 8:
        raise _malformed(where, name, value, "a mapping nested at most 8 deep")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or not _holds(_MEASURED.get(key), item):
                raise _malformed(where, f"{name}[{key!r}]", item, _MEASURED.get(key, "a value"))
            _measurements(item, where, f"{name}[{key!r}]", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _measurements(item, where, f"{name}[{i}]", depth + 1)
    elif not isinstance(value, (str, int, float, bool, type(None))):
        raise _malformed(where, name, value, "a number, text, true, false or null")


def _holds(wanted: str | None, value: Any) -> bool:
    """Whether ``value`` is what a measurement key ``wanted`` (``_MEASURED``'s words) holds;
    null stands for a measurement not taken."""
    if value is None or wanted is None:
        return True
    if wanted == "a number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, bool if wanted == "true or false" else str)


def _items(fields: dict, name: str, types, where: str, mapping: bool = False) -> None:
    """Refuse a list (or a mapping's values, ``mapping``) in ``fields[name]`` holding other
    than ``types``; the list is copied."""
    value = fields[name]
    items = value.values() if mapping else value
    if not all(isinstance(x, types) for x in items):
        raise _malformed(where, name, value, "a mapping to text" if mapping else "a list of text")
    fields[name] = dict(value) if mapping else list(value)


def _layers(d: dict, kind: str) -> list["LayerReport"]:
    return [LayerReport.from_dict(layer, f"layers[{i}]")
            for i, layer in enumerate(_typed(d, "layers", list, kind))]


def _notes(d: dict, kind: str) -> list[str]:
    notes = _typed(d, "notes", list, kind, [])
    if not all(isinstance(n, str) for n in notes):
        raise ReportFormatError(f"the {kind} report's notes are {notes!r:.60}, not a list of "
                                "text; re-create it with this version of ttt2la")
    return list(notes)


def _loss(d: dict, kind: str) -> dict | None:
    loss = _typed(d, "loss", (dict, type(None)), kind, None)
    for name, wanted in (("change", "a number"), ("inputs", "text")):
        value = (loss or {}).get(name)
        if not _holds(wanted, value):
            raise ReportFormatError(f"the {kind} report's loss {name} is {value!r:.60}, not "
                                    f"{wanted}; re-create it with this version of ttt2la")
    return loss


def _check_header(d: Any, kind: str) -> None:
    if not isinstance(d, dict):
        raise ReportFormatError(f"a {kind} report must be a dict, got {type(d).__name__}")
    version = d.get("version")
    if version != SCHEMA_VERSION:
        raise ReportFormatError(f"this {kind} report has schema version {version!r}; this "
                                f"version of ttt2la reads version {SCHEMA_VERSION} only")
    if d.get("kind", kind) != kind:
        raise ReportFormatError(f"expected a {kind} report, got a {d.get('kind')} report; "
                                "use ttt2la.report.load_report to read either")


def _markdown(title: str, summary: str, notes: list[str], layers: list[LayerReport]) -> str:
    parts = [f"# {title}", "", summary]
    if notes:
        parts += [""] + [f"> {n}" for n in notes]
    for layer in layers:
        parts += ["", layer.to_markdown()]
    return "\n".join(parts) + "\n"


def _rich(title: str, summary: str, notes: list[str], layers: list[LayerReport]) -> Group:
    parts: list[Any] = [Text(title, style="bold underline"), Text(summary)]
    parts += [Text(f"note: {n}", style="italic") for n in notes]
    for layer in layers:
        parts += [Text(""), layer]
    return Group(*parts)


def _first_parallel_level(layer: LayerReport) -> str:
    for level, verdict in sorted((layer.levels or {}).items()):
        if verdict.startswith(("parallel", "semi-parallel")):
            return f"level {level} ({verdict.split(':')[0]})"
    return "recurrent only"


def _count(items: Iterable[str]) -> str:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return ", ".join(f"{k} \u00d7{v}" for k, v in counts.items())


def _format_mapping(m: dict | None) -> str:
    if not m:
        return ""
    return ", ".join(f"{k}={_format_value(v)}" for k, v in m.items())


def _format_value(v: Any) -> str:
    if isinstance(v, dict):                  # a nested measurement: the lowering's judgment
        return f"({_format_mapping(v)})"
    if isinstance(v, (list, tuple)):
        flat = list(_flatten(v))
        shown = ", ".join(_format_value(x) for x in flat[:4])
        return f"[{shown}{', …' if len(flat) > 4 else ''}]"
    if isinstance(v, float) and math.isfinite(v) and v != 0 and not 1e-3 <= abs(v) < 1e4:
        return f"{v:.3e}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _flatten(v):
    for x in v:
        if isinstance(x, (list, tuple)):
            yield from _flatten(x)
        else:
            yield x


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


__all__ = ["SCHEMA_VERSION", "ReportFormatError", "PassRecord", "StateRecord", "LayerReport",
           "ConversionReport", "InspectionReport", "load_report", "render_text"]
