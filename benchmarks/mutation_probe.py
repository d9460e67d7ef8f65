"""Plant known bugs in a copy of the package and check that the test suite catches each one.

Every mutation below is a small deliberate bug: one or more textual replacements in a file of
``ttt2la/``, each of which must match exactly once. For each mutation the script copies the
repository (``ttt2la/``, ``tests/``, ``pyproject.toml``) to a temporary directory, applies the
replacements there, and runs the mutation's test selection with that directory as the working
directory, so the mutated copy is the ``ttt2la`` the tests import:

    python -m pytest -x -q -p no:cacheprovider <files> -k <expr>

The result is one of

* ``caught``      the selection failed (a test saw the bug);
* ``NOT CAUGHT``  the selection passed with the bug in place;
* ``stale``       a replacement's pattern no longer matches exactly once (the code changed):
                  update the pattern, nothing was run;
* ``baseline``    the selection fails without the bug too, so a failure says nothing;
* ``timeout`` / ``error``  the run did not finish in ``--timeout`` s / pytest could not run.

Before the mutated runs, every distinct selection is run once on an unmutated copy (the
baseline; skip with ``--no-baseline``). Not part of CI: it runs a slice of the suite per bug.
Run it before resolving a change to the runtime, lowering or passes:

    python benchmarks/mutation_probe.py              # every mutation, a table at the end
    python benchmarks/mutation_probe.py --list       # the mutations and their selections
    python benchmarks/mutation_probe.py --only momentum_sign --only prefix_sum_off_by_one

Exit status: 0 when every mutation run was caught, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPIED = ("ttt2la", "tests", "pyproject.toml")


@dataclass(frozen=True)
class Mutation:
    """A deliberate bug: ``(file, old, new)`` replacements and the tests that must catch it."""

    name: str
    what: str
    edits: tuple[tuple[str, str, str], ...]
    files: tuple[str, ...]
    select: str = ""


MUTATIONS = [
    Mutation(
        "momentum_sign", "momentum coefficient negated in the block op's scan",
        (("ttt2la/runtime/block.py", "factors = momentum[", "factors = -momentum["),),
        ("tests/test_convert.py",), "level2_equals and folded-H2-D4-C3"),
    Mutation(
        "ns_coefficient_runtime", "Newton–Schulz c coefficient +0.01 in the runtime's iteration",
        (("ttt2la/runtime/newton_schulz.py", "schedule = ns_schedule(steps, coefficients)",
          "schedule = tuple((a, b, c + 0.01) for a, b, c in ns_schedule(steps, coefficients))"),),
        ("tests/test_convert.py", "tests/test_runtime_block.py"),
        "folded-H1-D4-C8-with_momentum-muon5-float64 or newton_schulz_matches"),
    Mutation(
        "ns_coefficient_constant", "Muon's default triple 2.0315 -> 2.0415 in naive.py (shared)",
        (("ttt2la/runtime/naive.py", "(3.4445, -4.7750, 2.0315)", "(3.4445, -4.7750, 2.0415)"),),
        ("tests/test_runtime_block.py",), "every_option_combination_fp32 and muon5"),
    Mutation(
        "ns_coefficient_reference", "Newton–Schulz c coefficient +0.01 in naive.py's iteration",
        (("ttt2la/runtime/naive.py", "c * A @ A", "(c + 0.01) * A @ A"),),
        ("tests/test_runtime_block.py",), "naive_reference"),
    Mutation(
        "lr_per_feature", "per-feature learning rates applied reversed over features",
        (("ttt2la/runtime/naive.py", "if lr.dim() == 3 else lr)", "if lr.dim() == 3 else lr.flip(-1))"),),
        ("tests/test_runtime_block.py",), "naive_reference"),
    Mutation(
        "last_chunk_zeroed", "assemble_output drops the last chunk's outputs (zeros instead)",
        (("ttt2la/lowering/chunking.py", "    return joined if spec.items else joined.narrow(axis, 0, layout.length)",
          "    keep = (layout.n_chunks - 1) * layout.chunk_size\n"
          "    joined = torch.cat([joined.narrow(axis, 0, keep),\n"
          "                        torch.zeros_like(joined.narrow(axis, keep, joined.shape[axis] - keep))], axis)\n"
          "    return joined.narrow(axis, 0, layout.length)"),),
        ("tests/test_executors.py", "tests/test_passes.py"), "hand_written"),
    Mutation(
        "drop_norm_noop", "drop_norm reports 'applied' but leaves the normalisation (and its check)",
        (("ttt2la/passes/drop_norm.py", "m.output.replace_all_uses_with(m.input)", "pass"),
         ("ttt2la/passes/drop_norm.py", "if state_norms(program):", "if False:")),
        ("tests/test_passes.py",), "hand_written"),
    Mutation(
        "freeze_theta_noop", "freeze_theta reports 'applied' but keeps updating Θ (and its check)",
        (("ttt2la/passes/freeze_theta.py", "ins[i] if i in thetas else o", "o"),
         ("ttt2la/passes/freeze_theta.py", "if left:", "if False:")),
        ("tests/test_passes.py",), "hand_written"),
    Mutation(
        "momentum_shift", "the block op's momentum coefficients shifted by one chunk",
        (("ttt2la/runtime/block.py", "factors = momentum[", "factors = momentum.roll(1, 1)["),),
        ("tests/test_convert.py",), "level2_equals and folded-H2-D4-C3"),
    Mutation(
        "scan_shift", "the sequential affine scan reads the previous chunk's coefficient",
        (("ttt2la/runtime/scan.py", "zip(a.unbind(dim), f.unbind(dim))",
          "zip(a.roll(1, dim).unbind(dim), f.unbind(dim))"),),
        ("tests/test_executors.py",), "hand_written_loop"),
    Mutation(
        "weight_norm_target", "weight norm rescales to the initial state's norms, not the target",
        (("ttt2la/runtime/block.py",
          "normalise_columns(d if W is None else W + d, weight_norm)",
          "normalise_columns(d if W is None else W + d, weight_norm if W0 is None else "
          "torch.linalg.vector_norm(W0, dim=-2))"),),
        ("tests/test_runtime_block.py",), "random_shapes_and_options_bf16 or edge_lengths"),
    Mutation(
        "prefix_sum_off_by_one", "prefix_sum returns S_{j-1} at j (the first sum twice)",
        (("ttt2la/runtime/scan.py",
          "return blocked_scan(None, rows, init).reshape(shape).to(f.dtype)",
          "S = blocked_scan(None, rows, init).reshape(shape).to(f.dtype)\n"
          "    return torch.cat([S.narrow(dim, 0, 1), S.narrow(dim, 0, S.shape[dim] - 1)], dim)"),),
        ("tests/test_executors.py",), "hand_written_loop"),
    Mutation(
        "lift_scale_dropped", "the lifted plan drops the increment's constant scale",
        (("ttt2la/lowering/lift.py", "else value * self.lifted.scale", "else value"),),
        ("tests/test_convert.py",), "level2_equals and heads-H2-D4-C8"),
    Mutation(
        "ns_backward_transpose_term", "Newton–Schulz backward drops the dAᵀX term of A = XXᵀ",
        (("ttt2la/runtime/newton_schulz.py", "dA, X), dA.mT, X)", "dA, X), dA.mT, X, alpha=0.0)"),),
        ("tests/test_runtime_block.py",), "gradient_matches_autograd"),
    Mutation(
        "ns_iteration_dtype_widened", "a converted layer iterates Newton–Schulz in the op's accumulation dtype",
        (("ttt2la/lowering/lift.py", "return self.dtype or torch.promote_types(phi_k.dtype, value.dtype)",
          "return self.dtype"),),
        ("tests/test_zoo_published.py",), "iterates_in_the_dtype"),
    Mutation(
        "buffer_reuse_views", "buffer reuse ignores views: a buffer is free once its base is dead",
        (("ttt2la/lowering/buffer_reuse.py", "buf = by_storage.get(key)", "buf = None"),),
        ("tests/test_buffer_reuse.py",), "same_values or gradients_match"),
    Mutation(
        "tile_grid_default", "the chunk op's output grid ignores the tuned value tile (the default's 64)",
        (("ttt2la/runtime/triton/chunk.py", 'grid = (triton.cdiv(T, chunk), triton.cdiv(V, c["BV"]), B * H)',
          "grid = (triton.cdiv(T, chunk), triton.cdiv(V, 64), B * H)"),),
        ("tests/test_triton_kernels.py",), "chunk_op_is_right_with_every_tuning_candidate"),
    Mutation(
        "scan_map_tail", "the matrix-affine scan assembles a tall map from its blocks' last columns",
        (("ttt2la/lowering/lift_delta.py", "return torch.cat(moved.unbind(0), dim=-1)[..., :r]",
          "return torch.cat(moved.unbind(0), dim=-1)[..., -r:]"),),
        ("tests/test_lift_delta.py",), "rectangular"),
    Mutation(
        "scan_rule_inverted", "the CPU cost rule scans where the loop is cheaper, and loops where it is not",
        (("ttt2la/lowering/lift_delta.py", "return scanned < looped", "return scanned > looped"),),
        ("tests/test_lift_delta.py",), "beats_the_loop or large_memory"),
    Mutation(
        "loop_outputs_final_off_by_one", "the loop that reads the outputs as it goes keeps the last "
        "chunk's update as the final state where that chunk only reads (apply_only)",
        (("ttt2la/lowering/executors.py", "            if j < n_upd:\n", "            if j <= n_upd:\n"),),
        ("tests/test_executors.py",), "last_sequential or coupled"),
    Mutation(
        "lean_call_wrong_kernel", "the lean graph calls subtraction through torch.add",
        (("ttt2la/lowering/lean_calls.py", "aten.sub.Tensor: torch.sub,", "aten.sub.Tensor: torch.add,"),),
        ("tests/test_lean_calls.py", "tests/test_executors.py"), ""),
    Mutation(
        "batched_views_kept", "graphs run batched over chunks keep their views, which vmap refuses for a "
        "chunk of a stream, so a loop fallback runs",
        (("ttt2la/lowering/executors.py", "    reshape_views(gm.graph)\n", "\n"),),
        ("tests/test_titans.py",), "large_memory"),
    Mutation(
        "group_mask_unshifted", "in groups of chunks, the exclusive order reads its own chunk's "
        "increment (the mask not shifted by one chunk)",
        (("ttt2la/runtime/grouped_chunks.py",
          "A = F.pad(L[..., :-1, :], (0, 0, 1, 0)) if exclusive else L",
          "A = L"),),
        ("tests/test_runtime_block.py",), "groups_of_chunks"),
    Mutation(
        "decay_dropped_by_lift", "the lifted plan drops a decayed state's factor per chunk",
        (("ttt2la/lowering/lift.py",
          '("decay", lp.gamma), ("step_scale", lp.step)):',
          '("decay", None), ("step_scale", lp.step)):'),),
        ("tests/test_lift_decay.py",), "equals_its_loop or plain_decayed"),
    Mutation(
        "race_with_gradients", "a call that records gradients races the plan against the code "
        "as written (whose backward is the slower)",
        (("ttt2la/as_written.py",
          "    grad = torch.is_grad_enabled()",
          "    grad = False"),),
        ("tests/test_as_written.py",), "gradients"),
    Mutation(
        "race_during_the_checks", "convert's own checks of a layer already race it, so a check "
        "can compare the user's code with itself",
        (("ttt2la/conversion.py",
          "            install(layer.rl.candidate.module, layer.state)\n",
          "            install(layer.rl.candidate.module, layer.state)\n"
          "            layer.state.as_written = AsWritten()\n"),),
        ("tests/test_as_written.py",), "checks"),
    Mutation(
        "race_keeps_the_slower", "the race keeps the slower of the plan and the code as written",
        (("ttt2la/as_written.py",
          "self.winner = WRITTEN if written < plan * (1 - MARGIN) else PLAN",
          "self.winner = WRITTEN if written > plan * (1 - MARGIN) else PLAN"),),
        ("tests/test_as_written.py",), "faster_side"),
    Mutation(
        "affine_rule_inverted", "the scalar-affine cost rule scans large states and loops small ones",
        (("ttt2la/lowering/scan_choice.py",
          "return state.numel() * AFFINE_SCAN_ELEMENT_SECONDS < AFFINE_LOOP_STEP_SECONDS",
          "return state.numel() * AFFINE_SCAN_ELEMENT_SECONDS > AFFINE_LOOP_STEP_SECONDS"),),
        ("tests/test_scan_choice.py",), "rule or large_state"),
    Mutation(
        "affine_loop_reads_the_scan_state", "a looped scalar-affine state that feeds a later group "
        "hands it the initial state for every chunk",
        (("ttt2la/lowering/executors.py",
          "        return [torch.stack(a) for a in afters]",
          "        return [torch.stack(a).zero_() + states0[t] for a, t in zip(afters, step.states)]"),),
        ("tests/test_scan_choice.py",), "either_path"),
    Mutation(
        "expansions_batched", "a loop over the chunks reads its outer products batched beforehand",
        (("ttt2la/lowering/loop_expansions.py",
          "        if sum(_numel(a) for a in reads) < _numel(value):",
          "        if False:"),),
        ("tests/test_loop_expansions.py",), ""),
    Mutation(
        "expansion_size_rule_inverted", "a loop computes its small expansions itself and reads "
        "its large ones batched",
        (("ttt2la/lowering/loop_expansions.py",
          "    return largest * state.numel() >= EXPANSION_MIN_ELEMENTS * traced_state",
          "    return largest * state.numel() < EXPANSION_MIN_ELEMENTS * traced_state"),),
        ("tests/test_loop_expansions.py",), "size_rule"),
    Mutation(
        "deferred_values_zero", "a scan reads the values a loop would compute itself as zeros",
        (("ttt2la/lowering/executors.py",
          "        self.update(self._compute(self))",
          "        self.update({k: (torch.zeros_like(v), b) for k, (v, b) in self._compute(self).items()})"),),
        ("tests/test_loop_expansions.py",), "recurrent_loop"),
    Mutation(
        "output_joined_contiguous", "a loop's chunk outputs are joined contiguous, so the code "
        "after the loop copies them again into the order it reads",
        (("ttt2la/lowering/chunking.py",
          "    return torch.cat(chunks, dim=axis, out=out.permute(inverse_order(order)))",
          "    return torch.cat(chunks, dim=axis)"),),
        ("tests/test_output_assembly.py",), ""),
    Mutation(
        "whole_chunks_unrestricted", "a layer converted from a loop over whole chunks takes any length",
        (("ttt2la/frontend/recognize.py", "        if L % self.length_unit:", "        if False:"),),
        ("tests/test_whole_chunk_loops.py",), "refused_naming_the_loop"),
    Mutation(
        "step_scale_dropped", "the block op drops the step's factor after Newton–Schulz",
        (("ttt2la/runtime/block.py",
          "        delta = delta * step_scale[:, :n].transpose(1, 2)[..., None, None]",
          "        delta = delta * 1"),),
        ("tests/test_runtime_block.py",), "step_scale"),
    Mutation(
        "step_scale_fold_shifted", "the step's factor folded into the values one chunk late",
        (("ttt2la/runtime/block.py", ".repeat_interleave(C, dim=1)[:, :T]",
          ".repeat_interleave(C, dim=1).roll(C, 1)[:, :T]"),),
        ("tests/test_runtime_block.py",), "step_scale"),
    Mutation(
        "affine_constants_dropped", "an update's constant factors read as 1 (0.75·m read as m)",
        (("ttt2la/lowering/affine_update.py",
          "    return ((float(x), ()),) if not isinstance(x, torch.fx.Node) else ((1.0, (x,)),)",
          "    return ((1.0, ()),) if not isinstance(x, torch.fx.Node) else ((1.0, (x,)),)"),),
        ("tests/test_lift_affine.py",), ""),
    Mutation(
        "affine_difference_added", "``a − b`` read as ``a + b`` in an update (lerp's ``g − m``)",
        (("ttt2la/lowering/affine_update.py",
          "        sign = 1.0 if n.target is aten.add.Tensor else -1.0",
          "        sign = 1.0"),),
        ("tests/test_lift_affine.py",), ""),
    Mutation(
        "affine_factor_left_aligned", "a per-chunk coefficient's axes aligned from the left",
        (("ttt2la/lowering/affine_update.py",
          "v.reshape(v.shape[0], *([1] * pad), *v.shape[1:])",
          "v.reshape(v.shape[0], *v.shape[1:], *([1] * pad))"),),
        ("tests/test_lift_affine.py",), ""),
    Mutation(
        "placeholder_named_unlike_node", "a body's arguments named unlike their nodes (fx binds "
        "a state ``W`` where a weight ``w`` was meant)",
        (("ttt2la/ir.py", "    ph.target = ph.name\n", ""),),
        ("tests/test_state_names.py",), "case"),
    Mutation(
        "summed_product_transposed", "a product summed over an axis is rewritten with its "
        "matrix operand laid out transposed",
        (("ttt2la/frontend/summed_products.py",
          "rows = _laid_out(a, (self.batch, self.a_own, self.summed), self.b_own)",
          "rows = _laid_out(a, (self.batch, self.summed, self.a_own), self.b_own)"),),
        ("tests/test_summed_products.py", "tests/test_fla_reference_styles.py"), ""),
    Mutation(
        "log_of_a_signed_decay", "a per-token decay is taken as a log decay without checking it "
        "is positive",
        (("ttt2la/lowering/lift.py", "return bool((decay > 0).all())", "return True"),),
        ("tests/test_fla_reference_styles.py",), "decay_without"),
    Mutation(
        "generic_plan_runs_read_products", "a loop kept on the generic plan runs the products "
        "the matchers read as matmuls (a one-row bmm per token) instead of the code's own",
        (("ttt2la/lowering/executors.py", "program, analysis = written(program, analysis)",
          "pass"),),
        ("tests/test_fla_reference_styles.py",), "own_products"),
    Mutation(
        "read_first_unshifted", "a per-token loop that reads before its update runs the "
        "token-causal op on unshifted keys (each token reads its own write)",
        (("ttt2la/lowering/lift.py", "self._run_op(phi_q, later(phi_k), later(value)",
          "self._run_op(phi_q, phi_k, value"),),
        ("tests/test_fla_reference_styles.py", "tests/test_stream_exclusive.py"), ""),
    Mutation(
        "read_first_last_update_dropped", "a read-before-update loop's last update is not "
        "applied to the state it returns",
        (("ttt2la/lowering/lift.py", 'if self.lifted.program.last_chunk == "update":',
          "if False:"),),
        ("tests/test_fla_reference_styles.py",), "read_before"),
    Mutation(
        "iteration_start_fixed_offset", "an iteration cut from a one-statement loop starts a "
        "fixed number of ops before its marker, into the previous iteration where dead code "
        "removed leading ops",
        (("ttt2la/frontend/loops.py",
          "while start > starts[-1] + 1 and prefix[keys[start - 1]] > 0:",
          "while start > starts[-1] + 1 and start > at - marker_pos:"),),
        ("tests/test_convert.py",), "per_token_layer_is_parallel"),
    Mutation(
        "scanning_generic_plan_never_races", "a generic plan that prefix-sums every chunk's "
        "states is not raced against the code as written (it can run at a fifth of its speed)",
        (("ttt2la/lowering/executors.py", "        attention's, ran at 0.17-0.23x its token loop on a CPU).\"\"\"\n        return True",
          "        attention's, ran at 0.17-0.23x its token loop on a CPU).\"\"\"\n        return self.loops_over_chunks"),),
        ("tests/test_as_written.py",), "generic_plan_that_scans"),
    Mutation(
        "streams_named_breadth_first", "streams named from their line breadth first, not in the "
        "order Python reads it",
        (("ttt2la/frontend/source_names.py", "return [name for _, _, name in sorted(found)]",
          "return [name for _, _, name in found]"),),
        ("tests/test_fla_reference_styles.py",), "named_in_the_order"),
    Mutation(
        "channel_decay_between_off_by_one", "the sub-chunks between a key and a query sub-chunk "
        "include the query's own (a decay per key channel counted twice)",
        (("ttt2la/runtime/channel_decay.py", "return torch.cat([closed, Z[..., :-1, :, :]], dim=-3)",
          "return torch.cat([closed, Z[..., 1:, :, :]], dim=-3)"),),
        ("tests/test_runtime_chunk.py",), "per_channel_takes_each_path"),
    Mutation(
        "channel_decay_exact_transposed", "the exact per-channel decay inside a sub-chunk reads "
        "its segment sums transposed",
        (("ttt2la/runtime/channel_decay.py", "decays = segment_sums(g.transpose(-1, -2)).exp()",
          "decays = segment_sums(g.transpose(-1, -2)).exp().mT"),),
        ("tests/test_runtime_chunk.py",), "per_channel_takes_each_path and strong"),
    Mutation(
        "channel_decay_rows_unscanned", "chunk-boundary states decayed per head (the first "
        "channel's factor) instead of per key channel",
        (("ttt2la/runtime/channel_decay.py",
          "states = blocked_scan(decay.transpose(1, 2).reshape(R * Dk, n), rows, init,",
          "states = blocked_scan(decay[..., :1].expand(R, n, Dk).transpose(1, 2)"
          ".reshape(R * Dk, n), rows, init,"),),
        ("tests/test_runtime_chunk.py",), "random_shapes_and_options_fp32"),
    Mutation(
        "key_decay_on_value_axis", "a decay per value channel taken for one per key channel",
        (("ttt2la/lowering/lift.py",
          "return self.decay_axis is not None and self.decay_axis == (-2 if self.transposed else -1)",
          "return False"),),
        ("tests/test_fla_reference_styles.py",), "per_value_channel"),
    Mutation(
        "value_decay_scanned_per_row", "the block op's decay per value channel scanned as one per "
        "key channel (the states' rows)",
        (("ttt2la/runtime/block.py", "if columns and factors is not None and factors.dim() == 4:",
          "if False:"),),
        ("tests/test_runtime_value_decay.py",), "block_op_decays_columns_float64"),
    Mutation(
        "value_read_unscaled", "the token-causal op's read of the previous chunks' state not "
        "decayed per value channel inside the chunk",
        (("ttt2la/runtime/chunk.py", "reads * read_scale.reshape(-1, C, Dv)[1:]", "reads"),),
        ("tests/test_runtime_value_decay.py",), "chunk_op_decays_columns_float64"),
    Mutation(
        "value_suffix_counts_own_token", "between sub-chunks, a value decayed by its own token's "
        "decay too (an inclusive suffix)",
        (("ttt2la/runtime/value_decay.py", "values = (vs * suffix_sums(gs, -2).exp())",
          "values = (vs * gs.flip(-2).cumsum(-2).flip(-2).exp())"),),
        ("tests/test_runtime_value_decay.py",), "takes_each_path and medium"),
    Mutation(
        "value_exact_transposed", "a strong sub-chunk's exact decays per value channel transposed",
        (("ttt2la/runtime/value_decay.py",
          "decays = segment_sums(g.transpose(-1, -2)).exp()               # [..., Dv, t, i]",
          "decays = segment_sums(g.transpose(-1, -2)).exp().mT"),),
        ("tests/test_runtime_value_decay.py",), "takes_each_path and strong"),
    Mutation(
        "read_first_value_decay_on_rows", "a read-before loop's last update decays its state's "
        "rows by the decay per value channel",
        (("ttt2la/lowering/lift.py",
          'per_token["value_log_decay"][:, -1].unsqueeze(-2).exp()',
          'per_token["value_log_decay"][:, -1].unsqueeze(-1).exp()'),),
        ("tests/test_fla_reference_styles.py",), "per_value_channel and before"),
    Mutation(
        "read_first_key_decay_last", "a read-before loop's last update decays its state per "
        "head (the first key channel's decay) instead of per key channel",
        (("ttt2la/lowering/lift.py", "s_final = last.reshape(*last.shape[:2], -1, 1).exp() * s_final",
          "s_final = last.reshape(*last.shape[:2], -1, 1)[:, :, :1].exp() * s_final"),),
        ("tests/test_fla_reference_styles.py",), "per_key_channel and before"),
    Mutation(
        "companion_decay_unchecked", "a second memory decayed by its own gate taken for a "
        "value column of the first",
        (("ttt2la/lowering/shared_keys.py",
          "return ours.shape == theirs.shape and relative_error(ours - theirs, theirs) < 1e-12",
          "return True"),),
        ("tests/test_fla_reference_styles.py",), "second_memory"),
    Mutation(
        "companion_column_unscaled", "a second memory written with c times the key rides as a "
        "column of ones",
        (("ttt2la/lowering/shared_keys.py", "found.append(Companion(i, column, reader, units))",
          "found.append(Companion(i, ((1.0, column[0][1]),), reader, units))"),),
        ("tests/test_fla_reference_styles.py",), "value_column"),
    Mutation(
        "bonus_dropped", "a state read plus the token's own product lifted without its term",
        (("ttt2la/lowering/lift.py", "        if term:\n            o = o + bonus_read(",
          "        if False:\n            o = o + bonus_read("),),
        ("tests/test_bonus.py",), "rwkv6"),
    Mutation(
        "bonus_constant_lost", "the term's constant factor (0.5, a sign) dropped",
        (("ttt2la/lowering/bonus.py", "row_w = phi_q.new_ones(()) * bonus.constant",
          "row_w = phi_q.new_ones(())"),),
        ("tests/test_bonus.py",), "every_weight"),
    Mutation(
        "bonus_weights_on_the_other_axis", "a term weighted per key channel weighted per "
        "value channel instead (the state key-first)",
        (("ttt2la/lowering/bonus.py",
          "key, value = (left * row_w).transpose(-1, -2), right * col_w",
          "key, value = left.transpose(-1, -2), right * col_w * row_w.transpose(-1, -2)"),),
        ("tests/test_bonus.py",), "every_weight"),
    Mutation(
        "bonus_read_not_final", "a state read plus a term not taken for a read of the state "
        "(RWKV's loop kept on the generic plan)",
        (("ttt2la/analysis/roles.py",
          "                s = plus_term(program, dep, mine) if s is None else s\n", ""),),
        ("tests/test_bonus.py",), "rwkv6"),
    Mutation(
        "summed_product_matrix_permuted", "a matrix written before the vector it is read "
        "with laid out transposed (the read of ``S * q`` not found)",
        (("ttt2la/frontend/summed_products.py",
          "    if _reads_matrix_permuted(a_own, b_own, summed):",
          "    if False:"),),
        ("tests/test_summed_products.py",), "either"),
    Mutation(
        "token_step_dropped", "a per-token loop's step factor (lerp's 1 - a) not applied to "
        "its values",
        (("ttt2la/lowering/lift.py",
          "value = value * per_chunk.pop(\"step_scale\").transpose(0, 1).unsqueeze(-1)",
          "per_chunk.pop(\"step_scale\")"),),
        ("tests/test_cut_and_fused_styles.py",), "fused_op_runs"),
    Mutation(
        "addcmul_value_dropped", "addcmul read through its definition without its value factor",
        (("ttt2la/frontend/decompositions.py",
          "return input + (ab if value == 1 else ab * value)", "return input + ab"),),
        ("tests/test_cut_and_fused_styles.py",), "fused_op_runs"),
    Mutation(
        "read_after_relayout_missed", "a state read after its update through a view of the "
        "update's result not found (the loop kept generic)",
        (("ttt2la/lowering/lift.py", "else {outs[up.w], strip(outs[up.w])}",
          "else {outs[up.w]}"),),
        ("tests/test_cut_and_fused_styles.py",), "fused_op_runs"),
    Mutation(
        "flipped_read_missed", "a read through the state's transpose not found (einsum with "
        "the state first kept generic)",
        (("ttt2la/lowering/lift.py", "                      flips=True)",
          "                      flips=False)"),),
        ("tests/test_lift.py",), "through_the_state_s_transpose"),
    Mutation(
        "flipped_read_query_unflipped", "a read through the state's transpose takes its query "
        "in the state's own layout",
        (("ttt2la/lowering/lift.py", "        return self.transposed != self.flipped",
          "        return self.transposed"),),
        ("tests/test_lift.py",), "through_the_state_s_transpose"),
    Mutation(
        "one_token_slices_on_the_block_op", "a loop over slices of one token runs the block op "
        "at chunks of one (0.89x its source where the token-causal op runs 4x)",
        (("ttt2la/lowering/lift.py",
          "    token_causal = per_token or (program.chunk_size == 1 and ns is None and up.m is None",
          "    token_causal = per_token or (False and ns is None and up.m is None"),),
        ("tests/test_lift.py",), "one_token"),
    Mutation(
        "sub_chunks_never_shrink", "a decay per key channel too strong to factor over 16 "
        "tokens keeps sub-chunks of 16 (computed exactly, about 7x the cost)",
        (("ttt2la/runtime/channel_decay.py",
          "sizes = [first, *(s for s in (SUB // 2, SUB // 4) if s < first)]",
          "sizes = [first]"),),
        ("tests/test_runtime_chunk.py",), "sub_chunks_shrink"),
    Mutation(
        "companion_final_state_dropped", "a companion memory's final state is not returned "
        "(a read-before loop's last write to it lost)",
        (("ttt2la/lowering/lift.py",
          "finals[c.index] = s_final[..., Dv + j].reshape(states0[c.index].shape)",
          "finals[c.index] = torch.zeros_like(states0[c.index])"),),
        ("tests/test_fla_reference_styles.py",), "value_column"),
    Mutation(
        "row_decay_as_one_factor", "a decay per state row scanned as one factor per matrix "
        "(its first row's) in the block op",
        (("ttt2la/runtime/block.py",
          "    if factors is not None and factors.dim() == 4:\n",
          "    if factors is not None and factors.dim() == 4:\n        factors = factors[..., 0]\n"
          "    if False:\n"),),
        ("tests/test_runtime_block.py",), "decay_with_every_other_option"),
    Mutation(
        "row_decay_rows_misplaced", "the per-row scan's states put back with rows and chunks "
        "swapped within each head",
        (("ttt2la/runtime/block.py", "return S.view(B, H, Dk, n, Dv).transpose(2, 3)",
          "return S.view(B, H, n, Dk, Dv)"),),
        ("tests/test_runtime_block.py",), "decay_with_every_other_option"),
    Mutation(
        "row_decay_not_lifted", "a chunk loop's decay per key channel kept off the block op "
        "(the generic plan, as before)",
        (("ttt2la/lowering/lift.py", "                        is_vector_factor if norm is None else is_factor)",
          "                        is_vector_factor if norm is None and any(s.per_token for s in "
          "program.streams) else is_factor)"),),
        ("tests/test_fla_chunk_reference.py", "tests/test_lift_decay.py"), "lifts"),
    Mutation(
        "rejected_call_loses_its_class", "a call the layer's own code rejects raised as a "
        "ConversionError that is no longer the original error's class",
        (("ttt2la/rejected_call.py", "    return _dual_class(type(error))(message, where=where or None)",
          "    return RejectedCallError(message, where=where or None)"),),
        ("tests/test_call_errors.py",), "rejects"),
    Mutation(
        "rejected_call_unlocated", "a call the layer's own code rejects, without the line "
        "that failed",
        (("ttt2la/rejected_call.py", "    where, what, own = failed_where(failing_node(gm, inputs),",
          "    where, what, own = failed_where(None,"),),
        ("tests/test_call_errors.py",), "rejects"),
    Mutation(
        "ns_culprit_unrecognised", "a nonlinearity inside a Newton–Schulz iteration not "
        "recognised as one (the final layer refused by the theorem, or a crash)",
        (("ttt2la/analysis/associativity.py",
          "if m is not None and culprit in ancestors(m.output) - ancestors(m.input) | {m.input}:",
          "if m is not None and culprit in ancestors(m.input) - ancestors(m.input):"),),
        ("tests/test_zoo_published.py",), "squared_error"),
    Mutation(
        "ns_remedy_lost", "a state refused through its increment's Newton–Schulz names no pass "
        "that removes it",
        (("ttt2la/passes/remove_muon.py", '    removes = "increment_transform"\n', ""),),
        ("tests/test_zoo_published.py",), "squared_error"),
    Mutation(
        "training_mode_ignored", "a layer whose code differs in training mode runs its "
        "evaluation-mode graphs in training mode (dropout silently skipped)",
        (("ttt2la/converted.py", "        if module.training and self.training_dependence:\n"
          "            return (\"training\", \"\"), B, L",
          "        if False:\n            return (\"training\", \"\"), B, L"),),
        ("tests/test_training_mode.py",), "dropout"),
    Mutation(
        "traced_in_training_mode", "convert traces a layer in the mode it comes in (dropout's "
        "random mask traced, the exactness check failing as a bug)",
        (("ttt2la/as_found.py", "            evaluating(*models):",
          "            contextlib.nullcontext():"),),
        ("tests/test_training_mode.py",), "dropout"),
    Mutation(
        "compiled_training_mode_ignored", "under torch.compile a mode-dependent layer runs its "
        "evaluation-mode graphs in training mode",
        (("ttt2la/converted.py", "    instead = state.route(module, args, {}, list(args), weights_signature(weights))",
          "    instead = None"),),
        ("tests/test_training_mode.py",), "compile"),
    Mutation(
        "collapse_promise_on_theta_free_kernels", "collapse_mlp's postcondition also demands a "
        "linear map of keys weighted by their decay (no Θ), failing chunked GLA at level 3",
        (("ttt2la/passes/collapse_mlp.py",
          "            if (params & reads and nonlinear_ops(core, streamed, order)) or",
          "            if (nonlinear_ops(core, streamed, order)) or"),),
        ("tests/test_fla_chunk_reference.py",), "every_level"),
    Mutation(
        "broken_promise_escapes_raw", "a pass's failed postcondition escapes as a bare "
        "AssertionError",
        (("ttt2la/passes/base.py", "        except AssertionError as e:         # a broken promise",
          "        except ZeroDivisionError as e:      # a broken promise"),),
        ("tests/test_passes.py",), "promise"),
    Mutation(
        "constant_momentum_chunks_uncounted", "a constant momentum coefficient folded over the "
        "chunks of the first coefficient read per chunk (none: nothing to fold)",
        (("ttt2la/passes/remove_momentum.py",
          "* len(sample[-1])", "* (len(sample[0]) if nodes else 0)"),),
        ("tests/test_passes_lossy.py",), "constant_coefficient"),
    Mutation(
        "compiled_layers_share_a_key", "every converted layer registered under one key, so a "
        "compiled graph's guard cannot tell them apart",
        (("ttt2la/converted.py", "module._ttt2la_key = next(_KEYS)", "module._ttt2la_key = 0"),),
        ("tests/test_ordinary_module.py",), "two_conversions"),
    Mutation(
        "compile_break_ignored", "a plan that cannot be traced entered the compiled graph anyway",
        (("ttt2la/converted.py",
          "entry = _RUN_BETWEEN_GRAPHS[reason] if reason else _run_in_graph",
          "entry = _run_in_graph"),),
        ("tests/test_ordinary_module.py",), "between_compiled_graphs or fullgraph_compilation"),
    Mutation(
        "unit_axis_einsum_unread", "an einsum over a unit axis not read as the outer product",
        (("ttt2la/frontend/summed_products.py", "    return prod, units, False",
          "    return None"),),
        ("tests/test_summed_products.py", "tests/test_lift.py"), "unit_axis or one_token"),
    Mutation(
        "chunk_views_kept", "per-chunk graphs keep the trace's views on chunks laid out otherwise",
        (("ttt2la/lowering/lean_calls.py", "aten.view.default: torch.Tensor.reshape",
          "aten.view.default: torch.Tensor.view"),),
        ("tests/test_convert.py",), "half_precision"),
    Mutation(
        "calibration_views_kept", "the calibration runs the body's views on chunk slices",
        (("ttt2la/calibration.py", "return super().call_function(layout_free(target), args, kwargs)",
          "return super().call_function(target, args, kwargs)"),),
        ("tests/test_calibration.py",), "bf16"),
    Mutation(
        "meta_tensors_unchecked", "weights and inputs on the meta device reach the model",
        (("ttt2la/validation.py", "    check_materialized(model, example_inputs, example_kwargs)\n",
          ""),),
        ("tests/test_cli_inputs.py",), "meta_device"),
    Mutation(
        "recorded_inputs_ignored", "a converted checkpoint converted again guesses its inputs",
        (("ttt2la/cli.py", "elif (recorded := _recorded_spec(args.checkpoint)) is not None:",
          "elif False and (recorded := _recorded_spec(args.checkpoint)) is not None:"),),
        ("tests/test_checkpoint.py",), "recorded_inputs or stored_inputs"),
    Mutation(
        "inline_config_read_as_path", "--config's inline JSON object read as a file name",
        (("ttt2la/checkpoint/recipe.py",
          'return isinstance(text, str) and text.lstrip().startswith(("{", "["))',
          "return False"),),
        ("tests/test_cli_inputs.py",), "inline"),
    Mutation(
        "runtime_op_under_autocast", "the runtime ops run their matmuls under the caller's autocast",
        (("ttt2la/runtime/dispatch.py", "    with torch.autocast(device, enabled=False):",
          "    with torch.autocast(device, enabled=torch.is_autocast_enabled(device)):"),),
        ("tests/test_convert.py",), "autocast"),
    Mutation(
        "cast_weights_run_old_graphs", "a layer cast after conversion runs the graphs built for its old weights",
        (("ttt2la/converted.py", "if now == self.weights or not self.weights:",
          "if True:"),),
        ("tests/test_recast.py",), "cast"),
    Mutation(
        "recast_example_left_uncast", "the replay for cast weights traces on the example inputs as recorded",
        (("ttt2la/recast.py", "dtype=dtypes.get(t.dtype, t.dtype))", "dtype=t.dtype)"),),
        ("tests/test_recast.py",), "cast"),
    Mutation(
        "graphs_prepared_in_sight_of_autograd", "specialised graphs are prepared under the caller's autograd",
        (("ttt2la/lowering/specialize.py", "        with out_of_sight(autocast=autocast_state(args)):\n", "        if True:\n"),),
        ("tests/test_ordinary_module.py",), "activation"),
    Mutation(
        "padding_probe_in_sight_of_autograd", "the padding probe differentiates under the caller's saved-tensor hooks",
        (("ttt2la/preparation.py", "    with _disable_current_modes(), _without_saved_tensor_hooks(), _fake_failures_unlogged(), \\\n",
          "    with _disable_current_modes(), _fake_failures_unlogged(), \\\n"),),
        ("tests/test_ordinary_module.py", "tests/test_recast.py"), "activation or checkpointing"),
    Mutation(
        "second_order_dropped", "the runtime's hand-written backwards ignore create_graph=True",
        (("ttt2la/runtime/higher_order.py", "    return torch.is_grad_enabled()", "    return False"),),
        ("tests/test_runtime_block.py", "tests/test_fla_chunk_reference.py"), "second_order or penalty"),
    Mutation(
        "second_order_inputs_unaliased", "the plain form's gradient of an input counts paths through another input",
        (("ttt2la/runtime/higher_order.py",
          "x.view_as(x) if isinstance(x, torch.Tensor) and x.requires_grad else x", "x"),),
        ("tests/test_runtime_block.py",), "second_order"),
    Mutation(
        "triton_second_order_unrefused", "a backward recording a graph through the Triton kernels runs first-order",
        (("ttt2la/runtime/higher_order.py", "    if recording_graph():\n        raise",
          "    if False:\n        raise"),),
        ("tests/test_triton_kernels.py",), "recording_a_graph"),
    Mutation(
        "submodule_hooks_ignored", "a converted layer runs its graphs while hooks are on its submodules",
        (("ttt2la/converted.py", "    if hooked(self):\n", "    if False:\n"),),
        ("tests/test_submodule_hooks.py",), "after_conversion or global or lossy or carrying"),
    Mutation(
        "hooked_layer_converted", "conversion traces a layer whose submodules carry hooks",
        (("ttt2la/frontend/recognize.py", "    if hooks:\n        raise UnsupportedTTTError",
          "    if False:\n        raise UnsupportedTTTError"),),
        ("tests/test_submodule_hooks.py",), "at_conversion or in_a_model"),
    Mutation(
        "own_hooks_traced", "a trace runs the layer's own hooks, which then run again around it",
        (("ttt2la/frontend/recognize.py", "        return self.layer.forward(*args, **kwargs)",
          "        return self.layer(*args, **kwargs)"),),
        ("tests/test_submodule_hooks.py",), "own_hooks"),
    Mutation(
        "renamed_weights_run_old_graphs", "a parametrization registered after conversion runs the old graphs",
        (("ttt2la/recast.py", "    return tuple((name, t.dtype, t.device) for name, t in weights.items())",
          "    return tuple((\"\", t.dtype, t.device) for name, t in weights.items())"),),
        ("tests/test_submodule_hooks.py",), "parametrization"),
    Mutation(
        "stream_calls_shared_between_threads", "a stateful call's state is seen by plain calls on other threads",
        (("ttt2la/converted.py", '    calls = getattr(_STREAMING, "calls", None)',
          '    calls = getattr(_stream_calls, "shared", None)'),
         ("ttt2la/converted.py", "        calls = _STREAMING.calls = {}", "        calls = _stream_calls.shared = {}")),
        ("tests/test_threads.py",), "carries_state"),
    Mutation(
        "streaming_probe_on_the_cached_graph", "the streaming probe swaps the loop of the graph other calls run",
        (("ttt2la/locality.py", "        gm = lean_calls(state.outer.instantiate(*B_L))",
          "        gm = state.outer_for(*B_L)"),
         ("ttt2la/locality.py", "        y = gm.forward(pb, *inputs)\n",
          "        try:\n            y = gm.forward(pb, *inputs)\n        finally:\n"
          "            setattr(gm, LOOP_MODULE, loop)\n")),
        ("tests/test_threads.py",), "probes"),
    Mutation(
        "forward_ad_unserialised", "plans take forward-mode derivatives without the process's lock",
        (("ttt2la/lowering/executors.py", "from .forward_ad import jvp\n", "from torch.func import jvp\n"),),
        ("tests/test_threads.py",), "forward_mode"),
    Mutation(
        "stream_runs_share_a_state", "a layer run twice per call of a streamed model continues one state",
        (("ttt2la/stream.py", '        return path if run == 0 else f"{path} (run {run + 1})"',
          "        return path"),),
        ("tests/test_stream.py",), "run_twice or more_often"),
    Mutation(
        "loop_over_blocks_probed_longer", "a loop that took no slice is run again at doubling lengths",
        (("ttt2la/frontend/recognize.py", "    if _shows_two_chunks(cand) or seq_len is None or not cand.slice_starts:",
          "    if _shows_two_chunks(cand) or seq_len is None:"),),
        ("tests/test_frontend_styles.py",), "loop_over_blocks"),
    Mutation(
        "as_written_errors_raw", "a call run as written raises the code's raw error",
        (("ttt2la/converted.py", "        except Exception as e:\n            raise rejected_as_written(",
          "        except ConversionError as e:\n            raise rejected_as_written("),),
        ("tests/test_submodule_hooks.py", "tests/test_training_mode.py"), "as_written_fails or as_written_rejects"),
    Mutation(
        "folds_for_unknown_layers_ignored", "folds naming no layer of the model are ignored",
        (("ttt2la/conversion.py", "        if path not in paths:\n", "        if path not in paths and False:\n"),),
        ("tests/test_cli_inputs.py",), "naming_no_layer"),
    Mutation(
        "tied_weights_loaded_apart", "distinct weights a model ties load one of them twice",
        (("ttt2la/checkpoint/weights.py", "            untied.append(\" and \".join(present))", "            pass"),),
        ("tests/test_cli_inputs.py",), "tie or read_back"),
    Mutation(
        "autograd_trace_output_unflattened", "a graph traced with autograd live returns its output unflattened",
        (("ttt2la/frontend/capture.py", "run(*flat, enable_io_processing=False)", "run(*flat)"),),
        ("tests/test_frontend_styles.py",), "autograd_step"),
    Mutation(
        "partial_chunk_refused_when_exact", "an exact conversion refuses a partial last chunk its source runs",
        (("ttt2la/converted.py", "        except PartialChunkError as e:\n            return self._written_instead(",
          "        except PartialChunkError as e:\n            raise\n            return self._written_instead("),),
        ("tests/test_as_written.py",), "partial"),
    Mutation(
        "one_view_split_unread", "a view splitting the sequence and the heads together is no chunk split",
        (("ttt2la/frontend/prechunked.py", "    else:                           # the axes after the split regrouped too\n        hits = [",
          "    else:                           # the axes after the split regrouped too\n        hits = [] and ["),),
        ("tests/test_scan_style.py",), "split_axis or one_view"),
    Mutation(
        "chunk_index_first_axis_only", "a chunk indexed on a pre-chunked tensor's second axis reports one token",
        (("ttt2la/frontend/prechunked.py", "        if at is None or at[0] != known[0]:",
          "        if at is None or at[0] != known[0] or known[0] != 0:"),),
        ("tests/test_scan_style.py",), "taken"),
    Mutation(
        "prechunked_unbind_as_tokens", "unbinding a pre-chunked tensor's chunk axis reports one-token cuts",
        (("ttt2la/frontend/discover.py", "    chunked = chunks.cut(x, dim) if name == \"unbind\" else None",
          "    chunked = None"),),
        ("tests/test_scan_style.py",), "taken"),
    Mutation(
        "slice_copy_kept", "a functionalized slice assignment keeps its copy, which torch cannot differentiate",
        (("ttt2la/frontend/capture.py", "    gm = slice_assignments_as_values(gm)\n", "    gm = gm\n"),),
        ("tests/test_slice_assignments.py",), "leave_no_copy or generic_with_the_gradients"),
    Mutation(
        "select_write_vmapped", "a loop body's select_scatter is run vmapped as written",
        (("ttt2la/frontend/rollup.py", "    select_writes_as_slice_writes(body)     # run vmapped: see slice_assignments",
          "    pass"),),
        ("tests/test_slice_assignments.py",), "generic_with_the_gradients"),
    Mutation(
        "busiest_loop_chosen", "the loop with the most ops is taken over the one that walks the sequence",
        (("ttt2la/frontend/discover.py", "        cands.sort(key=lambda c: (c.cuts_only, -max(c.slice_lengths, default=0), -c.ops))",
          "        cands.sort(key=lambda c: -c.ops)"),),
        ("tests/test_scan_style.py",), "mini_batches_is_chosen"),
    Mutation(
        "weights_traced_without_grad", "a layer's weights are traced as tensors that do not require grad",
        (("ttt2la/frontend/recognize.py", "    return {k: v.detach().requires_grad_(v.requires_grad)",
          "    return {k: v.detach().requires_grad_(False)"),),
        ("tests/test_frontend_styles.py",), "weight_that_requires"),
    Mutation(
        "expanded_rate_no_factor", "a rate broadcast by an explicit expand is not read as a per-token factor",
        (("ttt2la/passes/absorb_lr.py", "    mine, theirs = node_shape(_unexpanded(operand)), node_shape(other)",
          "    mine, theirs = node_shape(operand), node_shape(other)"),),
        ("tests/test_passes_lossy.py",), "weights_the_inner_loss"),
    Mutation(
        "nested_loop_unnamed", "a stream refused inside a loop nested in the TTT loop is not said to be",
        (("ttt2la/frontend/rollup.py", "    if nested:\n        return (f\"{what} is taken inside",
          "    if False:\n        return (f\"{what} is taken inside"),),
        ("tests/test_frontend_styles.py",), "loop_over_heads_inside"),
    Mutation(
        "pieces_any_order", "pieces of a cut made before the loop count as chunks whatever order the body reads them in",
        (("ttt2la/frontend/split_pieces.py",
          "    if any(last >= spans[i + 1][0] for i, (_, last) in enumerate(spans[:-1])):\n        return set()",
          "    pass"),),
        ("tests/test_chunks_made_before_the_loop.py",), "every_iteration_reads"),
    Mutation(
        "generated_values_in_the_header", "values a generator in the loop statement yields keep the statement's line",
        (("ttt2la/frontend/split_pieces.py", "        if frames and loops_of(first, outer=outer):",
          "        if False:"),),
        ("tests/test_chunks_made_before_the_loop.py",), "lifts_onto and generator"),
    Mutation(
        "slices_before_the_loop_stay", "slices made before the loop are not moved to their reader",
        (("ttt2la/frontend/split_pieces.py", "    moved = _slices_before_loops(gm, order, outer)\n", "    moved = False\n"),),
        ("tests/test_chunks_made_before_the_loop.py",), "lifts_onto and list_of_slices"),
    Mutation(
        "stacked_chunks_joined", "the whole-sequence plan returns a stacked chunk-first output as a sequence",
        (("ttt2la/lowering/lift.py", "    if not spec.per_token or any(s.per_token for s in program.streams):\n        return y",
          "    if True:\n        return y"),),
        ("tests/test_chunks_made_before_the_loop.py",), "lifts_onto and pre_chunked"),
    Mutation(
        "plan_shape_unchecked", "the lowering's check compares outputs of different shapes by value",
        (("ttt2la/lowering/check.py", "    if got.shape != ref.shape:", "    if False:"),),
        ("tests/test_chunks_made_before_the_loop.py",), "another_shape"),
    Mutation(
        "dot_product_as_bmm", "a bmm of one row by one column stays a matrix product",
        (("ttt2la/frontend/dot_products.py", "    return (n, k) if rows == 1 and cols == 1", "    return (n, k) if rows == 0 and cols == 1"),),
        ("tests/test_dot_products.py",), ""),
    Mutation(
        "rate_divided_after_broadcast", "a rate divided by a constant after its broadcast is not read as a factor",
        (("ttt2la/passes/absorb_lr.py", "    readers = _readers(value, live, through_constants=True)",
          "    readers = _readers(value, live)"),),
        ("tests/test_passes_lossy.py",), "weights_the_inner_loss and mean"),
    Mutation(
        "computed_rate_unsaid", "a rate computed in the loop body is reported as a satisfied step",
        (("ttt2la/passes/absorb_lr.py", "            computed = computed_rates(program)", "            computed = []"),),
        ("tests/test_passes_lossy.py",), "computed_in_the_loop"),
    Mutation(
        "momentum_gate_as_rate", "a per-chunk momentum gate is taken for a rate computed in the loop",
        (("ttt2la/passes/absorb_lr.py", "        if program.chunk_size > 1 and program.chunk_size not in shape[:-1]:\n            continue",
          "        pass"),
         ("ttt2la/passes/absorb_lr.py",
          "        if _scales_updates(value, updates, live) and not _scales_a_state(value, live, states):\n            found.append(node)",
          "        if _scales_updates(value, updates, live):\n            found.append(node)")),
        ("tests/test_zoo_variants.py",), "converts_exactly_at_its_level and folded-4"),
    Mutation(
        "single_step_lifted_causally", "a single step may lift onto the token-causal or block op",
        (("ttt2la/lowering/plan.py", "    if schedule in (\"parallel\", \"semi-parallel\") and not program.single_step:",
          "    if schedule in (\"parallel\", \"semi-parallel\"):"),),
        ("tests/test_single_step.py",), "reads_tokens_in_order"),
    Mutation(
        "loop_failure_not_written", "a call the converted loop fails on is not answered by the code as written",
        (("ttt2la/converted.py", "        if not isinstance(error, ConversionError) and fails_in_loop(gm, [weights, *flat]):",
                                 "        if not isinstance(error, ConversionError) and False:"),),
        ("tests/test_call_errors.py",), "loop_fails or only_the_loop"),
    Mutation(
        "dict_keys_ignored", "states made by a dict literal are named by the line that updates them",
        (("ttt2la/frontend/source_names.py", "    if any(k is None for k in keys) or len(set(keys)) != len(keys):",
          "    if True:"),),
        ("tests/test_state_names.py",), "scanned_dict"),
    Mutation(
        "reversed_tokens_unsaid", "tokens selected in reverse order are not said to be read in reverse",
        (("ttt2la/frontend/rollup.py", "    if n.target in (*SLICE_TARGETS, *SELECT_TARGETS) and n2.args[0] is n.args[0] and \\",
          "    if n.target in SLICE_TARGETS and n2.args[0] is n.args[0] and \\"),),
        ("tests/test_rollup_phases.py",), "tokens_in_reverse"),
    Mutation(
        "partial_chunk_nowhere", "PartialChunkError does not name the loop",
        (("ttt2la/lowering/executors.py", "        where = str(program.loop_src) if program.loop_src else None",
          "        where = None"),),
        ("tests/test_as_written.py",), "partial"),
    Mutation(
        "decay_taken_for_a_rate", "a stream that decays the state is folded as a learning rate",
        (("ttt2la/passes/absorb_lr.py",
          "        if _scales_updates(value, updates, live) and not _scales_a_state(value, live, states):\n            found.append((i, value))",
          "        if _scales_updates(value, updates, live):\n            found.append((i, value))"),),
        ("tests/test_passes_lossy.py",), "leaves_the_decay"),
    Mutation(
        "rate_on_the_key_unread", "a rate that scales the key's column is not read as a per-token factor",
        (("ttt2la/passes/absorb_lr.py", "    if not any(a == 1 and b > 1 for a, b in pairs):",
          "    if theirs[-1] <= 1:"),),
        ("tests/test_passes_lossy.py",), "leaves_the_decay"),
    Mutation(
        "settled_tiles_unused", "the chunk op's backward launches its derived tiles where timing settled others",
        (("ttt2la/runtime/triton/chunk.py", "    settled = SETTLED_HALF_BACKWARD if want_dg else {}", "    settled = {}"),),
        ("tests/test_tile_tuning.py",), "settled"),
    Mutation(
        "head_decay_as_difference", "the chunk kernel's in-chunk decay mask from differences of cumulative sums",
        (("ttt2la/runtime/triton/chunk.py", "        b_a *= tl.exp(_chunk_segments(gr, i_b, i_h, i_t, T, H, BT))",
          "        b_a *= tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], 0.))"),),
        ("tests/test_triton_kernels.py",), "gates and head"),
    Mutation(
        "suffix_as_difference", "the chunks' suffix sums of per-head log decays as the total minus the prefix",
        (("ttt2la/runtime/triton/chunk.py", "later.flip(2).cumsum(2).flip(2)",
          "(w.sum(2, keepdim=True) - w.cumsum(2))"),),
        ("tests/test_triton_kernels.py",), "gates and head"),
    Mutation(
        "channel_suffix_as_difference", "the kernels' suffix sums of log decays per channel as the total minus the prefix",
        (("ttt2la/runtime/triton/chunk.py", "return cumulative(b_g, 0, False), cumulative(later, 0, True), total(b_g, 0)",
          "return cumulative(b_g, 0, False), total(b_g, 0)[None, :] - cumulative(b_g, 0, False), total(b_g, 0)"),),
        ("tests/test_triton_kernels.py",), "gates and channel"),
    Mutation(
        "between_counts_the_keys", "the decay between sub-chunks also counts the keys' own sub-chunk",
        (("ttt2la/runtime/triton/channel_decay.py",
          "                b_between = _between(g, i_b, i_h, i_t, i_r + 1, i_p,",
          "                b_between = _between(g, i_b, i_h, i_t, i_r, i_p,"),),
        ("tests/test_triton_kernels.py",), "matches_reference and channel"),
    Mutation(
        "key_diagonal_decays_itself", "a key's own token decays it in the in-chunk key gradient",
        (("ttt2la/runtime/triton/channel_decay.py", "tl.where(o_c[:, None] < j,", "tl.where(o_c[:, None] <= j,"),),
        ("tests/test_triton_kernels.py",), "matches_reference and channel"),
    Mutation(
        "channel_dg_counts_own_key", "the per-channel decay gradient counts each key's own state term",
        (("ttt2la/runtime/triton/channel_decay.py", "cumulative(inter_k, 0, False) - inter_k",
          "cumulative(inter_k, 0, False)"),),
        ("tests/test_triton_kernels.py",), "matches_reference and channel"),
    Mutation(
        "channel_state_decays_columns", "the state between chunks decays per value column, not per key row",
        (("ttt2la/runtime/triton/chunk.py", "b_h *= tl.exp(g_lastc)[:, None]", "b_h *= tl.exp(g_lastc)[None, :]"),),
        ("tests/test_triton_kernels.py",), "matches_reference and channel"),
    Mutation(
        "gated_column_unchecked", "a normaliser's first column candidate taken without comparing "
        "its product with the key to the loop's increment",
        (("ttt2la/lowering/shared_keys.py",
          "relative_error(ours - increment.reshape(-1), increment.reshape(-1)) < 1e-12:",
          "True:"),),
        ("tests/test_lift_gated_normaliser.py",), "unlike_the_memory"),
    Mutation(
        "gated_column_unpeeled", "the input gate is not peeled off a normaliser's term as its "
        "column value",
        (("ttt2la/lowering/shared_keys.py", "found.append(times(found[-1], as_polynomial(f)))",
          "found.append(found[-1])"),),
        ("tests/test_lift_gated_normaliser.py",), "rides_the_token_causal_op"),
    Mutation(
        "gated_increment_with_state", "a normaliser's increment evaluated with its memory "
        "random, not zero",
        (("ttt2la/lowering/shared_keys.py", "zeros={state})", "zeros=set())"),),
        ("tests/test_lift_gated_normaliser.py",), "rides_the_token_causal_op"),
    Mutation(
        "gated_column_tokens_shifted", "a gated column's values run one token late",
        (("ttt2la/lowering/lift.py", "(1,)).reshape(N, b, 1, 1)\n", "(1,)).reshape(N, b, 1, 1).roll(1, 0)\n"),),
        ("tests/test_lift_gated_normaliser.py",), "rides_the_token_causal_op"),
    Mutation(
        "vector_factor_left_aligned", "per_matrix aligns a memory vector's factor as a matrix's "
        "(two trailing axes)",
        (("ttt2la/lowering/affine_update.py", "pad = len(batch) + 1 + len(matrix) - v.dim()",
          "pad = len(batch) + 3 - v.dim()"),),
        ("tests/test_lift_gated_normaliser.py",), "rides_the_token_causal_op"),
    Mutation(
        "one_wide_slices_not_tokens", "a loop over one-wide token slices (x[:, t:t+1]) is not "
        "read as a per-token loop, so the delta rule stays on the generic plan",
        (("ttt2la/ir.py",
          "        return all(per_token) or (self.chunk_size == 1 and not any(per_token))",
          "        return all(per_token)"),),
        ("tests/test_folded_delta.py",), "boundaries"),
    Mutation(
        "one_wide_probe_gains_an_axis", "the delta rule's confirmation adds a token axis to a "
        "one-wide slice, which already has one",
        (("ttt2la/lowering/lift_delta_rule.py",
          "            invs[spec.source] = x.unsqueeze(spec.axis) if spec.per_token else x",
          "            invs[spec.source] = x.unsqueeze(spec.axis)"),),
        ("tests/test_folded_delta.py",), "value_computed_in_the_loop"),
    Mutation(
        "partial_chunk_numbers_unseen", "numbers that depend on the chunk's length are not looked for in the trace",
        (("ttt2la/frontend/rollup.py",
          "    program.partial_chunk = length_dependent_number(u.in_iteration(u.n_iter - 1))\n", ""),),
        ("tests/test_as_written.py",), "mean_over_the_chunk"),
    Mutation(
        "partial_chunk_divisor_unseen", "a divisor that differs in the partial chunk is not compared",
        (("ttt2la/frontend/partial_chunk.py", "    numbers = other_numbers(node, last)\n", "    numbers = None\n"),),
        ("tests/test_as_written.py",), "mean_over_the_chunk"),
    Mutation(
        "partial_chunk_mean_unseen", "a mean over fewer elements in the partial chunk is not compared",
        (("ttt2la/frontend/partial_chunk.py", "if ours is not None and ours != theirs:", "if False:"),),
        ("tests/test_as_written.py",), "mean_over_the_chunk"),
    Mutation(
        "normaliser_denominator_unwalked", "the output path stops at a division's denominator, so a normaliser is taken for Θ",
        (("ttt2la/analysis/roles.py",
          'if name == "div":               # a normaliser\'s memory is read in the denominator\n'
          "            stack.extend(node.all_input_nodes)",
          'if name == "div":\n            stack.append(node.args[0])'),),
        ("tests/test_fla_reference_styles.py",), "chunked_normaliser"),
    Mutation(
        "stream_probe_pads_partial_chunks", "the streaming probe never retries at whole chunks where the plan cannot pad",
        (("ttt2la/locality.py", "        except PartialChunkError:       # the plan pads no partial chunk of this loop",
          "        except ZeroDivisionError:"),),
        ("tests/test_fla_reference_styles.py",), "streams_in_whole_chunks"),
    Mutation(
        "untraced_length_runs_the_graphs", "a call at a length the layer could not be traced at runs the graphs",
        (("ttt2la/converted.py", "        untraced = layout.untraced_length(L)\n        if untraced:\n            return None",
          '        untraced = ""\n        if untraced:\n            return None'),),
        ("tests/test_whole_chunk_loops.py",), "could_not_be_traced"),
    Mutation(
        "untraced_remainder_accepted", "every remainder is taken for the one the layer was traced at",
        (("ttt2la/frontend/recognize.py", "        if L % C == r:\n", "        if True:\n"),),
        ("tests/test_whole_chunk_loops.py",), "could_not_be_traced"),
    Mutation(
        "second_loop_unnamed", "the code around a loop that differs with the length is named by an empty path",
        (("ttt2la/frontend/recognize.py", 'what=f"code around the loop at {cand.loop.src} in {_layer_name(cand)}")',
          'what=f"code around the loop of {cand.path}")'),),
        ("tests/test_tracing_failures.py",), "two_loops or changes_with_the_length"),
    Mutation(
        "block_column_read_shifted", "over whole sequences, a chunk loop's normaliser is read from the state's last value column",
        (("ttt2la/lowering/lift.py", "values[c.read] = o[..., Dv + j]", "values[c.read] = o[..., Dv - 1 + j]"),),
        ("tests/test_chunked_normaliser.py",), "rides_the_block_op"),
    Mutation(
        "chunk_column_read_shifted", "chunk by chunk, a normaliser is read from the state's first value column",
        (("ttt2la/lowering/lift.py", "reads = {c.read: o[..., Dv + j]", "reads = {c.read: o[..., j]"),),
        ("tests/test_chunked_normaliser.py",), "rides_the_block_op"),
    Mutation(
        "constant_column_of_ones", "a constant value column is always ones, whatever the normaliser's factor",
        (("ttt2la/lowering/lift.py", "column = value.new_full((), sum(k for k, _ in c.column))",
          "column = value.new_full((), 1.0)"),),
        ("tests/test_chunked_normaliser.py",), "constant_column"),
    Mutation(
        "column_beside_a_rate", "a chunk loop's normaliser rides the op beside a rate per chunk, which the op applies to it too",
        (("ttt2la/lowering/lift.py", "and all(isinstance(c, float) for c in increment.scales)", "and True"),),
        ("tests/test_chunked_normaliser.py",), "unlike_the_state"),
    Mutation(
        "invariant_named_by_trace", "an invariant a helper's unnamed line computes is named by the trace (unsqueeze_4)",
        (("ttt2la/frontend/rollup.py", "or _named_source(n) or a.name", "or a.name"),),
        ("tests/test_state_names.py",), "named_after_what_it_views"),
    Mutation(
        "detach_unseen", "a detach of the fast weights in the trace is not looked for",
        (("ttt2la/gradient_stops.py", "if n.target in (aten.detach.default, aten.alias.default) and n.args[0] in state_dep:", "if False:"),),
        ("tests/test_gradient_stops.py",), ""),
    Mutation(
        "gradient_stop_ignored", "a call recording gradients runs the plan though the loop stops some",
        (("ttt2la/converted.py", "        if self.gradient_stop and records_gradients(module, flat):\n            return", "        if False:\n            return"),),
        ("tests/test_gradient_stops.py",), "runs_as_written"),
    Mutation(
        "unseen_stop_unchecked", "the loop run as traced is never differentiated against the layer",
        (("ttt2la/gradient_stops.py", "    if err <= tolerance(dtype):", "    if True:"),),
        ("tests/test_gradient_stops.py",), "runs_as_written"),
    Mutation(
        "returned_state_gradients_unchecked", "gradients are compared through the first output only: a stop on a returned state alone (after the loop, or only in training mode) goes unseen",
        (("ttt2la/gradient_stops.py", "outs = _floating_outputs(module(*call_args, **call_kwargs))",
          "outs = _floating_outputs(module(*call_args, **call_kwargs))[:1]"),),
        ("tests/test_gradient_stops.py", "tests/test_training_mode.py"), "returned_state"),
    Mutation(
        "rate_behind_the_ones", "a rate a traced backward multiplies into the loss's ones is read only as the first operand",
        (("ttt2la/passes/absorb_lr.py", "        elif len(varying) == 1 and _with_constants(node, varying[0]):",
          "        elif len(varying) == 1 and varying[0] is node.all_input_nodes[0] and _with_constants(node, varying[0]):"),),
        ("tests/test_passes_lossy.py",), "weights_the_inner_loss"),
    Mutation(
        "product_read_at_first_step", "the expanded sequence is read at each token's first step, not its last",
        (("ttt2la/lowering/lift_delta_product.py",
          'first = n - 1 if self.program.order == "inclusive" else 0', "first = 0"),),
        ("tests/test_delta_product.py",), "chunk_boundaries"),
    Mutation(
        "product_keys_not_interleaved", "the steps' keys are laid out step-major, not interleaved token by token",
        (("ttt2la/lowering/lift_delta_product.py", "fold(torch.stack(ks, 1))", "fold(torch.stack(ks, 0))"),),
        ("tests/test_delta_product.py",), "chunk_boundaries"),
    Mutation(
        "product_decay_first_step_only", "a decay read for a later step of the token is dropped",
        (("ttt2la/lowering/lift_delta_product.py",
          "decays.append(None if step.decay.one else step.decay(atoms, like))",
          "decays.append(None if step.decay.one or decays else step.decay(atoms, like))"),),
        ("tests/test_delta_product.py",), "every_expanded_token"),
    Mutation(
        "product_last_token_written", "a read-then-write loop's last token is written into the expanded rule",
        (("ttt2la/lowering/lift_delta_product.py", "        keep[-1] = 0.0\n", ""),),
        ("tests/test_delta_product.py",), "unrolled"),
    Mutation(
        "per_head_beta_unseen", "a constant of the body with one number per row is no coefficient of the delta rule",
        (("ttt2la/lowering/lift_delta_rule.py", "or _per_row_constant(node, x, depends, batch)]", "or False]"),),
        ("tests/test_lossy_levels_on_ops.py",), "run_on_the_delta_rule_op and zoo-4"),
    Mutation(
        "per_head_beta_first_row", "a per-row coefficient is read from its first row for every row",
        (("ttt2la/lowering/lift_delta_rule.py", "atoms = [x.reshape(L, -1).expand(L, b) for x in atoms]",
          "atoms = [x.reshape(L, -1)[:, :1].expand(L, b) for x in atoms]"),),
        ("tests/test_lossy_levels_on_ops.py",), "run_on_the_delta_rule_op and naive-4"),
    Mutation(
        "padding_gradient_never_compared", "any target the padding moves is taken as a sum of the padded tokens",
        (("ttt2la/lowering/executors.py", "return math.isfinite(diff) and diff <= tolerance(y.dtype) * size",
          "return True"),),
        ("tests/test_lossy_levels_on_ops.py",), "padding_probe"),
    Mutation(
        "padding_average_taken_as_sum", "a body that averages over the chunk is taken as a sum of its tokens",
        (("ttt2la/lowering/executors.py", "if any(calls(n, AVERAGES) for n in program.body.graph.nodes):",
          "if False:"),),
        ("tests/test_lossy_levels_on_ops.py",), "padding_probe"),
    Mutation(
        "ns_difference_step_unread", "a Newton–Schulz step written as a difference (1.5 X − 0.5 X Xᵀ X) is no step",
        (("ttt2la/analysis/rules.py", 'or op_name(node) not in ("add", "sub") or len(node.args) < 2:', 'or op_name(node) != "add" or len(node.args) < 2:'),),
        ("tests/test_newton_schulz_spellings.py",), ""),
    Mutation(
        "ns_gram_factor_dropped", "the constant on a Gram matrix's first factor is dropped from the schedule",
        (("ttt2la/analysis/rules.py", "            o, k = scaled[0], k * scaled[1]", "            o = scaled[0]"),),
        ("tests/test_newton_schulz_spellings.py",), "lifts_with_its_schedule"),
    Mutation(
        "flattened_norm_unread", "a Frobenius norm taken over x.flatten(-2) is not read, so its epsilon is unknown",
        (("ttt2la/analysis/rules.py", "    want = [rank - 2] if flattened else [rank - 2, rank - 1]", "    want = [rank - 2, rank - 1]"),),
        ("tests/test_newton_schulz_spellings.py",), "lifts_with_its_schedule"),
    Mutation(
        "lerp_momentum_unread", "a momentum spelt with torch.lerp is not read as a momentum",
        (("ttt2la/analysis/rules.py", "    lerp = _lerp_momentum(output, state)\n", "    lerp = None\n"),),
        ("tests/test_passes_lossy.py",), "every_spelling"),
    Mutation(
        "lerp_weight_swapped", "lerp(M, G, w) is read with the weight on the momentum",
        (("ttt2la/analysis/rules.py", "(start, end, 1.0 - w, w)):", "(start, end, w, 1.0 - w)):"),),
        ("tests/test_passes_lossy.py",), "every_spelling"),
    Mutation(
        "momentum_factors_unfolded", "a momentum scaled twice in a row (a copy, then in place) keeps only its last factor",
        (("ttt2la/analysis/rules.py", "            return inner * alpha", "            return alpha"),),
        ("tests/test_passes_lossy.py",), "every_spelling"),
    Mutation(
        "in_place_state_unnamed", "a state updated by in-place calls on its own line is numbered, not named",
        (("ttt2la/frontend/source_names.py", "        name = _updated_in_place(stmt.value)", "        name = None"),),
        ("tests/test_passes_lossy.py",), "every_spelling"),
    Mutation(
        "offset_start_unsaid", "a loop that starts at token 1 is refused as reading neither a token nor a state",
        (("ttt2la/frontend/rollup.py", "    offset = _offset_start(n, n2)", "    offset = None"),),
        ("tests/test_refusal_messages.py",), "starts_at_an_offset"),
    Mutation(
        "strided_reads_one_step", "a read of n tokens per iteration is looked for one token further in the next iteration, not n",
        (("ttt2la/frontend/unlike_iterations.py", "!= [s + m * width for s in starts]",
          "!= [s + width for s in starts]"),),
        ("tests/test_refusal_messages.py",), "read_at_a_stride"),
    Mutation(
        "index_if_later_iterations_unread", "an `if` on the index is looked for in the first unlike iteration only, so a reset that kills the update before it is called control flow",
        (("ttt2la/frontend/rollup.py", "index_branch(iters, 2, depth, loop, later=True)",
          "index_branch(iters, 2, depth, loop, later=False)"),),
        ("tests/test_refusal_messages.py",), "if_on_the_loop_index"),
    Mutation(
        "state_shape_batch_only", "a state of another layer with the same names is taken for a batch change",
        (("ttt2la/stream.py", "if len(held) == len(needed) and held[1:] == needed[1:]:", "if True:"),),
        ("tests/test_refusal_messages.py",), "another_layer"),
    Mutation(
        "empty_sequence_runs_the_graphs", "a call of no tokens runs the converted graphs instead of the layer as written",
        (("ttt2la/converted.py", "            return lambda: self._at_length_zero(written, B)",
          "            return None"),),
        ("tests/test_refusal_messages.py",), "empty"),
    Mutation(
        "batch_constant_runs_the_graphs", "a call at a batch size other than the one a number of the traced code holds runs the graphs",
        (("ttt2la/converted.py", "            if other_batch:\n",
          "            if False:\n"),
         ("ttt2la/frontend/recognize.py", "        if self.batch_constant and B != unit:\n",
          "        if False:\n")),
        ("tests/test_size_constants.py",), "exact_at_every_batch_size or run_as_written"),
    Mutation(
        "chunk_count_untraced", "no trace one chunk longer: a number of the chunk count goes unseen",
        (("ttt2la/frontend/recognize.py", "rolled_N = None if plan.structured else",
          "rolled_N = None if True else"),),
        ("tests/test_size_constants.py",), "refused_naming_the_line and chunks"),
    Mutation(
        "iteration_numbers_unseen", "a number of the loop index is rolled up as iteration 1's",
        (("ttt2la/frontend/rollup.py", "refuse_iteration_numbers(u.in_iteration(2), loop.src)",
          "refuse_iteration_numbers({}, loop.src)"),),
        ("tests/test_size_constants.py",), "loop_index"),
    Mutation(
        "input_free_identity_sampled", "an invariant made from no input (torch.eye before the loop) is sampled at random by the delta rule's fit",
        (("ttt2la/lowering/lift_delta_rule.py", "value = node.meta.get(INPUT_FREE)", "value = None"),),
        ("tests/test_delta_spellings.py",), "householder"),
    Mutation(
        "padding_constant_unchecked", "a constant each padded token adds is not looked for at conversion",
        (("ttt2la/conversion.py", "    found = found or _padding(layer)\n", "    found = found\n"),),
        ("tests/test_padded_chunk.py",), "constant_per_padded_token or lossy_conversion_refuses"),
    Mutation(
        "padding_verdict_left_on_built_loops", "loops built before the padding check keep padding partial chunks",
        (("ttt2la/converted.py", "        self._loop_cache.clear()\n        self._outer_cache.clear()\n", ""),),
        ("tests/test_padded_chunk.py",), "constant_per_padded_token"),
    Mutation(
        "padding_probe_failure_raw", "a padding probe the body cannot run escapes as a raw RuntimeError",
        (("ttt2la/lowering/executors.py", "        except RuntimeError as e:       # a body whose shapes", "        except ZeroDivisionError as e:       # a body whose shapes"),),
        ("tests/test_padded_chunk.py",), "cannot_run"),
    Mutation(
        "hoisted_ops_after_the_loop_counted", "ops after the loop on fixed weights alone are compared with the loop's apply step, not its hoisted ops",
        (("ttt2la/frontend/rollup.py", "    ours = [n for n in tail_nodes if n in moving and n.target not in sliced]", "    ours = [n for n in tail_nodes if n.target not in sliced]"),),
        ("tests/test_peeled_apply.py",), "converts_with_heads_as_an_axis"),
    Mutation(
        "peeled_apply_values_unmatched", "a last output after the loop is matched by its ops alone, not the values they read",
        (("ttt2la/frontend/rollup.py", "            not all(same.op(a, b) for a, b in zip(ours, theirs)):", "            not all(True for a, b in zip(ours, theirs)):"),),
        ("tests/test_peeled_apply.py",), "other_values"),
    Mutation(
        "failed_piece_half_advances", "a stream call that fails in a later layer keeps the states the earlier layers advanced",
        (("ttt2la/stream.py", "            self.states = before\n", ""),),
        ("tests/test_stream.py",), "advances_no_layer"),
    Mutation(
        "grad_mode_retry_skipped", "a model that fails only without gradients is told to pass other inputs",
        (("ttt2la/validation.py", "needs_grad_mode(e) or _runs_with_gradients(model, args, kwargs)", "needs_grad_mode(e)"),),
        ("tests/test_cli_inputs.py",), "only_with_gradients"),
    Mutation(
        "narrow_state_called_a_bug", "a state stored narrower than the loop computes is reported as a bug of the lowering",
        (("ttt2la/conversion.py", "        if narrow:\n", "        if False:\n"),),
        ("tests/test_refusal_messages.py",), "narrower"),
    Mutation(
        "chunk_end_token_unnamed", "a token read once per chunk straight from the sequence gets the generic refusal",
        (("ttt2la/frontend/rollup.py", "            n2.args[2] - n.args[2] > 1:", "            n2.args[2] - n.args[2] > 10 ** 9:"),),
        ("tests/test_refusal_messages.py",), "once_per_chunk"),
    Mutation(
        "longer_table_unnamed", "a table longer than the sequence, read at the loop's index, gets the generic count mismatch",
        (("ttt2la/frontend/rollup.py", "    table = _longer_table(u, inputs, peeled) if u.n_iter != expected else None\n", "    table = None\n"),),
        ("tests/test_refusal_messages.py",), "longer_than_the_sequence"),
    Mutation(
        "index_steps_unread", "a value of the loop index made by a step (`j % R`, `j < 10`) is never looked for in the loop's source",
        (("ttt2la/frontend/rollup.py", "    refuse_index_steps(loop, u.lines_run())", "    pass"),),
        ("tests/test_index_values.py",), "beyond_the_traces"),
    Mutation(
        "index_modulo_not_a_step", "`%` of the loop index passes as a value that moves every iteration",
        (("ttt2la/frontend/index_flow.py", "STEP_OPS = (ast.Mod, ast.FloorDiv,", "STEP_OPS = (ast.FloorDiv,"),),
        ("tests/test_index_values.py",), "beyond_the_traces"),
    Mutation(
        "index_comparison_taken_for_an_end", "every comparison of the loop index is read as a test of the first or last iteration",
        (("ttt2la/frontend/index_flow.py",
          "        if isinstance(other, ast.Constant) and other.value in (0, 1):", "        if True:"),),
        ("tests/test_index_values.py",), "beyond_the_traces or source_analysis"),
    Mutation(
        "index_untaken_arms_read", "a switch of the configuration is read in the arm the traces never ran, refusing a layer that never runs it",
        (("ttt2la/frontend/index_flow.py", "            if len(live) == 1:", "            if False:"),),
        ("tests/test_index_values.py",), "remedy or legitimate"),
    Mutation(
        "enumerate_counter_unread", "an `enumerate` counter is no index variable of the loop",
        (("ttt2la/frontend/index_values.py",
          "        first = {target.elts[0].id} if isinstance(target.elts[0], ast.Name) else set()",
          "        first = set()"),),
        ("tests/test_index_values.py",), "beyond_the_traces"),
    Mutation(
        "last_iteration_unnamed", "a last iteration that runs other ops is refused without the op, its line or the remedy",
        (("ttt2la/frontend/rollup.py", "        raise u.fail(_last_iteration_differs(u))\n", "        raise u.fail(\"the last iteration differs from the others\")\n"),),
        ("tests/test_refusal_messages.py",), "padding_its_own"),
    Mutation(
        "prepended_piece_unnamed", "outputs joined after another piece get the generic order refusal",
        (("ttt2la/frontend/rollup.py", "        if first and pieces[first:first + len(per_iter)] == per_iter:", "        if False:"),),
        ("tests/test_refusal_messages.py",), "joined_after_another_piece"),
    Mutation(
        "heads_around_tokens_unnamed", "a loop over heads around the token loop gets the generic no-output refusal",
        (("ttt2la/frontend/rollup.py", "        nested = _nested_loops(u.iters[1], u.loop)\n", "        nested = []\n"),),
        ("tests/test_refusal_messages.py",), "heads_around_the_token_loop"),
    Mutation(
        "chunk_count_sizes_unchecked", "the template around the loop is not checked at one chunk more, so the sizes of a padded sequence's chunk count stay the traced ones",
        (("ttt2la/frontend/recognize.py", "longer = None if rolled_N is None else ChunkCountCheck(",
          "longer = None if True else ChunkCountCheck("),),
        ("tests/test_padded_chunk_views.py",), "every_length"),
    Mutation(
        "chunk_count_floor", "the chunk count of a padded sequence taken as floor(L/C) rather than ceil(L/C)",
        (("ttt2la/frontend/shapes.py", "N = -(-L // self.chunk)", "N = L // self.chunk"),),
        ("tests/test_padded_chunk_views.py",), "every_length"),
    Mutation(
        "length_values_unvouched", "a layer whose code computes Python values of the length runs the plan at every length, unchecked",
        (("ttt2la/converted.py", "if vouching is not None and not vouching.holds(B, L):\n            with buffers_kept",
          "if vouching is not None and False:\n            with buffers_kept"),),
        ("tests/test_length_values.py",), "branch or capped or lossy"),
    Mutation(
        "length_check_trusts_the_plan", "a new length's check keeps the plan without comparing it with the code as written",
        (("ttt2la/length_vouching.py", "agree = mine is not None and _same(mine, theirs)",
          "agree = mine is not None"),),
        ("tests/test_length_values.py",), "branch or capped"),
    Mutation(
        "chunk_size_moves_unrefused", "a chunk size that differs between probe lengths is not refused",
        (("ttt2la/frontend/recognize.py", "if len(set(sizes.values())) < 2:", "if True:"),),
        ("tests/test_length_values.py",), "chunk_size_of_the_length"),
    Mutation(
        "example_branch_called_a_bug", "a layer taking another branch at the example's length than at the probe lengths fails the conversion's check as a bug in ttt2la",
        (("ttt2la/conversion.py", "        check = _example_branch(layer, ref) or _padded_example(layer, ref) or check\n", "        pass\n"),),
        ("tests/test_length_values.py",), "example_length_runs"),
    Mutation(
        "example_branch_op_unnamed", "the traces at the example's length and the probe lengths are not compared op by op, so the report names no op the branch there differs in (and a branch nothing else finds is reported as a bug)",
        (("ttt2la/length_vouching.py", "        if a.target != e.target:\n", "        if False:\n"),),
        ("tests/test_length_values.py",), "example_length_runs and hidden"),
    Mutation(
        "branch_after_the_loop_unread", "a branch on the length after the loop is not read from the source, so the plan runs unchecked at lengths that take the other branch",
        (("ttt2la/length_vouching.py", "(axis, axis - rank, rank), after=True,", "(axis, axis - rank, rank),"),),
        ("tests/test_length_values.py",), "checked_at_other_lengths"),
    Mutation(
        "lossy_example_branch_converted", "a lossy conversion whose code takes another Python branch at the example's length than at the probe lengths is not refused: its graphs compute the probes' branch there",
        (("ttt2la/conversion.py", "        _refuse_lossy_branch(layer, ref)\n", "        pass\n"),),
        ("tests/test_length_branches.py",), "other_branch_at_the_example"),
    Mutation(
        "lossy_branch_named_by_ops_only", "a lossy conversion off the code at the example's length is refused only where the ops around the loop differ, so a branch whose value reaches the loop converts the probes' branch",
        (("ttt2la/conversion.py", "why = example_branch(layer.rl) or (held.what if held is not None else \"\")",
          "why = example_branch(layer.rl)"),),
        ("tests/test_length_branches.py",), "other_branch_at_the_example and rate"),
    Mutation(
        "helper_branch_unread", "the helpers the code around the loop calls are not read for uses of the length, so the plan runs unchecked at lengths where a helper takes another branch",
        (("ttt2la/frontend/length_values.py", "        if self.depth < _HELPER_DEPTH:\n", "        if False:\n"),),
        ("tests/test_length_branches.py",), "probes_branch_at_the_example or helper_lines"),
    Mutation(
        "helper_method_of_the_defining_class", "``self.helper(...)`` is read in the class that defines the loop's function, not in the layer's own class, so a subclass's override that branches goes unread",
        (("ttt2la/length_vouching.py", "owner=original_class(type(rl.candidate.module)))", "owner=None)"),),
        ("tests/test_length_branches.py",), "probes_branch_at_the_example and method"),
    Mutation(
        "helper_parameters_unbound", "a helper's parameters passed a value of the length are not taken as values of the length, so its branch on them goes unread",
        (("ttt2la/frontend/length_values.py", "_read(*helper, axes, True, names, self.out,", "_read(*helper, axes, True, set(), self.out,"),),
        ("tests/test_length_branches.py",), "probes_branch_at_the_example and helper"),
    Mutation(
        "changed_attributes_unguarded", "a plain attribute changed after conversion (a step size, the chunk size) is not looked at: the graphs run with the value traced",
        (("ttt2la/converted.py", "change = None if guard is None else guard.changed(self)",
          "change = None"),),
        ("tests/test_attribute_guard.py",), "as_written or lossy"),
    Mutation(
        "attribute_writes_unrefused", "a forward that assigns an attribute on its layer (a cache of its fast weights) is converted, and the write is dropped",
        (("ttt2la/frontend/recognize.py", "    if written:\n        raise SideEffectError(",
          "    if False:\n        raise SideEffectError("),),
        ("tests/test_side_effects.py",), "refused or as_written"),
    Mutation(
        "own_backward_failure_raw", "the gradient check lets the layer's own backward failure escape convert as torch's RuntimeError",
        (("ttt2la/gradient_stops.py", "saved, say\n        raise own_backward_failure(e) from e",
          "saved, say\n        raise"),),
        ("tests/test_gradient_stops.py",), "own_backward"),
    Mutation(
        "undifferentiable_backward_unrefused", "a converted layer whose own backward fails differentiates through its plan, gradients nobody checked",
        (("ttt2la/converted.py",
          "if state.undifferentiable and records_gradients(self, flat):",
          "if False:"),),
        ("tests/test_gradient_stops.py",), "own_backward"),
    Mutation(
        "manifest_factory_trusted", "the factory a converted checkpoint's manifest names is called without the caller's trust",
        (("ttt2la/checkpoint/trust.py", "    if trusted or is_bundled_factory(spec):\n", "    if True:\n"),),
        ("tests/test_checkpoint.py",), "manifest_cannot_make_load_call or users_factory_in_a_manifest"),
    Mutation(
        "json_over_an_input", "--json is not checked against the inputs and --out",
        (("ttt2la/checkpoint/writing.py", "        relation = _overlap(path, Path(other))\n", "        relation = \"\"\n"),),
        ("tests/test_cli_inputs.py",), "overwrite_an_input"),
    Mutation(
        "non_finite_weights_unnamed", "weights holding NaN or inf reach the conversion's check, which blames the lowering",
        (("ttt2la/validation.py", "    if level is not None:\n        check_finite_weights(model)\n", ""),),
        ("tests/test_call_errors.py",), "non_finite_weights"),
    Mutation(
        "several_results_taken_for_a_tensor", "the search for a chunk's token axes reads an op of several results (a layer norm) as one tensor",
        (("ttt2la/lowering/whole_sequence.py", "    if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)):\n", "    if False:\n"),),
        ("tests/test_lean_lift.py",), "norm_inside_the_loop"),
    Mutation(
        "buffers_left_advanced", "a conversion leaves the buffers its probe runs updated in place advanced",
        (("ttt2la/as_found.py", "            for b, before in saved:\n", "            for b, before in saved[:0]:\n"),),
        ("tests/test_side_effects.py",), "buffers_as_they_were"),
    Mutation(
        "length_check_counted_as_calls", "the check of a new length against the code as written advances the layer's buffers",
        (("ttt2la/converted.py", "            with buffers_kept(module):      # the check's runs are not the call's\n", "            if True:\n"),),
        ("tests/test_length_values.py",), "new_length_is_not"),
    Mutation(
        "plot_library_unasked", "a sweep asked for a plot finds matplotlib missing only after its work, raw",
        (("ttt2la/cli.py", "        plotting_library()                  # before the sweep, not after it\n", ""),),
        ("tests/test_cli_inputs.py",), "without_matplotlib"),
    Mutation(
        "head_index_read_as_the_chunk", "a slice of one head's chunk (`q[:, h, s:e]`) read as the loop's slice on the heads axis, so the heads loop inside the chunk loop is taken for the TTT loop",
        (("ttt2la/frontend/discover.py", "    on_sequence = [t for t in taken if t[1] == length]\n", "    on_sequence = []\n"),),
        ("tests/test_frontend_styles.py",), "heads_inside_the_chunk_loop"),
    Mutation(
        "heads_loop_around_chunks_unrefused", "a loop over heads around the chunk loop is taken for the TTT loop, and its refusal names the loops inverted",
        (("ttt2la/frontend/recognize.py", "        refuse_loop_around(gm, cand.loop, L)\n", "        pass\n"),),
        ("tests/test_refusal_messages.py",), "around_the_chunk_loop"),
    Mutation(
        "image_channels_taken_for_tokens", "a single step over an image [B, C, H, W] takes its channel axis for the sequence",
        (("ttt2la/frontend/single_step.py", "        image = _flattened_image(step, unit * b0, seq_len)\n", "        image = None\n"),),
        ("tests/test_single_step.py",), "image"),
    Mutation(
        "per_token_post_views_kept", "a lifted plan's graphs run under vmap keep the trace's views, which the token-causal op's read laid out batch first refuses",
        (("ttt2la/lowering/lift.py", "    reshape_views(gm.graph)\n    gm.recompile()\n    return gm, taken\n", "    gm.recompile()\n    return gm, taken\n"),),
        ("tests/test_frontend_styles.py",), "projected_inside"),
    Mutation(
        "unordered_buffer_read_unstacked", "a scan's output buffer read back otherwise than in sequence order is left a carried tensor, so the layer is refused as using no output",
        (("ttt2la/frontend/prechunked.py", "            if prechunked and _stacked_buffer(graph, writes, in_loop) is not None:\n", "            if False:\n"),),
        ("tests/test_scan_style.py",), "read_back_otherwise"),
    Mutation(
        "race_decided_by_medians", "the race against the code as written judges each side by its median call, which two preempted calls make",
        (("ttt2la/as_written.py", "            plan, written = min(self.plan), min(self.written)\n",
          "            plan, written = sorted(self.plan)[1], sorted(self.written)[1]\n"),),
        ("tests/test_as_written.py",), "preempted"),
    Mutation(
        "input_free_identity_as_theta", "an identity made from numbers alone (a UT transform's torch.eye) is read as the kernel's weights Θ, and collapse_mlp refuses a layer with no MLP",
        (("ttt2la/analysis/roles.py", "            if n in program.stream_inputs() or INPUT_FREE in n.meta:\n",
          "            if n in program.stream_inputs():\n"),),
        ("tests/test_collapse_mlp.py",), "no_mlp"),
    Mutation(
        "chunk_loop_views_kept", "a chunk loop calls its graph with the trace's expands and reshapes onto their input's own shape, a Python call each per chunk",
        (("ttt2la/lowering/executors.py", "                forward, settled = at_shapes(graph, args, kept).forward, True\n",
          "                forward, settled = graph.forward, True\n"),),
        ("tests/test_as_written.py",), "preempted"),
    Mutation(
        "own_shape_views_unchecked", "every expand and reshape of a chunk's graph is dropped, onto its input's own shape or not",
        (("ttt2la/lowering/lean_calls.py", "                and shapes.get(old.args[0]) == shapes[old]:\n",
          "                and shapes.get(old.args[0]) is not None:\n"),),
        ("tests/test_lean_calls.py",), "own_shape"),
    Mutation(
        "feature_graphs_planned_without_autocast", "a feature graph's copy is planned without the caller's autocast",
        (("ttt2la/lowering/specialize.py", "with out_of_sight(autocast=autocast_state(args)):",
          "with out_of_sight():"),),
        ("tests/test_specialize.py",), "autocast"),
    Mutation(
        "feature_graphs_share_autocast_states", "a feature graph's copies are not keyed by the caller's autocast",
        (("ttt2la/lowering/specialize.py", "return (records, autocast_state(args)) + tuple(",
          "return (records,) + tuple("),),
        ("tests/test_specialize.py",), "autocast"),
    Mutation(
        "padding_probed_without_autocast", "a partial last chunk's padding is probed without the caller's autocast",
        (("ttt2la/lowering/executors.py", "                          autocast=autocast):",
          "                          autocast=()):"),),
        ("tests/test_convert.py",), "weighted_kernel"),
    Mutation(
        "fake_failures_logged", "a failing preparation's fake tensors log their traceback",
        (("ttt2la/preparation.py", "    logger.addFilter(quiet)\n", "    pass\n"),),
        ("tests/test_specialize.py",), "logging"),
    Mutation(
        "keywords_matched_by_position", "a call whose keywords differ from the example's by name, not number, is taken as spelled like it: its values matched by position",
        (("ttt2la/frontend/call_signature.py", "        if len(args) == self.positional and tuple(kwargs) == self.keywords:\n", "        if len(args) == self.positional and len(kwargs) == len(self.keywords):\n"),),
        ("tests/test_call_errors.py",), "never_taken or binds_it_to"),
    Mutation(
        "default_passed_refused", "a parameter the example left out, passed at its default (a mask as `None`), is refused",
        (("ttt2la/frontend/call_signature.py", "                checks.append((got[name].source, name, then))\n", "                return f\"{name!r}, which the example did not pass\", (), ()\n"),),
        ("tests/test_call_errors.py",), "at_its_default or left_out"),
    Mutation(
        "keywords_out_of_the_cache_key", "layers of one class whose calls pass one value as different keywords share one trace",
        (("ttt2la/frontend/recognize.py", "tuple(attrs), tensors, in_spec, outside)", "tuple(attrs), tensors, outside)"),),
        ("tests/test_call_errors.py",), "traced_apart"),
    Mutation(
        "dict_keys_by_position", "a dict inside a call's arguments is compared and fed to the graphs by position, not by its keys",
        (("ttt2la/frontend/call_signature.py", "        nested = paths if any(", "        nested = () if any("),),
        ("tests/test_call_errors.py",), "dict_argument"),
    Mutation(
        "sweep_ignores_example_inputs", "sweep times and traces on its calibration data instead of the example inputs --example-shape asked for",
        (("ttt2la/cli.py", "table = ttt2la.sweep(source.model, calibration, example_inputs=inputs,", "table = ttt2la.sweep(source.model, calibration, example_inputs=calibration,"),),
        ("tests/test_cli_inputs.py",), "sweep_reads_the_model"),
    Mutation(
        "report_pass_drift_unchecked", "a saved report's pass drift of another type is let through, to fail in the rendering",
        (("ttt2la/report.py", '"drift": ((dict, type(None)), None)', '"drift": (object, None)'),),
        ("tests/test_report.py",), "drift_of_another_type or renders_or_is_refused"),
    Mutation(
        "interrupted_output_unsaid", "Ctrl-C after --out was written says nothing was written",
        (("ttt2la/cli.py", '        args.written.append(f"--out {args.out}")\n', ""),),
        ("tests/test_cli_inputs.py",), "ctrl_c_after_the_output"),
    Mutation(
        "second_loop_counted_once", "a loop over the sequence beside the converted one is run at the example's length only, so one that ran a single chunk there is taken for code of a fixed size",
        (("ttt2la/frontend/recognize.py", "    for at in (base, longer):", "    for at in (base, base):"),),
        ("tests/test_tracing_failures.py",), "second_loop_beside or two_loops_as_written"),
    Mutation(
        "partial_chunk_probe_size_stated", "a mean over the chunk is said to run over the probe's partial chunk, whatever the call's partial chunk holds",
        (("ttt2la/frontend/partial_chunk.py", "over fewer in a partial one", "over {theirs} in a partial one"),),
        ("tests/test_as_written.py",), "mean_over_the_chunk"),
    Mutation(
        "wrapped_argument_accepted", "an argument built otherwise than the example's (a tensor in a list) runs the graphs on its flattened inputs",
        (("ttt2la/frontend/call_signature.py",
          "            if all(type(a) in _TENSORS or pytree.tree_is_leaf(a) for a in args) and \\\n",
          "            if True or all(type(a) in _TENSORS or pytree.tree_is_leaf(a) for a in args) and \\\n"),),
        ("tests/test_call_errors.py",), "built_otherwise or wrong_call_is"),
    Mutation(
        "exported_block_op_writes_out", "torch.export traces the block op's increments with their out= writes, which the exported program cannot run on weights that require grad",
        (("ttt2la/runtime/block.py",
          "G = plain_increments(phi_k, u, n - shift, C) if _traced()",
          "G = plain_increments(phi_k, u, n - shift, C) if False"),),
        ("tests/test_ordinary_module.py",), "torch_export"),
    Mutation(
        "compiled_block_op_writes_out", "torch.compile traces the block op's increments and reads as the per-head out= Functions, which trace into copies, instead of plain batched products it fuses",
        (("ttt2la/runtime/block.py",
          "    return torch.compiler.is_compiling()\n",
          "    return torch.compiler.is_exporting()\n"),),
        ("tests/test_ordinary_module.py",), "plain_batched"),
    Mutation(
        "export_of_forward_mode_unrefused", "a plan that takes forward-mode derivatives is traced by torch.export, whose fake tensors fail on it: the refusal no longer names the reason",
        (("ttt2la/converted.py",
          "    if getattr(state.plan, \"forward_ad\", False):\n        return \"its plan takes an affine update's coefficients by forward-mode differentiation\"\n    return \"\"\n\n\ndef _exported_call",
          "    return \"\"\n\n\ndef _exported_call"),),
        ("tests/test_ordinary_module.py",), "torch_export"),
    Mutation(
        "export_dynamic_size_unrefused", "an export that marks the length dynamic is traced, and export's own error says only that a size was specialised",
        (("ttt2la/converted.py", "    if symbolic and not reason:", "    if False:"),),
        ("tests/test_ordinary_module.py",), "torch_export"),
    Mutation(
        "lagged_state_taken_for_an_invariant", "a value made two iterations back, which the loop's second iteration reads as the one made before the loop, is taken for a loop invariant",
        (("ttt2la/frontend/rollup.py", "                _no_lag_later(u, n, pos, lambda j, a=a: (a,))\n", ""),),
        ("tests/test_lagged_states.py",), "earlier_iteration or inside_a_model"),
    Mutation(
        "conversion_compiles_as_written", "the conversion runs the user's torch.compile-decorated functions compiled, compiling the code as written only to check against it",
        (("ttt2la/conversion.py", '    return torch.compiler.set_stance("force_eager")\n', '    return torch.compiler.set_stance("default")\n'),),
        ("tests/test_zoo_published.py",), "does_not_compile"),
    Mutation(
        "cutting_loop_taken_for_a_second", "a loop that only appends slices of the sequence to lists is refused as a second loop over it",
        (("ttt2la/frontend/discover.py", '        cand.cuts_only &= getattr(func, "__name__", "") in CUTTING\n', "        cand.cuts_only = False\n"),),
        ("tests/test_chunks_made_before_the_loop.py",), "appended"),
    Mutation(
        "cut_pieces_left_in_their_loop", "slices a loop that only cuts makes are not read as the chunks of the loop that reads them",
        (("ttt2la/frontend/split_pieces.py", "                and not loops_of(node, outer=outer) - cutting:", "                and not loops_of(node, outer=outer):"),),
        ("tests/test_chunks_made_before_the_loop.py",), "appended"),
    Mutation(
        "laid_out_pieces_left", "a slice a loop that only cuts transposes is moved without its transpose",
        (("ttt2la/frontend/split_pieces.py", "        chain.append(user)\n", "        break\n"),),
        ("tests/test_chunks_made_before_the_loop.py",), "appended_transposed"),
    Mutation(
        "op_named_by_graph_text", "a refusal names an op of the layer's own line by the traced graph's node text instead of the torch call, file:line and code",
        (("ttt2la/ir.py", '        return f"{what} at {src.at()}"', "        return node.format_node()"),),
        ("tests/test_refusal_messages.py",), "value_of_the_loop or no_form or no_line"),
    Mutation(
        "loop_read_after_by_graph_text", "code after the loop reading a value of the loop names that value by the traced graph's node text",
        (("ttt2la/frontend/rollup.py", 'f"inside it ({describe_op(n)}): return what',
          'f"inside it ({n.format_node()}): return what'),),
        ("tests/test_refusal_messages.py",), "value_of_the_loop"),
    Mutation(
        "length_number_by_graph_text", "a number of a single step's code that is no affine function of the length is named by the traced graph's node text",
        (("ttt2la/frontend/any_length.py", 'f"the number {v!r} of {describe_op(n0)} in the {what} is "',
          'f"the number {v!r} of {n0.format_node()} in the {what} is "'),),
        ("tests/test_single_step_any_length.py",), "fixed_to_its_length"),
    Mutation(
        "second_step_by_graph_text", "weights a single step steps again at another length are named by the traced graph's node text",
        (("ttt2la/frontend/single_step.py", 'f"({describe_op(stepped)}): a loop over chunks',
          'f"({stepped.format_node()}): a loop over chunks'),),
        ("tests/test_single_step_any_length.py",), "fixed_to_its_length"),
    Mutation(
        "chunk_count_size_by_graph_text", "a size of no form in the length or the number of chunks is named by the traced graph's node text",
        (("ttt2la/frontend/chunk_counts.py", 'of {describe_op(node)} in the {what} is "',
          'of {node.format_node()} in the {what} is "'),),
        ("tests/test_refusal_messages.py",), "no_form"),
    Mutation(
        "shape_structure_by_graph_text", "a call whose arguments change structure with the input shape is named by the traced graph's node text",
        (("ttt2la/frontend/shapes.py", 'f"in the arguments of {describe_op(a)}")',
          'f"in the arguments of {a.format_node()}")'),),
        ("tests/test_refusal_messages.py",), "follow_the_length"),
    Mutation(
        "specialised_per_shape", "feature graphs without a gradient are planned again for every new length and batch",
        (("ttt2la/lowering/specialize.py", "        (_exact(a) if records else _layout(a)) if isinstance", "        _exact(a) if isinstance"),),
        ("tests/test_specialize.py",), "one_specialisation or one_copy"),
    Mutation(
        "layout_ignores_unit_axes", "a copy planned where an axis had one element serves a call where it broadcasts",
        (("ttt2la/lowering/specialize.py", "    axes = tuple((n == 1, s == 0, s == 1)", "    axes = tuple((False, s == 0, s == 1)"),),
        ("tests/test_specialize.py",), "one_specialisation or one_copy"),
    Mutation(
        "recorded_copies_share_sizes", "a copy planned with a gradient, its buffers sized for one shape, serves another",
        (("ttt2la/lowering/specialize.py", "        (_exact(a) if records else _layout(a)) if isinstance", "        _layout(a) if isinstance"),),
        ("tests/test_specialize.py",), "one_specialisation or one_copy"),
    Mutation(
        "outer_made_lean_per_length", "the code around a converted loop is rewritten to call torch functions again for every new length",
        (("ttt2la/converted.py", "            if self._lean_outer is None:    # the calls", "            if True:    # the calls"),),
        ("tests/test_lean_calls.py",), "made_lean_once"),
    Mutation(
        "sizes_of_another_length", "the code around a converted loop runs with the sizes of the first length its batch size was called at",
        (("ttt2la/frontend/sized_graph.py", "        call = self._calls.get((B, L))\n",
          "        call = self._calls.get(B)\n"),
         ("ttt2la/frontend/sized_graph.py", "            call = self._calls[(B, L)] = ",
          "            call = self._calls[B] = ")),
        ("tests/test_sized_graph.py",), "any_shape"),
    Mutation(
        "sizes_flattened_into_items", "a call's sizes pass as a plain tuple, which re-running the graph to name a failing line flattens",
        (("ttt2la/frontend/sized_graph.py", "SizedCall(self.gm, Sizes([e(B, L) for e in self.exprs]))",
          "SizedCall(self.gm, tuple([e(B, L) for e in self.exprs]))"),),
        ("tests/test_sized_graph.py",), "names_the_line"),
    Mutation(
        "recorded_graphs_planned_at_once", "every recorded feature graph is planned at its first call, whatever its size",
        (("ttt2la/lowering/specialize.py", "        if records and not self._planned(args):", "        if False:"),),
        ("tests/test_specialize.py",), "planned_only or checkpointing"),
    Mutation(
        "small_recorded_graphs_planned", "small recorded feature graphs are planned from their second call",
        (("ttt2la/lowering/specialize.py", "               default=0) < PLANNED_FROM_BYTES:", "               default=0) < 0:"),),
        ("tests/test_specialize.py",), "planned_only or checkpointing"),
    Mutation(
        "checkpoint_recomputes_another_plan", "a checkpointed call runs the graph's own autograd in its forward and a planned copy when recomputed",
        (("ttt2la/lowering/specialize.py", "        if key in self._cache or key in self._seen \\\n                or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:",
          "        if key in self._cache or key in self._seen:"),),
        ("tests/test_specialize.py",), "planned_only or checkpointing"),
    Mutation(
        "training_gradients_uncompared", "a layer that stops gradients only in training mode, its "
        "outputs the same in both, is taken for mode-independent (its gradients never compared)",
        (("ttt2la/training_mode.py", "            if _same_gradients(run(_gradients, True), evaluated):",
          "            if True:"),),
        ("tests/test_training_mode.py",), "gradient_stop_only"),
    Mutation(
        "training_note_names_idle_dropout", "the training-mode note names every dropout or batch "
        "norm of the layer, acting or not",
        (("ttt2la/training_mode.py", "        acting = [m for _, m in dependent if acts([m])]",
          "        acting = [m for _, m in dependent]"),),
        ("tests/test_training_mode.py",), "names_what_differs"),
    Mutation(
        "own_training_read_unnamed", "the training-mode note leaves out the layer's own read of "
        "self.training beside a dropout that acts",
        (("ttt2la/training_mode.py", "        own = bool(others) and acts(others)",
          "        own = False"),),
        ("tests/test_training_mode.py",), "names_what_differs"),
    Mutation(
        "torch_func_transforms_unseen", "a call under a torch.func transform runs the block op's autograd functions, which have no rules for it",
        (("ttt2la/converted.py", "        return getattr(self.loop_for(B).plan, \"transform_limit\", \"\")\n", "        return \"\"\n"),),
        ("tests/test_recast.py",), "torch_func"),
    Mutation(
        "iterations_split_at_top_statements_only", "a loop body of one if/elif or with statement is split only at the body's own statements, so a read and an update on one line are split by key",
        (("ttt2la/frontend/loops.py", "            iters = _split_by_statement(nodes, loop, through_blocks=True)\n", "            iters = _split_by_statement(nodes, loop)\n"),),
        ("tests/test_frontend_styles.py",), "one_line_update_inside"),
    Mutation(
        "last_iteration_by_graph_text", "a last iteration that runs other ops names the first by the traced graph's node text",
        (("ttt2la/frontend/rollup.py", "    where = f\", the first of them {describe_op(node)}\"", "    where = f\", the first of them {node.format_node()}\""),),
        ("tests/test_refusal_messages.py",), "padding_its_own"),
    Mutation(
        "stride_read_by_aten_name", "a stream read at a stride is named by the op's aten overload (aten.select.int) instead of the torch call and the user's line",
        (("ttt2la/frontend/unlike_iterations.py", 'return (f"{describe_op(node)} reads {m} {what} of one sequence',
          'return (f"{node.target} reads {m} {what} of one sequence'),),
        ("tests/test_op_names_in_messages.py",), "stride"),
    Mutation(
        "nonreducible_op_by_aten_name", "a NonReducibleError and inspect's verdict name the op that blocks parallelism by its aten overload",
        (("ttt2la/analysis/associativity.py", "op=torch_name(b.op) if b.op is not None else None,",
          "op=str(b.op.target) if b.op is not None else None,"),),
        ("tests/test_op_names_in_messages.py", "tests/test_analysis.py"), "state_dependent_rate or not_reducible_and_names_the_op"),
    Mutation(
        "short_per_token_plans_never_race", "a plan on the token-causal or delta-rule op never races the code as written, even at lengths within the op's chunk, where the source can be faster",
        (("ttt2la/as_written.py", '    return plan.raced or length <= getattr(plan, "races_up_to", 0)',
          "    return plan.raced"),),
        ("tests/test_as_written.py",), "per_token"),
    Mutation(
        "per_token_plans_race_past_the_chunk", "a plan on the token-causal or delta-rule op races at lengths up to two of its op's chunks, where each of the source's calls is slow",
        (("ttt2la/as_written.py", 'length <= getattr(plan, "races_up_to", 0)',
          'length <= 2 * getattr(plan, "races_up_to", 0)'),),
        ("tests/test_as_written.py",), "per_token"),
    Mutation(
        "product_races_a_whole_chunk", "several delta-rule steps a token race up to the op's whole chunk in tokens, not the tokens that fill it",
        (("ttt2la/lowering/lift_delta_product.py", "return self.chunk_size // len(self.match.steps)",
          "return self.chunk_size"),),
        ("tests/test_as_written.py",), "per_token"),
    Mutation(
        "weights_walked_past_an_own_walk", "a converted layer reads its weights by its own walk of the module tree where a submodule walks its members otherwise, naming them unlike named_parameters",
        (("ttt2la/ir.py", "    if not _walks_plainly(type(m)):\n        return False\n",
          "    if False:\n        return False\n"),),
        ("tests/test_ordinary_module.py",), "reads_its_weights"),
    Mutation(
        "chunk_features_vmapped_through_pytrees", "a plan batches its chunk-level features with torch.func.vmap, whose pytree handling costs a short call more than the features",
        (("ttt2la/lowering/lift.py", "        return list(flat_vmap(lp.chunk_features, in_dims, args))",
          "        return list(torch.func.vmap(lp.chunk_features, in_dims=tuple(in_dims))(*args))"),),
        ("tests/test_plan_per_call_work.py",), "planned_call"),
    Mutation(
        "body_walked_per_call", "a whole-sequence plan finds the body's inputs by walking its graph on every call",
        (("ttt2la/lowering/lift.py", "        values, _ = _bind(self._inputs, dict(zip(self._inputs.streams,",
          "        values, _ = _bind(BodyInputs.of(prog), dict(zip(self._inputs.streams,"),),
        ("tests/test_plan_per_call_work.py",), "planned_call"),
    Mutation(
        "flat_vmap_sizes_unchecked", "flat_vmap batches inputs of different sizes along the chunk axis without saying so",
        (("ttt2la/lowering/flat_vmap.py", "    if len(sizes) != 1:", "    if not sizes:"),
         ("ttt2la/lowering/flat_vmap.py", "    (n,) = sizes", "    n = max(sizes)")),
        ("tests/test_plan_per_call_work.py",), "different_sizes"),
    Mutation(
        "scan_masks_made_per_call", "the scans' triangular masks are made again on every call",
        (("ttt2la/runtime/scan.py", "    if found is not None and type(like) is torch.Tensor",
          "    if False and found is not None and type(like) is torch.Tensor"),),
        ("tests/test_runtime_scan.py",), "transfer_masks"),
    Mutation(
        "scan_masks_kept_from_inference_mode", "masks first made under inference mode are kept as inference tensors, which a later call recording gradients cannot save",
        (("ttt2la/runtime/scan.py", "    with torch.inference_mode(False):", "    with torch.no_grad():"),),
        ("tests/test_runtime_scan.py",), "transfer_masks"),
    Mutation(
        "short_calls_grouped", "a short call of one or two state matrices runs the block op in groups of chunks, whose fixed cost it never repays",
        (("ttt2la/runtime/grouped_chunks.py", "    if matrices is not None and matrices <= SHORT_CALL_MATRICES",
          "    if matrices is not None and matrices <= 0"),),
        ("tests/test_runtime_block.py",), "short_call"),
    Mutation(
        "grouped_last_factor_padded_zero", "the grouped op's exclusive last chunk and padding take a factor 0 instead of 1",
        (("ttt2la/runtime/grouped_chunks.py", "        return F.pad(d[:, :-1], (0, m * s - n + 1), value=1.0)",
          "        return F.pad(d[:, :-1], (0, m * s - n + 1), value=0.0)"),),
        ("tests/test_runtime_block.py",), "groups_of_chunks"),
    Mutation(
        "kept_shape_runs_the_full_path", "a call at a shape whose race kept the code as written gathers the weights and fetches the plan's graph before running the code",
        (("ttt2la/converted.py", "        out = state.kept_call(self, args, kwargs, flat)",
          "        out = NOT_KEPT"),),
        ("tests/test_as_written.py",), "kept_as_written"),
    Mutation(
        "kept_shape_taken_with_gradients", "a call recording gradients at a shape whose race kept the code as written runs the code, not the plan",
        (("ttt2la/converted.py", "        if not kept or not races(module, flat):",
          "        if not kept:"),),
        ("tests/test_as_written.py",), "kept_as_written"),
    Mutation(
        "kept_shape_known_after_spelling", "a call of positional tensors at input shapes a kept call had before is spelled, flattened and guarded before it is known as kept",
        (("ttt2la/converted.py", "            and state.as_written.given and not kwargs and ttt_state is None \\\n",
          "            and False and ttt_state is None \\\n"),),
        ("tests/test_as_written.py",), "kept_shape_asks"),
    Mutation(
        "kept_shape_asks_the_guards", "a call at a shape whose race kept the code as written walks the modules and asks the hook and attribute guards first",
        (("ttt2la/converted.py", "    if not stateful:\n        out = state.kept_call(self, args, kwargs, flat)\n        if out is not NOT_KEPT:\n            return out\n    walk = state.walk\n    found = None if walk is None else walk.quiet(self)\n",
          "    walk = state.walk\n    found = None if walk is None else walk.quiet(self)\n    if not stateful:\n        out = state.kept_call(self, args, kwargs, flat)\n        if out is not NOT_KEPT:\n            return out\n"),
         ("ttt2la/converted.py", "        if _shapes(args) not in self.as_written.given or torch.jit.is_tracing() \\\n",
          "        if True or torch.jit.is_tracing() \\\n")),
        ("tests/test_as_written.py",), "kept_shape_asks"),
    Mutation(
        "compiled_calls_skip_the_route", "under torch.compile only a layer whose code differs in training mode takes the eager call's route; a call at another batch size, an untraced length or length 0 runs the compiled plan",
        (("ttt2la/converted.py", "    if instead is not None:\n        return instead()\n    reason = state.compile_break",
          "    if instead is not None and state.training_dependence:\n        return instead()\n    reason = state.compile_break"),),
        ("tests/test_ordinary_module.py",), "eager_calls_route"),
    Mutation(
        "partial_chunk_compiled_in_graph", "a layer whose partial last chunk cannot be padded runs its plan inside the compiled graph, where the plan's refusal escapes raw",
        (("ttt2la/converted.py", "    elif state.program.partial_chunk:", "    elif False:"),),
        ("tests/test_ordinary_module.py",), "eager_calls_route and partial"),
    Mutation(
        "recast_in_the_compilers_trace", "a layer cast after conversion is converted again inside torch.compile's trace of its first call, where the conversion's traces turn symbolic",
        (("ttt2la/recast.py", "torch._guards.tracing(None)", "torch.no_grad()"),),
        ("tests/test_ordinary_module.py",), "cast_layer_compiles"),
    Mutation(
        "plan_gradients_untied", "a loop input the loop as written reaches with a zero gradient and the plan skips is left off the plan's outputs (None where the layer gives zeros)",
        (("ttt2la/converted.py", "        if not any(missing):\n            return outputs, finals\n",
          "        if True:\n            return outputs, finals\n"),),
        ("tests/test_gradient_presence.py",), "plan_runs or zero_start or adamw"),
    Mutation(
        "first_iteration_skip_read", "a state whose use the first iteration skips (None first) is read as a zero the first iteration multiplies, tying a gradient the layer never gives",
        (("ttt2la/conversion.py", "if isinstance(a, torch.fx.Node) and a.meta.get(SKIPPED_FIRST))",
          "if isinstance(a, torch.fx.Node) and False)"),),
        ("tests/test_gradient_presence.py",), "plan_runs or parameter_has"),
    Mutation(
        "gradient_presence_unchecked", "conversion compares gradient values but not which tensors gradients reach, as written and converted",
        (("ttt2la/conversion.py", 'return found or (_presence_mismatch(layer) if layer.exact else "")',
          "return found"),),
        ("tests/test_gradient_presence.py",), "presence_mismatch_at_conversion"),
    Mutation(
        "pickled_recipe_at_conversion_dtype", "a converted layer cast after conversion pickles its example inputs at the conversion's dtype, so loading traces them against the cast weights",
        (("ttt2la/converted.py", "        recast_recipe(state.recipe, state.weights, now)\n",
          "        state.recipe\n"),),
        ("tests/test_recast.py",), "saved_whole and float64"),
    Mutation(
        "original_class_in_own_dict_only", "the user's class behind a converted one is looked up in the class's own dict, not its MRO, so a parametrized converted layer is its own original",
        (("ttt2la/original_class.py", "return next((k for k in cls.__mro__ if ORIGINAL in k.__dict__), None)",
          "return cls if ORIGINAL in cls.__dict__ else None"),),
        ("tests/test_recast.py",), "own_weight"),
    Mutation(
        "meta_call_prepared", "a converted layer called on meta tensors prepares (traces, probes values) for them instead of running its code as written for the shapes",
        (("ttt2la/converted.py", "    if on_meta({}, flat):    # shapes only",
          "    if False:    # shapes only"),
         ("ttt2la/converted.py", "    if now != state.weights and on_meta(weights, []):",
          "    if False:")),
        ("tests/test_meta_call.py",), "shapes_and_dtypes"),
    Mutation(
        "length_uses_unrun", "the code is not run with sizes that remember the length, so a value of it spelled otherwise than the source reading knows leaves other lengths on the probes' branch",
        (("ttt2la/length_vouching.py", "    found += [v for v in run if (v.file, v.line) not in read or v.of != \"the length\"]\n",
          "    found += []\n"),),
        ("tests/test_size_uses.py",), "each_spelling"),
    Mutation(
        "length_decisions_unrecorded", "a branch, comparison, lookup or index made with a value of the length is not recorded",
        (("ttt2la/frontend/size_uses.py", "        if not _library(frame.f_code.co_filename):\n            run.record(",
          "        if False:\n            run.record("),),
        ("tests/test_size_uses.py",), "branches_values or SizeKeyword or Lookup"),
    Mutation(
        "length_numbers_to_ops_unrecorded", "a number of the length passed to a torch op is not recorded",
        (("ttt2la/frontend/size_uses.py", "        if tracked:\n", "        if False:\n"),),
        ("tests/test_size_uses.py",), "branches_values or Value"),
    Mutation(
        "length_sizes_untracked", "sizes read off tensors are handed out as plain ints, so nothing computed from them is followed",
        (("ttt2la/frontend/size_uses.py", "    if n % L == 0:\n",
          "    if False:\n"),),
        ("tests/test_size_uses.py",), "branches_values or ShapeSlice"),
    Mutation(
        "length_uses_in_the_loop_body", "decisions in the loop's own statement and body, which the traces unroll, are counted as uses of the length",
        (("ttt2la/frontend/size_uses.py", "        if self.loop is None:\n            return False\n",
          "        if True:\n            return False\n"),),
        ("tests/test_size_uses.py",), "sizes_guards"),
    Mutation(
        "raising_guards_as_length_uses", "a guard that only raises is counted as a use of the length",
        (("ttt2la/frontend/size_uses.py", "            if not judged and _guard(file, line):\n",
          "            if False:\n"),),
        ("tests/test_size_uses.py",), "sizes_guards"),
    Mutation(
        "whole_chunk_sizes_as_length_uses", "a size affine in the whole-chunk lengths (the chunk count of a view) is counted as a use of the length",
        (("ttt2la/frontend/size_uses.py", "((n, at(n, B)) for n in lengths if n % chunk == 0)",
          "((n, at(n, B)) for n in lengths)"),),
        ("tests/test_size_uses.py",), "sizes_guards"),
    Mutation(
        "batch_values_unjudged", "a decision or number of the batch size is never judged a use, so other batch sizes run the probes' branch",
        (("ttt2la/frontend/size_uses.py", "        batch = _not_affine((b, at(L, b)) for b in batches)\n",
          "        batch = False\n"),
         ("ttt2la/frontend/size_uses.py", "        batch = _varies(at(L, b) for b in batches)\n",
          "        batch = False\n")),
        ("tests/test_size_uses.py",), "batch_spelling"),
    Mutation(
        "vouched_shapes_keyed_by_length", "the shapes a layer with values of the batch size holds are keyed by their length alone, so a new batch size at a traced length runs unchecked",
        (("ttt2la/length_vouching.py", "        return (B, L) if length and batch else B if batch else L\n",
          "        return L\n"),),
        ("tests/test_size_uses.py",), "batch_spelling"),
    Mutation(
        "iteration_decisions_as_length_uses", "decisions made in a loop's or comprehension's body (the end of the last chunk) are counted as uses of the length",
        (("ttt2la/frontend/size_uses.py", "        if self._in_loop(frame) or not (isinstance(at, _Sized) or iterations) and \\\n",
          "        if self._in_loop(frame) or False and \\\n"),),
        ("tests/test_size_uses.py", "tests/test_zoo_schedule.py"), "sizes_guards or causal_schedule_converts_at_any_length"),
    Mutation(
        "jit_trace_runs_the_plan", "a converted layer under torch.jit.trace runs its plan, whose sizes the tracer makes tensors, instead of its code as written",
        (("ttt2la/converted.py", "    if torch.jit.is_tracing():      # before any plan op",
          "    if False:      # before any plan op"),),
        ("tests/test_jit.py",), "gated or lossy"),
    Mutation(
        "jit_trace_lossy_as_written", "a lossy conversion under torch.jit.trace runs the code as written, another function than its own, instead of refusing",
        (("ttt2la/torchscript.py", "    if state.as_written is None:", "    if False:"),),
        ("tests/test_jit.py",), "lossy"),
    Mutation(
        "jit_script_unrefused", "torch.jit.script of a converted layer reaches TorchScript's compiler, which raises its own error about the forward's *args",
        (("ttt2la/converted.py", '                    "__prepare_scriptable__": refuse_scripting,\n', ""),),
        ("tests/test_jit.py",), "jit_script"),
    Mutation(
        "walk_misses_submodule_hooks", "the one walk of a converted layer's modules passes a hook on a submodule, so the plan runs without it",
        (("ttt2la/module_walk.py", "                if s.parent >= 0 and (d[\"_forward_pre_hooks\"]",
          "                if False and (d[\"_forward_pre_hooks\"]"),),
        ("tests/test_module_walk.py", "tests/test_submodule_hooks.py"), "hook"),
    Mutation(
        "walk_misses_added_submodules", "the one walk of a converted layer's modules counts no children, so a submodule added after conversion (with a hook) goes unvisited",
        (("ttt2la/module_walk.py", "if len(d[\"_modules\"]) != s.children or not s.get(d) == s.values:",
          "if not s.get(d) == s.values:"),),
        ("tests/test_module_walk.py",), "added_with_a_hook"),
    Mutation(
        "walk_misses_changed_attributes", "the one walk of a converted layer's modules compares no attributes, so a changed one runs the old graphs",
        (("ttt2la/module_walk.py", "if len(d[\"_modules\"]) != s.children or not s.get(d) == s.values:",
          "if len(d[\"_modules\"]) != s.children:"),),
        ("tests/test_module_walk.py", "tests/test_attribute_guard.py"), "attribute"),
    Mutation(
        "shape_case_keyed_without_features", "the shape case a call's decision remembers is keyed without the inputs' last size, so a call of another width at a remembered length is not refused",
        (("ttt2la/converted.py", "        shapes.append((t.shape, t.dtype, t.device))\n",
          "        shapes.append((t.shape[:-1], t.dtype, t.device))\n"),),
        ("tests/test_module_walk.py",), "remembered_shape"),
    Mutation(
        "range_count_untracked", "the run's stand-in for `range` counts no range of the sizes, so `len(range(0, T, C))` after the loop is a plain number and a branch on it goes unchecked",
        (("ttt2la/frontend/size_uses.py", "        if run is not None and None not in ats and any(isinstance(a, SizeInt) for a in args):",
          "        if False:"),),
        ("tests/test_counts_of_the_length.py",), "LenRange"),
    Mutation(
        "pieces_count_untracked", "the run counts no pieces of `split`/`chunk`/`unbind`, so `len(x.split(C, 1))` or `len(x.unbind(0))` is a plain number",
        (("ttt2la/frontend/size_uses.py", "        if isinstance(out, (tuple, list)) and getattr(func, \"__name__\", \"\") in _PIECES:",
          "        if False:"),),
        ("tests/test_counts_of_the_length.py",), "LenSplitValue or LenUnbind or number_of_samples"),
    Mutation(
        "appended_count_untracked", "the run does not count a list the loop appends to, so a value of `len(outs)` passed to an op after the loop goes unchecked",
        (("ttt2la/frontend/size_uses.py", "not any(frame.f_locals.get(name) is seq for name in self.grown)", "True"),),
        ("tests/test_counts_of_the_length.py",), "LenOutsValue or run_hands or Bounds"),
    Mutation(
        "strides_untracked", "the run hands out strides as plain numbers, so `x.stride(0) // D` escapes it",
        (("ttt2la/frontend/size_uses.py", ",\n          torch._C.TensorBase.stride}", "}"),),
        ("tests/test_counts_of_the_length.py",), "Stride"),
    Mutation(
        "tensor_of_shape_judged_affine", "a tensor made of a shape is judged as a number passed to an op (affine: no use), so `int(torch.tensor(x.shape)[1])` escapes",
        (("ttt2la/frontend/size_uses.py", "if frame is not None and func in _TENSOR_MAKERS and _shaped(args, kwargs):",
          "if False:"),),
        ("tests/test_counts_of_the_length.py",), "TensorOfShape"),
    Mutation(
        "appended_len_unread", "the source reading does not count the lists the loop appends to, so `n = len(outs)` after it binds no value of the length",
        (("ttt2la/frontend/length_values.py", "derived.counted |= appended_names(stmt)", "derived.counted |= set()"),),
        ("tests/test_counts_of_the_length.py",), "LenOuts and not Value or source_reads"),
    Mutation(
        "pieces_len_unread", "the source reading counts no pieces cut along the token axis, so `len(x.split(C, dim=1))` is no value of the length",
        (("ttt2la/frontend/length_values.py", "    return along or any(_derives(a, derived, axes, me) for a in args)",
          "    return any(_derives(a, derived, axes, me) for a in args)"),),
        ("tests/test_counts_of_the_length.py",), "source_reads"),
    Mutation(
        "appended_len_in_loop_unread", "the length of a list the loop grows is no index to the loop's source reading, so `if len(outs) >= 8` in the loop converts with the traced iterations' branch",
        (("ttt2la/frontend/index_flow.py", "and e.args[0].id in self.grown:", "and e.args[0].id in ():"),),
        ("tests/test_counts_of_the_length.py",), "chunks_appended_so_far"),
    Mutation(
        "token_axis_from_axis_1", "the token axis is axis 1 of the first input whatever the loop slices, so a heads-first [B, H, L, D] layer is traced with its heads as tokens",
        (("ttt2la/frontend/sliced_length.py", "            or not cand.slice_lengths or guessed in cand.slice_lengths:",
          "            or True:"),),
        ("tests/test_sliced_token_axis.py",), "heads or state or gate"),
    Mutation(
        "token_axis_unconfirmed", "a sliced length that an input axis happens to hold is taken for the tokens without the eager run confirming the loop walks that axis",
        (("ttt2la/frontend/sliced_length.py", "n > 1 and any(n in x.shape[1:] for x in tensors) and _walks(cand, flat, in_spec, n)",
          "n > 1 and any(n in x.shape[1:] for x in tensors)"),),
        ("tests/test_sliced_token_axis.py",), "tokens_first"),
    Mutation(
        "random_call_unnamed", "a layer drawing random numbers fails the conversion's check with a message blaming ttt2la, not naming the random call",
        (("ttt2la/call_variation.py", "        if found is not None:\n            return _random(found)\n", ""),),
        ("tests/test_call_variation.py",), "noise or variation"),
    Mutation(
        "grad_mode_branch_unnamed", "a layer branching on torch.is_grad_enabled() fails the conversion's check with a message blaming ttt2la, not naming the branch",
        (("ttt2la/call_variation.py", "    return \"\" if found is None else _grad_mode(found)", "    return \"\""),),
        ("tests/test_call_variation.py",), "grad_mode"),
    Mutation(
        "outside_values_unguarded", "class attributes and module globals the layer's code reads are not checked at each call, so a changed one runs the old value's graphs",
        (("ttt2la/converted.py", "    change = None if outside is None else outside.changed()\n",
          "    change = None\n"),),
        ("tests/test_global_guard.py",), "runs_the_new_function"),
    Mutation(
        "class_attribute_read_where_defined", "a class attribute is read from the class that defined it, so one set on a subclass since goes unseen",
        (("ttt2la/global_guard.py", "lambda k=most, n=name: getattr(k, n, _MISSING)",
          "lambda k=klass, n=name: k.__dict__.get(n, _MISSING)"),),
        ("tests/test_global_guard.py",), "class"),
    Mutation(
        "helper_globals_unread", "the globals of the functions a layer's methods call are not read",
        (("ttt2la/global_guard.py", "                _reads(value, depth - 1, seen, out, layer_code)\n",
          "                pass\n"),),
        ("tests/test_global_guard.py",), "helper"),
    Mutation(
        "settings_unguarded", "torch's global settings the layer's code reads (deterministic algorithms, the default dtype, inference mode, autocast, backends flags) are not read again at each call, so a branch on one runs the traced branch after it changed",
        (("ttt2la/converted.py",
          "if change is None and settings is not None and settings.read() != settings.value:",
          "if False:"),),
        ("tests/test_settings_guard.py",), "new_branch"),
    Mutation(
        "helper_settings_unread", "the settings read by the functions a layer's methods call are not found",
        (("ttt2la/global_guard.py", "                    visit(value, depth - 1)\n",
          "                    pass\n"),),
        ("tests/test_settings_guard.py",), "helper"),
    Mutation(
        "backend_flags_unread", "a torch.backends flag the layer's code reads is not guarded",
        (("ttt2la/settings_guard.py", "            if module in found and flag in found:",
          "            if False:"),),
        ("tests/test_settings_guard.py",), "backends"),
    Mutation(
        "layout_unguarded", "the memory layout of the inputs is not checked at each call of a layer whose code reads it, so another layout runs the example's branch",
        (("ttt2la/converted.py",
          "if change is None and layout is not None and layout.key(flat) != layout.example:",
          "if False:"),),
        ("tests/test_layout_guard.py",), ""),
    Mutation(
        "storage_offsets_unkeyed", "a layer that reads storage offsets is guarded on contiguity and strides only",
        (("ttt2la/layout_guard.py", "key = _placed if any(_READS[n] for n in found) else _layouts",
          "key = _layouts"),),
        ("tests/test_layout_guard.py",), ""),
    Mutation(
        "setting_aliases_unread", "torch's setting readers are found by the names the code spells only, so an alias (`from torch import get_default_dtype as gdd`, a global, `import torch.backends.mkldnn as mk`) escapes the guard",
        (("ttt2la/settings_guard.py",
          "names_read(layer, frozenset(_READERS) | _FLAG_NAMES, _OBJECTS, layer_code)",
          "names_read(layer, frozenset(_READERS) | _FLAG_NAMES, None, layer_code)"),),
        ("tests/test_settings_guard.py",), "alias"),
    Mutation(
        "layout_aliases_unread", "the layout reads are found by the method names the code spells only, so `contiguous = torch.Tensor.is_contiguous` escapes the guard",
        (("ttt2la/layout_guard.py", "names_read(layer, frozenset(_READS), _METHODS, layer_code)",
          "names_read(layer, frozenset(_READS), None, layer_code)"),),
        ("tests/test_layout_guard.py",), "alias"),
    Mutation(
        "held_functions_unfollowed", "the user functions a layer's code reaches other than by a global's name (held by the layer, a static method) are not read for settings and layouts",
        (("ttt2la/global_guard.py", "            visit(held, depth - 1)\n",
          "            pass\n"),),
        ("tests/test_settings_guard.py",), "held"),
    Mutation(
        "held_helper_globals_unread", "the globals of a helper the layer holds (`self.finish = finish`) are not guarded",
        (("ttt2la/global_guard.py", "        _reads(held, depth - 1, seen, out, layer_code)\n",
          "        pass\n"),),
        ("tests/test_global_guard.py",), "held"),
    Mutation(
        "held_attributes_unresolved", "a name the code loads as an attribute is not resolved to what the layer or a global object holds under it, so `self.read()` on a reader the layer was given escapes",
        (("ttt2la/loaded_values.py",
          "found = self._attributes.get(self._attribute_bases(), name)", "found = []"),),
        ("tests/test_settings_guard.py", "tests/test_layout_guard.py"), "holds or static"),
    Mutation(
        "held_objects_unread", "the objects a layer holds (`self.cfg`) are not searched for the attribute a load names, so `self.cfg.read()` on a reader escapes",
        (("ttt2la/loaded_values.py", "self._layer = list({id(b): b for b in modules + held}.values())",
          "self._layer = list(modules)"),),
        ("tests/test_settings_guard.py",), "object"),
    Mutation(
        "closure_cells_unresolved", "a name the code loads from its closure is not resolved to the cell's value, so a reader closed over escapes",
        (("ttt2la/loaded_values.py",
          "found = [self._cells.get(name, _MISSING), self._defaults.get(name, _MISSING)]",
          "found = [self._defaults.get(name, _MISSING)]"),),
        ("tests/test_settings_guard.py",), "closure"),
    Mutation(
        "parameter_defaults_unresolved", "a parameter is not resolved to its default, so `read=torch.get_default_dtype` in the signature escapes",
        (("ttt2la/loaded_values.py",
          "found = [self._cells.get(name, _MISSING), self._defaults.get(name, _MISSING)]",
          "found = [self._cells.get(name, _MISSING)]"),),
        ("tests/test_settings_guard.py", "tests/test_layout_guard.py"), "default"),
    Mutation(
        "size_outputs_as_tuples", "a torch.Size the layer returns comes back from the converted layer as a plain tuple",
        (("ttt2la/converted.py", "        return out if typed is None else typed(out)\n",
          "        return out\n"),),
        ("tests/test_output_types.py",), ""),
    Mutation(
        "settings_object_unguarded", "an object of settings the layer holds (`self.cfg`, which compares by identity) is guarded as the very object, so a field set after conversion goes unseen",
        (("ttt2la/attribute_guard.py", "    if plain_object(value):\n        return Fields(",
          "    if False:\n        return Fields("),),
        ("tests/test_attribute_guard.py",), "settings_object"),
    Mutation(
        "math_untracked", "the run hands the layer's code `math` as it is, so `math.sqrt(T)` or `math.log2(T)` makes a plain float and a branch or a number computed through it escapes",
        (("ttt2la/frontend/size_uses.py", "        mine.update(replacements(scope))\n", ""),),
        ("tests/test_size_uses.py",), "Math"),
    Mutation(
        "other_user_files_unpatched", "the run patches the loop's module only, so a helper in another file of the user's (`whole_root(T)` through `math.sqrt`) escapes",
        (("ttt2la/frontend/size_uses.py", "        if isinstance(source, str) and is_users(source):\n            out.append(m)",
          "        if False:\n            out.append(m)"),),
        ("tests/test_size_uses.py",), "HelperMath or HelperRange"),
    Mutation(
        "grown_elsewhere_uncounted", "a list the loop grows through a helper (`grow(outs, y)`, no `outs.append` in its source) is no count of the iterations, so `len(outs)` after it escapes",
        (("ttt2la/frontend/size_uses.py", "            return self._grown_elsewhere(seq, it, k)", "            return None"),),
        ("tests/test_counts_of_the_length.py",), "GrownElsewhere"),
    Mutation(
        "copied_pieces_uncounted", "a list or tuple copied from a tensor's counted pieces (`len(list(x.split(C, 1)))`, `len([c for c in x.split(C, 1)])`) is no count of them, so a decision on it escapes",
        (("ttt2la/frontend/size_uses.py", "            copy = copied(self.pieces, seq)\n", "            copy = None\n"),),
        ("tests/test_counts_of_the_length.py",), "ListOfPieces or PiecesComprehended"),
    Mutation(
        "generated_pieces_uncounted", "the run hands the layer's code `sum` as it is, so `sum(1 for _ in x.unbind(1))` makes a plain int and a decision on it escapes",
        (("ttt2la/frontend/size_uses.py", "(\"range\", _Range), (\"sum\", _sum)", "(\"range\", _Range)"),),
        ("tests/test_counts_of_the_length.py",), "SumOfPieces"),
    Mutation(
        "reshape_sizes_unread", "the sizes a reshape or view computes (its `-1`: `x.reshape(B, -1, C, D).shape[1]`, the number of chunks) are read as any other, no value of the length",
        (("ttt2la/frontend/size_uses.py", "            self.shaped[id(out)] = (weakref.ref(out), got)\n", "            pass\n"),),
        ("tests/test_counts_of_the_length.py",), "ChunksOfAView or vouches_for_the_lengths"),
    Mutation(
        "whole_slice_size_from_input", "the size of a slice that kept its whole axis is read from its input, which a loop's output read by getitem lacks, so a padded sequence converts for its example's remainder only",
        (("ttt2la/frontend/chunk_counts.py", "        x = nodes[i].meta.get(\"val\")\n",
          "        x = nodes[i].args[0].meta.get(\"val\")\n"),),
        ("tests/test_padded_sequence.py",), "every_length or every_remainder"),
    Mutation(
        "padded_size_fitted_affine", "a size both batch and length move that no product of them gives is fitted as b·B + c·L from three traces, not from a fourth at (B1, L1)",
        (("ttt2la/frontend/shapes.py",
          "            return _bilinear(v0, vL, vB, corner(), B0, L0, L1, B1)\n", "            pass\n"),),
        ("tests/test_padded_sequence.py",), "every_batch_size"),
    Mutation(
        "graph_fault_blamed_on_user", "a call the converted graphs fail on is blamed on the user's line without running the code as written, which takes it",
        (("ttt2la/converted.py",
          "            return self._plan_failed(e, module, written, weights, flat, B, L)\n",
          "            if self.as_written is None:\n                raise self._rejected(e, gm, [weights, *flat]) from e\n"
          "            return self._written_failed(e, written, weights, flat, B, L)\n"),),
        ("tests/test_padded_sequence.py",), "fault"),
    Mutation(
        "jit_trace_check_warns_again", "torch.jit.trace's check of its trace, which traces the layer again, warns a second time",
        (("ttt2la/torchscript.py", "    if not _checking_a_trace():\n", "    if True:\n"),),
        ("tests/test_jit.py",), "once_per_trace"),
    Mutation(
        "compiled_plan_error_raw", "a compiled graph's run of the plan lets torch's bare error through, naming no line",
        (("ttt2la/converted.py", "    except Exception as e:\n        if detect_fake_mode(flat)",
          "    except ZeroDivisionError as e:\n        if detect_fake_mode(flat)"),),
        ("tests/test_compiled_call_errors.py",), "exact"),
    Mutation(
        "compiled_fake_failure_traced_again", "the plan's call run after TorchDynamo's graph break is traced by TorchDynamo again, whose fake-tensor error names no line",
        (("ttt2la/converted.py", "torch.compiler.allow_in_graph(torch.compiler.disable(_run_converted))",
          "torch.compiler.allow_in_graph(_run_converted)"),),
        ("tests/test_compiled_call_errors.py",), "lossy"),
    Mutation(
        "chunking_decisions_vouched", "a decision on the length that is one of the plan's own cases (the scan's `if n > 0:` / `if rest > 0:`) is held like any other, so a lossy scan refuses untraced lengths and its exact one breaks a full graph",
        (("ttt2la/frontend/size_uses.py", "chunking_case(lambda n: at(n, B), chunk, lengths)", "\"\""),),
        ("tests/test_chunking_decisions.py",), "every_length or one_graph or that_length"),
    Mutation(
        "chunking_decisions_unchecked", "decisions that are the plan's own cases are dropped without checking the exact plan against the code as written in each combination, so a branch of the same case around other code runs the probes' branch",
        (("ttt2la/chunking_decisions.py", "                if not agree:\n                    return []\n", ""),),
        ("tests/test_chunking_decisions.py",), "keeps_the_lengths_held"),
    Mutation(
        "chunking_decisions_forgotten_when_unpickled", "a converted layer built again from its record (unpickled) holds its plan's own decisions again, so it refuses lengths the conversion held",
        (("ttt2la/converted.py", "        drop_cases(state, recipe.cases)\n", "        pass\n"),),
        ("tests/test_chunking_decisions.py",), "unpickled"),
    Mutation(
        "checkpoint_stop_taken_for_a_failure", "the early stop of an activation checkpoint's recomputation, raised inside the plan, is judged as the plan's failure and the code as written runs instead, saving other tensors than the forward did",
        (("ttt2la/converted.py", "        if isinstance(error, ConversionError) or steering(error):\n",
          "        if isinstance(error, ConversionError):\n"),),
        ("tests/test_recast.py",), "activation_checkpointing"),
    Mutation(
        "compiled_written_call_traced", "a compiled call's code as written runs inside TorchDynamo, which traces it on fake tensors and lets its own error out where that code fails",
        (("ttt2la/converted.py", "            return _written_between_graphs(written)\n",
          "            return written()\n"),),
        ("tests/test_ordinary_module.py",), "run_as_written_fails_as_the_eager_call"),
    Mutation(
        "untraced_lengths_blame_the_code", "lengths the conversion could not trace are said to be where the layer's own code failed, without running that code there",
        (("ttt2la/frontend/recognize.py",
          "            own = not _code_runs_at(cand, fn, flat, layout, usual_plan, C, seq_len)\n",
          "            own = True\n"),),
        ("tests/test_whole_chunk_loops.py",), "whose_failure"),
    Mutation(
        "single_step_corner_untraced", "a single step's size that both batch and length move (a padded sequence flattened) is fitted from three traces, as b*B + c*L",
        (("ttt2la/frontend/single_step.py", "                         corner=None if fixed else corner)\n",
          "                         corner=None)\n"),),
        ("tests/test_padded_sequence.py",), "padded_single_step"),
    Mutation(
        "integer_shape_constants_unseen", "a tensor constant of integers a trace bakes in (`torch.tensor(T)`) is not compared between the traces at other shapes",
        (("ttt2la/frontend/shape_constants.py", "t.numel() <= 64 and not t.is_complex() else {}",
          "t.numel() <= 64 and t.is_floating_point() else {}"),),
        ("tests/test_size_constants.py",), "tensor"),
    Mutation(
        "rebound_methods_unseen", "a method of the layer's class rebound since conversion (`Layer.close = f`, `Layer.forward = f`) is not watched",
        (("ttt2la/global_guard.py", "_watchable(value) or name in read and _code(value):",
          "_watchable(value) or False and _code(value):"),),
        ("tests/test_global_guard.py",), "method or forward"),
    Mutation(
        "rebound_functions_unseen", "a function of the user's the layer calls as a global, rebound since conversion, is not watched",
        (("ttt2la/global_guard.py", "            if user_function or _watchable(value):\n",
          "            if _watchable(value):\n"),),
        ("tests/test_global_guard.py",), "helper"),
    Mutation(
        "shadowing_attributes_unseen", "an attribute set on a module since conversion over its class's (a method, a class constant, a submodule's `forward`) is not watched",
        (("ttt2la/attribute_guard.py",
          "            absent = _absent(m, names, bool(path), (shadowed or {}).get(type(m), frozenset()))\n",
          "            absent = ()\n"),),
        ("tests/test_attribute_guard.py",), "over_its_class or patched_forward"),
    Mutation(
        "kept_forward_first_one", "a kept call runs the class's `forward` as it was at the first kept call, not as it is now",
        (("ttt2la/converted.py",
          "            original = classes[type(module)] = original_class(type(module))\n",
          "            original = classes[type(module)] = type(\"Kept\", (), {\"forward\": staticmethod(\n"
          "                original_class(type(module)).forward)})\n"),),
        ("tests/test_as_written.py",), "rebound_since"),
    Mutation(
        "input_writes_taken_for_noise", "a forward that writes into its input is refused as drawing random numbers at the next op reading it",
        (("ttt2la/call_variation.py", "        if changed:\n            return _changes_its_input(changed[0])\n",
          "        if False:\n            return _changes_its_input(changed[0])\n"),),
        ("tests/test_call_variation.py",), "writing_into_its_input"),
    Mutation(
        "dataclass_outputs_not_carried", "a dataclass the layer returns is left a leaf to pytree, on which its trace fails",
        (("ttt2la/frontend/output_types.py", "        carry_dataclasses(out)\n", "        pass\n"),),
        ("tests/test_output_types.py",), "dataclass"),
    Mutation(
        "dataclass_inputs_not_carried", "a dataclass the layer takes is left a leaf to pytree, so the layer takes no tensor input",
        (("ttt2la/frontend/recognize.py",
          "    carry_dataclasses((tuple(cand.args), dict(cand.kwargs)))    # ``Batch(x, mask)``: its fields\n",
          "    pass\n"),),
        ("tests/test_structured_inputs.py",), "dataclass"),
    Mutation(
        "structured_input_read_as_a_tensor", "the conversion's check describes its example by the first argument's shape, which a named tuple or dict has none of",
        (("ttt2la/conversion.py",
          '    result = {"inputs": f"example, shape {tuple(first.shape) if first is not None else ()}",',
          '    result = {"inputs": f"example, shape {tuple(args[0].shape) if args else ()}",'),),
        ("tests/test_structured_inputs.py",), "tuple or dict"),
    Mutation(
        "field_names_as_keys", "a field of an input dataclass or named tuple is named by pytree's key object, not `#0.scale`",
        (("ttt2la/validation.py",
          'f".{k.name}" if isinstance(k, pytree.GetAttrKey) else f"[{k!r}]"', 'f"[{k!r}]"'),),
        ("tests/test_structured_inputs.py",), "dataclass or tuple"),
    Mutation(
        "check_compares_the_first_tensor_alone", "the conversion's check compares the first tensor a layer returns, not the values beside it (a flag of the length)",
        (("ttt2la/conversion.py", "    if result[\"ok\"] and other:\n", "    if False:\n"),),
        ("tests/test_output_types.py",), "flag"),
    Mutation(
        "numpy_protocols_unset", "tracked sizes take no part in NumPy's protocols, so `np.sqrt(T)` or `np.ceil(T / 4)` is only a plain copy: a use wherever it is used",
        (("ttt2la/frontend/size_numpy.py",
          "    _cls.__array_ufunc__ = _array_ufunc\n    _cls.__array_function__ = _array_function\n",
          "    pass\n"),),
        ("tests/test_size_spellings.py",), "number_of_the_length"),
    Mutation(
        "numpy_numbers_flagged", "a number NumPy returns from a size is recorded as a decision instead of tracked, so `x * np.ceil(T / 4)` at whole chunks is a use",
        (("ttt2la/frontend/size_numpy.py", "    if number is not None:\n        return _wrap(number, at)\n",
          "    if False:\n        return _wrap(number, at)\n"),),
        ("tests/test_size_spellings.py",), "number_of_the_length"),
    Mutation(
        "numpy_decisions_unrecorded", "a NumPy array or bool made from a size, or any NumPy value of one in a run as written, is not recorded",
        (("ttt2la/frontend/size_numpy.py", "        run.record(frame, what, at)\n", "        pass\n"),),
        ("tests/test_size_spellings.py",), "NumPy or isclose"),
    Mutation(
        "text_of_sizes_undecided", "text made of a size (`f\"{T}\"`, `str(T)`) is no decision, so a branch or lookup on it (`f\"{T}\".endswith(...)`, a cache keyed by it) escapes",
        (("ttt2la/frontend/size_text.py",
          "    _cls.__format__, _cls.__str__, _cls.__repr__ = _formatted, _str, _repr\n", "    pass\n"),),
        ("tests/test_size_uses.py",), "Text"),
    Mutation(
        "printed_text_decided", "text a statement only prints or logs (`print(f\"length {T}\")`) is a decision, so a debug print makes the layer check every new length",
        (("ttt2la/frontend/size_text.py", "    return found\n", "    return False\n"),),
        ("tests/test_size_spellings.py",), "printed"),
    Mutation(
        "int_float_untracked", "the run hands the layer's code `int` and `float` as they are, so `int(T)` and `float(T)` are plain copies: decisions wherever they are used",
        (("ttt2la/frontend/size_conversions.py",
          "    out.update({name: t for name, t in ((\"int\", _Int), (\"float\", _Float)) if name not in scope})\n",
          ""),),
        ("tests/test_size_spellings.py",), "number_of_the_length"),
    Mutation(
        "plain_copies_unrecorded", "a plain copy of a size no version keeps (`np.float64(T)`, `np.array(T)`, `int(T)` in a run as written) is not recorded",
        (("ttt2la/frontend/size_conversions.py",
          "            run.record(frame, \"makes a plain number of\", lambda L, B: convert(f(L, B)))\n",
          "            pass\n"),),
        ("tests/test_size_spellings.py",), ""),
    Mutation(
        "int_methods_untracked", "the `int` and `float` methods that return numbers (`T.bit_length()`, `as_integer_ratio`, `is_integer`) make plain ones, and a branch on them escapes",
        (("ttt2la/frontend/size_conversions.py", "                setattr(cls, name, _method(name, convert))\n",
          "                pass\n"),),
        ("tests/test_size_uses.py",), "BitLength"),
    Mutation(
        "int_attributes_untracked", "`T.numerator`, `T.real` make plain ints, and a branch on them escapes",
        (("ttt2la/frontend/size_conversions.py", "        for name in (\"real\", \"imag\", \"numerator\", \"denominator\"):\n",
          "        for name in ():\n"),),
        ("tests/test_size_spellings.py",), "numerator"),
    Mutation(
        "operator_index_untracked", "the run hands the layer's code `operator` as it is, so `operator.index(T)` makes a plain int and a branch on it escapes",
        (("ttt2la/frontend/size_conversions.py", "        if value is operator:\n", "        if False:\n"),),
        ("tests/test_size_uses.py",), "IndexCall"),
    Mutation(
        "round_pow_arguments_dropped", "a tracked size's `__pow__` takes no modulus and `__round__` no digits, so `pow(T, 3, 8)` or `round(T / 7, 2)` fails the run, which then finds nothing",
        (("ttt2la/frontend/size_uses.py",
          "    cls.__round__, cls.__pow__, cls.__rpow__ = _round, _power(False), _power(True)\n",
          "    cls.__round__ = _unary(round)\n"
          "    cls.__pow__, cls.__rpow__ = _binary(operator.pow), _binary(operator.pow, True)\n"),),
        ("tests/test_size_uses.py",), "PowModulus"),
    Mutation(
        "failed_run_not_rerun", "code that fails with the tracked versions (`dtype=float` to torch, `np.sqrt(T).astype(...)`) is not run again as written, so the run finds nothing",
        (("ttt2la/frontend/size_uses.py", "    for plain in (False, True):\n", "    for plain in (False,):\n"),),
        ("tests/test_size_spellings.py",), "NumPy or dtype"),
    Mutation(
        "sizes_not_copyable", "`copy.deepcopy` of a tracked size builds it again without its function, so the run fails and finds nothing",
        (("ttt2la/frontend/size_conversions.py", "        cls.__deepcopy__ = lambda self, memo: self\n", ""),),
        ("tests/test_size_spellings.py",), "deepcopy"),
    Mutation(
        "dict_asked_through_getattr", "whether a global object has a `__dict__` is asked through its `__getattr__`, whose own error escapes the conversion",
        (("ttt2la/object_fields.py", "        object.__getattribute__(value, \"__dict__\")\n",
          "        getattr(value, \"__dict__\")\n"),),
        ("tests/test_global_guard.py",), "getattr"),
    Mutation(
        "input_types_unchecked", "a call's inputs are not compared with the dtypes and devices the layer was traced with, so float64 inputs reach graphs traced at float32",
        (("ttt2la/converted.py", "        types = self.input_types\n", "        types = None\n"),),
        ("tests/test_input_types.py",), "exact or lossy or state"),
    Mutation(
        "input_types_not_cast", "a compiled call compares its inputs with the example's dtypes as converted, not as the weights were cast since",
        (("ttt2la/converted.py", "            types = types.cast(self.weights, now)\n", "            pass\n"),),
        ("tests/test_input_types.py",), "cast"),
    Mutation(
        "float_left_unread", "a plain float on the left of an operator or a comparison with a value of the length (`0.5 * T`, `2.5 < T`) is not recorded, so a branch on it is converted with the probe lengths' outcome",
        (("ttt2la/frontend/size_operands.py", "    if type(left) is float and isinstance(right, SizeInt):\n        f, apply",
          "    if False:\n        f, apply"),
         ("ttt2la/frontend/size_operands.py", "    if op in _COMPARISONS and type(left) is float and isinstance(right, SizeInt):\n",
          "    if False:\n")),
        ("tests/test_size_spellings.py", "tests/test_size_uses.py"), "float or FloatLeft"),
    Mutation(
        "sequence_index_unread", "an index or slice of a plain list, tuple or string by a value of the length (`[a, b][T % 2]`) is not recorded",
        (("ttt2la/frontend/size_operands.py", "    if not isinstance(seq, _SEQUENCES):\n", "    if True:\n"),),
        ("tests/test_size_spellings.py", "tests/test_size_uses.py"), "index or slice or ListIndex"),
    Mutation(
        "run_lengths_sparse", "the run judges its decisions at every length up to two chunks only, not up to 512, so `x.size(dim=1) % 24 == 0` is taken for a constant",
        (("ttt2la/frontend/size_uses.py", "set(range(1, max(2 * chunk, 512) + 2))", "set(range(1, min(2 * chunk, 512) + 2))"),),
        ("tests/test_size_uses.py",), "EveryWindow"),
    Mutation(
        "constant_loops_taken_for_iterations", "a decision of the length in a `for` loop over a display of constants (`for t in (16, 24, 32): if x.size(1) == t:`) is dropped as an iteration's, so the plan takes the probes' branch at those lengths",
        (("ttt2la/frontend/size_uses.py", "or isinstance(node, ast.For) and not _constant_iterable(node.iter))",
          "or isinstance(node, ast.For))"),),
        ("tests/test_size_uses.py",), "LoopOverConstants"),
    Mutation(
        "one_run_of_the_code", "the code is run at one length only, so a membership test that stops at a constant the run's length equals (`x.size(1) in (16, 24, 32)` at 16) hides the other comparisons, and a lossy conversion takes the traced branch at 24",
        (("ttt2la/length_vouching.py", "            return [(L, B), (L2, B)]\n", "            return [(L, B)]\n"),),
        ("tests/test_size_uses.py",), "InConstants or AnyOfConstants"),
    Mutation(
        "display_index_unread", "an index by a value of the length into a tuple of tensors written at the line (`(o + 2, o * 2)[T % 2]`) is not recorded, so the plan takes the probes' item at every length",
        (("ttt2la/frontend/size_operands.py", "                return range(len(node.elts))\n", "                raise\n"),),
        ("tests/test_size_uses.py",), "OutputIndex"),
    Mutation(
        "percent_text_unread", "text `%`-formatted with a value of the length (`'%d' % T`) is not recorded",
        (("ttt2la/frontend/size_operands.py", "    if op is ast.Mod and isinstance(left, (str, bytes)) and _sized(right):\n",
          "    if False:\n"),),
        ("tests/test_size_spellings.py", "tests/test_size_uses.py"), "formatting or PercentText"),
    Mutation(
        "closure_cells_unwatched", "the variables a layer's functions close over (a class or helper made by a factory function) are not guarded, so a `nonlocal` assignment after conversion runs the old value",
        (("ttt2la/global_guard.py", "    cells = () if _made_by_library(fn) else fn.__closure__ or ()\n",
          "    cells = ()\n"),),
        ("tests/test_global_guard.py",), "closure"),
    Mutation(
        "extremes_untracked", "`min` or `max` of a value of the length and a plain float (`min(T, 40.5)`) returns the size it picked at the run's length, tracked as the length itself",
        (("ttt2la/frontend/size_order.py", "        return _wrap(_plain(out), lambda L, B: builtin(a(L, B) for a in ats))\n",
          "        return out\n"),),
        ("tests/test_size_spellings.py", "tests/test_size_uses.py"), "min or max or MinFloat"),
    Mutation(
        "sorted_order_unrecorded", "the order `sorted` puts a value of the length in among plain floats is not recorded",
        (("ttt2la/frontend/size_order.py", "    if at is not None:\n        _decide(\"sorts\"", "    if False:\n        _decide(\"sorts\""),),
        ("tests/test_size_spellings.py",), "sorted"),
    Mutation(
        "float_membership_unread", "`T in [16.0, 32.0]`, whose float items compare from their side, is not recorded",
        (("ttt2la/frontend/size_operands.py", "    if op in _MEMBERSHIP and isinstance(left, SizeInt)",
          "    if False and isinstance(left, SizeInt)"),),
        ("tests/test_size_spellings.py",), "list"),
    Mutation(
        "float_in_place_unread", "a plain float multiplied in place by a value of the length (`c *= T`) is not recorded",
        (("ttt2la/frontend/size_operands.py", "        if isinstance(node, ast.AugAssign):     # its target read as it is before the line\n",
          "        if False:\n"),),
        ("tests/test_size_spellings.py",), "multiplied"),
    Mutation(
        "tracer_displaces_watch", "a tracer set already that sets itself again when called (coverage's C tracer) displaces the watch of the size operands",
        (("ttt2la/frontend/size_operands.py", "        if sys.gettrace() is not tracer:\n            sys.settrace(tracer)\n", ""),),
        ("tests/test_size_spellings.py",), "tracer"),
    Mutation(
        "call_operand_unread", "an operand spelled as a call of the user's code (`0.5 * get_len(x)`) is not read as the value it returns",
        (("ttt2la/frontend/size_operands.py", "    operand = _operand_of(frame)\n", "    operand = None\n"),),
        ("tests/test_size_spellings.py", "tests/test_size_uses.py"), "helper or method or object or HelperFloat"),
    Mutation(
        "call_operand_misattributed", "the frame a builtin starts inside a call (`functools.reduce(f, xs)`) is taken for the call's value",
        (("ttt2la/frontend/size_operands.py", "    if found is None or not _runs(frame, caller, found[0].func):\n",
          "    if found is None:\n"),),
        ("tests/test_size_spellings.py",), "builtin"),
    Mutation(
        "picked_by_key_unrecorded", "the item `min` or `max` picks by a `key` whose values mix a plain float and a value of the length is not recorded",
        (("ttt2la/frontend/size_order.py", "            if ats is not None:\n                _decide(\"picks\"",
          "            if False:\n                _decide(\"picks\""),),
        ("tests/test_size_spellings.py",), "key"),
    Mutation(
        "sort_in_place_unread", "`xs.sort()` of a value of the length among plain floats is not recorded",
        (("ttt2la/frontend/size_operands.py", "    return isinstance(node, ast.Call) and _sorts_in_place(node)\n",
          "    return False\n"),),
        ("tests/test_size_spellings.py", "tests/test_size_uses.py"), "place or SortedInPlace"),
    Mutation(
        "builtin_operand_unread", "an operand that a builtin of numbers computes (`0.5 * abs(T)`) "
        "is not read",
        (("ttt2la/frontend/size_operands.py", "        if _builtin_call(node):\n            fn = self.value(",
          "        if False:\n            fn = self.value("),),
        ("tests/test_size_spellings.py", "tests/test_size_uses.py"),
        "abs or pow or round or divmod or IntFloat or int_of"),
    Mutation(
        "shadowed_builtin_called", "a name of a builtin bound to the user's code is called to read "
        "an operand",
        (("ttt2la/frontend/size_operands.py", "            if any(fn is f for f in _builtins_named(node.func)) and all(",
          "            if True and all("),),
        ("tests/test_size_spellings.py",), "local or bound"),
    Mutation(
        "made_objects_method_unread", "an operand that a method of a call's result computes "
        "(`0.5 * make(x).length()`) is not read",
        (("ttt2la/frontend/size_operands.py", "            fn = _method_of_receiver(frame, func)\n",
          "            return False\n"),),
        ("tests/test_size_spellings.py", "tests/test_size_uses.py"), "made or Made"),
    Mutation(
        "first_run_through_call", "a graph module's first run goes through fx's call wrapper, which "
        "prints the generated code of a graph that raises",
        (("ttt2la/ir.py", "        self.real_recompile()\n        return self.forward(*args, **kwargs)\n",
          "        self.real_recompile()\n        return self(*args, **kwargs)\n"),),
        ("tests/test_graph_code.py",), "prints_nothing"),
    Mutation(
        "product_traced_for_any_layout", "a summed product's matmul traced for one layout is "
        "copied in for another",
        (("ttt2la/frontend/summed_products.py", "        sub = _traced(how, layouts)\n",
          "        sub = _traced.__dict__.setdefault(how, _traced(how, layouts))\n"),),
        ("tests/test_summed_products.py",), "layout"),
    Mutation(
        "traces_start_where_runs_left", "a trace of the layer starts from the attributes the "
        "conversion's own runs left on it, not from those it was found with",
        (("ttt2la/frontend/recognize.py", "        with traced_as_found(module):\n",
          "        with contextlib.nullcontext():\n"),),
        ("tests/test_filled_caches.py",), "level_2 or exact"),
    Mutation(
        "check_run_fills_cache", "a run of the code as written that only checks a call leaves "
        "what it cached on the layer",
        (("ttt2la/as_found.py", "        for m, before in modules.values():\n            set_plain(m, before)\n",
          "        pass\n"),),
        ("tests/test_filled_caches.py",), "no_trace or fixed_number"),
    Mutation(
        "drift_probe_shares_guards", "the drift probe is installed with the converted layer's own "
        "state, recording its guards from the probe",
        (("ttt2la/drift.py", "    install(probe, copy.deepcopy(state))",
          "    install(probe, state)"),),
        ("tests/test_filled_caches.py",), "drift"),
    Mutation(
        "filled_cache_traced_as_found", "a cache the forward fills is traced as found, never as "
        "constructed",
        (("ttt2la/filled_caches.py", "    start = _constructed_start(module, found, [c for c in (call, longer) if c is not None])",
          "    start = found"),),
        ("tests/test_filled_caches.py",), "level_2"),
    Mutation(
        "constructed_start_unchecked", "the traces start from the constructor's constants without "
        "checking that the layer computes the same from them",
        (("ttt2la/filled_caches.py", "        if held is None or built is None or not _agree(held[0], built[0]):",
          "        if held is None or built is None:"),),
        ("tests/test_filled_caches.py",), "fixed_converts"),
    Mutation(
        "first_call_value_allowed", "a value the layer's first call fixes, and its later calls "
        "depend on, is allowed",
        (("ttt2la/filled_caches.py", "            return first[1], True, ()\n",
          "            return [], False, ()\n"),),
        ("tests/test_filled_caches.py",), "first_call_fixes"),
    Mutation(
        "setting_constructed", "an attribute the constructor sets to a constant is traced as "
        "constructed although the forward never assigns it",
        (("ttt2la/filled_caches.py", "               if (f\"{paths[id(m)]}.{name}\" if paths.get(id(m)) else name) in first[1]}",
          "               if True}"),),
        ("tests/test_filled_caches.py",), "outside or start"),
    Mutation(
        "lossy_length_unread", "a lossy conversion refuses every untraced length where its code "
        "computes values of the length, though it decides as at the traced ones",
        (("ttt2la/converted.py", "            if not vouching.decided_alike(B, L):\n",
          "            if True:\n"),),
        ("tests/test_lossy_lengths.py",), "alike"),
    Mutation(
        "unread_use_vouches", "a use of the length read off the source only, with no decision "
        "recorded, vouches for any length",
        (("ttt2la/length_vouching.py", "            v.outcomes and all(not judged",
          "            all(not judged"),),
        ("tests/test_lossy_lengths.py",), "cannot_read"),
    Mutation(
        "decision_read_at_new_shape_only", "a decision is read at the new shape only, not "
        "compared with the traced shapes",
        (("ttt2la/length_vouching.py", "        values = [at(L, B * unit) for B, L in (*traced, shape)]",
          "        values = [at(L, B * unit) for B, L in (shape,)]"),),
        ("tests/test_lossy_lengths.py",), "refused or alike"),
    Mutation(
        "caches_guarded", "the caches a layer's forward fills are guarded like its settings: once "
        "a call of its code as written fills one, it runs as written from then on",
        (("ttt2la/converted.py", "read_off_classes(module, code.names),\n                                         state.caches)",
          "read_off_classes(module, code.names))"),),
        ("tests/test_filled_caches.py",), "fixed_number"),
    Mutation(
        "half_gemms_unforced", "the switch that forces half GEMMs native or formed in fp32 is "
        "ignored: the precision tests hold only the path this CPU takes",
        (("ttt2la/runtime/newton_schulz.py",
          "return CPU_NATIVE_HALF.get(dtype, False) if _forced[0] is None else _forced[0]",
          "return CPU_NATIVE_HALF.get(dtype, False)"),),
        ("tests/test_runtime_block.py",), "half_gemms"),
    Mutation(
        "half_gemms_formed_off_cpu", "half GEMMs on a GPU are formed as fp32 GEMMs when the CPU "
        "path is forced",
        (("ttt2la/runtime/newton_schulz.py", '    if device.type != "cpu":\n        return True',
          '    if device.type != "cpu" and _forced[0] is None:\n        return True'),),
        ("tests/test_runtime_block.py",), "half_gemms"),
    Mutation(
        "operator_functions_unread", "an operand that a function of the operator module computes "
        "(`0.5 * operator.mul(T, 2)`) is not read, so a branch on it converts with the probes' "
        "outcome",
        (("ttt2la/frontend/size_operands.py",
          "        return _BUILTINS.get(func.id, ()) + _OPERATOR_FUNCTIONS.get(func.id, ())",
          "        return _BUILTINS.get(func.id, ())"),
         ("ttt2la/frontend/size_operands.py",
          "        return _OPERATOR_FUNCTIONS.get(func.attr, ())", "        return ()")),
        ("tests/test_size_spellings.py", "tests/test_length_branches.py",
         "tests/test_length_values.py"), "operator"),
    Mutation(
        "conditional_operand_unread", "an operand that is a conditional expression "
        "(`0.5 * (T if T > 0 else 1)`) is not read, so a branch on it in a helper no source "
        "reading resolves converts with the probes' outcome",
        (("ttt2la/frontend/size_operands.py",
          "        if kind is ast.IfExp:       # ``0.5 * (T if T > 0 else 1)``: the branch the code takes\n",
          "        if False:\n"),),
        ("tests/test_size_spellings.py", "tests/test_length_values.py"), "conditional"),
    Mutation(
        "unfollowed_operand_ignored", "an operand the run cannot follow (a comprehension, `sum` "
        "of a generator) that names a value of the length is not taken for one",
        (("ttt2la/frontend/size_operands.py", "        except Exception:\n            return self.unfollowed(node)\n",
          "        except Exception:\n            return None\n"),),
        ("tests/test_size_spellings.py", "tests/test_length_values.py"),
        "comprehension or generator"),
    Mutation(
        "unfollowed_text_flagged", "an f-string compared or indexed is taken for an unfollowed "
        "operand, so text of a constant becomes a use of the length",
        (("ttt2la/frontend/size_operands.py", "not isinstance(o, ast.JoinedStr)", "True"),),
        ("tests/test_size_spellings.py",), "text"),
    Mutation(
        "bench_compiled_rows_eager", "`bench --compile` times the eager models again under the compiled rows' names",
        (("ttt2la/cli.py", "        out[row] = compiled\n", "        out[row] = model\n"),),
        ("tests/test_cli.py",), "compiled_rows"),
    Mutation(
        "bench_compiler_failure_escapes", "a backend that fails on a model in `bench --compile` ends the run with its raw error instead of a row saying why",
        (("ttt2la/cli.py", "        except Exception as e:  # noqa: BLE001 - any compiler failure: the row says why",
          "        except ImportError as e:  # noqa: BLE001 - any compiler failure: the row says why"),),
        ("tests/test_cli.py",), "compiled_rows"),
    Mutation(
        "compiled_plan_unused", "convert(compile=...) records the compiler, and the layer runs its plan eagerly anyway",
        (("ttt2la/converted.py", "        if compiled is None or compiled.broken or self.compile_break \\\n",
          "        if True or compiled is None or compiled.broken or self.compile_break \\\n"),),
        ("tests/test_compiled_plan.py",), "eager_plan_outputs"),
    Mutation(
        "compile_failure_escapes", "a compiler failing on a call of a converted layer raises its raw error instead of running the plan eagerly and saying so",
        (("ttt2la/compiled_plan.py", "            out = eager()           # the plan's own error, where the plan fails eagerly too\n",
          "            raise\n"),),
        ("tests/test_compiled_plan.py",), "failing"),
    Mutation(
        "recompile_limit_unchecked", "past TorchDynamo's recompile limit a compiled plan is left to TorchDynamo's silent eager fallback, which the report does not mention",
        (("ttt2la/compiled_plan.py", "        return len(self.shapes) >= torch._dynamo.config.recompile_limit\n",
          "        return False\n"),),
        ("tests/test_compiled_plan.py",), "recompile_limit"),
    Mutation(
        "compiled_plan_lost_in_copies", "a deep copy of a layer converted with compile= runs its plan eagerly",
        (("ttt2la/converted.py", "            compiled=None if self.compiled is None else self.compiled.fresh())",
          "            compiled=None)"),),
        ("tests/test_compiled_plan.py",), "copies"),
    Mutation(
        "compiled_plan_lost_when_unpickled", "an unpickled layer converted with compile= runs its plan eagerly",
        (("ttt2la/converted.py", "    if recipe.compiler:         # checked when converted",
          "    if False:         # checked when converted"),),
        ("tests/test_compiled_plan.py",), "copies"),
    Mutation(
        "untraceable_plan_compiled_note", "a layer whose plan cannot be traced is reported compiled, though it runs eagerly",
        (("ttt2la/compiled_plan.py", "    if state.compile_break:\n        return (f\"compile=",
          "    if False:\n        return (f\"compile="),),
        ("tests/test_compiled_plan.py",), "cannot_be_traced"),
    Mutation(
        "compile_value_unchecked", "convert(compile=) takes a name no backend has, and fails later with the compiler's error instead of saying which names it takes",
        (("ttt2la/compiled_plan.py", "        if value not in known:\n", "        if False:\n"),),
        ("tests/test_compiled_plan.py",), "refused"),
    Mutation(
        "ran_plans_compiler_unnamed", "the plans a converted model ran do not say that a compiler ran them",
        (("ttt2la/cli.py", "            under = f\", under {compiled.name}\" if compiled is not None \\\n",
          "            under = \"\" if compiled is not None \\\n"),),
        ("tests/test_compiled_plan.py",), "eager_plan_outputs"),
    Mutation(
        "load_compile_dropped", "ttt2la.load(compile=...) converts the loaded model eagerly",
        (("ttt2la/checkpoint/__init__.py", "inplace=True, compile=compile, ", "inplace=True, "),),
        ("tests/test_checkpoint.py",), "compiles"),
    Mutation(
        "non_tensor_inputs_compiled", "a call with a Python number among its inputs is sent through the compiled entry, whose plan call takes tensors only",
        (("ttt2la/converted.py", "        if not all(isinstance(t, torch.Tensor) for t in flat):\n",
          "        if False:\n"),),
        ("tests/test_compiled_plan.py",), "values_other"),
    Mutation(
        "bench_compiled_plans_unbuilt", "`bench --compile-plan` converts the levels eagerly under the compiled rows' names",
        (("ttt2la/cli.py", "backend=backend, strict=strict, compile=compile)",
          "backend=backend, strict=strict)"),),
        ("tests/test_cli.py",), "made_with_compile"),
    Mutation(
        "avx512_bf16_units_unread", "a CPU with AVX512-BF16 and no AMX forms bf16 GEMMs in fp32, at a third of the native rate",
        (("ttt2la/runtime/newton_schulz.py", " or has(\"_is_avx512_bf16_supported\")", ""),),
        ("tests/test_runtime_block.py",), "dot_them"),
    Mutation(
        "compiler_off_claimed", "with TorchDynamo disabled or the stance force_eager a compiled plan runs eagerly, and the report still says it ran under torch.compile",
        (("ttt2la/converted.py", " or torch.jit.is_tracing() or compiler_off():\n",
          " or torch.jit.is_tracing():\n"),),
        ("tests/test_compiled_plan.py",), "torchdynamo_off"),
    Mutation(
        "own_attributes_key_the_traces", "what ttt2la keeps on a converted layer (its report) is part of what the traces are cached by, so copies of a converted layer cast together are each traced again",
        (("ttt2la/frontend/recognize.py",
          "                if k not in _MODULE_INTERNALS and not k.startswith(OWN_PREFIXES):\n",
          "                if k not in _MODULE_INTERNALS:\n"),),
        ("tests/test_recast.py",), "traced_again_once"),
    Mutation(
        "autograd_guard_unread", "a call whose input records gradients (or after a parameter's requires_grad changed) runs the plan traced on detached inputs, though the layer's code reads requires_grad, is_leaf or grad_fn",
        (("ttt2la/converted.py",
          "        change = autograd.changed(self, flat)\n",
          "        change = None\n"),),
        ("tests/test_autograd_guard.py",), ""),
    Mutation(
        "criterion_judged_once", "the precision criterion judges its first five inputs only, so a few unlucky inputs fail a conversion whose error is the original's",
        (("ttt2la/testing.py", "    for n in (samples, max(samples, confirm)):\n",
          "    for n in (samples,):\n"),),
        ("tests/test_precision_criterion.py",), ""),
    Mutation(
        "kept_trace_handed_out", "the trace cache hands out the graph it keeps, which the recognition then rewrites in place",
        (("ttt2la/frontend/trace_cache.py", "        return graph_module(kept, copy_graph(kept.graph))\n",
          "        return kept\n"),),
        ("tests/test_trace_cache.py",), ""),
    Mutation(
        "trace_key_without_requires_grad", "a trace is kept without whether its arguments require grad, which decides how code that takes gradients is traced",
        (("ttt2la/frontend/trace_cache.py", "x.dtype, str(x.device), x.requires_grad)",
          "x.dtype, str(x.device))"),),
        ("tests/test_trace_cache.py",), ""),
    Mutation(
        "open_chunk_keeps_padding", "a piece padded to whole chunks by the code before the loop keeps the padding in its open chunk, so the next piece's first chunk starts with it",
        (("ttt2la/stream.py", "narrow(axes[i], real - tail, tail)", "narrow(axes[i], length - tail, tail)"),),
        ("tests/test_stream.py",), "padding"),
    Mutation(
        "padded_state_from_padding", "the state carried after a padded piece is the padded run's, its padding folded in",
        (("ttt2la/stream.py", "    carried = states0\n    if folded:", "    carried = finals\n    if False:"),),
        ("tests/test_stream.py",), "padding"),
    Mutation(
        "outside_reads_unkeyed", "a layer's kept traces and recognition are keyed without the globals, class attributes and helpers its code reads, so a conversion after one changed gets the old function",
        (("ttt2la/frontend/recognize.py", "tensors, in_spec, outside)", "tensors, in_spec)"),),
        ("tests/test_trace_cache.py",), "outside"),
    Mutation(
        "keys_features_from_outside_collapsed", "a kernel computed on the queries only, the keys' features computed before the step, is collapsed on the queries alone",
        (("ttt2la/passes/collapse_mlp.py", "    _require_key_path(program, cores, sites, theta)\n", ""),),
        ("tests/test_collapse_mlp.py",), "before_the_step"),
    Mutation(
        "body_sizes_read_at_the_trace", "the fold replays the views between φ's product and its value at the traced sizes, not the calibration chunk's",
        (("ttt2la/passes/collapse_mlp.py", "map_arg(n.args[1:], sizes.__getitem__)", "map_arg(n.args[1:], lambda a: a.meta['val'])"),),
        ("tests/test_passes.py",), "sized_by_the_body"),
    Mutation(
        "detach_read_before_the_passes", "a detach of the state is looked for in the loop as recognized, not as the passes left it, so one only a dropped weight norm read refuses gradients",
        (("ttt2la/conversion.py", "found = detached_state(layer.state.program)", "found = detached_state(layer.rl.program)"),),
        ("tests/test_gradient_stops.py",), "passes_leave_dead"),
    Mutation(
        "rate_per_feature_called_satisfied", "absorb_lr calls a level satisfied where a stream named as a learning rate scales the update per token and feature",
        (("ttt2la/passes/absorb_lr.py", "            named = rates_by_name(program)\n", "            named = []\n"),),
        ("tests/test_passes_lossy.py",), "per_token_and_feature"),
    Mutation(
        "commuted_apply_refused", "the last chunk's apply after the loop must give a product's operands in the loop's order: `hh.mul_(gate)` in the loop and `gate * hh` after it are refused",
        (("ttt2la/frontend/rollup.py", "        return ours.target in _COMMUTATIVE and", "        return False and"),),
        ("tests/test_frontend_styles.py",), "in_place_in_the_loop"),
    Mutation(
        "empty_batch_on_the_plan", "an exact conversion runs an empty batch on its plan, which returns where the layer's own code fails",
        (("ttt2la/converted.py", "        if B == 0 and self.as_written is not None:", "        if False:"),),
        ("tests/test_call_errors.py",), "empty_batch_runs"),
    Mutation(
        "theta_stepped_inside_frozen", "freeze_theta freezes the Θ a loop carries between iterations and calls Θ frozen where a later chunk of the iteration reads it stepped",
        (("ttt2la/passes/freeze_theta.py", "        inside = stepped_inside(program, thetas)\n", "        inside = None\n"),),
        ("tests/test_passes.py",), "stepped_within"),
    Mutation(
        "scan_in_the_step_called_no_momentum", "remove_momentum calls a single step already free of momentum where its update runs along the sequence in order (titans-pytorch's scan over chunks)",
        (("ttt2la/passes/remove_momentum.py", "            scans = scans_within(program) if program.single_step else []\n", "            scans = []\n"),),
        ("tests/test_sequence_parallel.py",), "not_called_removed"),
    Mutation(
        "bias_taken_for_a_step", "a bias broadcast over the tokens inside a memory's own forward (`x @ W + b`) is taken for a single step's update, so the step reads as stepped twice and is refused",
        (("ttt2la/frontend/single_step.py", "    return not spread or len(small) - spread[-1] - 1 >= 2\n", "    return True\n"),),
        ("tests/test_sequence_parallel.py",), "converts_exactly"),
    Mutation(
        "end_slice_shows_a_second_chunk", "a slice from the sequence's end (`eta[:, -1]`) counts as a second chunk, so an example of one mini-batch is not run at longer lengths and its chunk size is misread",
        (("ttt2la/frontend/recognize.py", "    return len({s for s in cand.slice_starts if s >= 0}) >= 2\n", "    return len(cand.slice_starts) >= 2\n"),),
        ("tests/test_frontend_styles.py",), "slice_from_the_end"),
    Mutation(
        "rewritten_stream_select_looked_up", "a select of a pre-chunked stream the rewrite just replaced is looked up among the selects found before it, and the conversion fails on a KeyError at every probe shape",
        (("ttt2la/frontend/prechunked.py", "        taken = indices.get((src, sel.args[1]))", "        taken = indices[(src, sel.args[1])]"),),
        ("tests/test_frontend_styles.py",), "slice_from_the_end"),
    Mutation(
        "weight_with_fewer_axes_refused", "a single step's weight stored with fewer axes than its increment (`[H, D, D]` plus `[B, H, D, D]`) is not read as a stepped weight, and the layer is refused",
        (("ttt2la/frontend/single_step.py", "    if small is None or shape is None or len(small) > len(shape):", "    if small is None or shape is None or len(small) != len(shape):"),),
        ("tests/test_single_step.py",), "broadcast_over_the_batch"),
    Mutation(
        "attribute_names_watched_as_globals", "every name of `co_names` is watched as a global, attribute names included: a script's global named like an attribute the code reads (`shape`) refuses the converted layer's calls once it changes",
        (("ttt2la/global_guard.py", "        for name in global_names(code):\n            if name not in g:", "        for name in code.co_names:\n            if name not in g:"),),
        ("tests/test_global_guard.py",), "named_like"),
    Mutation(
        "target_installs_read_as_users", "a package installed into a directory on `sys.path` outside site-packages (pip's `--target`) is read as the user's code, so its Python decisions on the shape pin a lossy conversion to the example's shapes",
        (("ttt2la/frontend/user_code.py", '("site-packages", "dist-packages")) or _holds_distributions(p)}', '("site-packages", "dist-packages"))}'),),
        ("tests/test_installed_packages.py",), "installed_helper"),
    Mutation(
        "transposed_rate_unread", "a per-token rate read transposed with the values (`(vᵀ ⊙ lrᵀ) @ k`, weights laid out `W @ x`) is not taken for a rate: absorb_lr says there is none to fold and the level keeps it",
        (("ttt2la/passes/absorb_lr.py", "    if mine[-1] != 1 and not (scalar and scalar[-1] == 1 and _numel(scalar) == _numel(mine)):", "    if mine[-1] != 1:"),),
        ("tests/test_passes_lossy.py",), "tokens_last"),
    Mutation(
        "step_size_folded_with_the_norm", "remove_muon takes a learned step size times a normalised increment (`η · g/(‖g‖+1)`) for the normalisation and folds it into the scale: the step size is a parameter frozen",
        (("ttt2la/passes/remove_muon.py", "            norm = None if _scales_a_norm(node) else match_norm(node)", "            norm = match_norm(node)"),),
        ("tests/test_single_step.py",), "learned_step_size"),
    Mutation(
        "probe_failures_logged", "a probe trace the layer's code rejects leaves fake tensors' ERROR records, with tracebacks, in the user's log for a conversion that worked",
        (("ttt2la/frontend/capture.py", "    logger.disabled = True\n", "    logger.disabled = before\n"),),
        ("tests/test_single_step.py",), "log_nothing"),
    Mutation(
        "final_state_read_unsaid", "a loop that only accumulates its state, read after it by every token, is refused with \"no iteration output is used after the loop\" and no remedy",
        (("ttt2la/frontend/rollup.py", "        final = [n for n in u.iters[-1] if any(x not in u.in_loop for x in n.users)]", "        final = []"),),
        ("tests/test_refusal_messages.py",), "final_state_alone"),
    Mutation(
        "semicolon_statements_one_name", "two statements on one line (`w0 = f(w0); w2 = f(w2)`) give both states the first one's name, and the states are named from frames further out",
        (("ttt2la/frontend/source_names.py", "    if len(together) > 1:\n", "    if False:\n"),),
        ("tests/test_state_names.py",), "semicolons"),
    Mutation(
        "callers_frames_name_states", "a state no line of the layer names takes its name from the code that called the layer (ttt2la's own `layers, inputs, notes = ...`)",
        (("ttt2la/frontend/source_names.py", "    if outside:             # the code that called the layer", "    if False:             # the code that called the layer"),),
        ("tests/test_state_names.py",), "no_name_from_the_code"),
    Mutation(
        "schedule_counted_as_one_iteration", "a loop of schedule steps that each take the same stretch of the sequence is refused as having \"run 1 iteration(s)\"",
        (("ttt2la/frontend/rollup.py", "        raise _fail(same_stretch(loop_nodes, loop) or\n", "        raise _fail(None or\n"),),
        ("tests/test_refusal_messages.py",), "schedule_of_steps"),
    Mutation(
        "seed_unchecked", "a `--seed` torch cannot take escapes as a raw traceback",
        (("ttt2la/cli.py", '    p.add_argument("--seed", type=_seed, default=0, help="seed of weights and inputs (0)")', '    p.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (0)")'),),
        ("tests/test_cli_inputs.py",), "seed_torch"),
    Mutation(
        "example_shape_drops_batch", "`--batch` and `--length` beside `--example-shape` are dropped without a word",
        (("ttt2la/cli.py", "    if given and (args.example_shape or args.example_inputs):", "    if False:"),),
        ("tests/test_cli_inputs.py",), "example_shape_beside"),
    Mutation(
        "inline_array_read_as_path", "`--config '[1, 2]'` is read as a file's path and refused as missing",
        (("ttt2la/checkpoint/recipe.py", 'text.lstrip().startswith(("{", "["))', 'text.lstrip().startswith("{")'),),
        ("tests/test_cli_inputs.py",), "inline_config_that_is_json"),
    Mutation(
        "level_of_numpy_refused", "a level of another integer type (`numpy.int64`, a one-element integer tensor) is refused",
        (("ttt2la/validation.py", "        value = level if isinstance(level, bool) else operator.index(level)", "        value = level"),),
        ("tests/test_cli_inputs.py",), "any_integer_type"),
    Mutation(
        "text_prompt_echoed_first", "`generate --prompt` writes the prompt, then refuses a model that is not byte-level",
        (("ttt2la/cli.py", "    check_byte_model(model)                         # before the prompt is echoed", "    pass"),),
        ("tests/test_generate.py",), "no_language_model"),
    Mutation(
        "layer_checkpoint_sampled", "`generate` on a converted layer's checkpoint feeds it token ids, and the refusal blames the call's shape",
        (("ttt2la/generate.py", "    if vocab is None:\n        raise InvalidInputError(\n", "    if False:\n        raise InvalidInputError(\n"),),
        ("tests/test_generate.py",), "no_language_model"),
    Mutation(
        "other_weights_loaded_silently", "weights loaded into a lossy conversion keep the constants folded from the old ones without a word",
        (("ttt2la/conversion.py", "            if layer.state.folded_weights is not None:\n                watch(", "            if False:\n                watch("),),
        ("tests/test_folded_weights.py",), "warns_naming"),
    Mutation(
        "measured_folds_taken_for_replayed", "the folds a conversion measured are taken for replayed ones (the context adds them to the replay dict), so loading other weights is never watched",
        (("ttt2la/conversion.py", "        state.folded_weights = FoldedWeights.of(module, rl.path, prepared.results, given)", "        state.folded_weights = FoldedWeights.of(module, rl.path, prepared.results, replay)"),),
        ("tests/test_folded_weights.py",), "warns_naming"),
    Mutation(
        "replayed_folds_watched", "loading weights into a conversion whose folds were replayed knowingly (`folds=`, a converted checkpoint read back) warns",
        (("ttt2la/folded_weights.py", "        measured = tuple(r.name for r in results if r.folded and r.name not in replayed)", "        measured = tuple(r.name for r in results if r.folded)"),),
        ("tests/test_folded_weights.py",), "quiet or nothing_is_lost"),
    Mutation(
        "stream_deepcopy_raw", "`copy.deepcopy` of a stream whose pieces recorded gradients escapes as torch's raw RuntimeError",
        (("ttt2la/stream.py", '    def __deepcopy__(self, memo) -> "Stream":', '    def _deepcopy(self, memo) -> "Stream":'),),
        ("tests/test_stream.py",), "branches"),
    Mutation(
        "forks_share_their_states", "a forked stream shares its states' dict with the stream it forked from, so each branch's piece moves the other",
        (("ttt2la/stream.py", "        other.states, other._runs = dict(self.states), {}", "        other.states, other._runs = self.states, {}"),),
        ("tests/test_stream.py",), "branches"),
    Mutation(
        "stream_hooks_in_the_recast", "a layer cast after conversion is converted again with its call hooks, a stream's among them, which pass `ttt_state` to the code as written",
        (("ttt2la/recast.py", "            stand_in.__dict__[hooks] = type(module.__dict__[hooks])()", "            pass"),),
        ("tests/test_recast.py",), "stream_as_the_first"),
    Mutation(
        "replayed_loop_uncompared", "a converted checkpoint whose recipe was edited to build another loop (another chunk size) loads as the checkpoint",
        (("ttt2la/checkpoint/manifest.py", '    out = {name.replace("_", " "): layer.get(name) for name in _LAYER_FIELDS}', '    out = {}'),),
        ("tests/test_checkpoint.py",), "builds_another_loop"),
    Mutation(
        "manifest_level_unchecked", "a manifest's level outside 0 to 6 is refused by `convert` without naming the manifest",
        (("ttt2la/checkpoint/manifest.py", "        if not 0 <= self.level <= MAX_LEVEL:", "        if False:"),),
        ("tests/test_checkpoint.py",), "malformed_manifest"),
    Mutation(
        "caller_schedule_probed_in_the_layer", "a layer its caller hands a schedule of token offsets is converted alone, probed at other lengths with the example's schedule",
        (("ttt2la/frontend/discover.py", "    found = _to_callers(_busiest_loops(", "    found = (lambda f, *a: f)(_busiest_loops("),),
        ("tests/test_caller_schedules.py",), "every_length"),
    Mutation(
        "unconvertible_caller_refused", "where the caller that computes a layer's schedule cannot be converted, the conversion is refused instead of converting the layer it calls",
        (("ttt2la/conversion.py", "    return recognize_layer(cand.callee, seq_len)", "    raise UnsupportedTTTError(cand.path)"),),
        ("tests/test_caller_schedules.py",), "cannot_be_converted"),
    Mutation(
        "argument_writes_unrefused", "a layer whose forward writes into the objects it is called with (a decoding cache, a list of losses) converts, and the converted layer loses the write",
        (("ttt2la/frontend/recognize.py", "    if cand.argument_writes:\n", "    if False:\n"),),
        ("tests/test_side_effects.py",), "arguments"),
    Mutation(
        "stream_mixing_unchecked", "a stream over a model that mixes tokens outside its converted layers (attention beside the TTT layer) returns other outputs than the whole sequence without a word",
        (("ttt2la/stream.py", "        if not err <= max(1e-3, 2 * TOLERANCE.get(want.dtype, 1e-5)):", "        if False:"),),
        ("tests/test_stream.py",), "mixed_outside"),
    Mutation(
        "subtracted_increment_unread", "remove_muon reads only `W + Δ`: Newton–Schulz or a normalisation on an increment subtracted (`W − η·NS(m)`, `w − g/(‖g‖+1)`) stays, and the step is called already satisfied",
        (("ttt2la/passes/remove_muon.py", '    if not isinstance(w_out, torch.fx.Node) or op_name(w_out) not in ("add", "sub") \\\n', '    if not isinstance(w_out, torch.fx.Node) or op_name(w_out) not in ("add",) \\\n'),),
        ("tests/test_passes_lossy.py",), "subtracted"),
    Mutation(
        "constant_taken_for_a_weight", "a constant added to a value of the inputs (`torch.eye(C) + a`) is taken for a single step's weight, and a chunked layer the loop reader refused converts as one step over the example's tokens",
        (("ttt2la/frontend/single_step.py", "                    and len(_shape(n) or ()) >= 2 and w in from_weights:", "                    and len(_shape(n) or ()) >= 2:"),),
        ("tests/test_scan_style.py",), "chosen_over_a_longer"),
    Mutation(
        "rate_from_tokens_called_satisfied", "absorb_lr calls a rate the loop body computes from the tokens and a parameter named as a rate (TTT-Linear's σ(x·w + b)) already satisfied",
        (("ttt2la/passes/absorb_lr.py", "            from_tokens = rates_computed_from_tokens(program)\n", "            from_tokens = []\n"),),
        ("tests/test_scan_eta.py",), "keeps_the_rate"),
    Mutation(
        "kept_layer_called_converted", "the summary says a layer kept as written (not reducible at the level, strict=False) was converted exactly",
        (("ttt2la/report.py", "        if kept == n:\n", "        if False:\n"),),
        ("tests/test_report.py",), "kept_as_written"),
    Mutation(
        "different_iterations_unlocated", "iterations that run other ops are refused as data-dependent control flow, naming no op",
        (("ttt2la/frontend/rollup.py", '        raise _fail(f"iterations 1 and 2 run different ops ({_first_difference(I1, I2, depth)}): "', '        raise _fail(f"iterations 1 and 2 run different ops (somewhere): "'),),
        ("tests/test_refusal_messages.py",), "first_op_that_differs"),
    Mutation(
        "stream_pieces_kept_by_reference", "the stream's check keeps the pieces' tensors by reference, so a caller decoding into one buffer makes the check compare the wrong tokens and refuse",
        (("ttt2la/stream.py", "        self.pieces.append((*_kept((args, kwargs, y)), same))", "        self.pieces.append((args, kwargs, y, same))"),),
        ("tests/test_stream.py",), "alike_and_a_reused"),
    Mutation(
        "constant_inputs_joined", "the stream's check joins a tensor every piece passes alike (a style vector) along the tokens, and the whole call fails with a raw error",
        (("ttt2la/stream.py", "        if tensors and len(set(idents)) == 1 and all(", "        if False and all("),),
        ("tests/test_stream.py",), "alike_and_a_reused"),
    Mutation(
        "last_logits_unchecked", "the stream's check is skipped where the model returns the last token's logits, and mixing outside the converted layers goes unsaid",
        (("ttt2la/stream.py", "    if got.shape == want.shape:\n        return got, want\n", "    if False:\n        return got, want\n"),),
        ("tests/test_stream.py",), "last_tokens_logits"),
    Mutation(
        "slots_unwalked", "an argument object with `__slots__` is not looked into, so a layer writing into it converts and loses the write",
        (("ttt2la/frontend/argument_writes.py", "        for name in (slots,) if isinstance(slots, str) else slots:", "        for name in ():"),),
        ("tests/test_side_effects.py",), "arguments"),
    Mutation(
        "meta_load_fingerprinted", "loading into a lossy conversion on the meta device fingerprints tensors that hold no values, and a raw RuntimeError escapes load_state_dict",
        (("ttt2la/folded_weights.py", "    if folded is None or any(t.is_meta for t in params_and_buffers(module).values()):", "    if folded is None:"),),
        ("tests/test_folded_weights.py",), "meta"),
    Mutation(
        'measurement_of_another_type_rendered', "a report's pass drift holding text where a measurement belongs is rendered as measured, not refused",
        (('ttt2la/report.py', '            _measurements(p.drift, f"{where}: passes[{i}]", "drift")\n', '            pass\n'),),
        ('tests/test_report.py',), 'measurement_or_level'),
    Mutation(
        'report_level_unbounded', 'a report read from a file may say it was converted at level -1 or 10**20',
        (('ttt2la/report.py', '        if _typed(d, "level", int, cls.kind, 0) not in LEVELS:\n', '        if False:\n'),),
        ('tests/test_report.py',), 'measurement_or_level'),
    Mutation(
        'usage_block_on_bad_command_line', "a command-line usage error prints argparse's usage block before its line",
        (('ttt2la/cli.py', '    parser = _OneLineParser(\n', '    parser = argparse.ArgumentParser(\n'),),
        ('tests/test_cli.py',), 'bad_command'),
    Mutation(
        'model_kept_as_written_not_named', 'a stream over a model that is itself a layer kept as written asks to convert the converted model',
        (('ttt2la/stream.py', '                if layer.module_path not in self.layers]\n', '                if layer.module_path not in self.layers and layer.module_path != ""]\n'),),
        ('tests/test_stream.py',), 'kept_as_written'),
    Mutation(
        'altered_open_chunk_read', 'a ttt_state whose open chunk or token counts were altered by hand is run, failing deep in the plan or read as another state',
        (('ttt2la/stream.py', '    _check_open(state, program, invariants, axes, where)\n', '    pass\n'),),
        ('tests/test_stream.py',), 'altered'),
    Mutation(
        'altered_values_read', 'a ttt_state whose values were replaced (None, dropped, on the meta device) is run, failing deep in the plan',
        (('ttt2la/stream.py', '    _check_tensors("values", state.values, states0, where)\n', '    pass\n'),),
        ('tests/test_stream.py',), 'altered'),
    Mutation(
        'calibration_unchecked', 'calibration inputs with an empty axis reach the resizing to the traced batch (a ZeroDivisionError)',
        (('ttt2la/conversion.py', '        check_finite(calibration, None, "calibration")\n', '        pass\n'),),
        ('tests/test_cli_inputs.py',), 'calibration_inputs_with_an_empty_axis'),
    Mutation(
        'sparse_example_read', 'a sparse example tensor reaches the finiteness check, a raw NotImplementedError',
        (('ttt2la/validation.py', '        if leaf.layout != torch.strided:\n', '        if False:\n'),),
        ('tests/test_cli_inputs.py',), 'sparse'),
    Mutation(
        'torchscript_model_traced', 'a TorchScript model is run as if Python and its failure blamed on the example inputs',
        (('ttt2la/validation.py', '    if isinstance(model, torch.jit.ScriptModule):\n', '    if False:\n'),),
        ('tests/test_cli_inputs.py',), 'torchscript'),
    Mutation(
        'keywords_only_given_made_up_ids', 'a keyword-only forward given example_kwargs alone is asked for example_inputs it cannot take',
        (('ttt2la/conversion.py', '    if example_inputs is None and example_kwargs and first_embedding(model) is None:\n', '    if False:\n'),),
        ('tests/test_cli_inputs.py',), 'keywords_only'),
    Mutation(
        'return_state_truthy', "return_ttt_state='yes' is taken as True",
        (('ttt2la/converted.py', '        check_flag(return_ttt_state, "return_ttt_state")\n', '        pass\n'),),
        ('tests/test_stream.py',), 'switch'),
    Mutation(
        'unknown_compiler_benched', 'bench --compile with a backend torch.compile does not know times every row and exits 0',
        (('ttt2la/cli.py', '                   type=_compile_backend,\n                   help="also time the original', '                   help="also time the original'),),
        ('tests/test_cli.py',), 'bad_command'),
    Mutation(
        'root_layer_path_quoted_bare', "folds naming no layer of a model that is its own layer list the layers as ''",
        (('ttt2la/conversion.py', "{', '.join(repr(p) if p else repr(p) + ' (the model itself)' for p in paths)}", "{', '.join(map(repr, paths))}"),),
        ('tests/test_cli_inputs.py',), 'its_layer_name_its_empty_path'),
    Mutation(
        'overflow_called_a_bug', "example inputs whose products overflow fp32 fail the plan's check and are reported as a bug in the lowering",
        (('ttt2la/conversion.py', '        overflow = _overflowing(invariants)\n', '        overflow = ""\n'),),
        ('tests/test_cli_inputs.py',), 'overflow'),
    Mutation(
        'replay_rules_uncompared', "load compares the replayed conversion's states by role only, so a model built with another update rule (Muon on where it was off) loads silently",
        (('ttt2la/checkpoint/manifest.py', '_STATE_FIELDS = ("role", "update_rule", "dependence")', '_STATE_FIELDS = ("role",)'),),
        ('tests/test_checkpoint_contract.py',), 'another_update_rule or recorded_config_building'),
    Mutation(
        'save_unverified', 'save writes a checkpoint without reading it back, so one load cannot rebuild (inputs the model fails on, a config of another function) is written',
        (('ttt2la/checkpoint/__init__.py', '            verify(tmp)', '            pass'),),
        ('tests/test_checkpoint_contract.py',), 'fails_on or config_building_another or replay_fails'),
    Mutation(
        'save_outputs_uncompared', "save's read-back does not compare the reloaded model's outputs with the saved model's",
        (('ttt2la/checkpoint/__init__.py', '    if bad or len(leaves[0]) != len(leaves[1]):', '    if False:'),),
        ('tests/test_checkpoint_contract.py',), 'compares_the_reloaded'),
    Mutation(
        'checkpoint_path_unchecked', 'save or load given a directory that is no path (None, a number) raises a raw TypeError',
        (('ttt2la/checkpoint/arguments.py', '    if not isinstance(value, (str, os.PathLike)):', '    if False:'),),
        ('tests/test_checkpoint_contract.py',), 'dir-None or dir-int or load_refuses_arguments'),
    Mutation(
        'factory_uncallable_recorded', 'save records a factory that is neither a name nor a callable, and raises a raw error',
        (('ttt2la/checkpoint/arguments.py', '    if not callable(factory):', '    if False:'),),
        ('tests/test_checkpoint_contract.py',), 'factory-int'),
    Mutation(
        'deep_manifest_raw', 'a manifest nested too deeply raises a raw RecursionError',
        (('ttt2la/checkpoint/errors.py', '    except RecursionError as e:', '    except ZeroDivisionError as e:'),),
        ('tests/test_checkpoint_contract.py',), 'deeply_nested_manifest'),
    Mutation(
        'deep_report_traceback', 'ttt2la report on a deeply nested JSON file prints a traceback',
        (('ttt2la/cli.py', '    except (ValueError, RecursionError) as e:', '    except ValueError as e:'),),
        ('tests/test_checkpoint_contract.py',), 'cli_report_refuses_a_deeply'),
    Mutation(
        'missing_weights_file_raw', 'a manifest naming a weights file that is not there raises a raw FileNotFoundError',
        (('ttt2la/checkpoint/__init__.py', '    for name in [*manifest.files, manifest.weights["file"]]:', '    for name in manifest.files:'),),
        ('tests/test_checkpoint_contract.py',), 'missing_weights_file'),
    Mutation(
        'other_bytes_called_a_pickle', 'a .pt file that is neither a zip nor a pickle is called a pickle that would run code',
        (('ttt2la/checkpoint/weights.py', '        if _not_a_pickle(e):', '        if False:'),),
        ('tests/test_checkpoint_contract.py',), 'pt_file_of_other_bytes'),
    Mutation(
        'manifest_versions_untyped', "a manifest's ttt2la_version or torch_version of any type is accepted",
        (('ttt2la/checkpoint/manifest.py', 'types = {"ttt2la_version": str, "torch_version": str,', 'types = {'),),
        ('tests/test_checkpoint_contract.py',), 'manifest_fields'),
    Mutation(
        'example_file_spec_untyped', "a manifest's example-input file entry without a text file name or hash is accepted",
        (('ttt2la/checkpoint/manifest.py', '        if kind == "file":', '        if False:'),),
        ('tests/test_checkpoint_contract.py',), 'manifest_fields'),
    Mutation(
        'whole_sequence_divisor_unchecked', "a whole-sequence plan runs a partial last chunk with the divisor the trace read from a whole chunk",
        (('ttt2la/lowering/lift.py', '        if layout.partial and prog.partial_chunk:', '        if False:'),),
        ('tests/test_padded_chunk.py',), 'divisor_read_from_the_chunk'),
    Mutation(
        'output_fed_back_called_stored_states', "a loop carrying its output into the next chunk is told to collect its outputs, which it does",
        (('ttt2la/frontend/rollup.py', '        if fed_back:', '        if False:'),),
        ('tests/test_refusal_messages.py',), 'output_fed'),
    Mutation(
        'peeled_piece_unplaced', "a last piece joined as the loop's last chunk is refused without its line",
        (('ttt2la/frontend/rollup.py', 'f"code after the loop computes a last output ({_where(y_tail)}) that is not the "', '"code after the loop computes a last output that is not the "'),),
        ('tests/test_refusal_messages.py',), 'last_piece'),
    Mutation(
        'unfold_traced_opaque', "windows that do not overlap (unfold(1, C, C)) traced as one op, not as the reshape and move they are",
        (('ttt2la/frontend/decompositions.py', '    aten.unfold.default: unfold,', ''),),
        ('tests/test_chunks_made_before_the_loop.py',), 'unfold'),
    Mutation(
        'unfold_chunks_undiscovered', "chunks made by unfold(1, C, C) are not known as chunks when the layer first runs",
        (('ttt2la/frontend/prechunked.py', '        if name == "unfold":', '        if False:'),),
        ('tests/test_chunks_made_before_the_loop.py',), 'unfold'),
    Mutation(
        'zero_gate_refused_on_the_delta_rule', "a call whose gate underflows to zero fails on the delta-rule op instead of running the generic plan",
        (('ttt2la/lowering/lift_delta_rule.py', '        except NonPositiveDecay:    # the generic plan of the same program takes any decay', '        except ZeroDivisionError:'),),
        ('tests/test_delta_lowering.py',), 'underflows'),
    Mutation(
        'zero_gate_fallback_unnamed', "the report names the delta-rule op for a call that ran the generic plan",
        (('ttt2la/lowering/lift_delta_rule.py', '        if self.decay_fallback:\n', '        if False:\n'),),
        ('tests/test_delta_lowering.py',), 'underflows'),
    Mutation(
        'bumped_global_called_lossy', "a global counter the forward bumps is refused as a lossy conversion's changed attribute, to be converted again",
        (('ttt2la/conversion.py', '        except ChangedAttributeError as e:  # only the layer\'s own forward ran meanwhile', '        except ZeroDivisionError as e:'),),
        ('tests/test_side_effects.py',), 'counter'),
    Mutation(
        'bumped_global_unplaced', "the write of a global or class counter is refused without its line",
        (('ttt2la/side_effects.py', '            if any(_rooted_at(t, parts) for t in targets):', '            if False:'),),
        ('tests/test_side_effects.py',), 'counter'),
    Mutation(
        'failed_call_recorded_as_run', "a call the code as written fails on too is recorded in the report's runs as run as written",
        (('ttt2la/converted.py', '        out = self._as_written(written, why)    # a call the code fails on too ran nothing\n        self.runs[f"batch {self._batch(B)}, length {L}, {case}"] = f"as written: {note}"\n', '        self.runs[f"batch {self._batch(B)}, length {L}, {case}"] = f"as written: {note}"\n        out = self._as_written(written, why)\n'),),
        ('tests/test_input_types.py',), 'cast_as_the_weights'),
    Mutation(
        'cli_out_unverified', "ttt2la convert --out writes a checkpoint without reading it back as load will",
        (('ttt2la/cli.py', '                             verify=lambda tmp: check_reads_back(', '                             verify=lambda tmp: None and check_reads_back('),),
        ('tests/test_cli_inputs.py',), 'out_is_read_back'),
    Mutation(
        'race_runs_unreported', "calls that ran the user's code while the race runs are missing from the report's runs",
        (('ttt2la/as_written.py', '        elif side == WRITTEN:               # the report says what ran while the race runs', '        elif False:'),),
        ('tests/test_as_written.py',), 'every_call_is_the_sources'),
    Mutation(
        'later_run_hides_earlier', "a call on another path replaces the report's record of the calls before it at that batch",
        (('ttt2la/converted.py', '        runs[key] = before + SOME_CALLS + what', '        runs[key] = what'),),
        ('tests/test_delta_lowering.py',), 'underflows_to_zero'),
    Mutation(
        'attention_in_loop_fused', "softmax attention inside a loop body is traced as the fused CPU kernel, which vmap runs chunk by chunk",
        (('ttt2la/frontend/decompositions.py', '    aten._scaled_dot_product_flash_attention_for_cpu.default: _attention_in_loop_body,', ''),),
        ('tests/test_frontend_styles.py',), 'softmax_attention_inside'),
    Mutation(
        'manifest_source_untyped', "a manifest's record of its source weights is read without checking its entries' types",
        (('ttt2la/checkpoint/manifest.py', '        _check_entries(self.source, "source", _SOURCE_ENTRIES, where, required=False)', ''),),
        ('tests/test_checkpoint_contract.py',), 'wrong_type'),
    Mutation(
        'integer_weights_loaded', "a checkpoint's integer tensors load into float weights, truncated",
        (('ttt2la/checkpoint/weights.py', '             for n, t in full.items() if _kind(t.dtype) != _kind(expected[n].dtype)]', '             for n, t in full.items() if False]'),),
        ('tests/test_cli_inputs.py',), 'kind_of_number'),
    Mutation(
        'stepped_caller_kept', "a model looping over its TTT blocks is converted as one step holding them, beside the blocks",
        (('ttt2la/conversion.py', '        if inner and layer.program.single_step:', '        if False:'),),
        ('tests/test_single_step.py',), 'looping_over_its_blocks'),
    Mutation(
        'later_calls_forgotten', "discovery keeps a layer's first call only, so the model's own later call made otherwise is refused",
        (('ttt2la/frontend/discover.py', '                c.other_calls = hooks.later.get(c.path, [])', '                c.other_calls = []'),),
        ('tests/test_call_errors.py',), 'otherwise_again'),
    Mutation(
        'lossy_other_calls_installed', "a lossy conversion of a layer the example run calls otherwise again is returned, to fail on its own example",
        (('ttt2la/conversion.py', '    _refuse_lossy_other_calls(built)\n', ''),),
        ('tests/test_call_errors.py',), 'otherwise_again'),
    Mutation(
        'linear_memory_no_final_layer', "freeze_theta says no final layer was found where the roles find the memory's weights final",
        (('ttt2la/passes/freeze_theta.py', '            finals = program.states_with_role("final")', '            finals = []'),),
        ('tests/test_titans.py',), 'lossy_steps_say'),
    Mutation(
        'scalar_rate_called_per_feature', "a rate of one value per token is said to hold a value per token and feature",
        (('ttt2la/passes/absorb_lr.py', '    wide = [n for n in named if _has_features(*shapes[n])]', '    wide = list(named)'),),
        ('tests/test_titans.py',), 'lossy_steps_say'),
    Mutation(
        'scanned_momentum_called_absent', "a momentum carried between updates, not as a*M + G, is reported as no momentum",
        (('ttt2la/passes/remove_momentum.py', '            if carried:\n                return self.result("not_applicable", _carried_reason(program, carried))\n', ''),),
        ('tests/test_titans.py',), 'lossy_steps_say'),
    Mutation(
        'stream_named_without_line', "a step leaving a stream like a rate names it by the tracer's name alone, with no line",
        (('ttt2la/passes/absorb_lr.py', '                                   f"stream(s) {_read_at(program, left)} look like learning "', '                                   f"stream(s) {\', \'.join(program.streams[i].name for i in left)} look like learning "'),),
        ('tests/test_scan_style.py',), 'absorb_lr_leaves'),
    Mutation(
        'nested_check_as_repr', "a nested check in the Markdown report prints as a Python dict",
        (('ttt2la/report.py', '    if isinstance(v, dict):                  # a nested measurement: the lowering\'s judgment\n        return f"({_format_mapping(v)})"\n', ''),),
        ('tests/test_report.py',), 'nested_check'),
    Mutation(
        'unread_op_unnamed', "a tensor computed after the cut is refused without the op where reading its mini-batches stopped",
        (('ttt2la/frontend/chunked_computations.py', '            sel.meta[UNREAD] = str(e)       # the op the refusal names, where the reading stopped\n', ''),),
        ('tests/test_scan_eta.py',), 'no_identity_covers'),
    Mutation(
        'one_term_prefix_scanned', "a prefix sum of one term runs the blocked scan's products",
        (('ttt2la/runtime/scan.py', '    if f.shape[dim] == 1:       # one term', '    if False:       # one term'),),
        ('tests/test_runtime_scan.py',), 'one_term'),
    Mutation(
        'one_chunk_vmapped', "a call of one chunk batches its body with vmap over an axis of one",
        (('ttt2la/lowering/executors.py', '    if n_chunks == 1:       # one chunk', '    if False:       # one chunk'),),
        ('tests/test_executors.py',), 'one_chunk_runs'),
    Mutation(
        'values_hold_themselves', "a call's values hold a reference to themselves, freed by the cycle collector only",
        (('ttt2la/lowering/executors.py', '        self._deferred, self._compute = set(deferred), compute\n', '        self._deferred, self._compute, self._me = set(deferred), compute, self\n'),),
        ('tests/test_executors.py',), 'reference_cycle'),
    Mutation(
        'other_values_refused_at_exact', "an exact conversion refuses a plain argument of another value than the example's",
        (('ttt2la/converted.py', '            if other_values:\n                return ("other values", other_values), 0, 0, None\n', ''),),
        ('tests/test_call_errors.py',), 'never_taken_for_another'),
    Mutation(
        'default_value_refused_at_exact', "an exact conversion refuses a plain argument the example left at its default, given another value",
        (('ttt2la/converted.py', '            if state.as_written is None or ttt_state is not None or return_ttt_state:\n', '            if True:\n'),),
        ('tests/test_call_errors.py',), 'left_out_is_checked_by_name'),
    Mutation(
        'lossy_default_value_run_as_written', "a lossy conversion runs the code as written for a plain argument given another value than its default",
        (('ttt2la/converted.py', '            if state.as_written is None or ttt_state is not None or return_ttt_state:\n', '            if ttt_state is not None or return_ttt_state:\n'),),
        ('tests/test_call_errors.py',), 'built_in_python_value'),
    Mutation(
        'transformed_calls_captured', "a module called inside vmap(grad(...)) records the transform's wrapped inputs as its own",
        (('ttt2la/frontend/discover.py', '        if self.stack and torch._C._functorch.peek_interpreter_stack() is not None:\n', '        if False:\n'),),
        ('tests/test_single_step.py',), 'vmap_is_part'),
    Mutation(
        'internal_failure_raw', "a failure inside ttt2la while reading a candidate escapes as a raw exception",
        (('ttt2la/conversion.py', "            except Exception as e:          # a failure of ttt2la's own, not the layer's\n", '            except NotImplementedError as e:\n'),),
        ('tests/test_single_step.py',), 'failure_of_ttt2la'),
    Mutation(
        'mixed_token_reads_refused', "a loop reading tokens as x[t] beside slices of one token x[:, t:t+1] is refused as mixing per-token and per-chunk streams",
        (('ttt2la/lowering/chunking.py', '    if per_token and c != 1 and not all(', '    if per_token and not all('),),
        ('tests/test_frontend_styles.py',), 'tokens_and_slices'),
    Mutation(
        'remade_views_left', "views made again in every iteration after an in-place write are left in the loop",
        (('ttt2la/frontend/recognize.py', '        hoist_remade_views(gm, cand.loop)           # views of a tensor written in place\n', '        pass\n'),),
        ('tests/test_slice_assignments.py',), 'written_in_place'),
    Mutation(
        'remade_views_not_merged', "the copies of a view made again in every iteration are not read as one value",
        (('ttt2la/frontend/remade_views.py', '        if copies[key] < 2:\n', '        if True:\n'),),
        ('tests/test_slice_assignments.py',), 'written_in_place'),
    Mutation(
        'image_channels_as_length', "an image's channels, on its axis 1, are taken for the sequence length of the layers of a model taking images",
        (('ttt2la/conversion.py', '    return None if x is None or x.dim() >= 4 else x.shape[1]\n', '    return None if x is None else x.shape[1]\n'),),
        ('tests/test_single_step.py',), 'backbone_taking_images'),
    Mutation(
        'layer_length_unread', "a layer of a model whose input has no sequence is left with no length, its own input's axis 1 unread",
        (('ttt2la/conversion.py', '                layers.append(_recognized(cand, _own_input_length(cand, _seq_len(inputs))))\n', '                layers.append(_recognized(cand, _seq_len(inputs)))\n'),),
        ('tests/test_single_step.py',), 'backbone_taking_images'),
    Mutation(
        'single_step_other_batch_refused', "a single step whose code runs at its example's batch size only is refused",
        (('ttt2la/frontend/single_step.py', '    except OtherBatch as e:     # the example\'s batch runs, another fails: that batch only\n        if fixed:\n', '    except OtherBatch as e:     # the example\'s batch runs, another fails: that batch only\n        if True:\n'),),
        ('tests/test_probe_shapes.py',), 'single_step_taking'),
    Mutation(
        'lower_level_advice_bare', "collapse_mlp's refusal sends the layer to a lower level without saying what a layer not reducible there does",
        (('ttt2la/passes/collapse_mlp.py', '          "reducible there converts with strict=False, on the recurrent schedule).")\n', '          "reducible there).")\n'),),
        ('tests/test_scan_style.py',), 'says_what_lower'),
    Mutation(
        'untraced_batch_refused_at_exact', "an exact conversion refuses a call at a batch size its probes could not trace, where the code as written runs",
        (('ttt2la/frontend/recognize.py', '            return f"batch size {B}, where the layer was traced at {accepted}: {self.why}"\n', '            return ""\n'),),
        ('tests/test_probe_shapes.py',), 'runs_as_written_where'),
    Mutation(
        'split_items_left', "the items of a split made again after an in-place write are left in the loop",
        (('ttt2la/frontend/remade_views.py', '        part = n.target is operator.getitem and n.args[0] in keys     # one piece of a split\n', '        part = False\n'),),
        ('tests/test_slice_assignments.py',), 'split_written'),
    Mutation(
        'sized_graph_sizes_lazy', 'the sizes of a graph sized per (batch, length) built from a generator, which TorchDynamo cannot rebuild',
        (('ttt2la/frontend/sized_graph.py', 'Sizes([e(B, L) for e in self.exprs])', 'Sizes(e(B, L) for e in self.exprs)'),),
        ('tests/test_ordinary_module.py',), 'plain_float'),
    Mutation(
        'mini_batch_items_cut_to_length', "a loop's outputs of one item per mini-batch are cut to the length in tokens",
        (('ttt2la/lowering/chunking.py', '    return joined if spec.items else joined.narrow(axis, 0, layout.length)\n', '    return joined.narrow(axis, 0, layout.length)\n'),),
        ('tests/test_chunks_made_before_the_loop.py',), 'mini_batch_first'),
    Mutation(
        'example_plan_fault_called_lossy', "a plan failing on the example inputs is refused as a lossy conversion's uncovered shape",
        (('ttt2la/conversion.py', '        if why is None:\n            raise\n        raise _ExampleFault(', '        if why is None or True:\n            raise\n        raise _ExampleFault('),),
        ('tests/test_chunks_made_before_the_loop.py',), 'fault_of'),
    Mutation(
        'chunk_count_sizes_unfitted', 'a size that moves by a count of chunks between whole-chunk lengths is not fitted as one',
        (('ttt2la/frontend/shapes.py', '    if rc and not rb and chunk and (L1 - L0) % chunk == 0:', '    if False and rc and not rb and chunk and (L1 - L0) % chunk == 0:'),),
        ('tests/test_whole_chunk_counts.py',), 'whole_chunk or same_function'),
    Mutation(
        'chunk_counts_unchecked', 'sizes fitted as counts of chunks from two lengths are checked at no other',
        (('ttt2la/frontend/shapes.py', '    if whole_chunks is not None and any(e.n for e in slots.values()):', '    if False and whole_chunks is not None and any(e.n for e in slots.values()):'),),
        ('tests/test_whole_chunk_counts.py',), 'moves_with_the_chunks'),
    Mutation(
        'chunk_counts_checked_near_only', 'sizes fitted as counts of chunks are checked one chunk further only',
        (('ttt2la/frontend/shapes.py', '        for L2 in (2 * L1 - L0, L0 + 7 * (L1 - L0)):', '        for L2 in (2 * L1 - L0,):'),),
        ('tests/test_whole_chunk_counts.py',), 'moves_with_the_chunks'),
    Mutation(
        'conversion_failure_called_the_codes', "where the layer's code runs but the conversion fails, the refusal says the code fails at every shape",
        (('ttt2la/frontend/recognize.py', "    if ours is not None:    # the code runs there: the failure is the conversion's", "    if False:    # the code runs there: the failure is the conversion's"),),
        ('tests/test_whole_chunk_counts.py',), 'moves_with_the_chunks'),
    Mutation(
        'module_held_twice_set_twice', "a module held twice has its weights set through both names, which torch's restore leaves traced",
        (('ttt2la/frontend/recognize.py', '            if t is None or (id(m), attr) in seen or id(t) not in canonical:', '            if t is None or id(t) not in canonical:'),),
        ('tests/test_shared_layers.py',), 'held_twice'),

    Mutation(
        'forward_signature_bare', "a converted forward shows its own (*args, **kwargs) signature, not the original's",
        (('ttt2la/converted.py', '                   {"forward": forward_like(cls, _converted_forward),', '                   {"forward": _converted_forward,'),),
        ('tests/test_ordinary_module.py',), 'signature or dynamic_length'),
    Mutation(
        'traced_float_formatted', "a call's other float is formatted as TorchDynamo traces it",
        (('ttt2la/frontend/call_signature.py', '                return f"{leaf.name} = {_concrete(x)!r}, where it was converted with " \\', '                return f"{leaf.name} = {x!r}, where it was converted with " \\'),),
        ('tests/test_ordinary_module.py',), 'fullgraph_with_another'),
    Mutation(
        'repeat_unread', 'a repeat of a unit axis after the cut is no op whose mini-batches are read',
        (('ttt2la/frontend/chunked_computations.py', '    if target is aten.repeat.default:', '    if False:'),),
        ('tests/test_scan_eta.py',), 'einsum'),
    Mutation(
        'einsum_rows_unit_axes_kept', 'rows mapped by one matrix are not read through the unit axes einsum lays around the contracted one',
        (('ttt2la/frontend/chunked_computations.py', '    rows = _without_trailing_units(_shape(a))     # einsum', '    rows = _shape(a)     # einsum'),),
        ('tests/test_scan_eta.py',), 'einsum'),
    Mutation(
        'reshape_keeping_the_axis_unread', 'a reshape that keeps the mini-batch axis whole is not read through',
        (('ttt2la/frontend/chunked_computations.py', '    dj = _kept_axis(_shape(source), shape, d) if isinstance(source, torch.fx.Node) else None', '    dj = None'),),
        ('tests/test_scan_eta.py',), 'einsum'),
    Mutation(
        'items_told_by_chunk_extent', "a loop's joined items are taken for tokens, cut back to the length where a chunk's items are as many as its tokens",
        (('ttt2la/frontend/rollup.py', '    if len(lengths) != 1 or joined in lengths:\n        return False\n', '    return False\n'),),
        ('tests/test_chunk_items.py',), 'two'),
    Mutation(
        'padding_probe_narrows_items', "the padding probe cuts a chunk's items to the partial chunk's tokens",
        (('ttt2la/lowering/executors.py', '                targets.append((f"the chunk output {spec.name}", y if spec.items', '                targets.append((f"the chunk output {spec.name}", y if False'),),
        ('tests/test_chunk_items.py',), 'leaves_alone'),
    Mutation(
        'partial_example_refused_when_exact', "an exact conversion whose example's partial chunk the plan refuses is refused",
        (('ttt2la/conversion.py', '        if not layer.exact:\n            raise\n        check = _padded_example(layer, ref, e.what)', '        if True:\n            raise\n        check = _padded_example(layer, ref, e.what)'),),
        ('tests/test_chunk_items.py',), 'True'),
    Mutation(
        'padded_example_unchecked', 'an example whose partial chunk zero padding changes fails the check as a bug',
        (('ttt2la/conversion.py', '        check = _example_branch(layer, ref) or _padded_example(layer, ref) or check', '        check = _example_branch(layer, ref) or check'),),
        ('tests/test_chunk_items.py',), 'max'),
    Mutation(
        'plan_checked_on_the_partial_example', "the plan is checked on the example's partial chunk, which runs as written",
        (('ttt2la/conversion.py', '    if state.program.partial_chunk and L % C:   # a partial chunk, which runs as written', '    if False:   # a partial chunk, which runs as written'),),
        ('tests/test_chunk_items.py',), 'max'),
    Mutation(
        'own_ttt_state_clash_unsaid', "a layer's own ttt_state argument passed by keyword is refused as a wrong streaming state, the clash unsaid",
        (('ttt2la/converted.py', '            own = "ttt_state" in _parameters(original.forward)', '            own = False'),),
        ('tests/test_ordinary_module.py',), 'own_ttt_state'),
    Mutation(
        'code_padded_tokens_taken_for_items', 'tokens of chunks the code pads itself, cut back after the loop, are taken for items and the padding probe judges the padded ones',
        (('ttt2la/frontend/rollup.py', '    return not _cut_back_to(tail.collector, tail.axis, *lengths)', '    return True'),),
        ('tests/test_meta_call.py',), 'to_empty_and_the_weights'),
    Mutation(
        'whole_cut_unrecorded', 'the run records no cut whose constant bound takes a whole axis of the sizes',
        (('ttt2la/frontend/size_uses.py', '        if func in _INDEXING and isinstance', '        if False and func in _INDEXING and isinstance'),),
        ('tests/test_whole_axis_cuts.py',), 'past_the_traced and prefix'),
    Mutation(
        'whole_piece_unrecorded', 'one piece of split taking the whole axis is no decision',
        (('ttt2la/frontend/whole_axis_cuts.py', '        return (lambda L, B: count(L, B) == 1) if count(L, B) == 1 else None', '        return None'),),
        ('tests/test_whole_axis_cuts.py',), 'past_the_traced and split'),
    Mutation(
        'ellipsis_axes_shifted', 'the axes after an Ellipsis counted one short',
        (('ttt2la/frontend/whole_axis_cuts.py', '            axis += ndim - consumed', '            axis += ndim - consumed - 1'),),
        ('tests/test_whole_axis_cuts.py',), 'past_the_traced and ellipsis'),
    Mutation(
        'whole_cut_inverted', 'cuts that take part of the axis at the run recorded, whole ones not',
        (('ttt2la/frontend/whole_axis_cuts.py', 'if c != slice(None) and _whole(c, t.shape[axis])]', 'if c != slice(None) and not _whole(c, t.shape[axis])]'),),
        ('tests/test_whole_axis_cuts.py',), 'within_the_traced or prefix'),
    Mutation(
        'sliding_window_unnamed', 'a window over the last tokens refused with the generic words',
        (('ttt2la/frontend/rollup.py', '    return spans if a <= c < b and d > b else None', '    return None'),),
        ('tests/test_refusal_messages.py',), 'sliding_window'),
    Mutation(
        'witness_ignored', "each run's sizes taken as its divisibility guesses them, the other run unread",
        (('ttt2la/frontend/size_witness.py', '        at = guess if other is None or key not in other.seen else \\', '        at = guess if True or key not in other.seen else \\'),),
        ('tests/test_whole_axis_cuts.py',), 'past_the_traced and (memory_tokens or shifted or padded)'),
    Mutation(
        'witness_unsettled', "the first run's sizes never checked against the second's",
        (('ttt2la/frontend/size_witness.py', '            if key in other.seen:\n                self.table[key]', '            if False:\n                self.table[key]'),),
        ('tests/test_whole_axis_cuts.py',), 'settled or line_through'),
    Mutation(
        'witness_line_for_bends', 'a size that bends between the two lengths given the line through them',
        (('ttt2la/frontend/size_witness.py', '    if slope.denominator == 1:', '    if True:'),),
        ('tests/test_whole_axis_cuts.py',), 'line_through'),
    Mutation(
        'calibration_failure_raw', "the outer graph failing at the example's length escapes the calibration",
        (('ttt2la/calibration.py', '        except _GraphFailed as failed:', '        except _Captured as failed:'),),
        ('tests/test_length_branches.py',), 'clamped_size'),
    Mutation(
        'example_fault_called_a_bug', "a plan failing at the example's length, where the code branches, called a bug",
        (('ttt2la/conversion.py', '        check = (_example_branch(layer, ref) if layer.exact and state is not None else None)', '        check = None'),),
        ('tests/test_length_branches.py',), 'clamped_size'),
    Mutation(
        'size_argument_by_position', 'a size argument named by its position in the traced call',
        (('ttt2la/frontend/shapes.py', '        name = f"`{schema.arguments[head].name}`"', '        name = f"#{head}"'),),
        ('tests/test_length_branches.py',), 'size_argument'),
    Mutation(
        'chunk_view_offset_by_token', "each (batch, head)'s chunk view starts a token per chunk in, not a chunk",
        (('ttt2la/runtime/block.py', 'x.storage_offset() + b * sB + chunk * C * sT + h * sH)', 'x.storage_offset() + b * sB + chunk * sT + h * sH)'),),
        ('tests/test_runtime_block.py',), 'edge_lengths'),
    Mutation(
        'state_view_offset_dropped', "every chunk's state view starts at the first state",
        (('ttt2la/runtime/block.py', 'S.storage_offset() + b * sB + h * sH + s * sN)', 'S.storage_offset() + b * sB + h * sH)'),),
        ('tests/test_runtime_block.py',), 'edge_lengths'),
    Mutation(
        'first_read_other_head', "chunk 0's read over the batch takes the first head's initial state for every head",
        (('ttt2la/runtime/block.py', 'torch.bmm(phi_q[:, :head, h], first[:, h], out=o[:, :head, h])', 'torch.bmm(phi_q[:, :head, h], first[:, 0], out=o[:, :head, h])'),),
        ('tests/test_runtime_block.py',), 'edge_lengths'),
    Mutation(
        'whole_cut_in_iterations_dropped', "a whole-axis cut in a generator before the loop dropped as an iteration's decision",
        (('ttt2la/frontend/size_uses.py', '                            iterations=True)', '                            iterations=False)'),),
        ('tests/test_whole_axis_cuts.py',), 'past_the_traced and generator'),
    Mutation(
        'bound_types_unread', 'a NumPy or 0-d tensor bound of a cut read as no number',
        (('ttt2la/frontend/whole_axis_cuts.py', 'slice(*map(as_number, (c.start, c.stop, c.step)))', 'slice(c.start, c.stop, c.step)'),),
        ('tests/test_whole_axis_cuts.py',), 'past_the_traced and (numpy_bound or tensor_bound)'),
    Mutation(
        'batch_reading_kept', "a size read as the batch's kept where the second run shows it moves with the length",
        (('ttt2la/frontend/size_witness.py', '    if guess is not None and _same(guess, L1, L2, B):', '    if False:'),),
        ('tests/test_whole_axis_cuts.py',), 'batch_reading'),
    Mutation(
        'made_tensor_bound_untracked', 'a 0-d tensor made of the length read as the number it held at the run',
        (('ttt2la/frontend/size_uses.py', '        return hit[1] if hit is not None and hit[0]() is bound else number(bound)', '        return number(bound)'),),
        ('tests/test_whole_axis_cuts.py',), 'tensor_made_of_the_length or tensor_bound'),
]


def copy_tree(dest: str) -> None:
    """The parts of the repository the tests need, without caches."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", "*.egg-info")
    for name in COPIED:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, name), ignore=ignore)
        else:
            shutil.copy2(src, os.path.join(dest, name))


def apply(mutation: Mutation, dest: str) -> str | None:
    """Apply every edit in the copy at ``dest``; the first pattern that is stale, or None."""
    for path, old, new in mutation.edits:
        full = os.path.join(dest, path)
        text = open(full, encoding="utf-8").read() if os.path.exists(full) else ""
        count = text.count(old)
        if count != 1:
            return f"{path}: {old!r} matches {count} times"
        with open(full, "w", encoding="utf-8") as f:
            f.write(text.replace(old, new))
    return None


def run_selection(dest: str, files, select: str, timeout: float) -> tuple[str, float, str]:
    """``(outcome, seconds, output tail)`` of the selection run in ``dest``."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *files]
    if select:
        cmd += ["-k", select]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HYPOTHESIS_PROFILE"] = "ci"
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, ""
    seconds = time.monotonic() - start
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-6:])
    outcome = {0: "passed", 1: "failed"}.get(done.returncode, f"error (pytest exit {done.returncode})")
    return outcome, seconds, tail


def check_import(dest: str) -> None:
    """The tests in ``dest`` must import ``dest``'s ttt2la, not an installed one."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import ttt2la; print(ttt2la.__file__)"],
                         cwd=dest, env=env, capture_output=True, text=True, check=True).stdout
    if not os.path.realpath(out.strip()).startswith(os.path.realpath(dest)):
        raise SystemExit(f"the copy in {dest} imports ttt2la from {out.strip()}; cannot probe")


def probe(mutations, *, timeout: float, baseline: bool, verbose: bool):
    rows = []
    baselines: dict[tuple, str] = {}
    for m in mutations:
        key = (m.files, m.select)
        with tempfile.TemporaryDirectory(prefix="ttt2la-mutant-") as dest:
            copy_tree(dest)
            check_import(dest)
            if baseline and key not in baselines:
                outcome, seconds, tail = run_selection(dest, m.files, m.select, timeout)
                baselines[key] = outcome
                print(f"[baseline] {' '.join(m.files)} -k {m.select!r}: {outcome} "
                      f"({seconds:.0f} s)", flush=True)
                if outcome != "passed" and verbose:
                    print(tail, flush=True)
            stale = apply(m, dest)
            if stale is not None:
                rows.append((m, "stale", 0.0, stale))
            elif baseline and baselines[key] != "passed":
                rows.append((m, "baseline", 0.0, f"unmutated selection: {baselines[key]}"))
            else:
                outcome, seconds, tail = run_selection(dest, m.files, m.select, timeout)
                status = {"failed": "caught", "passed": "NOT CAUGHT"}.get(outcome, outcome)
                rows.append((m, status, seconds, tail.splitlines()[-1] if tail else ""))
        m_, status, seconds, note = rows[-1]
        print(f"[{status}] {m.name} ({seconds:.0f} s)" + (f": {note}" if status == "stale" else ""),
              flush=True)
        if verbose and status not in ("caught", "stale"):
            print(note, flush=True)
    return rows


def table(rows) -> str:
    lines = ["| mutation | bug | tests run | result | time |", "|---|---|---|---|---:|"]
    for m, status, seconds, note in rows:
        tests = " ".join(os.path.basename(f) for f in m.files)
        if m.select:
            tests += f" `-k \"{m.select}\"`"
        shown = f"**{status}**" if status != "caught" else status
        if status == "stale":
            shown += f" ({note})"
        lines.append(f"| `{m.name}` | {m.what} | {tests} | {shown} | {seconds:.0f} s |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="run only this mutation (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds allowed per pytest run (default 600)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unmutated run of each selection")
    parser.add_argument("--verbose", action="store_true", help="print pytest's tail when not caught")
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTATIONS}
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:26} {m.what}\n{'':26} {' '.join(m.files)} -k {m.select!r}")
        return 0
    unknown = [n for n in args.only or [] if n not in by_name]
    if unknown:
        parser.error(f"unknown mutation(s) {', '.join(unknown)}; see --list")
    chosen = [by_name[n] for n in args.only] if args.only else MUTATIONS
    rows = probe(chosen, timeout=args.timeout, baseline=not args.no_baseline,
                 verbose=args.verbose)
    print()
    print(table(rows))
    return 0 if all(status == "caught" for _, status, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
