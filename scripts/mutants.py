"""Mutation check: plant known bugs one at a time and require the tests to catch each.

Usage (after `source scripts/env.sh`):

    python scripts/mutants.py                 # every mutant; non-zero exit if any survives
    python scripts/mutants.py --only rms-dw-overwrite,gmm-skip-last-expert
    python scripts/mutants.py --check         # only verify the list (fast, no tests run)
    python scripts/mutants.py --list

Each mutant is (file, exact original text, replacement, the tests that should
catch it). The script copies the working tree (the files git tracks or would
track) to a temporary directory, never touching the checkout; runs every
selected test once on the unmodified copy (the baseline must pass, or a
"caught" would mean nothing); then for each mutant writes the replacement
into the copy, runs its tests (`-x`, no hypothesis shrinking), records
caught/survived and the seconds taken, and restores the file. It exits
non-zero if any mutant survives, if the baseline fails, or if an original
text does not occur exactly once in its file (so the list cannot silently
rot when the code changes: update the text, keep the bug).

Test runs are forked from a parent that has already imported JAX, torch and
pytest (no project module), so each mutant pays for its tests, not for a
fresh interpreter (`--no-fork`: a fresh one each). `--workers` runs (default
2, one per core of the CI machine) go at once, each in its own copy of the
tree; every run's wall and CPU seconds (its own rusage) are printed, then a
table and a summary line with the totals and the costliest mutants.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to the repository root
    original: str  # must occur exactly once in the file
    replacement: str
    tests: tuple[str, ...]  # pytest node ids (relative to the root) that should fail
    what: str


RMS = "kernels/rmsnorm/rmsnorm_tpu/kernel.py"
RMS_API = "kernels/rmsnorm/rmsnorm_tpu/api.py"
GMM = "kernels/ragged_dot/ragged_dot_tpu/kernel_gmm.py"
TGMM = "kernels/ragged_dot/ragged_dot_tpu/kernel_tgmm.py"
RD = "kernels/ragged_dot/ragged_dot_tpu/api.py"
RD_OPS = "kernels/ragged_dot/ragged_dot_tpu/ops.py"
RD_W8A8 = "kernels/ragged_dot/ragged_dot_tpu/w8a8.py"
MOE = "kernels/ragged_dot/ragged_dot_tpu/moe.py"
MOE_DEC = "kernels/ragged_dot/ragged_dot_tpu/kernel_moe_decode.py"
COMBINE = "kernels/ragged_dot/ragged_dot_tpu/kernel_combine.py"
EXPERTS = "kernels/ragged_dot/ragged_dot_tpu/layers.py"
MX = "kernels/ragged_dot/ragged_dot_tpu/mxfp4.py"
HF_MX = "kernels/ragged_dot/ragged_dot_tpu/hf_mxfp4.py"
HF_FP8 = "kernels/ragged_dot/ragged_dot_tpu/hf_fp8.py"
FA = "kernels/flash_attention/flash_attention_tpu/kernel_fwd.py"
FA_BWD = "kernels/flash_attention/flash_attention_tpu/kernel_bwd.py"
FA_API = "kernels/flash_attention/flash_attention_tpu/api.py"
FA_SCHED = "kernels/flash_attention/flash_attention_tpu/schedule.py"
FA_TILING = "kernels/flash_attention/flash_attention_tpu/tiling.py"
FA_OPS = "kernels/flash_attention/flash_attention_tpu/ops.py"
FA_DEC = "kernels/flash_attention/flash_attention_tpu/kernel_decode.py"
FA_KV = "kernels/flash_attention/flash_attention_tpu/kvcache.py"
TB = "torch_bindings"

T_RMS = "tests/rmsnorm/test_kernel.py"
T_RMS_OP = "tests/rmsnorm/test_torch_op.py"
T_GMM = "tests/ragged_dot/test_gmm.py"
T_RD_OP = "tests/ragged_dot/test_torch_op.py"
T_QUANT = "tests/ragged_dot/test_quantized.py"
T_MX = "tests/ragged_dot/test_mxfp4.py"
T_E2E = "tests/ragged_dot/test_e2e_models.py"
T_W8 = "tests/ragged_dot/test_w8a8.py"
T_ROUTE = "tests/ragged_dot/test_routing.py"
T_MOE = "tests/ragged_dot/test_moe_jax.py"
T_COMB = "tests/ragged_dot/test_combine.py"
T_DEC = "tests/ragged_dot/test_moe_decode.py"
T_EXP = "tests/ragged_dot/test_experts.py"
T_FA = "tests/flash_attention/test_flash_attention.py"
T_FA_OP = "tests/flash_attention/test_torch_op.py"
T_KV = "tests/flash_attention/test_kvcache.py"
T_TB = "tests/test_torch_bindings.py"
T_AR = "tests/test_autograd_residuals.py"

RMS_BLOCKS = f"{T_RMS}::test_backward_across_row_blocks_with_eps_that_matters"
FA_SCALE = f"{T_FA}::test_softmax_scale_reaches_every_kernel[fused-dq-0.05-float32]"
FA_SCALE_DQ = f"{T_FA}::test_softmax_scale_reaches_every_kernel[dq-kernel-0.05-float32]"

MUTANTS: tuple[Mutant, ...] = (
    # -- RMSNorm kernels ------------------------------------------------------
    Mutant(
        "rms-bwd-eps",
        RMS,
        "rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)\n    xhat = x * rstd",
        "rstd = 1.0 / (jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True)) + eps)\n    xhat = x * rstd",
        (RMS_BLOCKS,),
        "backward: eps as 1/(sqrt(ms)+eps), not rsqrt(ms+eps)",
    ),
    Mutant(
        "rms-dw-overwrite",
        RMS,
        "acc_ref[...] += contrib.reshape(cr // 8, 8, hidden).sum(axis=0)",
        "acc_ref[...] = contrib.reshape(cr // 8, 8, hidden).sum(axis=0)",
        (RMS_BLOCKS,),
        "backward: weight grad overwritten per row block",
    ),
    Mutant(
        "rms-dw-tail-mask",
        RMS,
        "contrib = jnp.where(row < rows, contrib, 0.0)",
        "contrib = contrib",
        (RMS_BLOCKS,),
        "backward: ragged last block's padded rows summed into dweight",
    ),
    Mutant(
        "rms-gemma",
        RMS,
        "return 1.0 + w if gemma else w",
        "return w",
        (RMS_BLOCKS,),
        "Gemma's (1 + w) dropped",
    ),
    Mutant(
        "rms-bwd-ds",
        RMS,
        "dx, contrib = _bwd_rows(x, dy, ds_ref[rs, :] if has_ds else None, w, eps)",
        "dx, contrib = _bwd_rows(x, dy, None, w, eps)",
        (RMS_BLOCKS,),
        "backward: residual-stream grad ds not added",
    ),
    Mutant(
        "rms-fused-normalises-x",
        RMS,
        "s_ref[...] = s\n        x = s.astype(jnp.float32)",
        "s_ref[...] = s\n        x = x_ref[...].astype(jnp.float32)",
        (f"{T_RMS}::test_fused_residual_matches_reference",),
        "fused forward normalises x instead of x + residual",
    ),
    Mutant(
        "rms-op-residual-grad",
        RMS_API,
        "return dx, dx, dw",
        "return dx, None, dw",
        (f"{T_RMS_OP}::test_fused_add_grads_flow_to_both_inputs",),
        "binding: no gradient to the residual input",
    ),
    # -- ragged_dot: gmm ----------------------------------------------------------
    Mutant(
        "gmm-row-mask",
        GMM,
        "return jnp.logical_and(ridx >= jnp.maximum(r_lo, fresh), ridx < r_hi)",
        "return ridx < r_hi",
        (f"{T_GMM}::test_gmm_edge_cases[50-64-256-sizes3-float32]",),
        "gmm: lower row mask dropped (a group overwrites its neighbour's shared tile rows)",
    ),
    Mutant(
        "gmm-skip-last-expert",
        GMM,
        "count, _ = lax.fori_loop(j1, num_local, tail, (count, prev))",
        "count, _ = lax.fori_loop(j1, num_local - 1, tail, (count, prev))",
        (f"{T_GMM}::test_kernel_fetches_each_active_expert_once_and_never_an_empty_one",),
        "gmm: last expert never made active",
    ),
    Mutant(
        "gmm-group-offset",
        GMM,
        "g = goff_ref[0] + j",
        "g = j",
        (f"{T_GMM}::test_shard_fetches_only_its_own_active_experts",),
        "gmm: expert-parallel group offset ignored",
    ),
    Mutant(
        "gmm-tile-end",
        GMM,
        "tile_hi = jnp.minimum(tile_lo + block_m, m)",
        "tile_hi = jnp.minimum(tile_lo + block_m - 1, m)",
        (f"{T_GMM}::test_kernel_fetches_each_active_expert_once_and_never_an_empty_one",),
        "gmm: off-by-one at the row tile's end",
    ),
    Mutant(
        "gmm-last-row-tile",
        GMM,
        "last = jnp.clip(lax.div(jnp.maximum(hi - 1, 0), block_m), first, tiles - 1)",
        "last = jnp.clip(lax.div(jnp.maximum(hi - 1, 0), block_m) - 1, first, tiles - 1)",
        (f"{T_GMM}::test_kernel_fetches_each_active_expert_once_and_never_an_empty_one",),
        "gmm: lhs index map skips the last row tile holding rows",
    ),
    Mutant(
        "gmm-dma-slot",
        GMM,
        "ahead = q + buffers - 1",
        "ahead = q + buffers",
        (f"{T_GMM}::test_kernel_fetches_each_active_expert_once_and_never_an_empty_one",),
        "gmm: weight ring refills the slot in use and skips an item",
    ),
    Mutant(
        "gmm-cast",
        GMM,
        "            x = x.astype(compute_dtype)",
        "            x = x.astype(jnp.bfloat16)",
        (f"{T_GMM}::test_gmm_edge_cases[50-64-256-sizes3-float32]",),
        "gmm: f32 lhs rounded to bf16 before the MXU (wrong cast)",
    ),
    Mutant(
        "gmm-gather-wait-late",
        GMM,
        "            last = lax.div(r_end - 1, chunk_m)",
        "            last = lax.div(r_end - 1, chunk_m) - 1",
        (f"{T_GMM}::test_gathered_rows_are_waited_for_under_tpu_interpreter",),
        "gmm gather: a pass waits for the chunks before its last one only (reads rows in flight)",
    ),
    Mutant(
        "gmm-gather-this-slot",
        GMM,
        "            issue_batch(ids_next, 1 - gslot, c, valid)",
        "            issue_batch(ids_next, gslot, c, valid)",
        (f"{T_GMM}::test_gmm_gathers_its_rows_as_xla_would",),
        "gmm gather: the next tile's rows land in the rows this tile still reads",
    ),
    Mutant(
        "gmm-gather-rest-from-zero",
        GMM,
        "issue_batch(ids_next, 1 - gslot, state_ref[3] + b * chunk_m, True)",
        "issue_batch(ids_next, 1 - gslot, b * chunk_m, True)",
        (f"{T_GMM}::test_gmm_gathers_its_rows_as_xla_would",),
        "gmm gather: the step's end issues the next tile's first rows again, not the rest",
    ),
    Mutant(
        "gmm-gather-unpack-order",
        GMM,
        "                parts.extend(pairs.group_values(words, contraction, g))",
        "                parts.extend(pairs.group_values(words, contraction, g)[::-1])",
        (f"{T_GMM}::test_gmm_gathers_its_rows_as_xla_would",),
        "gmm gather: a word group's two 128-column halves unpacked in swapped order",
    ),
    Mutant(
        "gmm-gather-row-token",
        GMM,
        "                tok = ids_ref[0, c + j]",
        "                tok = ids_ref[0, c + j // 2]",
        (f"{T_GMM}::test_gmm_gathers_its_rows_as_xla_would",),
        "gmm gather: each pair of rows copies the first one's token (the copy loop's index,"
        " rolled in interpret mode, unrolled on the TPU: the same body)",
    ),
    Mutant(
        "gmm-vmem-gather-one-tile",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        "        need = (2 * bm + chunk + resident_tokens) * _row_bytes(k)",
        "        need = (bm + resident_tokens) * _row_bytes(k)",
        (
            "tests/ragged_dot/test_compile_gate.py::"
            "test_gate_up_gmm_gathering_its_rows_compiles_at_its_vmem_estimate"
            "[gather-qwen3_30b_a3b-8192-tpu7x]",
        ),
        "gmm VMEM estimate with gather: one tile of packed rows counted, not two and the junk",
    ),
    Mutant(
        "gmm-merged-start",
        GMM,
        "emit(pl.multiple_of(jnp.maximum(a_hi - size, 0), sub), size, last_r0)",
        "emit(pl.multiple_of(last_r0, sub), size, last_r0)",
        (f"{T_GMM}::test_row_passes_keep_every_row_of_the_group_once[8-merged]",),
        "gmm merged tail: the pass starts at the last whole pass and runs past the group",
    ),
    Mutant(
        "gmm-merged-fresh",
        GMM,
        "emit(pl.multiple_of(jnp.maximum(a_hi - size, 0), sub), size, last_r0)",
        "emit(pl.multiple_of(jnp.maximum(a_hi - size, 0), sub), size, jnp.maximum(a_hi - size, 0))",
        (f"{T_GMM}::test_row_passes_keep_every_row_of_the_group_once[4-merged]",),
        "gmm merged tail: rows the earlier whole passes stored are kept again",
    ),
    Mutant(
        "gmm-merged-wide",
        GMM,
        "extra = wide.astype(jnp.int32) + whole_alone.astype(jnp.int32)",
        "extra = whole_alone.astype(jnp.int32)",
        (f"{T_GMM}::test_ragged_dot_fwd_and_grads_match_references",),
        "gmm merged tails: a tail wider than the largest merged size never computed",
    ),
    Mutant(
        "gmm-alone-whole-twice",
        GMM,
        "alone = jnp.logical_not(jnp.logical_or(has_big, whole_alone))",
        "alone = jnp.logical_not(has_big)",
        (f"{T_GMM}::test_row_passes_keep_every_row_of_the_group_once[8-merged-alone-whole]",),
        "gmm merged tails: a group of over half a chunk takes its whole pass and its tail passes",
    ),
    Mutant(
        "gmm-alone-whole-outside",
        GMM,
        "emit(pl.multiple_of(jnp.maximum(jnp.minimum(r0, a_hi - chunk), 0), sub), chunk, r0)",
        "emit(pl.multiple_of(jnp.minimum(r0, a_hi - chunk), sub), chunk, r0)",
        (f"{T_GMM}::test_row_passes_keep_every_row_of_the_group_once[8-merged-alone-whole]",),
        "gmm merged tails: a whole pass for a group near the tile's start reaches before the tile",
    ),
    Mutant(
        "gmm-gather-first-chunks",
        GMM,
        "lax.fori_loop(1, n_ck, first, 0)",
        "lax.fori_loop(2, n_ck, first, 0)",
        (f"{T_GMM}::test_gmm_gathers_its_rows_as_xla_would",),
        "gmm gather: the first tile's second chunk of rows never fetched",
    ),
    Mutant(
        "gmm-alone-whole-unused",
        GMM,
        "on_whole=issue_next if gather_rw else None,\n                alone_whole=transpose_rhs,",
        "on_whole=issue_next if gather_rw else None,\n                alone_whole=False,",
        (f"{T_GMM}::test_tpu7x_prefill_merges_tails_into_whole_passes_as_modelled[NK]",),
        "gmm: [N, K] weights' group parts of over half a chunk keep two narrow passes",
    ),
    Mutant(
        "gmm-merged-window",
        GMM,
        "jnp.logical_and(merge, jnp.logical_and(n_small > below, n_small <= tiles))",
        "jnp.logical_and(merge, jnp.logical_and(n_small > below, n_small < tiles))",
        (f"{T_GMM}::test_row_passes_keep_every_row_of_the_group_once[8-merged]",),
        "gmm merged tails: a tail of exactly a merged size falls between the sizes",
    ),
    Mutant(
        "gmm-merged-not-passed",
        GMM,
        "        merged_tails=cfg.merged_tails,\n",
        "        merged_tails=(),\n",
        (f"{T_GMM}::test_tpu7x_prefill_merges_tails_into_whole_passes_as_modelled",),
        "gmm: the config's merged tails never reach the kernel",
    ),
    Mutant(
        "gmm-merged-model",
        GMM,
        "            return [chunk] * (n_big + 1)",
        "            return [chunk] * n_big",
        (f"{T_GMM}::test_tpu7x_prefill_merges_tails_into_whole_passes_as_modelled",),
        "gmm pass_sizes: the wide tail's extra whole pass left out of the model",
    ),
    Mutant(
        "gmm-merged-never",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        "merged = merged_tail_tiles(chunk, sub) if top else ()",
        "merged = ()",
        (f"{T_GMM}::test_tpu7x_takes_wider_row_tiles_only_where_the_mxus_bind",),
        "gmm tiling: tails never merged where the MXUs bind",
    ),
    # -- ragged_dot: quantized weights -------------------------------------------
    Mutant(
        "gmm-channel-scale-offset",
        GMM,
        "y = y * sbuf[slot, :, pl.ds(c0, width)]",
        "y = y * sbuf[slot, :, pl.ds(0, width)]",
        (f"{T_QUANT}::test_scales_are_applied_per_output_channel_not_ignored",),
        "gmm: every column piece takes the first piece's per-channel scales",
    ),
    Mutant(
        "gmm-block-scale-index",
        GMM,
        "sbuf[slot, a * b_blocks + b]",
        "sbuf[slot, b * b_blocks + a]",
        (f"{T_QUANT}::test_block_scales_are_applied_per_block",),
        "gmm: 128 x 128 block scales read transposed",
    ),
    # -- ragged_dot: tgmm and the custom_vjp ---------------------------------------
    Mutant(
        "tgmm-acc-overwrite",
        TGMM,
        "acc_ref[:, pl.ds(c0, piece_n)] += d",
        "acc_ref[:, pl.ds(c0, piece_n)] = d",
        (f"{T_GMM}::test_tgmm_matches_reference_with_empty_groups",),
        "tgmm: accumulator overwritten per row pass",
    ),
    Mutant(
        "tgmm-row-mask",
        TGMM,
        "x = jnp.where(keep, x, jnp.zeros_like(x)).astype(compute_dtype)",
        "x = x.astype(compute_dtype)",
        (f"{T_GMM}::test_tgmm_matches_reference_with_empty_groups",),
        "tgmm: lhs rows outside the group not masked (NaN in padded rows leaks)",
    ),
    Mutant(
        "row-passes-fresh",
        GMM,
        "fresh = r0 + jnp.where(lead, widest * sub, 0)",
        "fresh = r0",
        (
            f"{T_GMM}::test_row_passes_keep_every_row_of_the_group_once",
            f"{T_GMM}::test_tgmm_sums_each_row_once_where_tail_passes_reach_back",
        ),
        "row_passes: the tail window after a lead pass keeps the lead's rows again",
    ),
    Mutant(
        "row-passes-window-start",
        GMM,
        "window_r0 = pl.multiple_of(jnp.maximum(a_hi - rows_b, 0), sub)",
        "window_r0 = pl.multiple_of(jnp.maximum(a_hi - rows_b + sub, 0), sub)",
        (f"{T_GMM}::test_row_passes_keep_every_row_of_the_group_once",),
        "row_passes: the tail window starts a sublane tile late",
    ),
    Mutant(
        "tgmm-fresh-ignored",
        TGMM,
        "keep = jnp.logical_and(ridx >= jnp.maximum(r_lo, fresh), ridx < r_hi)",
        "keep = jnp.logical_and(ridx >= r_lo, ridx < r_hi)",
        (f"{T_GMM}::test_tgmm_sums_each_row_once_where_tail_passes_reach_back",),
        "tgmm: rows a tail window reaches back over summed twice",
    ),
    Mutant(
        "tgmm-acc-not-reset",
        TGMM,
        "            # them, 4,770 a group); the next group's first pass overwrites.\n            state_ref[2] = 1",
        "            # them, 4,770 a group); the next group's first pass overwrites.\n            state_ref[2] = 0",
        (f"{T_GMM}::test_tgmm_matches_reference_with_empty_groups",),
        "tgmm: a finished group's sums carried into the next group's",
    ),
    Mutant(
        "tgmm-tile-end",
        TGMM,
        "tile_hi = jnp.minimum(tile_lo + block_m, m)",
        "tile_hi = jnp.minimum(tile_lo + block_m - 1, m)",
        (f"{T_GMM}::test_tgmm_matches_reference_with_empty_groups",),
        "tgmm: off-by-one at the row tile's end",
    ),
    Mutant(
        "rd-dlhs-offset",
        RD,
        "        group_offset=group_offset,\n        rhs_scale=scale,\n        scale_axis=scale_axis,\n        transpose_rhs=not transpose_rhs,",
        "        group_offset=0,\n        rhs_scale=scale,\n        scale_axis=scale_axis,\n        transpose_rhs=not transpose_rhs,",
        (f"{T_GMM}::test_group_offset_shards_sum_to_full_result[bfloat16]",),
        "custom_vjp: d_lhs ignores the shard's group offset",
    ),
    # -- MoE glue -------------------------------------------------------------------
    Mutant(
        "moe-offset-sign",
        MOE,
        "ids = top_k_index.reshape(-1).astype(jnp.int32) - jnp.asarray(",
        "ids = top_k_index.reshape(-1).astype(jnp.int32) + jnp.asarray(",
        (f"{T_MOE}::test_expert_parallel_sentinels_and_shards",),
        "moe: expert offset added instead of subtracted",
    ),
    Mutant(
        "moe-unpermute",
        MOE,
        "inv_km = inv.reshape(t, k).T.reshape(-1)",
        "inv_km = order.reshape(t, k).T.reshape(-1)",
        (f"{T_MOE}::test_matches_transformers_grouped_mm_f32",),
        "moe: rows unpermuted with the forward permutation",
    ),
    Mutant(
        "moe-combine-slot-major",
        MOE,
        "valid_km, w_km = valid.reshape(t, k).T, w.reshape(t, k).T",
        "valid_km, w_km = valid.reshape(k, t), w.reshape(k, t)",
        (f"{T_MOE}::test_matches_transformers_grouped_mm_f32",),
        "moe: the combine's routing weights read token-major against slot-major rows",
    ),
    Mutant(
        "moe-inverse-sort",
        MOE,
        "    _, inv = jax.lax.sort((order, jnp.arange(",
        "    inv, _ = jax.lax.sort((order, jnp.arange(",
        (f"{T_MOE}::test_matches_transformers_grouped_mm_f32",),
        "moe: the inverse permutation's sort returns its keys (the identity)",
    ),
    Mutant(
        "gmm-unaligned-tail-dropped",
        GMM,
        "                columns(n_pieces * piece_n, tail_n)",
        "                pass",
        (f"{T_GMM}::test_gmm_edge_cases[24-136-300-sizes5-bfloat16]",),
        "gmm: the narrower last piece of an unaligned slab never computed",
    ),
    Mutant(
        "gmm-vmem-lhs-rows",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        "    need += rows * kp * (4 if is_quantized(w_dtype) else ib)",
        "    need += rows * kp * (4 if is_quantized(w_dtype) else 0)",
        (
            "tests/ragged_dot/test_compile_gate.py::test_vmem_estimate_is_a_limit_mosaic_accepts"
            "[vmem_limit_at_estimate-mixtral_8x7b-down-8192-fwd-v6e]",
        ),
        "gmm VMEM estimate: the row pass's lhs rows left out (blocks Mosaic cannot fit)",
    ),
    Mutant(
        "gmm-piece-offset-past-3",
        GMM,
        "columns(pl.multiple_of(c * piece_n, piece_n) if n_pieces > 1 else 0, piece_n)",
        "columns(pl.multiple_of(jnp.minimum(c, 2) * piece_n, piece_n) if n_pieces > 1 else 0, piece_n)",
        ("tests/ragged_dot/test_gmm.py::test_gmm_glu_epilogue_matches_reference",),
        "gmm: a slab's fourth and later pieces (unrolled 4 in one body, or 2 a body) write the third's columns",
    ),
    Mutant(
        "llo-mxu-rate-ignored",
        "bench/llo.py",
        "            if f - t > q * c:  # its queue is full: wait until it takes one",
        "            if False:  # its queue is full: wait until it takes one",
        ("tests/bench/test_llo.py::test_matmuls_issued_faster_than_their_mxu_takes_them_wait",),
        "scheduled time: matmul ops issued faster than their MXU takes them never wait",
    ),
    Mutant(
        "rd-hbm-view-ignored",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        "    return swapped < as_given",
        "    return False",
        (
            "tests/ragged_dot/test_hbm_layout.py::test_swap_rule_predicts_the_compilers_weight_layout[tpu7x]",
        ),
        "ragged_dot: weights handed to the kernels row-major whatever XLA's layout (a copy per call)",
    ),
    Mutant(
        "rd-bwd-cotangent-dtype",
        RD,
        "    grad = grad.astype(lhs.dtype)\n",
        "",
        (f"{T_GMM}::test_bf16_inputs_with_f32_output_and_grads",),
        "ragged_dot backward: an f32 cotangent of bf16 inputs not rounded once for the MXU",
    ),
    Mutant(
        "moe-route-weights-one-term",
        MOE,
        "    res = _exact_dot(hi, clean) + _exact_dot(lo, clean)\n",
        "    res = _exact_dot(hi, clean)\n",
        (f"{T_ROUTE}::test_combine_matches_f64_forward_and_backward",),
        "routing by matmul: the f32 routing weights rounded to one bf16 term",
    ),
    Mutant(
        "moe-route-non-finite-spreads",
        MOE,
        "    return jnp.where(nonfinite > 0, jnp.nan, res)\n",
        "    return res\n",
        (f"{T_ROUTE}::test_combine_keeps_non_finite_rows_to_their_token",),
        "routing by matmul: a non-finite expert row zeroed instead of kept with its token",
    ),
    Mutant(
        "moe-interleave",
        MOE,
        "gate, up = h[:, 0::2], h[:, 1::2]",
        "up, gate = h[:, 0::2], h[:, 1::2]",
        (f"{T_MOE}::test_matches_transformers_grouped_mm_f32[gpt_oss]",),
        "moe: interleaved gate/up halves swapped",
    ),
    Mutant(
        "moe-last-expert-bias",
        MOE,
        "ids_clamped = jnp.minimum(key_sorted, num_experts - 1)",
        "ids_clamped = jnp.minimum(key_sorted, num_experts - 2)",
        (f"{T_MOE}::test_matches_transformers_grouped_mm_f32[gpt_oss]",),
        "moe: last expert gets its neighbour's bias",
    ),
    Mutant(
        "moe-weights-cast",
        MOE,
        "w = jnp.where(valid, top_k_weights.reshape(-1).astype(jnp.float32), 0.0)",
        "w = jnp.where(valid, top_k_weights.reshape(-1).astype(jnp.bfloat16), 0.0)",
        (f"{T_MOE}::test_matches_transformers_grouped_mm_f32[qwen_mixtral]",),
        "moe: routing weights rounded to bf16 (wrong cast)",
    ),
    # -- the one-launch decode layer ---------------------------------------------
    Mutant(
        "dec-mask-by-zero-weight",
        MOE_DEC,
        "acc_ref[...] += jnp.where(chose, w * y, 0.0)",
        "acc_ref[...] += w * y",
        (f"{T_DEC}::test_non_finite_tokens_stay_their_own",),
        "fused layer: tokens that did not pick the expert multiplied by 0 (NaN leaks)",
    ),
    Mutant(
        "dec-slice-offset",
        MOE_DEC,
        "start = pl.multiple_of(2 * col if interleaved else p * inter + col, 128)",
        "start = pl.multiple_of(2 * col if interleaved else p * inter, 128)",
        (f"{T_DEC}::test_matches_transformers_per_element",),
        "fused layer: every slice of an expert reads the gate/up rows of the first",
    ),
    Mutant(
        "dec-up-scales",
        MOE_DEC,
        "y = y * gsbuf[slot, p].astype(jnp.float32)",
        "y = y * gsbuf[slot, 0].astype(jnp.float32)",
        (f"{T_DEC}::test_quantized_weights_match_the_same_rounding_points",),
        "fused layer: the up projection scaled by the gate's scales",
    ),
    Mutant(
        "moe-up-bias-dropped",
        RD,
        "return gmm_as_stored(x, w, group_sizes, gate_up_scale, up_config, bias=gate_up_bias)",
        "return gmm_as_stored(x, w, group_sizes, gate_up_scale, up_config, bias=None)",
        (f"{T_MOE}::test_inference_adds_the_gate_up_bias_in_the_gate_up_kernel",),
        "moe inference: the unfused gate/up gmm never adds the gate/up bias",
    ),
    Mutant(
        "dec-interleaved-slice-offset",
        MOE_DEC,
        "start = pl.multiple_of(2 * col if interleaved else p * inter + col, 128)",
        "start = pl.multiple_of(col if interleaved else p * inter + col, 128)",
        (f"{T_DEC}::test_interleaved_gate_up_and_biases_in_the_one_launch",),
        "fused layer, interleaved gate/up: a slice's columns read from col, not 2 x col",
    ),
    Mutant(
        "dec-deinterleave-parity",
        MOE_DEC,
        "kernel_gmm.deinterleave(y, p)[:tokens] for p in (0, 1)",
        "kernel_gmm.deinterleave(y, p)[:tokens] for p in (1, 0)",
        (f"{T_DEC}::test_interleaved_gate_up_and_biases_in_the_one_launch",),
        "fused layer, interleaved gate/up: odd columns taken for the gate, even for up",
    ),
    Mutant(
        "dec-gate-up-bias-of-the-gate",
        MOE_DEC,
        "y = (y.astype(jnp.float32) + gubuf[slot, p]).astype(dtype)",
        "y = (y.astype(jnp.float32) + gubuf[slot, 0]).astype(dtype)",
        (f"{T_DEC}::test_interleaved_gate_up_and_biases_in_the_one_launch",),
        "fused layer, biased halves: the up projection given the gate's bias",
    ),
    Mutant(
        "dec-gate-up-bias-unrounded-product",
        MOE_DEC,
        """            y = y.astype(dtype)
            if gu_bias:""",
        """            if gu_bias:""",
        (f"{T_DEC}::test_interleaved_gate_up_and_biases_in_the_one_launch",),
        "fused layer: the bias added to the f32 product, not to the projection rounded first",
    ),
    Mutant(
        "dec-down-bias-dropped",
        MOE_DEC,
        "y = (y + dnbuf[slot]).astype(dtype).astype(jnp.float32)",
        "y = (y + 0 * dnbuf[slot]).astype(dtype).astype(jnp.float32)",
        (f"{T_DEC}::test_interleaved_gate_up_and_biases_in_the_one_launch",),
        "fused layer: the down bias never added",
    ),
    Mutant(
        "dec-gate-up-bias-first-slice",
        MOE_DEC,
        "src = gub_hbm.at[pl.ds(e, 1), pl.ds(start, width)]",
        "src = gub_hbm.at[pl.ds(e, 1), pl.ds(0, width)]",
        (f"{T_DEC}::test_interleaved_gate_up_and_biases_in_the_one_launch",),
        "fused layer: every slice of I given the first slice's gate/up bias",
    ),
    Mutant(
        "fused-interleaved-multiple-any-down",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        "return GLU_INTERLEAVED_MULTIPLE if interleaved and dn_transposed else 128",
        "return GLU_INTERLEAVED_MULTIPLE if interleaved else 128",
        (f"{T_DEC}::test_hand_written_blocks_are_checked",),
        "fused layer: 64-column slices of I allowed where down's I is on its lanes",
    ),
    Mutant(
        "fused-narrow-fallback-for-halves",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        "if not fitting and interleaved and wide == [inter]:",
        "if not fitting and wide == [inter]:",
        (f"{T_DEC}::test_gate_up_halves_keep_mxu_wide_slices",),
        "fused layer: Gemma 4's halves in 64-column slices (the interleaved fallback for all)",
    ),
    Mutant(
        "fused-gpt-oss-narrowest-slices",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        "fitting = [b for b in blocks if item_of(b) <= FUSED_MOE_ITEM_BYTES]",
        "fitting = []",
        (f"{T_DEC}::test_gpt_oss_decode_blocks",),
        "fused layer: GPT-OSS bf16 in 64-column slices (no MXU-wide slice fits the item size)",
    ),
    Mutant(
        "experts-unfused-unpermute",
        EXPERTS,
        "return weighted[inv].view(num_tokens, k, -1).sum(dim=1).to(hidden_states.dtype)",
        "return weighted[order].view(num_tokens, k, -1).sum(dim=1).to(hidden_states.dtype)",
        (f"{T_EXP}::test_custom_gate_and_post_norm_take_the_unfused_path",),
        "experts_forward (unfused path): wrong unpermutation",
    ),
    Mutant(
        "experts-gelu-tanh",
        EXPERTS,
        '"GELUTanh": "gelu_pytorch_tanh",',
        '"GELUTanh": "gelu",',
        (f"{T_EXP}::test_forward_and_grads_match_transformers[gemma4-reference]",),
        "experts_forward: tanh GELU mapped to the exact GELU",
    ),
    Mutant(
        "experts-up-bias",
        EXPERTS,
        'up_bias = getattr(module, f"{prefix}_bias", None) if module.has_bias else None',
        "up_bias = None",
        (f"{T_EXP}::test_forward_and_grads_match_transformers[gpt_oss-reference]",),
        "experts_forward: gate/up bias dropped",
    ),
    # -- flash attention --------------------------------------------------------------
    Mutant(
        "fa-fwd-mask",
        FA,
        "s = jnp.where(mask, s, NEG_INF)",
        "s = s",
        (f"{T_FA}::test_masked_keys_with_the_largest_logits_stay_out_of_the_maximum",),
        "forward: mask dropped from the logits",
    ),
    Mutant(
        "fa-fwd-chunk-alpha",
        FA,
        "acc = jnp.where(fresh, 0.0, acc_ref[a, :, l0 : l0 + lc]) * alpha",
        "acc = jnp.where(fresh, 0.0, acc_ref[a, :, l0 : l0 + lc])",
        (f"{T_FA}::test_forward_slabs_match_reference",),
        "forward: a fully visible pair's chunk does not rescale the accumulator to its new maximum",
    ),
    Mutant(
        "fa-fwd-chunk-buffer",
        FA,
        "nxt = chunk_scores(a, l0, bufs[(c + 1) % 2], span=span)",
        "nxt = chunk_scores(a, l0, bufs[c % 2], span=span)",
        (f"{T_FA}::test_forward_slabs_match_reference",),
        "forward pipeline: the next chunk's scores overwrite the buffer this chunk reads",
    ),
    Mutant(
        "fa-fwd-chunk-lanes",
        FA,
        "chunk_pipeline([(c // per, (c % per) * lc, None) for c in range(units * per)])",
        "chunk_pipeline([(c // per, 0, None) for c in range(units * per)])",
        (f"{T_FA}::test_forward_chunk_layouts_match_reference",),
        "forward pipeline: every chunk of a unit takes the unit's first lanes",
    ),
    Mutant(
        "fa-fwd-chunk-heads",
        FA,
        "heads = range(l0 // unit, (l0 + lc) // unit)",
        "heads = range(0, lc // unit)",
        (f"{T_FA}::test_forward_chunk_layouts_match_reference",),
        "forward pipeline: a chunk of several heads' units takes the first heads' queries",
    ),
    Mutant(
        "fa-fwd-chunk-tail",
        FA,
        "        for c in range(n):\n            nxt = None\n",
        "        for c in range(n - 1):\n            nxt = None\n",
        (f"{T_FA}::test_forward_slabs_match_reference",),
        "forward pipeline: the last chunk of a fully visible pair never updated",
    ),
    Mutant(
        "fa-fwd-exp2-max",
        FA,
        "m_new = jnp.maximum(m_prev, row_max * prm.scale if fold else row_max)",
        "m_new = jnp.maximum(m_prev, row_max)",
        (f"{T_FA}::test_full_pairs_keep_the_running_maximum_in_logit_units",),
        "forward: raw scores' maximum kept unscaled beside the masked pairs' logit units",
    ),
    Mutant(
        "fa-bwd-chunk-buffer",
        FA_BWD,
        "produce(at(k, r + 1), bufs[(r + 1) % 2])",
        "produce(at(k, r + 1), bufs[r % 2])",
        (f"{T_FA}::test_backward_chunk_layouts_match_reference",),
        "dK/dV: a full pair's next chunk written into the buffer this chunk's matmuls read",
    ),
    Mutant(
        "fa-fwd-masked-mask",
        FA,
        "s = jnp.where(chunk_mask(a, l0, *keys), s, NEG_INF)",
        "s = s",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward masked pipeline: the mask is not applied to the scores",
    ),
    Mutant(
        "fa-fwd-masked-empty-rows",
        FA,
        "m = jnp.where(m_new < 0.5 * NEG_INF * (prm.scale if fold else 1.0), 0.0, m_new)",
        "m = m_new",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward masked pipeline: a row that saw no key yet gives its masked keys p = 1",
    ),
    Mutant(
        "fa-fwd-masked-key-offset",
        FA,
        "vt = vt_ref[:, pl.ds(k_lo, span)]",
        "vt = vt_ref[:, pl.ds(0, span)]",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward masked pipeline: every key range reads the block's first values",
    ),
    Mutant(
        "fa-fwd-masked-vt-tail",
        FA,
        "vt = jnp.where(_key_valid_row(prm, j, k_lo, span), vt, jnp.zeros_like(vt))",
        "vt = vt",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward masked pipeline: values past the sequence's end reach the PV matmul",
    ),
    Mutant(
        "fa-fwd-masked-unit-bounds",
        FA,
        "c_lo, c_hi = _chunk_range(prm, i, j, a)  # pipelined",
        "c_lo, c_hi = _chunk_range(prm, i, j, 0)  # pipelined",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward masked pipeline: every unit takes the first unit's key ranges",
    ),
    Mutant(
        "fa-bwd-masked-p",
        FA_BWD,
        "        if mask is not None:\n            p = jnp.where(mask, p, 0.0)",
        "        if mask is not None:\n            p = p",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "dK/dV masked pipeline: P not masked",
    ),
    Mutant(
        "bench-ours-moe-bench-layout",
        "bench/registry.py",
        '    is_t = hf_is_transposed(point)\n    op = _contract_entry("ragged_dot_tpu", "moe_experts"',
        '    is_t = True\n    op = _contract_entry("ragged_dot_tpu", "moe_experts"',
        ("tests/bench/test_registry.py::test_ours_gets_the_weights_as_the_model_stores_them",),
        "bench: ours timed on [E, in, out] weights where the model stores [E, out, in]"
        " (tpu7x prefill 11% faster than what experts_forward gets)",
    ),
    Mutant(
        "llo-int8-smem-row-major",
        "bench/llo.py",
        "    tiled = _int8_tiles(a) if a.ndim >= 2 and a.dtype.itemsize == 1 else None",
        "    tiled = None",
        ("tests/bench/test_llo.py::test_int8_smem_words_follow_the_compiled_addressing",),
        "bench: an int8 scalar-prefetch array seeded into SMEM row-major (JAX's splash"
        " read most of its causal block mask as empty)",
    ),
    Mutant(
        "llo-forward-branch-runs-skipped-block",
        "bench/llo.py",
        "            if forward and any(",
        "            if False and any(",
        (
            "tests/bench/test_llo.py::test_block_delay_rule_never_runs_a_skipped_blocks_wait_or_copy",
        ),
        "tpu7x: a forward branch's delay slots run the skipped block's wait"
        " (another row slot's semaphore in the combine)",
    ),
    Mutant(
        "llo-padding-ends-delay-slots",
        "bench/llo.py",
        "            if forward and any(",
        "            if not nxt.ops and nxt.depth < bd.depth or forward and any(",
        (
            "tests/bench/test_llo.py::test_block_delay_rule_runs_a_predicated_copy_past_the_padding",
            "tests/bench/test_llo.py::test_block_delay_rule_keeps_a_back_edges_slots_in_its_loop",
        ),
        "tpu7x: empty padding ends a branch's delay slots (drops a pipelined loop's"
        " prefetch and a loop body's last bundles)",
    ),
    Mutant(
        "llo-back-edge-runs-code-after-its-loop",
        "bench/llo.py",
        "        depth = bd.depth if forward or target is None else max(bd.depth, bundles[target].depth)",
        "        depth = bd.depth",
        ("tests/bench/test_llo.py::test_block_delay_rule_keeps_a_back_edges_slots_in_its_loop",),
        "tpu7x: a back-edge one level above its body runs the code after the loop on every"
        " trip (the dK/dV kernel waited for each dQ copy it had just started)",
    ),
    Mutant(
        "bench-cut-off-as-figure",
        "bench/sweep.py",
        "if sch.stopped:",
        "if False:",
        ("tests/bench/test_llo.py::test_the_sweep_reports_no_time_for_a_run_cut_off",),
        "bench: a schedule cut off at the bundle limit reported as the launch's time",
    ),
    Mutant(
        "fa-fwd-full-pair-stale-vt",
        FA,
        """        st = chunk_scores(a, l0, bufs[0], span=span)
        transpose_v()
""",
        """        st = chunk_scores(a, l0, bufs[0], span=span)
""",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward: a fully visible pair reads the V^T of the step before (its own transpose dropped)",
    ),
    Mutant(
        "fa-fwd-range-prefetch-keys",
        FA,
        "nxt.append(chunk_scores(a, r * lc, buf, keys(c + 1), row0))",
        "nxt.append(chunk_scores(a, r * lc, buf, keys(c), row0))",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward masked pair: the next range's first chunk scored against this range's keys",
    ),
    Mutant(
        "fa-fwd-odd-range-first-chunk",
        FA,
        "st = chunk_scores(a, 0, s0_ref, keys)",
        "st = chunk_scores(a, lc, s0_ref, keys)",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward masked pair, odd chunks a unit: each range's first chunk scored from the second's rows",
    ),
    Mutant(
        "fa-fwd-range-peel",
        FA,
        "st = lax.fori_loop(0, trips, body, st)",
        "st = lax.fori_loop(1, trips, body, st)",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward masked pair: a unit's first loop trip (two key ranges) skipped",
    ),
    Mutant(
        "fa-fwd-range-slot-sets",
        FA,
        "        s = p * per + r\n",
        "        s = r\n",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward masked pair: the next range's scores overwrite the ones this range still updates from",
    ),
    Mutant(
        "fa-fwd-range-even-tail",
        FA,
        "                step(c + 1, 1, step(c, 0, st), last=True)",
        "                step(c, 0, st, last=True)",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward masked pair: a unit with an even count of key ranges drops its last",
    ),
    Mutant(
        "fa-fwd-diagonal-triangle-open",
        FA,
        "return kr > rel if edge else kr <= rel",
        "return kr > rel if edge else kr < rel",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward diagonal pair: a row no longer sees its own key",
    ),
    Mutant(
        "fa-fwd-diagonal-drops-keys-below",
        FA,
        "            if w1 > w0:\n                whole = s[w0 - lo : w1 - lo]",
        "            if w1 > w0 + ck:\n                whole = s[w0 - lo : w1 - lo]",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward diagonal pair: a unit's second range of keys keeps the other buffer's stale scores",
    ),
    Mutant(
        "fa-bwd-diagonal-triangle-open",
        FA_BWD,
        "(kc, w), 0) <= lane + (off + d - k0)",
        "(kc, w), 0) < lane + (off + d - k0)",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "dK/dV diagonal pair: a row's own key gets no gradient",
    ),
    Mutant(
        "fa-bwd-diagonal-rows-from-block-start",
        FA_BWD,
        "            for off in range(max(c * ck - d, 0), br, lc)\n",
        "            for off in range(max(c * ck - d, 0), br - c * ck, lc)\n",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "dK/dV diagonal pair: a later key range drops the block's last rows",
    ),
    Mutant(
        "fa-fwd-far-edge-triangle-shut",
        FA,
        "return kr > rel if edge else kr <= rel",
        "return kr >= rel if edge else kr <= rel",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward, a window of whole blocks: its far edge also shows the key one past the window",
    ),
    Mutant(
        "fa-fwd-far-edge-pairs-skipped",
        FA,
        "                pl.when(on_far_edge)(far_edge_pair)",
        "                pass",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward, a window of whole blocks: the pairs its far edge cuts are never computed",
    ),
    Mutant(
        "fa-fwd-window-edge-pairs-skipped",
        FA,
        "            pl.when(jnp.logical_not(own_pipeline))(cut_pair)",
        "            pass",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward, windowed: the pairs the window's far edge cuts are never computed",
    ),
    Mutant(
        "fa-bwd-window-edge-pairs-skipped",
        FA_BWD,
        "                    pl.when(d_now - prm.left == e)(functools.partial(far_edge_pair, e))",
        "                    pass",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "dK/dV, windowed: the pairs the window's far edge cuts are never computed",
    ),
    Mutant(
        "fa-swapped-layout-never",
        FA,
        "return not seq_major and max(head_dim, head_dim_v) < tiling.LANES",
        "return not seq_major and max(head_dim, head_dim_v) < 0",
        (
            f"{T_FA}::test_short_head_dims_reach_the_kernels_with_their_minor_axes_swapped",
            "tests/flash_attention/test_compile_gate.py::"
            "test_short_head_dims_cross_into_the_kernels_without_a_copy",
        ),
        "short head dims: row-major blocks again, each input and result copied by XLA",
    ),
    Mutant(
        "fa-swapped-delta-over-positions",
        FA_API,
        "d_axis = -2 if st.dkdv.swapped else -1",
        "d_axis = -1",
        (f"{T_FA}::test_softmax_scale_reaches_every_kernel",),
        "swapped layout, dQ kernel: delta = rowsum(dO * O) summed over positions, not D",
    ),
    Mutant(
        "fa-swapped-output-one-head",
        FA,
        ":, hh * unit : (hh + 1) * unit",
        ":, 0:unit",
        (f"{T_FA}::test_backward_chunk_layouts_match_reference",),
        "swapped layout, forward: every head of a block written with the first head's output",
    ),
    Mutant(
        "fa-fwd-finish-before-last-chunk",
        FA,
        "            chunk_update(a, l0, bufs[c % 2], *st, span=span)\n"
        "            if finishes and last[a] == c:\n                finish(a)",
        "            if finishes and last[a] == c:\n                finish(a)\n"
        "            chunk_update(a, l0, bufs[c % 2], *st, span=span)",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward: a diagonal pair normalises a unit before its last chunk's update",
    ),
    Mutant(
        "fa-fwd-fresh-acc-unselected",
        FA,
        "acc = jnp.where(fresh, 0.0, acc_ref[a, :, l0 : l0 + lc]) * alpha",
        "acc = acc_ref[a, :, l0 : l0 + lc] * alpha",
        (f"{T_FA}::test_forward_slabs_match_reference",),
        "forward: a q row's first pair scales unzeroed VMEM into its accumulator",
    ),
    Mutant(
        "fa-fwd-fresh-in-cut-pairs",
        FA,
        "covers_every_unit = jnp.logical_and(compute, jnp.logical_not(masked_step))",
        "covers_every_unit = compute",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "forward: a q row whose first pair a window cuts skips the zeroing its unseen units need",
    ),
    Mutant(
        "fa-bwd-dq-start-adds",
        FA_BWD,
        "                if dq_start is True:\n                    ref[...] = x",
        "                if dq_start is True:\n                    ref[...] += x",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "fused dQ: a q block's first full pair adds to unzeroed VMEM",
    ),
    Mutant(
        "fa-bwd-dq-start-wrong-range",
        FA_BWD,
        "start = first_pair if dq_starts and ck_[1][0] == 0 else False",
        "start = first_pair if dq_starts and ck_[1][0] == ck else False",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "fused dQ: a first diagonal pair starts dQ at its second key range, dropping the first",
    ),
    Mutant(
        "fa-bwd-dq-start-unselected",
        FA_BWD,
        "ref[...] = jnp.where(dq_start, 0.0, ref[...]) + x",
        "ref[...] = ref[...] + x",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "fused dQ: a first diagonal pair adds to unzeroed VMEM",
    ),
    Mutant(
        "fa-bwd-dq-last-copies-unwaited",
        FA_BWD,
        "@pl.when(last_head if defer_dq_waits else True)",
        "@pl.when(jnp.logical_and(last_head, False) if defer_dq_waits else True)",
        (f"{T_FA}::test_fused_dq_copies_carried_across_kv_heads_land",),
        "fused dQ: the grid's last copies are never waited for",
    ),
    Mutant(
        "fa-bwd-dq-megacore-head-end-unwaited",
        FA_BWD,
        "@pl.when(last_head if defer_dq_waits else True)",
        "@pl.when(last_head if defer_dq_waits else False)",
        (f"{T_FA}::test_fused_dq_copies_carried_across_kv_heads_land",),
        "fused dQ, megacore: a kv head's last copies are never waited for",
    ),
    Mutant(
        "fa-bwd-dq-slot-reused-unwaited",
        FA_BWD,
        "        slot = qi % 2\n        _settle_dq_slot(prm, dq_out, sems, dq_hbm, state, slot)\n",
        "        slot = qi % 2\n",
        (f"{T_FA}::test_fused_dq_copies_carried_across_kv_heads_land",),
        "fused dQ: a block is made in a slot whose copy may still be in flight",
    ),
    Mutant(
        "fa-bwd-dq-flags-reset-each-head",
        FA_BWD,
        "            jnp.logical_and(step == 0, jnp.logical_and(bh[0] == 0, bh[1] == 0))\n"
        "            if defer_dq_waits",
        "            step == 0\n            if defer_dq_waits",
        (f"{T_FA}::test_fused_dq_copies_carried_across_kv_heads_land",),
        "fused dQ: each kv head forgets the copies the last one left in flight",
    ),
    Mutant(
        "fa-bwd-stream-read-overtakes-write",
        FA_BWD,
        "        settle_block(blk)\n        read(blk, slot).start()",
        "        read(blk, slot).start()",
        (f"{T_FA}::test_streamed_dq_matches_reference",),
        "streamed dQ: a q block's read is issued while its last write is still in flight",
    ),
    Mutant(
        "fa-bwd-stream-slot-reread",
        FA_BWD,
        "carry_in = (step > 0) & _flag(f_prev, bsched.COMPUTE) & (i_prev == i)",
        "carry_in = (step < 0) & _flag(f_prev, bsched.COMPUTE) & (i_prev == i)",
        (f"{T_FA}::test_streamed_dq_matches_reference",),
        "streamed dQ: a q block two steps running is read again over its unwritten sum",
    ),
    Mutant(
        "fa-bwd-stream-buffer-not-zeroed",
        FA_BWD,
        "        aliases = {len(prefetch) + len(args): len(out_shape)}",
        "        aliases = {}",
        (f"{T_FA}::test_streamed_dq_matches_reference",),
        "streamed dQ: the HBM buffer is not the zeroed one (unvisited q blocks, first reads)",
    ),
    Mutant(
        "fa-bwd-stream-last-writes-undrained",
        FA_BWD,
        "            for s in range(slots.shape[0]):\n                settle(s)",
        "            pass",
        (f"{T_FA}::test_streamed_dq_matches_reference",),
        "streamed dQ: the head's last writes are never waited for",
    ),
    Mutant(
        "fa-bwd-far-edge-triangle-shut",
        FA_BWD,
        "(kc, w), 0) >= lane + (off + e - k0)",
        "(kc, w), 0) > lane + (off + e - k0)",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "dK/dV, windowed: the far edge's first visible key of each row gets no gradient",
    ),
    Mutant(
        "fa-bwd-far-edge-rows-cut-short",
        FA_BWD,
        "((hh, off, min(lc, hi - off)), (c * ck, ck))",
        "((hh, off, min(lc, hi - off, 256)), (c * ck, ck))",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "dK/dV, windowed: a far-edge key range skips the rows past a head's first 256",
    ),
    Mutant(
        "fa-bwd-dq-written-early",
        FA_BWD,
        "dq_sems, dst, dq_state, i)",
        "dq_sems, dst, dq_state, i + 1)",
        (f"{T_FA}::test_backward_chunk_layouts_match_reference",),
        "fused dQ: a kv block's first q block written before that kv block's contribution",
    ),
    Mutant(
        "fa-tile-rows-segmented",
        FA_TILING,
        "sub = bsched.sub_tiles(geom, sub_block, eligible=not segmented)",
        "sub = bsched.sub_tiles(geom, sub_block, eligible=True)",
        (f"{T_FA}::test_plan_fuses_dq_in_vmem_while_the_kv_heads_dq_fits_else_streams_it",),
        "dK/dV VMEM estimate: segmented calls' whole-block tiles counted as one chunk",
    ),
    Mutant(
        "fa-tile-rows-unsplit",
        FA_TILING,
        "return lanes if sub is not None and geom.rows > lanes else geom.rows",
        "return lanes",
        (f"{T_FA}::test_dkdv_tile_rows_follow_the_kernels_paths",),
        "dK/dV VMEM estimate: blocks with no sub-tiles counted as pipelined chunks",
    ),
    Mutant(
        "fa-varlen-unsegmented",
        FA_API,
        "generation, plan = _plan(pb, q.dtype, config, segmented=True)",
        "generation, plan = _plan(pb, q.dtype, config, segmented=False)",
        (f"{T_FA}::test_calls_with_segments_plan_whole_block_temporaries",),
        "varlen calls planned as dense: fused dQ past the VMEM their masked tiles hold",
    ),
    Mutant(
        "fa-own-delta-first",
        FA_SCHED,
        "& (kv == lo[q]), FIRST, 0)",
        "& (kv == lo[q] + 1), FIRST, 0)",
        (
            f"{T_FA}::test_schedule_visits_exactly_visible_pairs",
            f"{T_FA}::test_backward_chunk_layouts_match_reference",
        ),
        "dK/dV schedule: FIRST on each q block's second pair, delta derived late",
    ),
    Mutant(
        "fa-o-block-late",
        FA_SCHED,
        "xp.where(nxt < n, nxt, last)",
        "xp.where(nxt + 1 < n, nxt + 1, last)",
        (
            f"{T_FA}::test_schedule_visits_exactly_visible_pairs",
            f"{T_FA}::test_backward_chunk_layouts_match_reference",
        ),
        "dK/dV schedule: O holds the q block after each FIRST step's, delta from the wrong O",
    ),
    Mutant(
        "fa-o-block-every-step",
        FA_SCHED,
        "    return xp.where(last >= 0, o, 0).astype(np.int32)",
        "    return q.astype(np.int32)",
        (f"{T_FA}::test_schedule_visits_exactly_visible_pairs",),
        "dK/dV schedule: O's block follows every step's q block (copied where it is not read)",
    ),
    Mutant(
        "fa-o-block-map",
        FA_BWD,
        "(b, h, 0) + minor(o[p], 0)",
        "(b, h, 0) + minor(o[0], 0)",
        (f"{T_FA}::test_backward_chunk_layouts_match_reference",),
        "dK/dV own delta: O's index map holds the first FIRST step's block at every step",
    ),
    Mutant(
        "fa-dq-carried-head",
        FA_BWD,
        "prev = jnp.maximum(head - 1, 0)",
        "prev = head",
        (f"{T_FA}::test_fused_dq_written_inside_the_diagonal_pipelines_lands",),
        "dK/dV: a head's first step writes the last head's last dQ blocks into its own rows",
    ),
    Mutant(
        "fa-dq-carried-blocks",
        FA_BWD,
        "jnp.where(later, i, nq) - r for r",
        "jnp.where(later, i - r, nq - ratio) for r",
        (f"{T_FA}::test_fused_dq_written_inside_the_diagonal_pipelines_lands",),
        "dK/dV: the carried dQ blocks are the last head's first pending one, twice",
    ),
    Mutant(
        "fa-dq-inside-early",
        FA_BWD,
        "jnp.where(later, i, nq) - r for r",
        "jnp.where(later, i - r + 1, nq - r) for r",
        (f"{T_FA}::test_fused_dq_written_inside_the_diagonal_pipelines_lands",),
        "dK/dV: a kv block's first step writes its own first q block's dQ, before its sum ends",
    ),
    Mutant(
        "fa-kv-init-skipped",
        FA_BWD,
        "        init_kv_block()  # its stores and transposes beside the matmuls, as the dQ's\n",
        "",
        (f"{T_FA}::test_fused_dq_written_inside_the_diagonal_pipelines_lands",),
        "dK/dV: the INIT step's diagonal pipeline neither zeroes dK, dV nor stores K^T",
    ),
    Mutant(
        "fa-resident-ignored",
        FA_TILING,
        "    if bs.bwd_resident and bs.fuse_dq and not bs.stream_dq:",
        "    if False:",
        (f"{T_FA}::test_v6e_d256_backward_takes_1024_positions_while_dq_stays_in_vmem",),
        "plan: the table's resident dK/dV blocks never tried",
    ),
    Mutant(
        "fa-resident-streams",
        FA_TILING,
        "(False,) if resident_only else (False, True)",
        "(False, True) if resident_only else (False, True)",
        (f"{T_FA}::test_v6e_d256_backward_takes_1024_positions_while_dq_stays_in_vmem",),
        "plan: the resident dK/dV blocks taken with dQ streamed through HBM",
    ),
    Mutant(
        "fa-dq-inside-slot",
        FA_BWD,
        "        return [(qi, lax.rem(qi, 2), dst) for qi in blocks], ",
        "        return [(qi, 0, dst) for qi in blocks], ",
        (f"{T_FA}::test_fused_dq_written_inside_the_diagonal_pipelines_lands",),
        "dK/dV: both dQ blocks an INIT step writes go through slot 0",
    ),
    Mutant(
        "fa-own-delta-chunk-offset",
        FA_BWD,
        "            ref[pl.ds(hh, 1), off : off + lc] = x",
        "            ref[pl.ds(hh, 1), 0:lc] = x",
        (f"{T_FA}::test_backward_chunk_layouts_match_reference",),
        "dK/dV own delta: every chunk of a head stores its delta rows at lane 0",
    ),
    Mutant(
        "fa-own-delta-chunk-heads",
        FA_BWD,
        "                ref[pl.ds(hh + t, 1), :] = x[:, t * br : (t + 1) * br]",
        "                ref[pl.ds(hh + t, 1), :] = x[:, 0:br]",
        (f"{T_FA}::test_backward_chunk_layouts_match_reference",),
        "dK/dV own delta: heads in a chunk all store the first head's delta rows",
    ),
    Mutant(
        "fa-own-delta-block-head",
        FA_BWD,
        "_delta_row(o_ref[hh], do_ref[hh])",
        "_delta_row(o_ref[0], do_ref[0])",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "dK/dV own delta: a masked first pair gives every head the first head's delta",
    ),
    Mutant(
        "fa-own-delta-dlse",
        FA_BWD,
        "                delta = delta - chunk_lane_row(c, dlse_ref)",
        "                delta = delta",
        (f"{T_FA}::test_backward_chunk_layouts_match_reference",),
        "dK/dV own delta: a full first pair drops the lse cotangent",
    ),
    Mutant(
        "fa-own-delta-row",
        FA_BWD,
        "    x = jnp.transpose(o).astype(jnp.float32) * jnp.transpose(do).astype(jnp.float32)",
        "    x = jnp.transpose(o).astype(jnp.float32)",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "dK/dV own delta: rowsum(O) without dO",
    ),
    Mutant(
        "fa-bwd-masked-ds",
        FA_BWD,
        "            ds = jnp.where(mask, ds, 0.0)",
        "            ds = ds",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "dK/dV masked pipeline: dS of keys past the end (dP from unspecified V) kept",
    ),
    Mutant(
        "fa-bwd-masked-q-tail",
        FA_BWD,
        "must not reach dV, dK\n                q, do = zero_tail_rows(c, q, do)",
        "must not reach dV, dK\n                pass",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "dK/dV masked pipeline: unspecified q / dO rows past the end reach dV and dK",
    ),
    Mutant(
        "fa-bwd-masked-key-range",
        FA_BWD,
        "keys = (k0, prm.sub[1])\n        _two_buffer_pipeline(",
        "keys = (0, prm.sub[1])\n        _two_buffer_pipeline(",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "dK/dV masked pipeline: every key range computes the block's first keys",
    ),
    Mutant(
        "fa-bwd-masked-block-rows",
        FA_BWD,
        "_visible_chunks(prm, i, j, 0, masked_range, rows=br)",
        "_visible_chunks(prm, i, j, 0, masked_range)",
        (f"{T_FA}::test_masked_pair_pipelines_match_reference",),
        "dK/dV masked pipeline: only the key ranges the block's first sub-tile rows see",
    ),
    Mutant(
        "fa-bwd-chunk-exp2",
        FA_BWD,
        "p = jnp.exp2(s * (prm.scale * LOG2E) - lse * LOG2E)",
        "p = jnp.exp2(s * (prm.scale * LOG2E) - lse)",
        (f"{T_FA}::test_backward_chunk_layouts_match_reference",),
        "dK/dV: a full pair's chunk subtracts the logsumexp in the wrong units",
    ),
    Mutant(
        "fa-bwd-chunk-head",
        FA_BWD,
        "return k * (depth // per) + r // per, (r % per) * lc",
        "return k * (depth // per), (r % per) * lc",
        (f"{T_FA}::test_backward_chunk_layouts_match_reference",),
        "dK/dV: chunks of a full pair's later heads read the first head of the loop step",
    ),
    Mutant(
        "fa-bwd-chunk-heads-in-chunk",
        FA_BWD,
        "return (k * depth + r) * (lc // br), 0",
        "return k * depth + r, 0",
        (f"{T_FA}::test_backward_chunk_layouts_match_reference",),
        "dK/dV: a chunk of several heads starts at the chunk index, not its first head",
    ),
    Mutant(
        "fa-bwd-fused-dq-offset",
        FA_BWD,
        "accumulate(dq_here.at[hh, :, pl.ds(off, w)], dqt)",
        "accumulate(dq_here.at[hh, :, pl.ds(0, w)], dqt)",
        (f"{T_FA}::test_backward_chunk_layouts_match_reference",),
        "fused dQ: every chunk of a head added to its first lanes",
    ),
    Mutant(
        "fa-bwd-fused-dq-masked-ds",
        FA_BWD,
        "add_dq(jnp.where(mask, ds, 0.0) if masked else ds, r0, rc, k0, ck)",
        "add_dq(ds, r0, rc, k0, ck)",
        (f"{T_FA}::test_backward_chunk_layouts_match_reference",),
        "fused dQ: dS of keys past the end (unspecified V) reaches K^T dS^T",
    ),
    Mutant(
        "fa-bwd-fused-dq-scale",
        FA_BWD,
        "dqt = dq_acc[qi, hh] * prm.scale",
        "dqt = dq_acc[qi, hh] * prm.head_dim**-0.5",
        (FA_SCALE,),
        "fused dQ: softmax_scale ignored (1/sqrt(D) used)",
    ),
    Mutant(
        "fa-bwd-fused-dq-subtile",
        FA_BWD,
        "dq_here[hh, :, pl.ds(r0, rc)] += part",
        "dq_here[hh, :, pl.ds(0, rc)] += part",
        (f"{T_FA}::test_streamed_dq_matches_reference",),
        "fused dQ: a masked pair's row sub-tiles all added to the block's first rows",
    ),
    Mutant(
        "fa-bwd-fused-dq-block",
        FA_BWD,
        "rows = pl.ds(pl.multiple_of(qi * br, br), br)",
        "rows = pl.ds(0, br)",
        (f"{T_FA}::test_backward_chunk_layouts_match_reference",),
        "fused dQ: every q block's dQ written over the first block's rows",
    ),
    Mutant(
        "fa-fwd-ones-row",
        FA,
        "vt_ref.shape[1]), 0) == 0",
        "vt_ref.shape[1]), 0) == 1",
        (f"{T_FA}::test_gqa_8_causal_cross_lengths_f32",),
        "forward: the row of ones below V^T one row off (row sums of 0)",
    ),
    Mutant(
        "fa-fwd-unit-store",
        FA,
        "_set_rows(o_ref, a * unit, unit, out.astype(o_ref.dtype))",
        "_set_rows(o_ref, 0, unit, out.astype(o_ref.dtype))",
        (f"{T_FA}::test_forward_slabs_match_reference",),
        "forward: every unit's output written over the block's first unit",
    ),
    Mutant(
        "fa-fwd-sinks",
        FA,
        "l = l * keep + jnp.exp(sink - m_fin)",
        "l = l * keep",
        (f"{T_FA}::test_decode_layout_multiple_row_blocks_with_sinks",),
        "forward: sink left out of the softmax denominator",
    ),
    Mutant(
        "fa-dq-scale",
        FA_BWD,
        "out = jnp.transpose(dq_acc[a] * prm.scale)",
        "out = jnp.transpose(dq_acc[a] * prm.head_dim**-0.5)",
        (FA_SCALE_DQ,),
        "dQ: softmax_scale ignored (1/sqrt(D) used)",
    ),
    Mutant(
        "fa-dq-k-tail",
        FA_BWD,
        "                k = _zero_tail_rows(k, kvalid)\n",
        "",
        (FA_SCALE_DQ,),
        "dQ: keys past the end not zeroed (softcap's tanh of garbage reaches dS)",
    ),
    Mutant(
        "fa-dq-unit-store",
        FA_BWD,
        "_set_rows(dq_ref, a * unit, unit, out.astype(dq_ref.dtype))",
        "_set_rows(dq_ref, 0, unit, out.astype(dq_ref.dtype))",
        (FA_SCALE_DQ, f"{T_FA}::test_dense_matches_reference"),
        "dQ: every unit's rows written over the block's first unit",
    ),
    Mutant(
        "fa-dq-lse-unit",
        FA_BWD,
        "lse = _flat_rows(_rows(lse_ref, r0, unit))",
        "lse = _flat_rows(_rows(lse_ref, 0, unit))",
        (FA_SCALE_DQ, f"{T_FA}::test_dense_matches_reference"),
        "dQ: every unit reads the first unit's logsumexp",
    ),
    Mutant(
        "fa-dk-overwrite",
        FA_BWD,
        "dk_acc[...] += dkt",
        "dk_acc[...] = dkt",
        (FA_SCALE, f"{T_FA}::test_backward_chunk_layouts_match_reference"),
        "dK: accumulator overwritten per q block",
    ),
    Mutant(
        "fa-dv-subtile-offset",
        FA_BWD,
        "dv_acc[:, pl.ds(k0, ck)] += dvt",
        "dv_acc[:, pl.ds(0, ck)] += dvt",
        (f"{T_FA}::test_dense_matches_reference",),
        "dV: every key sub-tile of a masked pair added to the block's first keys",
    ),
    Mutant(
        "fa-dk-scale",
        FA_BWD,
        "jnp.transpose(dk_acc[...] * prm.scale)",
        "jnp.transpose(dk_acc[...] * prm.head_dim**-0.5)",
        (FA_SCALE,),
        "dK: softmax_scale ignored (1/sqrt(D) used)",
    ),
    Mutant(
        "fa-plan-shrink-both",
        FA_TILING,
        "block_kv=max(512, kv // 2) if fwd_over else kv,",
        "block_kv=max(512, kv // 2),",
        (f"{T_FA}::test_a_table_entry_over_budget_shrinks_only_the_kernels_that_are_over",),
        "plan: a backward over budget shrinks the forward's key blocks too",
    ),
    Mutant(
        "fa-dkdv-softcap",
        FA_BWD,
        "ds = ds * (1.0 - t * t)\n        dkt = _dot_f32",
        "ds = ds\n        dkt = _dot_f32",
        (FA_SCALE,),
        "dK: softcap's tanh derivative dropped",
    ),
    Mutant(
        "fa-window-left",
        FA,
        "terms.append(kidx >= qpos - prm.left)",
        "terms.append(kidx > qpos - prm.left)",
        (f"{T_FA}::test_decode_layout_multiple_row_blocks_with_sinks",),
        "mask: left window edge off by one",
    ),
    Mutant(
        "fa-lse-cotangent",
        FA_API,
        "delta = delta - dlse.astype(jnp.float32)",
        "delta = delta + dlse.astype(jnp.float32)",
        # the XLA delta: dQ unfused (fused calls derive it in the kernel)
        (FA_SCALE_DQ,),
        "backward: logsumexp cotangent folded in with the wrong sign (XLA delta)",
    ),
    Mutant(
        "fa-subtile-last",
        FA_SCHED,
        "c_hi = xp.minimum(((hi - kf) >> shift) + 1, geom.block_kv // ck)",
        "c_hi = xp.minimum(((hi - kf) >> shift), geom.block_kv // ck)",
        (f"{T_FA}::test_sub_tiles_cover_exactly_the_visible_ones",),
        "schedule: last visible sub-tile of a masked pair skipped",
    ),
    Mutant(
        "fa-varlen-segments",
        FA_API,
        'kseg = jnp.clip(jnp.searchsorted(cu_k, t_k, side="right") - 1, 0, cu_k.shape[0] - 2)',
        'kseg = jnp.clip(jnp.searchsorted(cu_k, t_k, side="left") - 1, 0, cu_k.shape[0] - 2)',
        (f"{T_FA}::test_varlen_many_sequences_some_empty",),
        "varlen: first key of each sequence assigned to the previous one",
    ),
    # -- bindings ---------------------------------------------------------------------
    Mutant(
        "tb-bf16-view",
        f"{TB}/convert.py",
        "return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)",
        "return t.view(torch.float16).numpy()",
        (f"{T_RMS_OP}::test_forward_and_grads_match_torch[interpret]",),
        "bindings: bf16 tensors reinterpreted as f16 (wrong cast)",
    ),
    Mutant(
        "tb-jit-cache-key",
        f"{TB}/op.py",
        "key = (impl, statics)",
        "key = (impl,)",
        (f"{T_TB}::test_jit_cache_is_keyed_by_static_arguments",),
        "bindings: compiled functions cached without their static arguments",
    ),
    Mutant(
        "tb-optional-grad",
        f"{TB}/op.py",
        "result[i] = None if _no_gradient(args[i]) else g",
        "result[i] = g",
        (f"{T_TB}::test_forward_and_autograd_with_optional_tensor",),
        "bindings: a gradient returned for an absent optional tensor",
    ),
    Mutant(
        "tb-residual-recompute",
        f"{TB}/op.py",
        "args, outputs, residuals, cts = split_bwd_args(a[:-1])\n",
        "args, outputs, residuals, cts = split_bwd_args(a[:-1])\n"
        "        outputs, residuals = forward(*args, interpret=interpret)\n"
        "        outputs = as_tuple(outputs)\n",
        (f"{T_AR}::test_backward_program_runs_no_forward_kernel[flash_attention]",),
        "bindings: the backward op runs the forward again for its residuals",
    ),
    Mutant(
        "tb-saved-outputs",
        f"{TB}/op.py",
        "outs, residuals = saved[n_in : n_in + n_out], list(saved[n_in + n_out :])",
        "outs, residuals = saved[n_in - 1 : n_in - 1 + n_out], list(saved[n_in + n_out :])",
        (f"{T_FA_OP}::test_flash_attn_varlen_func_and_grads_match_torch[case0-interpret]",),
        "bindings: the backward reads an input where autograd saved the output",
    ),
    Mutant(
        "fa-residual-lse",
        FA_API,
        "lse5, o5 = residuals if len(residuals) == 2 else (residuals[0], c.q_in(out))",
        "lse5, o5 = residuals if len(residuals) == 2 else (0.0 * residuals[0], c.q_in(out))",
        (f"{T_FA}::test_gqa_8_causal_cross_lengths_f32",),
        "backward: the forward's logsumexp residual not used (zeros instead)",
    ),
    Mutant(
        "rd-op-offset",
        RD_OPS,
        "return lhs, rhs, group_sizes, jnp.asarray(group_offset, jnp.int32), rhs_scale",
        "return lhs, rhs, group_sizes, jnp.asarray(0, jnp.int32), rhs_scale",
        (f"{T_RD_OP}::test_group_offset_shards_sum_to_full_result",),
        "binding: ragged_dot op drops group_offset",
    ),
    Mutant(
        "fa-op-scale",
        FA_OPS,
        "scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)",
        "scale = 1.0 / math.sqrt(head_dim)",
        (f"{T_FA_OP}::test_attention_forward_padding_masks_and_sinks[none]",),
        "binding: softmax_scale ignored",
    ),
    # -- MXFP4 ------------------------------------------------------------------
    Mutant(
        "mx-subnormal",
        MX,
        "v = jnp.minimum(f, f + f - sub)",
        "v = f",
        (f"{T_MX}::test_decode_pairs_gives_every_byte_its_two_e2m1_values",),
        "decode: the subnormal codes (0, 0.5) read as normals (0.5, 0.75)",
    ),
    Mutant(
        "mx-folded-scale-range",
        MX,
        "FOLDED_SCALES = (2, 252)",
        "FOLDED_SCALES = (0, 255)",
        (f"{T_MX}::test_decode_pairs_folds_each_scale_into_the_values",),
        "decode: scales folded past bf16's range (exponent carried into the sign)",
    ),
    Mutant(
        "mx-nan-scale-finite",
        MX,
        "sub = spread((jnp.where(raw == 255, 255, e) << 7) * _PAIR)",
        "sub = spread((e << 7) * _PAIR)",
        (f"{T_MX}::test_decode_pairs_folds_each_scale_into_the_values",),
        "decode: a NaN scale decodes its block as finite values",
    ),
    Mutant(
        "mx-high-sign",
        MX,
        "_SPREAD_SIGN = (1 << 12) | (1 << 24)",
        "_SPREAD_SIGN = (1 << 12) | (1 << 23)",
        (f"{T_MX}::test_mxfp4_ragged_dot_and_d_lhs_match_dequantized_reference",),
        "decode: the odd k's sign taken from its exponent bit",
    ),
    Mutant(
        "mx-scale-rows",
        MX,
        "jnp.broadcast_to(v[:, None, :], (nb, BLOCK // 2, c)).reshape(r, c)",
        "jnp.broadcast_to(v[:1, None, :], (nb, BLOCK // 2, c)).reshape(r, c)",
        (
            f"{T_MX}::test_each_scale_reaches_its_own_32_rows_and_column",
            f"{T_MX}::test_decode_pairs_folds_each_scale_into_the_values",
        ),
        "scales: every 32-row block decoded with the first block's scale",
    ),
    Mutant(
        "mx-piece-scales",
        GMM,
        "w = mxfp4.decode_pairs(b, sbuf[slot, :, pl.ds(c0, width)])",
        "w = mxfp4.decode_pairs(b, sbuf[slot, :, pl.ds(0, width)])",
        (f"{T_MX}::test_mxfp4_ragged_dot_and_d_lhs_match_dequantized_reference",),
        "gmm: every slab piece scaled by the first piece's scales",
    ),
    Mutant(
        "mx-once-columns",
        GMM,
        "store(r0, size, c0, width, y, kept_rows(r0, size, fresh))",
        "store(r0, size, 0, width, y, kept_rows(r0, size, fresh))",
        (f"{T_MX}::test_mxfp4_ragged_dot_and_d_lhs_match_dequantized_reference",),
        "gmm: a many-row group's decoded pieces all written to the first columns",
    ),
    Mutant(
        "mx-torch-layout",
        EXPERTS,
        "w = weight.detach().view(torch.uint8).transpose(1, 2).contiguous()",
        "w = weight.detach().view(torch.uint8).reshape(weight.shape[0], weight.shape[2], -1)",
        (f"{T_MX}::test_torch_fp4_experts_convert_like_to_kernel_layout_and_check_float_scales",),
        "experts_forward: FP4 weights reshaped, not transposed, to the kernel layout",
    ),
    Mutant(
        "mx-fused-piece-scales",
        MOE_DEC,
        "w = mxfp4.decode_pairs(b, s_ref[:, pl.ds(c0, width)])",
        "w = mxfp4.decode_pairs(b, s_ref[:, pl.ds(0, width)])",
        (f"{T_DEC}::test_mxfp4_weights_decode_in_the_one_launch",),
        "one-launch MXFP4: every column piece decoded with the first piece's scales",
    ),
    Mutant(
        "mx-fused-down-scales",
        MOE_DEC,
        "src = ds_hbm.at[e] if mx else ds_hbm.at[pl.ds(e, 1)]",
        "src = ds_hbm.at[active[0]] if mx else ds_hbm.at[pl.ds(e, 1)]",
        (f"{T_DEC}::test_mxfp4_weights_decode_in_the_one_launch",),
        "one-launch MXFP4: every expert's down projection scaled by the first active one's",
    ),
    Mutant(
        "fp8-hf-linear-scale",
        HF_FP8,
        "module.weight.detach(), module.weight_scale_inv.detach(), module.block_size, torch.float32",
        "module.weight.detach(), torch.ones_like(module.weight_scale_inv), module.block_size, torch.float32",
        (f"{T_E2E}::test_fp8_checkpoint_loads_fp8_experts_on_a_host_without_cuda",),
        "FP8 loader: the dequantized Linears lose their scales",
    ),
    Mutant(
        "mx-hf-blocks",
        HF_MX,
        "w, s = _fp4_projection(blocks.reshape(*blocks.shape[:2], -1), scales)",
        "w, s = _fp4_projection(blocks.transpose(2, 3).reshape(*blocks.shape[:2], -1), scales)",
        (f"{T_E2E}::test_gpt_oss_mxfp4_checkpoint_loads_4bit_and_runs_our_experts",),
        "GPT-OSS loader: each 32-value block's 16 bytes read column-major",
    ),
    Mutant(
        "mx-hf-save-scales",
        HF_MX,
        'state[f"{name}.{proj}_scales"] = s[:, : half_k // 16]',
        'state[f"{name}.{proj}_scales"] = s[:, : half_k // 16 + 1]',
        (f"{T_E2E}::test_gpt_oss_mxfp4_checkpoint_loads_4bit_and_runs_our_experts",),
        "GPT-OSS save: the scale rows' padding written into the checkpoint",
    ),
    # -- w8a8 -------------------------------------------------------------------
    Mutant(
        "w8a8-torch-flag",
        RD_OPS,
        "        quantize_lhs=quantize_lhs,\n    )\n\n\ndef _rd_arrays",
        "        quantize_lhs=False,\n    )\n\n\ndef _rd_arrays",
        (f"{T_W8}::test_torch_op_quantize_lhs_matches_reference_and_keeps_weight_only_gradient",),
        "torch ragged_dot: quantize_lhs dropped before the kernel",
    ),
    Mutant(
        "w8a8-experts-flag",
        RD_OPS,
        '    statics["quantize_activations"] = args[17]',
        '    statics["quantize_activations"] = False',
        (f"{T_W8}::test_experts_forward_w8a8_quantizes_fp8_experts_activations",),
        "torch moe_experts op: quantize_activations dropped before the program",
    ),
    Mutant(
        "w8a8-row-scale",
        GMM,
        "                if row_scale is not None:\n                    y = y * row_scale",
        "                if row_scale is not None:\n                    y = y",
        (f"{T_W8}::test_w8a8_ragged_dot_matches_reference_on_quantized_rows",),
        "gmm w8a8: the rows' quantization scales never multiply the product back",
    ),
    Mutant(
        "w8a8-qmax",
        RD_W8A8,
        "q = xf * jnp.where(amax > 0, qmax / amax, 0.0)",
        "q = xf * jnp.where(amax > 0, (qmax - 1) / amax, 0.0)",
        (f"{T_W8}::test_rows_quantize_to_their_largest_magnitude[int8]",),
        "w8a8: rows quantized to 126, not the dtype's largest value",
    ),
    # -- decode attention over a KV cache ----------------------------------------
    Mutant(
        "kv-resident-init",
        FA_DEC,
        "            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)\n",
        "            pass\n",
        (f"{T_KV}::test_kvcache_cases[short-kw5]",),
        "decode: resident outputs of sequences with no work left unwritten",
    ),
    Mutant(
        "kv-resident-lse-init",
        FA_DEC,
        "lse_ref[...] = jnp.full(lse_ref.shape, -jnp.inf, jnp.float32)",
        "lse_ref[...] = jnp.full(lse_ref.shape, 0.0, jnp.float32)",
        (f"{T_KV}::test_kvcache_cases[short-kw5]",),
        "decode: a sequence with no work reads lse 0, not +inf",
    ),
    Mutant(
        "kv-resident-q-rows",
        FA_DEC,
        "q = qbuf[b, pl.ds(hh * br, br)]",
        "q = qbuf[b, pl.ds(0, br)]",
        (f"{T_KV}::test_kvcache_cases[heads-major-mask-kw3]",),
        "decode, [B, Hkv, S, D] cache: every kv head scored with the first head's queries",
    ),
    Mutant(
        "kv-resident-out-row",
        FA_DEC,
        "o_ref[b] = o.reshape(hb * br, prm.head_dim_v)",
        "o_ref[0] = o.reshape(hb * br, prm.head_dim_v)",
        (f"{T_KV}::test_kvcache_cases[paged-window-kw2]",),
        "decode: every sequence's output written to the first sequence's rows",
    ),
    Mutant(
        "kv-direct-lse",
        FA_KV,
        "lse = jnp.where(lse[0, ..., 0] == -jnp.inf, jnp.inf, lse[0, ..., 0])",
        "lse = lse[0, ..., 0]",
        (f"{T_KV}::test_kvcache_cases[short-kw5]",),
        "decode without a combine step: empty rows' lse -inf, not flash-attn's +inf",
    ),
    Mutant(
        "kv-sched-offset",
        FA_DEC,
        "blk = g_live - off[0] - jnp.sum(",
        "blk = g_live - jnp.sum(",
        (f"{T_KV}::test_kvcache_cases[paged-window-kw2]",),
        "decode schedule: the first sequence's window start dropped from its blocks",
    ),
    Mutant(
        "kv-sched-window-steps",
        FA_DEC,
        "jnp.where(before, step, 0)",
        "jnp.where(before, count, 0)",
        (f"{T_KV}::test_schedule_walks_only_valid_blocks",),
        "decode schedule: later sequences' blocks counted from 0, not their window start",
    ),
    Mutant(
        "glu-up-offset",
        GMM,
        "for h, src_col in enumerate((col + c * piece_n, half + col + c * piece_n)):",
        "for h, src_col in enumerate((col + c * piece_n, col + c * piece_n)):",
        (f"{T_GMM}::test_gmm_glu_epilogue_matches_reference",),
        "gmm glu: the up block is fetched from the gate half (act(gate) * gate)",
    ),
    Mutant(
        "glu-piece-layout",
        GMM,
        "dst = 2 * c * piece_n + h * width",
        "dst = c * piece_n + h * width",
        (f"{T_GMM}::test_gmm_glu_epilogue_matches_reference",),
        "gmm glu: pieces' gate and up columns overlap in the slab",
    ),
    Mutant(
        "moe-primal-unfused",
        RD,
        "return _moe_program(*arrays, **statics, inference=True)",
        "return _moe_program(*arrays, **statics, inference=False)",
        (f"{T_MOE}::test_inference_applies_the_activation_in_the_gate_up_kernel",),
        "moe: inference runs the unfused activation pass (the [S, 2I] projection is written)",
    ),
    Mutant(
        "gmm-no-zero-outside-shard",
        GMM,
        "inside = jnp.logical_and(tile_lo >= shard_lo, tile_hi <= shard_hi)",
        "inside = jnp.logical_or(tile_lo >= shard_lo, tile_hi <= shard_hi)",
        (f"{T_COMB}::test_gmm_writes_every_word_of_the_tiles_its_groups_fill",),
        "gmm: a tile holding rows before the shard's groups is not zeroed",
    ),
    Mutant(
        "gmm-packed-padding-unwritten",
        GMM,
        "padded = packed and pairs.row_words(block_n) > pairs.groups(block_n)",
        "padded = False",
        (f"{T_COMB}::test_gmm_writes_every_word_of_the_tiles_its_groups_fill",),
        "gmm: packed padding words of a tile inside the shard left unwritten",
    ),
    Mutant(
        "gmm-resident-rows-unwaited",
        GMM,
        "                    whole.wait()\n",
        "",
        (f"{T_GMM}::test_gathered_rows_are_waited_for_under_tpu_interpreter",),
        "gmm: rows stored from the resident hidden states before their copy is waited for",
    ),
    Mutant(
        "gmm-staged-rows-unwaited",
        GMM,
        "                    stage_copy(c).wait()\n",
        "",
        (f"{T_GMM}::test_gathered_rows_are_waited_for_under_tpu_interpreter",),
        "gmm: a staging copy of the hidden states packed before it is waited for",
    ),
    Mutant(
        "gmm-staged-last-copy-short",
        GMM,
        "jnp.minimum(c * bt, t_main - bt), 8)",
        "jnp.minimum(c * bt, t_main - bt - 8), 8)",
        (f"{T_GMM}::test_gmm_gathers_its_rows_beside_a_bias",),
        "gmm: the last staging copy ends a tile early: those hidden states never packed",
    ),
    Mutant(
        "gmm-staged-tail-dropped",
        GMM,
        "                        tail.start()\n",
        "                        pass\n",
        (f"{T_GMM}::test_gmm_gathers_its_rows_beside_a_bias",),
        "gmm: the hidden states past the last whole tile (packed by XLA) never copied",
    ),
    Mutant(
        "tiling-vmem-stage-uncounted",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        "        need += stage_bytes(stage_rows, resident_tokens, k, jnp.dtype(in_dtype))",
        "        need += 0",
        (
            "tests/ragged_dot/test_compile_gate.py::"
            "test_gate_up_gmm_gathering_its_rows_compiles_at_its_vmem_estimate"
            "[gather-qwen3_30b_a3b-8192-v6e]",
        ),
        "tiling: the staging copies of resident hidden states left out of gmm's VMEM",
    ),
    Mutant(
        "gmm-resident-wrong-row",
        GMM,
        "src = hid.at[pl.ds(pl.multiple_of(tok * rw, 8), rw)]",
        "src = hid.at[pl.ds(pl.multiple_of((c + j) * rw, 8), rw)]",
        (f"{T_GMM}::test_gmm_gathers_its_rows_as_xla_would",),
        "gmm: a resident row taken from the row's position, not its token",
    ),
    Mutant(
        "tiling-resident-shrinks-tiles",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        "if res is not None and (best is None or (res[1], res[5]) >= (best[1], best[5])):",
        "if res is not None:",
        (f"{T_GMM}::test_gathering_gmm_keeps_the_hidden_states_in_vmem_only_beside_full_blocks",),
        "tiling: resident rows taken with smaller row tiles than without them",
    ),
    Mutant(
        "tiling-resident-narrow-tiles",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        "(gen.mxu_bound_block_m or (RESIDENT_BLOCK_M if resident else 0))",
        "gen.mxu_bound_block_m",
        (f"{T_GMM}::test_gathering_gmm_keeps_the_hidden_states_in_vmem_only_beside_full_blocks",),
        "tiling: resident rows without the 2048-row tiles and merged tails",
    ),
    Mutant(
        "gmm-vmem-resident-rows-uncounted",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        "        need = (2 * bm + chunk + resident_tokens) * _row_bytes(k)",
        "        need = (2 * bm + chunk) * _row_bytes(k)",
        (
            "tests/ragged_dot/test_compile_gate.py::"
            "test_gate_up_gmm_gathering_its_rows_compiles_at_its_vmem_estimate"
            "[gather-qwen3_30b_a3b-8192-v6e]",
        ),
        "tiling: the resident hidden states' rows left out of the gather gmm's VMEM estimate",
    ),
    Mutant(
        "combine-rows-anywhere",
        COMBINE,
        "rows if interpret else _in_hbm(rows)",
        "rows",
        (f"{T_COMB}::test_combine_reads_its_rows_where_the_gmm_wrote_them",),
        "combine: rows left to XLA's placement (copied whole into VMEM before the kernel)",
    ),
    Mutant(
        "combine-halves-swapped",
        COMBINE,
        "values = pairs.group_values(words, h, g)\n",
        "values = pairs.group_values(words, h, g)[::-1]\n",
        (f"{T_COMB}::test_combine_matches_f32_sum_of_the_same_rows",),
        "combine: a word's high half written where its low half goes",
    ),
    Mutant(
        "gmm-wide-tiles-when-weight-bound",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        "    many = m >= gen.chunk_m * max(g, 1)  # the groups average a whole pass",
        "    many = True",
        (
            "tests/ragged_dot/test_gmm.py::test_tpu7x_takes_wider_row_tiles_only_where_the_mxus_bind",
        ),
        "tiling: tpu7x's 2048-row gmm tiles also where the weight stream binds"
        " (Qwen3 2,048 tokens: gate/up 299.6 -> 308.0 us)",
    ),
    Mutant(
        "combine-tile-ignores-latency",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        "    return max(16, min(COMBINE_BLOCK_T, fit, cover, eighth))",
        "    return max(16, min(COMBINE_BLOCK_T, fit, eighth))",
        (f"{T_COMB}::test_combine_steps_copy_for_about_a_dma_latency",),
        "combine: tiles as large as the slots' VMEM allows, not as a DMA latency asks"
        " (v6e Gemma 4 at 8,192 tokens: 417.0 -> 423.7 us)",
    ),
    Mutant(
        "combine-ahead-slot",
        COMBINE,
        "functools.partial(step, cur, (cur + 2) % SLOTS)",
        "functools.partial(step, cur, (cur + 1) % SLOTS)",
        (f"{T_COMB}::test_combine_matches_f32_sum_of_the_same_rows",),
        "combine: the copies of the tile two ahead land in the next step's slot",
    ),
    Mutant(
        "gmm-packed-group",
        GMM,
        "g = lax.div(c0, pairs.GROUP) + gg",
        "g = lax.div(c0, pairs.GROUP)",
        (f"{T_COMB}::test_gmm_packed_writes_the_packed_rows_of_its_output",),
        "gmm packed: every 256-column group of a piece stored in the piece's first word row",
    ),
    Mutant(
        "gmm-deinterleave-parity",
        GMM,
        "gate, up = deinterleave(y, 0), deinterleave(y, 1)",
        "gate, up = deinterleave(y, 1), deinterleave(y, 0)",
        (f"{T_GMM}::test_gmm_interleaved_glu_epilogue_matches_reference",),
        "gmm glu_interleaved: the odd columns taken for the gate, the even for up",
    ),
    Mutant(
        "gmm-deinterleave-second-tile",
        GMM,
        "parts.append(jnp.where(lane < 64, take(t0), take(t0 + 128)))",
        "parts.append(take(t0))",
        (f"{T_GMM}::test_gmm_interleaved_glu_epilogue_matches_reference",),
        "gmm glu_interleaved: each output tile gathered from the first of its two product tiles",
    ),
    Mutant(
        "gmm-bias-unrounded-product",
        GMM,
        "            y = y.astype(dtype).astype(jnp.float32)\n",
        "            y = y.astype(jnp.float32)\n",
        (f"{T_GMM}::test_gmm_bias_matches_reference",),
        "gmm bias: added to the f32 product, not to the product rounded to the output dtype",
    ),
    Mutant(
        "gmm-bias-slab-offset",
        GMM,
        "pl.ds(pl.multiple_of(n_q * slab_n, 128), slab_n)]",
        "pl.ds(0, slab_n)]",
        (f"{T_GMM}::test_gmm_bias_matches_reference",),
        "gmm bias: every N slab of a group given the group's first slab's bias",
    ),
    Mutant(
        "moe-epilogue-bias-twice",
        MOE,
        "return in_epilogue(x, w, group_sizes)",
        "return in_epilogue(x, w, group_sizes) + bias[ids_clamped].astype(dtype)",
        (
            f"{T_MOE}::test_inference_applies_the_activation_in_the_gate_up_kernel",
            f"{T_MOE}::test_inference_adds_the_gate_up_bias_in_the_gate_up_kernel",
        ),
        "moe: inference adds a bias again after the gmm added it (down, or unfused gate/up)",
    ),
    Mutant(
        "gmm-fp4-glu-decodes-output-columns",
        GMM,
        "            slab_c0, slab_w = (2 * c0, 2 * width) if glu else (c0, width)\n",
        "            slab_c0, slab_w = (c0, 2 * width) if glu else (c0, width)\n",
        (f"{T_MX}::test_mxfp4_interleaved_glu_is_the_unfused_program_bit_for_bit",),
        "gmm FP4 glu: a group of many rows decodes the slab from its output column, not"
        " its product column",
    ),
    Mutant(
        "moe-fp4-gate-up-unfused",
        RD,
        "    if scale is not None and not (fp4 and not is_concatenated):\n",
        "    if scale is not None:\n",
        (f"{T_MX}::test_mxfp4_gpt_oss_inference_applies_bias_and_activation_in_its_kernels",),
        "moe: GPT-OSS's FP4 checkpoints keep XLA's bias and activation at inference",
    ),
    Mutant(
        "moe-interleaved-glu-any-rows",
        RD,
        "    if interleaved and m < tiling.GLU_INTERLEAVED_MIN_GROUP_ROWS * w.shape[0]:\n",
        "    if False:\n",
        (f"{T_MOE}::test_gpt_oss_layer_takes_the_kernels_its_shapes_allow",),
        "moe: GPT-OSS's gate/up fused at decode too, where its two whole-expert slots lose",
    ),
    Mutant(
        "moe-fp4-glu-smaller-tiles",
        RD,
        "        return cfg.block_m >= plain.block_m\n",
        "        return True\n",
        (f"{T_MOE}::test_gpt_oss_layer_takes_the_kernels_its_shapes_allow",),
        "moe: FP4 GPT-OSS fused where its whole-expert slabs leave smaller row tiles (tpu7x)",
    ),
    Mutant(
        "moe-combine-off",
        MOE,
        "    if down_combine is not None:\n",
        "    if False:\n",
        (f"{T_MOE}::test_inference_combines_each_tokens_rows_in_the_combine_kernel",),
        "moe: inference gathers rows for the combine in XLA although the kernel applies",
    ),
    Mutant(
        "moe-gather-not-in-one-hot-range",
        MOE,
        'routing == "auto" and not kernel_gathers and tiling.route_by_matmul(',
        'routing == "auto" and tiling.route_by_matmul(',
        (f"{T_MOE}::test_prefill_inference_gathers_rows_in_the_gate_up_kernel",),
        "moe: in the one-hot range inference dispatches by the matmul although the gate/up"
        " gmm can fetch its rows",
    ),
    Mutant(
        "moe-combine-one-hot-nan",
        MOE,
        "        res = jnp.where(bad[:, None], jnp.nan, res)\n",
        "        res = res\n",
        (f"{T_MOE}::test_inference_combines_each_tokens_rows_in_the_combine_kernel",),
        "moe: in the one-hot range a token whose hidden state is not finite gets a finite row",
    ),
    Mutant(
        "rms-ring-prefetch-slot",
        RMS,
        "for c in in_copies(ahead, lax.rem(ahead, n_in)):",
        "for c in in_copies(ahead, lax.rem(b, n_in)):",
        (f"{T_RMS}::test_ring_forward_matches_reference",),
        "rmsnorm ring: the prefetch lands in the slot being normalised",
    ),
    Mutant(
        "rms-ring-last-block",
        RMS,
        "return pl.multiple_of(jnp.minimum(b * br, rows - br), 8)",
        "return pl.multiple_of(jnp.minimum(b * br, rows - br - 8), 8)",
        (f"{T_RMS}::test_ring_forward_matches_reference",),
        "rmsnorm ring: the last block stops short of the array's end",
    ),
    Mutant(
        "rms-ring-normalises-x",
        RMS,
        "obufs[1][oslot, rs, :] = s\n                x = s.astype(jnp.float32)",
        "obufs[1][oslot, rs, :] = s",
        (f"{T_RMS}::test_ring_forward_matches_reference",),
        "rmsnorm ring: the fused forward normalises x instead of x + residual",
    ),
    Mutant(
        "rms-ring-dw-overlap",
        RMS,
        "    shared = blocks * block_rows - rows\n",
        "    shared = 0\n",
        (f"{T_RMS}::test_ring_backward_matches_reference",),
        "rmsnorm ring backward: rows the last block shares are counted twice in dweight",
    ),
    Mutant(
        "rms-ring-dx-projection",
        RMS,
        "k = rstd * rstd * rstd * (jnp.sum(gx, axis=-1, keepdims=True) / hidden)",
        "k = rstd * rstd * (jnp.sum(gx, axis=-1, keepdims=True) / hidden)",
        (f"{T_RMS}::test_ring_backward_matches_reference",),
        "rmsnorm ring backward: dx's projection term misses a factor of rstd",
    ),
    Mutant(
        "rms-ring-bwd-ds",
        RMS,
        "dx = dx + ibufs[1][slot, rs, cs].astype(jnp.float32)",
        "dx = dx",
        (f"{T_RMS}::test_ring_backward_matches_reference",),
        "rmsnorm ring backward: residual-stream grad ds not added",
    ),
    Mutant(
        "rms-ring-lane-tiles-short",
        RMS,
        "    for t in range(1, x.shape[-1] // 128):",
        "    for t in range(1, x.shape[-1] // 128 - 1):",
        (f"{T_RMS}::test_ring_backward_matches_reference",),
        "rmsnorm ring backward: the row sums miss a column's last lane tile",
    ),
    Mutant(
        "rms-ring-dw-unscaled",
        RMS,
        "acc_ref[:, cs] += _sublane_sums(t * x)",
        "acc_ref[:, cs] += _sublane_sums(dy * x)",
        (f"{T_RMS}::test_ring_backward_matches_reference",),
        "rmsnorm ring backward: the weight gradient's rows miss rstd",
    ),
    Mutant(
        "rms-ring-uncount-mask",
        RMS,
        "jnp.where(row < shared, contrib, 0.0)",
        "jnp.where(row <= shared, contrib, 0.0)",
        (f"{T_RMS}::test_ring_backward_matches_reference",),
        "rmsnorm ring backward: one row past the shared ones is taken out of dweight",
    ),
    Mutant(
        "rms-ring-bwd-eps",
        RMS,
        "rstd = jax.lax.rsqrt(jnp.sum(sq, axis=-1, keepdims=True) / hidden + eps)",
        "rstd = 1.0 / (jnp.sqrt(jnp.sum(sq, axis=-1, keepdims=True) / hidden) + eps)",
        (f"{T_RMS}::test_ring_backward_matches_reference",),
        "rmsnorm ring backward: eps as 1/(sqrt(ms)+eps), not rsqrt(ms+eps)",
    ),
    Mutant(
        "cache-ignores-code",
        "bench/xla_cost.py",
        "[key, generation, INSTRUMENT_VERSION, source_fingerprint()], sort_keys=True, default=str",
        "[key, generation, INSTRUMENT_VERSION], sort_keys=True, default=str",
        ("tests/bench/test_xla_fusions.py::test_a_record_of_other_code_is_compiled_again",),
        "bench cache: a record made by other code is served (stale figures after an edit)",
    ),
    Mutant(
        "pairs-partial-high-garbage",
        "kernels/ragged_dot/ragged_dot_tpu/pairs.py",
        "        high = jnp.zeros((rows, lw), jnp.float32)\n",
        "        high = y[:, o : o + lw]\n",
        (f"{T_COMB}::test_pack_rows_kernel_writes_pack_rows_bit_for_bit",),
        "pairs: a partial group with no high columns packs its low half there too",
    ),
    Mutant(
        "pairs-partial-high-cut",
        "kernels/ragged_dot/ragged_dot_tpu/pairs.py",
        "        pieces.append(high if hw == HALF else high[:, :hw])",
        "        pieces.append(high)",
        (f"{T_GMM}::test_gmm_gathers_its_rows_as_xla_would",),
        "pairs: a partial high half unpacked whole (its zero columns kept)",
    ),
    Mutant(
        "combine-partial-group-offset",
        COMBINE,
        "out_ref[pl.ds(r0, SUB), pl.ds(o + p * half, v.shape[1])]",
        "out_ref[pl.ds(r0, SUB), pl.ds(o + p * v.shape[1], v.shape[1])]",
        (f"{T_COMB}::test_combine_matches_f32_sum_of_the_same_rows",),
        "combine: a group's high half stored at its low half's width, not 128 on",
    ),
    Mutant(
        "tiling-packed-pieces-off-groups",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        "    if packed and p % pairs.GROUP and block_n > p:",
        "    if False:",
        (f"{T_COMB}::test_gmm_packed_adds_its_bias_before_packing",),
        "tiling: packed pieces of 128 columns, off the 256-column word groups",
    ),
    Mutant(
        "gmm-packed-bias-dropped",
        RD,
        "            x, w, group_sizes, down_scale, down_config, packed=True, bias=down_bias\n",
        "            x, w, group_sizes, down_scale, down_config, packed=True\n",
        (f"{T_MX}::test_mxfp4_gpt_oss_inference_applies_bias_and_activation_in_its_kernels",),
        "api: the down bias left out of the packed down gmm feeding the combine",
    ),
    Mutant(
        "tiling-combine-partial-on-tpu7x",
        "kernels/ragged_dot/ragged_dot_tpu/tiling.py",
        'return hidden % pairs.GROUP == 0 or get_generation(generation).name != "tpu7x"',
        "return True",
        (f"{T_COMB}::test_the_layer_combines_in_the_kernel_where_tiling_says",),
        "tiling: GPT-OSS's partial word groups combined in the kernel on tpu7x too",
    ),
)


# -- the list itself ---------------------------------------------------------------


def check_mutants(root: Path = ROOT, mutants=MUTANTS) -> list[str]:
    """Problems with the list: each original occurs exactly once, differs from
    its replacement, ids are unique, and the named test files and test
    functions exist."""
    problems = []
    ids = [m.id for m in mutants]
    for dup in sorted({i for i in ids if ids.count(i) > 1}):
        problems.append(f"{dup}: duplicate id")
    for m in mutants:
        path = root / m.file
        if not path.is_file():
            problems.append(f"{m.id}: {m.file} does not exist")
            continue
        n = path.read_text().count(m.original)
        if n != 1:
            problems.append(
                f"{m.id}: original text occurs {n} times in {m.file} "
                f"(expected once): {m.original!r}"
            )
        if m.original == m.replacement:
            problems.append(f"{m.id}: replacement equals the original")
        if not m.tests:
            problems.append(f"{m.id}: no tests")
        for t in m.tests:
            test_file = root / t.split("::")[0]
            if not test_file.is_file():
                problems.append(f"{m.id}: test file of {t} does not exist")
                continue
            # The test function itself (a renamed test would leave the full run's
            # baseline selecting nothing). Parameter ids are checked by that run.
            name = t.split("::")[-1].split("[")[0]
            if f"def {name}(" not in test_file.read_text():
                problems.append(f"{m.id}: {t}: no test function {name} in its file")
    return problems


# -- running ----------------------------------------------------------------------


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked-but-not-ignored files)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    for rel in sorted(set(out.decode().split("\0")) - {""}):
        src = ROOT / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        dst = dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)


PYTEST_ARGS = [
    "-x",
    "-q",
    "-p",
    "no:randomly",
    "-p",
    "no:cacheprovider",
    "--no-header",
    "-o",
    "addopts=--import-mode=importlib",
    "--tb=short",
    "-W",
    "ignore",
]


def first_error(log: Path) -> str:
    """The first `E ...` line pytest printed: what the failing test said."""
    try:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("E "):
                return " ".join(line[1:].split())[:110]
    except OSError:
        pass
    return ""


def _in_copy(path: str, tree: Path) -> str:
    """scripts/env.sh's import paths of this checkout (its root, its kernel folders),
    pointed at the copy; other paths (site-packages, even inside ROOT/.venv) unchanged."""
    root = str(ROOT)
    if path == root or path.startswith(str(ROOT / "kernels") + os.sep):
        return str(tree) + path[len(root) :]
    return path


def _child_env(tree: Path) -> dict:
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"),
        HYPOTHESIS_PROFILE="mutants",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONPATH=os.pathsep.join(
            _in_copy(p, tree) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p
        ),
    )
    return env


def _child(tree: Path, tests, log: Path, exec_pytest: bool) -> None:
    """In a forked child: run pytest on `tests` in `tree`, output to `log`; never returns."""
    code = 3
    try:
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(tree)
        env = _child_env(tree)
        if exec_pytest:  # --no-fork: a fresh interpreter
            os.execve(sys.executable, [sys.executable, "-m", "pytest", *PYTEST_ARGS, *tests], env)
        os.environ.update(env)
        sys.dont_write_bytecode = True
        # Drop this script's folder; the checkout's import paths become the copy's.
        sys.path[:] = [_in_copy(p, tree) for p in sys.path if p not in ("", str(ROOT / "scripts"))]
        import pytest

        code = int(pytest.main([*PYTEST_ARGS, *tests]))
    except BaseException:  # noqa: BLE001 - report, never unwind into the parent's loop
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@dataclasses.dataclass
class Job:
    """One pytest run in a forked child."""

    key: Any
    pid: int
    started: float
    deadline: float


@dataclasses.dataclass(frozen=True)
class Done:
    key: Any
    rc: int  # pytest's exit code; -9: killed at the timeout
    wall_s: float
    cpu_s: float  # the child's own user + system time (os.wait4)


class Runner:
    """Runs pytest selections in up to `workers` forked children at once.

    Forked from a parent that has already imported JAX, torch and pytest, each
    run pays for its tests, not for a fresh interpreter (`exec_pytest`: a
    fresh one). Each child's CPU time comes from its own rusage, so it is
    right however many run at once.
    """

    def __init__(self, workers: int, exec_pytest: bool):
        self.workers = workers
        self.exec_pytest = exec_pytest
        self.jobs: dict[int, Job] = {}

    def free(self) -> bool:
        return len(self.jobs) < self.workers

    def start(self, key, tree: Path, tests, timeout: float, log: Path) -> None:
        pid = os.fork()
        if pid == 0:
            _child(tree, tests, log, self.exec_pytest)
        now = time.monotonic()
        self.jobs[pid] = Job(key, pid, now, now + timeout)

    def wait(self) -> Done:
        """Blocks until a run ends (or is killed at its timeout)."""
        while True:
            for pid, job in list(self.jobs.items()):
                killed = False
                if time.monotonic() > job.deadline:
                    os.killpg(pid, signal.SIGKILL)
                    killed = True
                done, status, usage = os.wait4(pid, 0 if killed else os.WNOHANG)
                if done:
                    del self.jobs[pid]
                    rc = -9 if killed else os.waitstatus_to_exitcode(status)
                    cpu = usage.ru_utime + usage.ru_stime
                    return Done(job.key, rc, time.monotonic() - job.started, cpu)
            time.sleep(0.2)


def _preload() -> None:
    """Third-party imports the forked children inherit (no project module)."""
    import hypothesis  # noqa: F401
    import jax  # noqa: F401
    import jax.numpy  # noqa: F401
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import torch  # noqa: F401
    from jax.experimental import pallas  # noqa: F401


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated mutant ids")
    ap.add_argument("--check", action="store_true", help="verify the list only")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the run of the selected tests on the unmodified copy",
    )
    ap.add_argument("--no-fork", action="store_true", help="a fresh interpreter per test run")
    ap.add_argument(
        "--workers",
        type=int,
        default=int(os.environ.get("MUTANT_WORKERS", 0)) or min(2, os.cpu_count() or 1),
        help="test runs at once, each in its own copy of the tree (default: 2)",
    )
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy and logs")
    args = ap.parse_args(argv)
    t_start = time.monotonic()

    mutants = list(MUTANTS)
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {m.id for m in mutants}
        if unknown:
            ap.error(f"--only: unknown ids {sorted(unknown)}")
        mutants = [m for m in mutants if m.id in wanted]
    if args.list:
        for m in mutants:
            print(f"{m.id:28s} {m.file}: {m.what}")
        return 0
    problems = check_mutants(ROOT, mutants)
    if problems:
        print("mutant list is out of date with the code:", *problems, sep="\n  ")
        return 2
    print(f"{len(mutants)} mutants well-formed ({len({m.file for m in mutants})} files)")
    if args.check:
        return 0

    if not args.no_fork:
        _preload()
    runner = Runner(args.workers, exec_pytest=args.no_fork)
    work = Path(tempfile.mkdtemp(prefix="mutants-"))
    # One copy of the tree per worker: a mutant is planted in its worker's copy.
    trees = [work / f"tree{i}" for i in range(args.workers)]
    for tree in trees:
        copy_tree(tree)
    logs = work / "logs"
    logs.mkdir()
    rows, failed, cpu_total = [], False, 0.0
    try:
        if not args.no_baseline:
            selected = sorted({t for m in mutants for t in m.tests})
            # The test files dealt out to the workers, each share in one run.
            files = sorted({t.split("::")[0] for t in selected})
            parts = [
                [t for t in selected if files.index(t.split("::")[0]) % args.workers == i]
                for i in range(args.workers)
            ]
            parts = [p for p in parts if p]
            t0 = time.monotonic()
            for i, part in enumerate(parts):
                runner.start(i, trees[i], part, args.timeout * 3, logs / f"baseline{i}.log")
            results = [runner.wait() for _ in parts]
            cpu = sum(r.cpu_s for r in results)
            cpu_total += cpu
            bad = [r for r in results if r.rc != 0]
            print(
                f"baseline: {len(selected)} test selections on the unmodified tree in "
                f"{len(parts)} runs: {'pass' if not bad else 'FAIL'} in "
                f"{time.monotonic() - t0:.0f} s ({cpu:.0f} s CPU)",
                flush=True,
            )
            if bad:
                for r in bad:
                    print(f"-- baseline{r.key}.log (rc {r.rc}):")
                    print((logs / f"baseline{r.key}.log").read_text()[-4000:])
                print("baseline failed: the mutants would prove nothing")
                return 1
        queue = list(mutants)
        busy: dict[int, tuple[Mutant, str]] = {}  # worker -> (mutant, its file's text)
        while queue or busy:
            while queue and runner.free():
                i = next(i for i in range(args.workers) if i not in busy)
                m = queue.pop(0)
                path = trees[i] / m.file
                text = path.read_text()
                path.write_text(text.replace(m.original, m.replacement, 1))
                busy[i] = (m, text)
                runner.start(i, trees[i], list(m.tests), args.timeout, logs / f"{m.id}.log")
            done = runner.wait()
            m, text = busy.pop(done.key)
            (trees[done.key] / m.file).write_text(text)
            cpu_total += done.cpu_s
            # pytest: 1 = tests failed; 2-4 = collection/usage errors still mean
            # the bug broke the tests; 5 = nothing collected is a list error.
            if done.rc == 5:
                result = "NO TESTS"
            elif done.rc == 0:
                result = "SURVIVED"
            elif done.rc == -9:
                result = "caught (timeout)"
            else:
                result = "caught"
            failed |= result in ("SURVIVED", "NO TESTS")
            why = first_error(logs / f"{m.id}.log") if result.startswith("caught") else ""
            rows.append((m, result, done.wall_s, done.cpu_s))
            print(
                f"  {m.id:26s} {result:16s} {done.wall_s:6.1f} s {done.cpu_s:6.1f} s CPU  {why}",
                flush=True,
            )
    finally:
        for pid in list(runner.jobs):
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    total = time.monotonic() - t_start
    order = {m.id: i for i, m in enumerate(MUTANTS)}
    rows.sort(key=lambda r: order[r[0].id])
    print()
    print("| id | file | planted bug | result | wall s | CPU s |")
    print("|---|---|---|---|---|---|")
    for m, result, secs, cpu in rows:
        print(
            f"| {m.id} | {m.file.split('/')[-1]} | {m.what} | {result} | {secs:.0f} | {cpu:.0f} |"
        )
    caught = sum(r.startswith("caught") for _, r, _, _ in rows)
    slowest = sorted(rows, key=lambda r: -r[3])[:5]
    print(
        f"\n{caught}/{len(rows)} mutants caught; total {total / 60:.1f} min wall with "
        f"{args.workers} workers, {cpu_total / 60:.1f} min CPU in the test runs "
        "(baseline included); most CPU: "
        + ", ".join(f"{m.id} {cpu:.0f} s" for m, _, _, cpu in slowest)
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
