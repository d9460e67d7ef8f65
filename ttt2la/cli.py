"""The ``ttt2la`` command line: ``demo``, ``inspect``, ``convert``, ``report`` and ``bench``.

Models come from a checkpoint — a Hugging Face directory, a state dict with ``--model
pkg.module:factory``, a converted checkpoint directory — or from the bundled zoo (``--zoo NAME``,
or the name in place of the checkpoint). ``convert --out DIR`` writes a converted checkpoint that
``ttt2la.load`` rebuilds. Bad input (a missing or corrupt file, weights that do not fit, an
output path that exists ...) is answered with one line naming what and where, exit status 2,
and nothing written; so is an interruption (Ctrl-C), whose line names any output already
written whole before it.
"""
from __future__ import annotations

import argparse
import json
import sys

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .as_written import CALLS_TO_DECIDE
from .checkpoint.errors import CheckpointError
from .drift import run_module
from .errors import ConversionError, first_line
from .report import ConversionReport, InspectionReport, load_report
from .timing import Timing, time_side_by_side
from .validation import InvalidInputError

#: Exit status of bad input (a command line misuse, a file that cannot be read or written, a
#: checkpoint that does not fit its model) and of an interruption; nothing is written.
EXIT_BAD_INPUT = 2
#: The same status, under its former name.
EXIT_UNSUPPORTED = EXIT_BAD_INPUT
#: Exit status when a conversion, an inspection or a report file is refused.
EXIT_REFUSED = 1

VOCAB_SIZE = 256


@dataclass(frozen=True)
class ZooModel:
    """A bundled model the command line can build: a seeded constructor and its example inputs."""

    description: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[int, int, torch.Generator], tuple]   # (batch, length, generator) -> inputs
    length: int            # default sequence length of the example inputs
    chunk_size: int

    def example_inputs(self, batch: int, length: int | None = None, seed: int = 0) -> tuple:
        """Seeded example inputs of ``batch`` sequences of ``length`` tokens (default: ``self.length``)."""
        generator = torch.Generator().manual_seed(seed)
        return self.inputs(batch, length or self.length, generator)


def _token_ids(batch: int, length: int, generator: torch.Generator) -> tuple:
    return (torch.randint(0, VOCAB_SIZE, (batch, length), generator=generator),)


def _features(d_model: int) -> Callable[[int, int, torch.Generator], tuple]:
    def inputs(batch: int, length: int, generator: torch.Generator) -> tuple:
        return (torch.randn(batch, length, d_model, generator=generator),)
    return inputs


def _lact_lm(style: str = "folded", d_model: int = 64, n_layers: int = 2, num_heads: int = 2,
             chunk_size: int = 64, **layer_kwargs) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        from .zoo import TinyLaCTLM
        return TinyLaCTLM(VOCAB_SIZE, d_model, n_layers, num_heads, chunk_size, style=style,
                          **layer_kwargs)
    return build


def _lact_layer(**kw) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        from .zoo import LaCTFoldedLayer
        return LaCTFoldedLayer(64, 2, 64, **kw)
    return build


def _lact_published_layer() -> torch.nn.Module:
    from .zoo import LaCTPublishedLayer
    return LaCTPublishedLayer(64, 2, 64)


def _per_token_inline_layer() -> torch.nn.Module:
    from .zoo import PerTokenInlineTTTLayer
    return PerTokenInlineTTTLayer(64, 4)


def _gated_memory() -> torch.nn.Module:
    from .zoo import GatedChunkMemory
    return GatedChunkMemory(256, 4, 16)


def _titans_linear_memory() -> torch.nn.Module:
    from .zoo import TitansLinearMemory
    return TitansLinearMemory(64, 16, momentum=True)


def _fla_reference(rule: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        from .zoo import FlaReferenceLayer
        return FlaReferenceLayer(256, 4, rule)
    return build


def _per_token_layer() -> torch.nn.Module:
    from .zoo import PerTokenTTTLayer
    return PerTokenTTTLayer(64, 4)


ZOO: dict[str, ZooModel] = {
    "lact-lm": ZooModel("2-block LaCT language model (SwiGLU fast weights, momentum, Muon, "
                        "weight norm), heads folded into the batch",
                        _lact_lm(), _token_ids, length=512, chunk_size=64),
    "lact-lm-heads": ZooModel("the same language model with head-major LaCT layers written "
                              "with torch.func.grad",
                              _lact_lm(style="heads"), _token_ids, length=512, chunk_size=64),
    "lact-layer": ZooModel("one LaCT layer as published (d_model 64, 2 heads, chunk 64)",
                           _lact_layer(), _features(64), length=512, chunk_size=64),
    "lact-variant2": ZooModel("one LaCT layer built as the paper's variant 2 (Θ not updated, "
                              "no weight norm)",
                              _lact_layer(update_theta=False, weight_norm=False), _features(64),
                              length=512, chunk_size=64),
    "lact-published": ZooModel("one LaCT layer in the style of its published operator: "
                               "compiled, heads folded into the batch by the caller, bf16 "
                               "Newton–Schulz (d_model 64, 2 heads, chunk 64)",
                               _lact_published_layer, _features(64), length=512, chunk_size=64),
    "per-token": ZooModel("per-token linear TTT layer (update, then read; 4 heads)",
                          _per_token_layer, _features(64), length=64, chunk_size=1),
    "per-token-inline": ZooModel("the per-token layer with its token loop written inline in "
                                 "forward, outputs stacked (4 heads)",
                                 _per_token_inline_layer, _features(64), length=64, chunk_size=1),
    "gated-memory": ZooModel("a gated linear memory: 4 heads of 64, a decay per chunk of 16 "
                             "from a gate, einsum style (a loop over the chunks on a CPU)",
                             _gated_memory, _features(256), length=512, chunk_size=16),
    "titans-linear": ZooModel("a Titans-like linear memory with momentum and weight decay "
                              "(dim 64, chunk 16)",
                              _titans_linear_memory, _features(64), length=512, chunk_size=16),
    "gla": ZooModel("gated linear attention, a gate per key channel, token by token as "
                    "flash-linear-attention's reference loop writes it (4 heads of 64)",
                    _fla_reference("vector_gate"), _features(256), length=512, chunk_size=1),
    "normalised-attention": ZooModel("linear attention with its normaliser (elu + 1 features, "
                                     "a second memory of the keys), token by token (4 heads "
                                     "of 64)",
                                     _fla_reference("normalised"), _features(256), length=512,
                                     chunk_size=1),
    "rwkv6": ZooModel("RWKV-6's time mixing: a decay per key channel, the state read before "
                      "each token's write plus the token's own product weighted by a bonus, "
                      "token by token (4 heads of 64)",
                      _fla_reference("rwkv6"), _features(256), length=512, chunk_size=1),
}


def build_zoo_model(name: str, seed: int = 0) -> torch.nn.Module:
    """Build the bundled model ``name`` with weights drawn from ``seed``, in eval mode."""
    torch.manual_seed(seed)
    return ZOO[name].build().eval()


# -- throughput ---------------------------------------------------------------------------------
def measure_throughput(models: dict[str, Callable], inputs: tuple, units: float, *,
                       repeats: int = 15, warmup: int = 2, max_seconds: float = 60.0,
                       progress: Progress | None = None) -> dict[str, float]:
    """Rate of each model on the same inputs, in ``units`` (tokens, FLOPs ...) per second.

    The median over interleaved rounds (``ttt2la.timing.time_side_by_side``: ``warmup`` untimed
    rounds, then up to ``repeats`` timed rounds, at least 3, time-boxed by ``max_seconds``).
    Use ``measure_timings`` for the spread as well.
    """
    timings = measure_timings(models, inputs, units, repeats=repeats, warmup=warmup,
                              max_seconds=max_seconds, progress=progress)
    return {name: t.rate for name, t in timings.items()}


def measure_timings(models: dict[str, Callable], inputs: tuple, units: float, *,
                    repeats: int = 15, warmup: int = 2, max_seconds: float = 60.0,
                    progress: Progress | None = None, no_grad: bool = True) -> dict[str, Timing]:
    """``time_side_by_side`` with a progress bar: per-round times, median and spread per model."""
    task = progress.add_task(f"timing {len(models)} models side by side", total=repeats) \
        if progress is not None else None

    def advance(done: int) -> None:
        if progress is not None:
            progress.update(task, completed=done)
    return time_side_by_side(models, inputs, units, rounds=repeats, warmup=warmup,
                             max_seconds=max_seconds, no_grad=no_grad, on_round=advance)


def ran_plans(model: torch.nn.Module, batch: int | None = None) -> str:
    """The plans a converted model's layers run — schedule and implementation — as one string.

    Read from the plans the converted layers built for the batch sizes they have run at (only
    ``batch`` if given; so call it after running the model), else from the conversion report.
    Where the report names another schedule or op than the one that ran, that is said too.
    """
    seen, kept = [], False
    for module in model.modules():
        state = getattr(module, "_ttt2la", None)
        for size, loop in getattr(state, "_loop_cache", {}).items():
            if batch is not None and size != batch:
                continue
            plan = loop.plan
            compiled = getattr(state, "compiled", None)
            under = f", under {compiled.name}" if compiled is not None \
                and size in compiled.batches else ""
            seen.append(f"{getattr(plan, 'schedule', '?')} on "
                        f"{getattr(plan, 'implementation', '?')}{under}")
            kept = kept or (state.as_written is not None and state.as_written.kept_at(size))
    report = getattr(model, "ttt2la_report", None)
    named = sorted({f"{layer.schedule} on {layer.runtime}"
                    for layer in getattr(report, "layers", [])})
    if not seen:
        return ", ".join(named) or "as written"
    seen = sorted(set(seen))
    also = [AS_WRITTEN_FASTER] if kept else []
    if named and {_op_name(p) for p in seen} != {_op_name(p) for p in named}:
        return f"{', '.join(also + seen)} (the report names {', '.join(named)})"
    return ", ".join(also + seen)


#: What ``ran_plans`` says of a layer whose race kept the user's own code.
AS_WRITTEN_FASTER = "as written without gradients (the user's loop, measured faster)"


def _op_name(plan: str) -> str:
    """``"parallel on block_linear_attention[auto]"`` -> ``"parallel on block_linear_attention"``
    (and without the compiler that ran it, if one did)."""
    return plan.split(", under ")[0].split("[")[0].split("(")[0].strip()


def throughput_table(original: torch.nn.Module, converted: dict[str, torch.nn.Module],
                     inputs: tuple, *, repeats: int, max_seconds: float = 60.0,
                     progress: Progress | None = None, compiled: str | None = None,
                     not_built: dict[str, str] | None = None) -> Table:
    """Compare the original model with its converted forms side by side: tokens/s (median and
    spread of interleaved rounds), paired speed-up, the plan that ran and the output drift.
    ``compiled`` (a ``torch.compile`` backend): each model also runs compiled, as a row of its
    own beside it. ``not_built``: rows whose model a compiler failed on, and why."""
    from .testing import rel_rms_error

    failed: dict[str, str] = dict(not_built or {})
    if compiled is not None:
        converted = {**converted, **_compiled_models({"original": original, **converted},
                                                      inputs, compiled, failed)}
    models = {"original": original, **converted}
    tokens = inputs[0].shape[0] * inputs[0].shape[1]
    # warm-up long enough for any race against the code as written to be decided (as_written)
    timings = measure_timings(models, inputs, tokens, repeats=repeats, max_seconds=max_seconds,
                              warmup=CALLS_TO_DECIDE, progress=progress)
    reference = run_module(original, inputs)          # a model's main output (first tensor)
    drift = {name: rel_rms_error(run_module(model, inputs), reference)
             for name, model in converted.items()}
    shape = "x".join(str(s) for s in inputs[0].shape)
    rounds = timings["original"].rounds
    table = Table(title=f"throughput on {shape} inputs, {torch.get_num_threads()} threads: "
                        f"median of {rounds} interleaved round{'s' * (rounds != 1)} after "
                        f"warm-up (at most {repeats}, time-boxed to {max_seconds:g} s)",
                  caption="spread: interquartile range and min-max range of the per-round "
                          "times, % of the median; speed-up: median of per-round ratios")
    table.add_column("model")
    table.add_column("plan that ran")
    table.add_column("tokens/s", justify="right")
    table.add_column("spread", justify="right")
    table.add_column("speed-up", justify="right")
    table.add_column("rel. RMS vs original", justify="right")
    base = timings["original"]
    table.add_row("original", "as written", f"{base.rate:,.0f}", base.spread(), "1.00x", "")
    for name, model in converted.items():
        t = timings[name]
        table.add_row(name, _plan_that_ran(name, model, inputs[0].shape[0]), f"{t.rate:,.0f}",
                      t.spread(), str(t.speedup_over(base)), f"{drift[name]:.2e}")
    for name, why in failed.items():
        table.add_row(name, f"not compiled: {why}", "", "", "", "")
    return table


#: How ``throughput_table`` names a model's compiled row.
COMPILED = "{name}, compiled"


def _compiled_models(models: dict[str, torch.nn.Module], inputs: tuple, backend: str,
                     failed: dict[str, str]) -> dict[str, torch.nn.Module]:
    """Each model under ``torch.compile(backend=backend)``, compiled by one first call; a model
    the compiler fails on is left out, its reason in ``failed`` (a machine without a C++
    compiler, a backend that does not exist)."""
    out = {}
    for name, model in models.items():
        row = COMPILED.format(name=name)
        try:
            compiled = torch.compile(model, backend=backend)
            run_module(compiled, inputs)
        except Exception as e:  # noqa: BLE001 - any compiler failure: the row says why
            failed[row] = f"{type(e).__name__}: {first_line(e)[:160]}"
            continue
        out[row] = compiled
    return out


def _plan_that_ran(name: str, model: torch.nn.Module, batch: int) -> str:
    """``ran_plans`` of a row's model; a compiled row names its backend too."""
    inner = getattr(model, "_orig_mod", None)
    if inner is None:
        return ran_plans(model, batch)
    plans = "as written" if name == COMPILED.format(name="original") else ran_plans(inner, batch)
    return f"{plans}, under torch.compile"


# -- commands -----------------------------------------------------------------------------------
def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True)


def _say(console: Console, text: str) -> None:
    """Print plain text: no markup, no highlighting, no emoji codes (``pkg:factory:`` stays as
    written), no wrapping (Markdown tables stay intact)."""
    console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)


def _print_report(console: Console, report, markdown: bool) -> None:
    if markdown:
        _say(console, report.to_markdown())
    else:
        console.print(report)


def _save_json(report, path: str | None, console: Console) -> None:
    """Write the report as JSON to ``path`` (through a temporary file, so never half-written)."""
    if path:
        _write_text(path, json.dumps(report.to_dict(), indent=2) + "\n", console, "report ")


def _convert_at_levels(model: torch.nn.Module, levels: Sequence[tuple[int, bool]],
                       example_inputs: tuple, backend: str, err: Console,
                       compile: str | None = None, failed: dict | None = None
                       ) -> dict[str, torch.nn.Module]:
    """Convert ``model`` once per ``(level, strict)`` with a progress bar; keys are ``"level k"``
    (``"level k, compile=BACKEND"`` with ``compile``, where a backend failing on the plan is
    recorded in ``failed`` by the row's name instead)."""
    import ttt2la

    converted = {}
    suffix = "" if compile is None else f", compile={compile}"
    with _progress(err) as progress:
        task = progress.add_task("converting", total=len(levels))
        for level, strict in levels:
            progress.update(task, description=f"converting at level {level}{suffix}")
            name = f"level {level}{suffix}"
            try:
                converted[name] = ttt2la.convert(model, level=level, example_inputs=example_inputs,
                                                 backend=backend, strict=strict, compile=compile)
            except ttt2la.CompileError as e:
                if failed is None:
                    raise
                failed[name] = first_line(e)[:200]
            progress.advance(task)
    return converted


def cmd_demo(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Convert the committed trained character LM at every implemented level; show each report,
    the held-out loss beside the original's, and tokens/s side by side (``ttt2la.demo``)."""
    from dataclasses import replace

    from .demo import DEMO_SIZES, run_demo

    size = DEMO_SIZES["quick" if args.quick else "default"]
    size = replace(size, sequences=args.sequences or size.sequences,
                   length=args.length or size.length, repeats=args.repeats or size.repeats,
                   max_seconds=args.max_seconds or size.max_seconds)
    return run_demo(size, out, err, _progress, args.markdown, _print_report)


def cmd_inspect(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Print what ``ttt2la.inspect`` finds in a model: loops, states and the verdict per level."""
    import ttt2la

    _check_outputs(args)
    model, spec, (inputs, kwargs) = _open_model(args, err)
    with err.status(f"inspecting {_model_name(args)}"):
        report: InspectionReport = ttt2la.inspect(model, example_inputs=inputs,
                                                  example_kwargs=kwargs, show=False)
    _print_report(out, report, args.markdown)
    _save_json(report, args.json, err)
    return 0


def cmd_convert(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Convert a model at a level, print the conversion report and optionally save the converted
    checkpoint (``--out``) and the report as JSON (``--json``)."""
    import ttt2la
    from .checkpoint import check_reads_back, write_checkpoint

    _check_outputs(args)
    source, spec, (inputs, kwargs) = _open_source(args, err)
    with err.status(f"converting {_model_name(args)} at level {args.level}"):
        converted = ttt2la.convert(source.model, level=args.level, example_inputs=inputs,
                                   example_kwargs=kwargs, backend=args.backend,
                                   strict=args.strict)
    report: ConversionReport = converted.ttt2la_report
    _print_report(out, report, args.markdown)
    if args.out:
        with err.status(f"writing {args.out}"):
            given = (inputs, kwargs) if inputs is not None or kwargs else None
            # read back before it is renamed into place, as ``ttt2la.save`` does
            write_checkpoint(converted, args.out, recipe=source.recipe, spec=spec,
                             source=source.info, inputs=(inputs, kwargs), force=args.force,
                             hf_dir=source.hf_dir,
                             verify=lambda tmp: check_reads_back(
                                 converted, tmp, Path(args.out), source.recipe, given))
        args.written.append(f"--out {args.out}")
        _say(err, f"converted checkpoint written to {args.out} (reload with ttt2la.load)")
    _save_json(report, args.json, err)
    return 0


def cmd_report(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Render a report saved as JSON by ``convert --json`` or ``inspect --json`` (under any file
    name: what counts is that it reads as a report), or the one in a converted checkpoint
    directory. A path that does not exist or cannot be read is bad input (exit status 2); a
    file that is not JSON or not a report is refused (exit status 1)."""
    from .checkpoint import MANIFEST_NAME, Manifest

    path = Path(args.path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory; name a JSON report written "
                              "by --json or a converted checkpoint directory")
    if path.is_dir():
        if not (path / MANIFEST_NAME).is_file():
            raise CheckpointError(f"{path}: a directory without {MANIFEST_NAME}, so not a "
                                  "converted checkpoint; name a JSON report written by --json "
                                  "or a directory written by convert --out")
        _print_report(out, load_report(Manifest.read(path).report), args.markdown)
        return 0
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from e
    except (ValueError, RecursionError) as e:   # malformed, too deeply nested, not text
        _say(err, f"ttt2la report: {path} is not JSON ({_one_line(e)}), so neither a report "
                  f"written by --json nor a converted checkpoint directory")
        return EXIT_REFUSED
    _print_report(out, load_report(data), args.markdown)
    return 0


def cmd_bench(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Measure tokens/s of a model and of its conversions at the given levels."""
    model, _spec, (inputs, kwargs) = _open_model(args, err)
    if kwargs:
        raise InvalidInputError("bench times positional example inputs only; --example-inputs "
                                f"{args.example_inputs} holds keyword inputs "
                                f"({', '.join(kwargs)})")
    levels = [(level, args.strict) for level in args.levels]
    converted = _convert_at_levels(model, levels, inputs, args.backend, err)
    not_built: dict[str, str] = {}
    if args.compile_plan is not None:
        converted |= _convert_at_levels(model, levels, inputs, args.backend, err,
                                        compile=args.compile_plan, failed=not_built)
    with _progress(err) as progress:
        table = throughput_table(model, converted, inputs, repeats=args.repeats,
                                 max_seconds=args.max_seconds, progress=progress,
                                 compiled=args.compile, not_built=not_built)
    out.print(table)
    return 0


def cmd_sweep(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Convert a model at every level and print the paper's Table 2 for it.

    The model and its example inputs come from the same options, read the same way, as for
    ``convert`` (a bundled model, a checkpoint with ``--model``/``--config``, ``--example-shape``,
    ``--example-inputs``); the calibration data are drawn like the example inputs with
    ``--calibration-batch`` sequences and the next seed, or are the example inputs themselves
    when those come from a file."""
    import ttt2la

    _check_outputs(args)
    source, spec, (inputs, kwargs) = _open_source(args, err)
    if inputs is None:
        raise InvalidInputError(f"{_model_name(args)}: no example inputs to sweep on; pass "
                                "--example-shape B,L[,D] or --example-inputs FILE.safetensors")
    calibration = _calibration_inputs(spec, args.calibration_batch)
    with err.status("sweeping") as status:
        table = ttt2la.sweep(source.model, calibration, example_inputs=inputs,
                             example_kwargs=kwargs, levels=args.levels, backend=args.backend,
                             time_budget=args.max_seconds,
                             progress=lambda msg: status.update(f"sweep: {msg}"))
    if args.format == "markdown":
        out.print(table.to_markdown(), markup=False, highlight=False)
    elif args.format == "json":
        out.print(table.to_json(), markup=False, highlight=False)
    else:
        out.print(table)
    if args.json:
        _write_text(args.json, table.to_json() + "\n", err)
        args.written.append(f"--json {args.json}")
    if args.plot:
        from .checkpoint.writing import atomic_file

        with atomic_file(args.plot) as tmp:
            table.plot(str(tmp))
        _say(err, f"plot written to {args.plot}")
    return 0


def _calibration_inputs(spec: dict, batch: int) -> tuple | None:
    """Calibration data for ``sweep``: ``batch`` sequences drawn as the example-input ``spec``
    draws its own, from the next seed; ``None`` (the example inputs serve) for inputs read from
    a file, which cannot be drawn again."""
    from .checkpoint.example_inputs import build_inputs

    kind = spec.get("kind")
    if kind == "zoo":
        spec = {**spec, "batch": batch}
    elif kind in ("token_ids", "normal"):
        spec = {**spec, "shape": [batch, *spec["shape"][1:]]}
    else:
        return None
    return build_inputs({**spec, "seed": int(spec["seed"]) + 1})[0]


def _write_text(path: str, text: str, console: Console, what: str = "") -> None:
    """Write ``text`` to ``path`` through a temporary file, so it is never half-written."""
    from .checkpoint.writing import atomic_file

    with atomic_file(path) as tmp:
        tmp.write_text(text)
    _say(console, f"{what}written to {path}")


def cmd_generate(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Sample from a converted language-model checkpoint, the fast weights carried across
    tokens (``ttt2la.Stream``)."""
    import ttt2la
    from .generate import check_byte_model, check_temperature, generate_text, sample_tokens

    check_temperature(args.temperature)             # before the checkpoint is loaded
    sampling = dict(temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    with err.status(f"loading {args.checkpoint}"):
        model = ttt2la.load(args.checkpoint, factory=args.model,
                            trust_factory=args.trust_factory,
                            trust_remote_code=args.trust_remote_code).eval()
    if args.prompt_ids is not None:
        prompt = torch.tensor(args.prompt_ids)
        ids = [str(t) for t in sample_tokens(model, prompt, args.tokens, **sampling)]
        out.print(" ".join(ids), markup=False, highlight=False)
        return 0
    check_byte_model(model)                         # before the prompt is echoed
    sys.stdout.write(args.prompt)
    generate_text(model, args.prompt, args.tokens,
                  on_token=lambda piece: (sys.stdout.write(piece), sys.stdout.flush()),
                  **sampling)
    sys.stdout.write("\n")
    return 0


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}")


# -- models and inputs named on the command line ------------------------------------------------
def _model_name(args: argparse.Namespace) -> str:
    return args.zoo or args.checkpoint


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse output paths that cannot be written, or that would overwrite an input or another
    output, before any work is done."""
    from .checkpoint.recipe import inline_config
    from .checkpoint.writing import check_output_dir, check_output_file

    _bundled_name_as_zoo(args)
    for option in ("out", "json", "plot"):
        value = getattr(args, option, None)
        if value is not None and not value.strip():
            raise InvalidInputError(f"--{option} is empty ({value!r}); name the path to write, "
                                    f"or leave out --{option}")
    inputs = [args.checkpoint] if getattr(args, "checkpoint", None) else []
    inputs += [p for p in (getattr(args, "example_inputs", None), getattr(args, "config", None))
               if p and not inline_config(p)]
    out = getattr(args, "out", None)
    if out:
        check_output_dir(Path(out), force=args.force, inputs=inputs)
    if getattr(args, "json", None):
        check_output_file(args.json, name="--json", inputs=inputs, out=out)
    if getattr(args, "plot", None):
        check_output_file(args.plot, name="--plot", inputs=inputs,
                          others=[("--json", getattr(args, "json", None))])
        from .sweep import plotting_library

        plotting_library()                  # before the sweep, not after it


def _open_source(args: argparse.Namespace, err: Console):
    """The source model of the command line, its example-input spec and the inputs themselves."""
    from .checkpoint import open_checkpoint, open_zoo
    from .checkpoint.example_inputs import build_inputs, read_inputs, spec_from_shape
    from .checkpoint.recipe import read_config

    _bundled_name_as_zoo(args)
    if args.zoo is not None and args.checkpoint:
        raise InvalidInputError(f"name either a checkpoint ({args.checkpoint}) or --zoo "
                                f"{args.zoo}, not both")
    if args.zoo is None and not args.checkpoint:
        raise InvalidInputError("name a model: a checkpoint (a Hugging Face directory, a state "
                                "dict with --model pkg.module:factory, a converted checkpoint) "
                                f"or --zoo NAME, one of: {', '.join(sorted(ZOO))}")
    if args.config and not args.model:
        raise InvalidInputError(f"--config {args.config}: holds keyword arguments for --model "
                                "pkg.module:factory, which is missing")
    if args.example_shape and args.example_inputs:
        raise InvalidInputError("pass --example-shape or --example-inputs, not both")
    given = [f"--{n} {v}" for n, v in (("batch", args.batch), ("length", args.length))
             if v is not None]
    if given and (args.example_shape or args.example_inputs):
        which = "--example-shape" if args.example_shape else "--example-inputs"
        raise InvalidInputError(f"{' and '.join(given)}: {which} gives the example's batch "
                                f"size and length; pass {which} alone, or --batch and --length")
    inputs_file = read_inputs(Path(args.example_inputs)) if args.example_inputs else None
    with err.status(f"reading {_model_name(args)}"):
        if args.zoo is not None:
            if args.model:
                raise InvalidInputError(f"--model {args.model}: a bundled model is built by "
                                        "ttt2la itself; --model goes with a state dict file")
            source = open_zoo(args.zoo, args.seed)
        else:
            kwargs = read_config(args.config) if args.config else None
            source = open_checkpoint(args.checkpoint, factory=args.model, kwargs=kwargs,
                                     trust_remote_code=args.trust_remote_code,
                                     trust_factory=args.trust_factory)
    model = source.model
    if inputs_file is not None:
        return source, {"kind": "file"}, inputs_file
    if args.example_shape:
        spec = spec_from_shape(model, args.example_shape, args.seed)
    elif args.zoo is not None:
        spec = {"kind": "zoo", "name": args.zoo, "batch": args.batch or 1,
                "length": args.length or ZOO[args.zoo].length, "seed": args.seed}
    elif (recorded := _recorded_spec(args.checkpoint)) is not None:
        inputs = build_inputs(recorded, Path(args.checkpoint))
        return source, {"kind": "file"} if recorded["kind"] == "file" else recorded, inputs
    else:
        spec = _default_spec(model, args)
    return source, spec, build_inputs(spec)


def _bundled_name_as_zoo(args: argparse.Namespace) -> None:
    """``ttt2la convert lact-lm``: a bundled model's name (not a path) in place of a checkpoint."""
    if args.zoo is None and args.checkpoint in ZOO and not Path(args.checkpoint).exists():
        args.zoo, args.checkpoint = args.checkpoint, None


def _recorded_spec(checkpoint: str) -> dict | None:
    """The example inputs a converted checkpoint directory was converted with, reused when it is
    converted again (at another level) without new ones."""
    from .checkpoint import MANIFEST_NAME, Manifest

    path = Path(checkpoint)
    if not (path.is_dir() and (path / MANIFEST_NAME).is_file()):
        return None
    return dict(Manifest.read(path).example_inputs)


def _default_spec(model: torch.nn.Module, args: argparse.Namespace) -> dict:
    from .checkpoint.example_inputs import first_embedding, spec_from_shape

    if first_embedding(model) is None:
        raise InvalidInputError(f"{args.checkpoint}: {type(model).__name__} does not start with "
                                "an embedding, so its inputs cannot be guessed: pass "
                                "--example-shape B,L,D or --example-inputs FILE.safetensors")
    return spec_from_shape(model, (args.batch or 1, args.length or DEFAULT_LENGTH), args.seed)


def _open_model(args: argparse.Namespace, err: Console):
    source, spec, inputs = _open_source(args, err)
    return source.model, spec, inputs


#: Sequence length of the token ids made up for a checkpoint that starts with an embedding.
DEFAULT_LENGTH = 256


# -- argument parsing ---------------------------------------------------------------------------
class _OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, as every other bad input's are."""

    def error(self, message: str):
        self.exit(EXIT_UNSUPPORTED, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ttt2la`` command (one sub-parser per command)."""
    parser = _OneLineParser(
        prog="ttt2la",
        description="Rewrite test-time-training layers as chunk-parallel linear attention.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help_: str) -> argparse.ArgumentParser:
        p = commands.add_parser(name, help=help_, description=help_)
        p.set_defaults(func=func)
        return p

    _add_demo(add)
    _add_model_commands(add)
    _add_generate(add)
    return parser


def _add_demo(add) -> None:
    """The demo: the bundled trained model converted at every level."""
    p = add("demo", cmd_demo, "convert a small trained character-level LaCT language model at "
                              "every implemented level; compare held-out loss and throughput")
    p.add_argument("--quick", action="store_true", help="less held-out text and shorter timing")
    p.add_argument("--sequences", type=_positive, default=None,
                   help="held-out sequences to score and time (32; 4 with --quick)")
    p.add_argument("--length", type=_positive, default=None,
                   help="bytes per held-out sequence (256, the training length; 128 with --quick)")
    p.add_argument("--repeats", type=_positive, default=None,
                   help="at most this many timed rounds, each running every model once "
                        "(15; 5 with --quick)")
    p.add_argument("--max-seconds", type=_seconds, default=None,
                   help="stop timing after this many seconds, once 3 rounds are done "
                        "(20; 5 with --quick)")
    p.add_argument("--markdown", action="store_true", help="print the reports as Markdown")



def _add_model_commands(add) -> None:
    """The commands that read a model: inspect, convert, report, bench, sweep."""
    p = add("inspect", cmd_inspect, "analyse a model: its TTT loops, states and what each "
                                    "level gives")
    _model_options(p)
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--markdown", action="store_true", help="print the report as Markdown")

    p = add("convert", cmd_convert, "convert a model at a level and print the conversion report")
    _model_options(p)
    p.add_argument("--level", type=_level, default=2, help="simplification level 0-6 (2)")
    _conversion_options(p, strict=True)
    p.add_argument("--out", "--output", dest="out", metavar="DIR",
                   help="write the converted checkpoint to this new directory (model.safetensors, "
                        "ttt2la.json, report.md)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--markdown", action="store_true", help="print the report as Markdown")

    p = add("report", cmd_report, "render a report saved with --json or in a converted checkpoint")
    p.add_argument("path", help="a JSON report written by `ttt2la convert --json` or "
                                "`ttt2la inspect --json`, or a converted checkpoint directory")
    p.add_argument("--markdown", action="store_true", help="print the report as Markdown")

    p = add("bench", cmd_bench, "measure tokens/s of a model and of its conversions")
    _model_options(p)
    p.add_argument("--levels", type=_level, nargs="+", default=[0, 1, 2],
                   help="levels to convert at (0 1 2)")
    p.add_argument("--repeats", type=_positive, default=15,
                   help="at most this many timed rounds, each running every model once (15)")
    p.add_argument("--max-seconds", type=_seconds, default=30.0,
                   help="stop timing after this many seconds, once 3 rounds are done (30)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   type=_compile_backend,
                   help="also time the original and each conversion under torch.compile, as rows "
                        "of their own (backend: inductor unless named; the first call compiles)")
    p.add_argument("--compile-plan", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   type=_compile_backend,
                   help="also time each level converted with compile=BACKEND (its plan alone "
                        "under torch.compile; inductor unless named), as rows of their own")
    _conversion_options(p, strict=False)

    p = add("sweep", cmd_sweep, "convert a model at every level 0-6 and tabulate exactness, "
                                "drift, schedule and TTT-layer throughput per level")
    _model_options(p)
    p.add_argument("--levels", type=_level, nargs="+", default=None,
                   help="levels to convert at (all, 0-6)")
    p.add_argument("--calibration-batch", type=_positive, default=2,
                   help="sequences of calibration data (drawn like the example inputs, another "
                        "seed) (2)")
    p.add_argument("--format", choices=("rich", "markdown", "json"), default="rich",
                   help="how to print the table (rich)")
    p.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    p.add_argument("--plot", metavar="PNG", help="also plot drift and throughput against level")
    p.add_argument("--max-seconds", type=_seconds, default=30.0,
                   help="time budget of the side-by-side timing (30)")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton", "naive"),
                   help="runtime backend (auto)")



def _add_generate(add) -> None:
    """Sampling from a converted language-model checkpoint."""
    p = add("generate", cmd_generate, "sample text from a converted language-model checkpoint "
                                      "(a directory written by `convert --out`)")
    p.add_argument("checkpoint", help="a converted checkpoint directory")
    p.add_argument("--model", metavar="PKG.MODULE:FACTORY",
                   help="the function that builds the model, called with the recorded keyword "
                        "arguments (instead of trusting the factory the checkpoint names)")
    _trust_options(p)
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="def ", help="text to continue (byte-level models)")
    prompt.add_argument("--prompt-ids", type=_token_ids, default=None,
                        help="token ids to continue, comma-separated (any vocabulary)")
    p.add_argument("--tokens", type=_positive, default=200, help="tokens to sample (200)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature; 0 is greedy (0.8)")
    p.add_argument("--top-k", type=_positive, default=None, help="sample among the k likeliest")
    p.add_argument("--seed", type=_seed, default=0, help="sampling seed (0)")


def _model_options(p: argparse.ArgumentParser) -> None:
    """Where the model comes from and the example inputs it is traced on."""
    p.add_argument("checkpoint", nargs="?", metavar="MODEL",
                   help="a Hugging Face model directory (config.json + safetensors), a state "
                        "dict (.safetensors, .pt, .bin) with --model, a converted checkpoint "
                        "directory, or a bundled model name")
    p.add_argument("--model", metavar="PKG.MODULE:FACTORY",
                   help="the function that builds the state dict's model")
    p.add_argument("--config", metavar="JSON", help="keyword arguments for --model: a JSON "
                   "object, inline or in a file")
    _trust_options(p)
    p.add_argument("--zoo", choices=sorted(ZOO),
                   help="a bundled model: " + "; ".join(f"{k}: {v.description}"
                                                       for k, v in ZOO.items()))
    p.add_argument("--example-shape", type=_shape, metavar="B,L[,D]",
                   help="example inputs of this shape: token ids when the model starts "
                        "with an embedding (B,L), standard-normal features otherwise (B,L,D)")
    p.add_argument("--example-inputs", metavar="FILE",
                   help="example inputs in a .safetensors file: tensors named 0, 1, ... "
                        "are positional, others keyword arguments")
    p.add_argument("--seed", type=_seed, default=0, help="seed of weights and inputs (0)")
    p.add_argument("--batch", type=_positive, default=None, help="example batch size (1)")
    p.add_argument("--length", type=_positive, default=None,
                   help=f"example sequence length (the zoo model's default, "
                        f"{DEFAULT_LENGTH} for a checkpoint)")


def _trust_options(p: argparse.ArgumentParser) -> None:
    """Opt-ins to run code a checkpoint names: a Hugging Face directory's own code, or the
    factory a converted checkpoint's manifest records (never run without one of them)."""
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a Hugging Face directory's own code (auto_map) to run")
    p.add_argument("--trust-factory", action="store_true",
                   help="allow the factory a converted checkpoint's ttt2la.json names to be "
                        "imported and called (bundled models need no opt-in)")


def _conversion_options(p: argparse.ArgumentParser, strict: bool) -> None:
    """The runtime backend, and whether a layer not reducible at the level is refused."""
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton", "naive"),
                   help="runtime backend (auto)")
    if strict:
        p.add_argument("--no-strict", dest="strict", action="store_false",
                       help="run a layer that is not reducible at the level recurrently "
                            "instead of refusing it")
    else:
        p.add_argument("--strict", action="store_true",
                       help="refuse a layer that is not reducible at the level instead of "
                            "running it recurrently")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _seed(text: str) -> int:
    """A seed ``torch.manual_seed`` takes: an integer of 0 to 2**64 - 1."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2 ** 64:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**64 - 1, got {text}")
    return value


def _compile_backend(text: str) -> str:
    """A ``torch.compile`` backend name this torch knows, refused before any work otherwise."""
    from .compiled_plan import compiler_backend

    try:
        return compiler_backend(text)
    except InvalidInputError as e:
        said = first_line(e).split(" (compile=True")[0]
        raise argparse.ArgumentTypeError(said.replace("compile=", "", 1)) from e


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) not in (2, 3) or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected B,L or B,L,D of positive integers, got {text}")
    return shape


def _level(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"levels run from 0 to 6, got {text}") from None
    if not 0 <= value <= 6:
        raise argparse.ArgumentTypeError(f"levels run from 0 to 6 (the paper's steps), got {text}")
    return value


def _version() -> str:
    from . import __version__
    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ttt2la`` command; returns the process exit status."""
    from .interrupt_at_launch import restore

    restore()          # from here on, an interruption is answered below, after cleaning up
    args = build_parser().parse_args(argv)
    args.written = []           # the outputs complete on disk, said if interrupted after them
    # piped output gets wide lines rather than tables squeezed to 80 columns
    out, err = Console(width=None if sys.stdout.isatty() else 160), Console(stderr=True)
    try:
        return args.func(args, out, err)
    except (InvalidInputError, CheckpointError) as e:
        _say(err, f"ttt2la {args.command}: {type(e).__name__}: {_one_line(e)}")
        return EXIT_BAD_INPUT
    except ConversionError as e:
        _say(err, f"ttt2la {args.command}: {type(e).__name__}: {e}")
        return EXIT_REFUSED
    except KeyboardInterrupt:
        _say(err, f"ttt2la {args.command}: {_interrupted(args.written)}")
        return EXIT_BAD_INPUT


def _interrupted(written: list[str]) -> str:
    """What an interruption left: nothing, or the outputs written whole before it (each output
    is written atomically, so the one under way when it came was not written at all)."""
    if not written:
        return "interrupted; nothing was written"
    return f"interrupted after writing {' and '.join(written)}; nothing else was written"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


__all__ = ["ZOO", "ZooModel", "EXIT_BAD_INPUT", "build_zoo_model", "measure_throughput", "measure_timings",
           "ran_plans", "throughput_table", "build_parser", "main"]

