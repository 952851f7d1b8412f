"""tokamax 0.0.12 `ragged_dot` with its Pallas Mosaic TPU kernel forced.

What a user on a TPU gets from `tokamax.ragged_dot(lhs, rhs, group_sizes)`:
the default implementation list is ("mosaic", ..., "xla"); "mosaic" resolves
to `PallasMosaicTpuRaggedDot` (a megablox `gmm` run by an `emit_pipeline`
inside one grid-less `pallas_call`, `gmm_megablox`), whose config comes from
tokamax's autotuning cache for the device kind (`data/autotuning/<kind>/`:
tpu7x and tpu_v5_lite only, all keys at M >= 131072 rows), then from its
heuristics table (exact (m, k, n, g) keys at M >= 65536), else
`Config()` = tiles (128, 128, 128) with 2 input buffers.

Off a TPU the same call silently runs XLA: the Pallas op's `supported_on`
wants `device.platform == "tpu"`, raises NotImplementedError, and the list
falls through to "xla". `forced_op` removes only that device check (and
tokamax's `custom_vmap` wrapper, which only serves `jax.vmap` and which the
bench walker cannot step through; the forward program is the same), and
resolves the config as tokamax would on the target generation's device.

The Pallas kernel also refuses any lhs/rhs matrix dimension < 128 (decode
with fewer than 128 routed rows): there a TPU user silently gets XLA. The
bench pads the rows to 128 instead (`MIN_ROWS`) so the Pallas kernel runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

MIN_ROWS = 128  # the Pallas kernel rejects lhs / rhs dims < 128

# jax `Device.device_kind` of each generation, as tokamax keys its caches
# (lower-cased, spaces -> underscores: "tpu_v6_lite", "tpu7x").
DEVICE_KINDS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "tpu7x": "TPU7x", "v5p": "TPU v5"}


class Unavailable(Exception):
    pass


def _modules():
    try:
        import tokamax  # noqa: F401
        from tokamax._src.ops.ragged_dot import base
        from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as pmt
    except Exception as e:  # noqa: BLE001 - any import failure means unavailable
        raise Unavailable(f"import tokamax failed: {type(e).__name__}: {e}") from None
    return base, pmt


@functools.lru_cache(maxsize=None)
def _forced_class():
    _, pmt = _modules()

    class ForcedPallasMosaicTpuRaggedDot(pmt.PallasMosaicTpuRaggedDot):
        """tokamax's Pallas TPU ragged dot, traced on any host for a TPU."""

        supports_batched_args_capture = False  # no custom_vmap wrapper

        def supported_on(self, device) -> bool:  # the TPU is the target, not the host
            del device
            return True

    return ForcedPallasMosaicTpuRaggedDot


def version() -> str:
    import importlib.metadata as md

    _modules()
    return md.version("tokamax")


def config_for(m: int, k: int, n: int, groups: int, dtype, generation: str):
    """(config, source): the config tokamax picks for this problem on the
    generation's device: autotuning cache, else heuristics."""
    base, pmt = _modules()
    op = _forced_class()()
    lhs = jax.ShapeDtypeStruct((m, k), dtype)
    rhs = jax.ShapeDtypeStruct((groups, k, n), dtype)
    sizes = base.GroupSizes(jax.ShapeDtypeStruct((groups,), jnp.int32), m)
    ba = op.bind(lhs, rhs, group_sizes=sizes)
    kind = DEVICE_KINDS.get(generation)
    if kind is not None:
        try:
            data = (
                pmt.PallasMosaicTpuRaggedDot()
                .get_autotuning_cache(kind)
                .get(ba.autotuning_cache_key)
            )
        except Exception:  # noqa: BLE001 - no cache for this kind
            data = None
        if data is not None and data.items():
            return data.fastest_config, f"tokamax autotuning cache ({kind})"
    return ba.heuristics_config, "tokamax heuristics"


def forced_op(config=None, interpret: bool = False):
    return _forced_class()(config=config, interpret=interpret)


def _absl_flags_parsed():
    """tokamax reads its config options from absl flags and, when the flags are
    not parsed yet, parses `sys.argv` itself: any program with its own
    command-line options (this bench's CLI, pytest) then dies with
    UnrecognizedFlagError. Mark them parsed (defaults), as a non-absl program
    calling tokamax has to."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def ragged_dot(lhs, rhs, group_sizes, *, op):
    """`tokamax.ragged_dot(lhs, rhs, group_sizes)` through the given op."""
    import tokamax

    _absl_flags_parsed()
    return tokamax.ragged_dot(lhs, rhs, group_sizes, implementation=(op,))
