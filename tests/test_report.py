"""The conversion report: JSON round trips, Markdown and rich renderings, schema checks."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttt2la.errors import ConversionError
from ttt2la.report import (SCHEMA_VERSION, ConversionReport, InspectionReport, LayerReport,
                           PassRecord, ReportFormatError, StateRecord, load_report, render_text)


def lact_layer_report(module_path: str = "blocks.0.ttt", exact: bool = True) -> LayerReport:
    return LayerReport(
        module_path=module_path,
        function="block_causal_lact_swiglu",
        loop_src="zoo/lact_folded.py:83",
        chunk_size=64,
        order="exclusive",
        last_chunk="apply_only",
        states=[
            StateRecord("w1", "final", "W1' = W1 + Muon(a*M + phi(k)^T (lr1*v))", "additive"),
            StateRecord("dw1_momentum", "momentum", "M' = a*M + phi(k)^T (lr1*v)",
                        "scalar affine"),
        ],
        streams=["q", "k", "v", "lr1", "momentum"],
        passes=[
            PassRecord(1, "freeze_theta", "applied", False, "w0 and w2 were updated in the loop",
                       drift={"rel_rms_error": 0.0213, "calibration_batches": 2}),
            PassRecord(2, "drop_norm", "already_satisfied", True, "no normalisation of w1"),
        ],
        schedule="parallel",
        runtime="torch",
        reducible=True,
        exact=exact,
        notes=["the last chunk is applied without an update | as in LaCT"],
        levels={0: "recurrent: w0 updated at lact_folded.py:120", 1: "semi-parallel",
                2: "parallel", 3: "not implemented"},
        check={"rel_rms_error": 3.1e-7, "tolerance": 1e-5, "dtype": "float32"},
    )


def conversion_report() -> ConversionReport:
    return ConversionReport(level=2, backend="torch", strict=True, notes=["calibrated on 2 batches"],
                            layers=[lact_layer_report("blocks.0.ttt"),
                                    lact_layer_report("blocks.1.ttt", exact=False)])


def json_round_trip(report):
    return load_report(json.loads(json.dumps(report.to_dict())))


# -- round trips ---------------------------------------------------------------------------------
def test_conversion_report_round_trips_through_json():
    report = conversion_report()
    back = json_round_trip(report)
    assert isinstance(back, ConversionReport)
    assert back == report
    assert back.layers[0].levels == {0: "recurrent: w0 updated at lact_folded.py:120",
                                     1: "semi-parallel", 2: "parallel", 3: "not implemented"}


def test_inspection_report_round_trips_through_json():
    report = InspectionReport(layers=[lact_layer_report()], notes=["one model"])
    back = json_round_trip(report)
    assert isinstance(back, InspectionReport)
    assert back == report


def test_dict_is_versioned_and_says_its_kind():
    d = conversion_report().to_dict()
    assert d["version"] == SCHEMA_VERSION == 1
    assert d["kind"] == "conversion"
    assert d["exact"] is False
    assert InspectionReport(layers=[]).to_dict()["kind"] == "inspection"


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=24)
drift = st.none() | st.dictionaries(st.sampled_from(["rel_rms_error", "max_abs", "batches"]),
                                    st.floats(allow_nan=False, allow_infinity=False) | st.integers(),
                                    max_size=3)
passes = st.builds(PassRecord, step=st.integers(1, 6), name=text, status=st.sampled_from(
    ["applied", "already_satisfied", "not_applicable"]), exact=st.booleans(), reason=text,
    drift=drift)
states = st.builds(StateRecord, name=text, role=st.sampled_from(["final", "theta", "momentum"]),
                   update_rule=text, dependence=text)
layers = st.builds(
    LayerReport, module_path=text, function=text, loop_src=text, chunk_size=st.integers(1, 4096),
    order=st.sampled_from(["exclusive", "inclusive"]),
    last_chunk=st.sampled_from(["apply_only", "update"]), states=st.lists(states, max_size=3),
    streams=st.lists(text, max_size=4), passes=st.lists(passes, max_size=6),
    schedule=st.sampled_from(["parallel", "semi-parallel", "recurrent"]), runtime=text,
    reducible=st.booleans(), exact=st.booleans(), notes=st.lists(text, max_size=2),
    levels=st.none() | st.dictionaries(st.integers(0, 6), text, max_size=7),
    check=st.none() | st.dictionaries(text, st.floats(allow_nan=False) | text, max_size=3))


@settings(max_examples=60, deadline=None)
@given(level=st.integers(0, 6), layers=st.lists(layers, max_size=3), strict=st.booleans(),
       notes=st.lists(text, max_size=2))
def test_any_report_round_trips(level, layers, strict, notes):
    report = ConversionReport(level=level, layers=layers, backend="torch", strict=strict,
                              notes=notes)
    assert json_round_trip(report) == report
    assert report.exact == all(layer.exact for layer in layers)


# -- refusing what it cannot read ----------------------------------------------------------------
def test_unknown_schema_version_is_refused():
    d = conversion_report().to_dict()
    d["version"] = SCHEMA_VERSION + 1
    with pytest.raises(ReportFormatError, match="schema version 2"):
        ConversionReport.from_dict(d)
    assert issubclass(ReportFormatError, ConversionError)


def test_wrong_kind_is_refused():
    d = InspectionReport(layers=[]).to_dict()
    with pytest.raises(ReportFormatError, match="expected a conversion report"):
        ConversionReport.from_dict(d)
    with pytest.raises(ReportFormatError, match="not a ttt2la report"):
        load_report({"version": 1, "kind": "weights"})


def test_missing_field_is_refused_with_the_layer_named():
    d = conversion_report().to_dict()
    del d["layers"][1]["states"]
    with pytest.raises(ReportFormatError, match="blocks.1.ttt"):
        ConversionReport.from_dict(d)
    del d["level"]
    with pytest.raises(ReportFormatError, match="level"):
        ConversionReport.from_dict(d)


# -- renderings ------------------------------------------------------------------------------------
def test_summary_counts_exact_layers_and_schedules():
    report = conversion_report()
    assert report.summary.startswith(
        "2 TTT layers converted at level 2: 1 exactly, 1 lossy by design (step 1 changes the "
        "function)")
    assert "parallel \u00d72" in report.summary
    assert not report.exact
    exact = ConversionReport(2, [lact_layer_report()], "torch", True)
    assert exact.exact and exact.summary.startswith("1 TTT layer converted exactly at level 2")
    report.loss = {"original": 2.0, "converted": 2.04, "change": 0.04, "inputs": "calibration"}
    assert "loss +0.04 nats on the calibration inputs" in report.summary


def test_summary_says_a_layer_kept_as_written_is_not_converted():
    """strict=False keeps a layer not reducible at the level as the user wrote it: the
    summary says so, not that it was converted."""
    import dataclasses

    from ttt2la.report import KEPT_AS_WRITTEN

    kept = dataclasses.replace(lact_layer_report(), runtime=KEPT_AS_WRITTEN,
                               schedule="recurrent")
    alone = ConversionReport(0, [kept], "auto", False)
    assert alone.summary.startswith("1 TTT layer kept as written at level 0: not reducible "
                                    "there"), alone.summary
    beside = ConversionReport(0, [kept, lact_layer_report()], "auto", False)
    assert "2 TTT layers converted exactly at level 0, 1 of them kept as written" in \
        beside.summary


def test_inspection_summary_names_the_first_parallel_level():
    report = InspectionReport(layers=[lact_layer_report()])
    assert report.summary == "1 TTT layer found; parallel from: level 1 (semi-parallel) \u00d71"
    recurrent = lact_layer_report()
    recurrent.levels = {0: "recurrent: state normalised", 1: "recurrent: state normalised"}
    assert "recurrent only" in InspectionReport(layers=[recurrent]).summary


def test_markdown_lists_every_pass_state_and_level():
    report = conversion_report()
    md = report.to_markdown()
    assert md.startswith("# ttt2la conversion report\n\n" + report.summary)
    for layer in report.layers:
        assert f"## `{layer.module_path}`" in md
        for p in layer.passes:
            assert f"| {p.step} | `{p.name}` | {p.status} |" in md
        for s in layer.states:
            assert f"| `{s.name}` | {s.role} | `{s.update_rule}` | {s.dependence} |" in md
        for level, verdict in layer.levels.items():
            assert f"| {level} | {verdict} |" in md
    assert "rel_rms_error=0.0213, calibration_batches=2" in md
    assert "Check: rel_rms_error=3.100e-07, tolerance=1.000e-05, dtype=float32" in md


def test_a_nested_check_reads_as_fields_not_a_python_dict():
    """The lowering's judgment by the precision criterion is a mapping inside the check: it
    renders as its fields, numbers formatted, not as a Python dict's repr."""
    layer = lact_layer_report()
    layer.check = {"rel_rms_error": 3.1e-07, "lowering": {
        "criterion": "2x the loop's own error", "output": {"rel_rms_error": 4.46e-07, "ok": True}}}
    md = layer.to_markdown()
    assert ("Check: rel_rms_error=3.100e-07, lowering=(criterion=2x the loop's own error, "
            "output=(rel_rms_error=4.460e-07, ok=True))") in md, md
    assert "{" not in md.split("Check:")[1].splitlines()[0]


def test_markdown_escapes_table_separators():
    layer = lact_layer_report()
    layer.states[0].update_rule = "W' = W + |k|"
    md = layer.to_markdown()
    assert "`W' = W + \\|k\\|`" in md
    assert "> the last chunk is applied without an update | as in LaCT" in md


def test_rich_rendering_works_without_a_terminal():
    report = conversion_report()
    rendered = render_text(report, width=160)
    assert str(report) == render_text(report)
    assert rendered.startswith("ttt2la conversion report\n" + report.summary)
    for layer in report.layers:
        assert layer.title in rendered
        for p in layer.passes:
            assert p.name in rendered and p.reason in rendered
        for s in layer.states:
            assert s.name in rendered and s.update_rule in rendered
    assert "schedule parallel  runtime torch" in rendered
    assert "\x1b[" not in rendered


def test_rich_console_renders_the_report_objects():
    from rich.console import Console

    console = Console(record=True, width=100, force_terminal=True)
    console.print(conversion_report())
    console.print(InspectionReport(layers=[lact_layer_report()]))
    exported = console.export_text()
    assert "freeze_theta" in exported and "1 TTT layer found" in exported


def _paths(value, path=()):
    """Every path into a JSON document: keys of objects, indices of lists."""
    yield path
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield from _paths(item, path + (key,))


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner,
                                                                max_size=2),
    max_leaves=4)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), replacement=_json_values)
def test_a_report_with_any_field_replaced_renders_or_is_refused(data, replacement):
    """A report read from a file is checked field by field: with any field, however nested,
    replaced by any JSON value, it either renders in every form or is refused with a
    ``ReportFormatError`` — never another exception from deep in the rendering."""
    import copy

    base = conversion_report().to_dict()
    paths = [p for p in _paths(base) if p]
    path = data.draw(st.sampled_from(paths))
    d = copy.deepcopy(base)
    target = d
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = replacement
    try:
        report = load_report(json.loads(json.dumps(d)))
    except ReportFormatError:
        return
    report.to_markdown()
    render_text(report)
    json.dumps(report.to_dict())


def test_a_pass_drift_of_another_type_is_refused_naming_it():
    d = conversion_report().to_dict()
    d["layers"][0]["passes"][0]["drift"] = "lots"
    with pytest.raises(ReportFormatError, match=r"layers\[0\] 'blocks.0.ttt': passes\[0\] .*drift "
                                                r"is 'lots', not an object or null"):
        load_report(d)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["layers"][0]["passes"][0]["drift"].update(rel_rms_error="x"),
     r"passes\[0\] is malformed: drift\['rel_rms_error'\] is 'x', not a number"),
    (lambda d: d["layers"][0]["check"].update(tolerance=[1e-5]),
     r"check\['tolerance'\] is \[1e-05\], not a number"),
    (lambda d: d["layers"][0]["passes"][0]["drift"].update(nested={"ok": "yes"}),
     r"drift\['nested'\]\['ok'\] is 'yes', not true or false"),
    (lambda d: d.update(level=-1), r"level is -1, not one of 0..6"),
    (lambda d: d.update(level=10**20), r"not one of 0..6"),
    (lambda d: d.update(exact="zz"), r"exact is 'zz', not bool"),
])
def test_a_measurement_or_level_of_another_type_is_refused(edit, match):
    """A report's measurements (drift, folds, checks) are checked inside, and its level is one of
    the levels: a hand-edited number is refused, not rendered as if measured."""
    d = conversion_report().to_dict()
    edit(d)
    with pytest.raises(ReportFormatError, match=match):
        load_report(json.loads(json.dumps(d)))
