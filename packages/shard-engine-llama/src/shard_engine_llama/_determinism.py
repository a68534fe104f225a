"""What the llama engine declares about its results: split-exact with f32 boundaries, and the
tolerances of batch shapes and 16-bit boundaries, measured per weight type."""

from __future__ import annotations

from typing import Final

from shard_engine_api import Determinism, Tolerance
from shard_engine_llama._gguf import GGUFHeader

__all__ = ["declared_determinism"]

_FLOAT_TYPES: Final = frozenset({"F32", "F64"})
_HALF_TYPES: Final = frozenset({"F16", "BF16"})

_BOUNDARY_TOLERANCE: Final[dict[str, Tolerance]] = {
    "f32": Tolerance(),
    "f16": Tolerance(absolute=1e-3, relative=1e-2),
    "bf16": Tolerance(absolute=1e-2, relative=0.1),
}
"""The logits drift of a pipeline whose boundaries carry 16-bit hidden states, against the
same split with f32 boundaries (which equals the unsplit model bit for bit), relative to each
row's magnitude.

Measured (teacher-forced over prompt + 32 greedy tokens, all rows; 2- and 3-way splits):
generated llama and gemma3 models (n_embd 64 and 512, F32 and F16, logits up to ~5): bf16 up to
0.012 (~2.4e-3 of the row), f16 up to 0.0022 (~4.4e-4); gemma3-270m Q4_K_M (logits up to ~31):
bf16 up to 1.19 (~0.04), f16 refused (hidden states reach ~8.3e4, beyond its range). bf16 keeps
8 significant bits, so its drift grows with the logit scale: 0.1 covers the real model with
margin; f16 is declared at ~20x its measurement because it is only usable where states stay
below 65504."""

_BOUNDARY_ROUNDING: Final[dict[str, float]] = {"f32": 0.0, "f16": 0.0, "bf16": 2.0**-7}
"""Hidden states leave a shard rounded to the boundary dtype: when a batch-shape difference
moves a value across a rounding step, the emitted rows differ by one step (relative 2**-8 of
the value for bf16, bounded by the row's magnitude; declared with a factor 2). The conformance
suite already allows one f16 step itself."""


def declared_determinism(
    header: GGUFHeader, explicit: float | None, boundary_dtype: str
) -> Determinism:
    """What the engine declares: splits are bit-exact with f32 boundaries (the split recipe
    reproduces unsplit llama.cpp; a 16-bit boundary rounds the hidden states), batch shapes are
    not (llama.cpp picks other kernels and groupings for other batch and ubatch sizes), within
    a tolerance per output kind chosen by the widest-error weight type of the model (a shard
    carries its source's weight types), widened by the boundary dtype's drift.

    The weight-type tolerances are the largest per-row differences measured by
    ``tools/measure_tolerance.py`` (one prefill of 40 positions vs. chunks of 1, 3, 7, 16 and
    17 rows and a 3-session decode_batch, on a full, a head and a middle shard, n_ubatch 16,
    relative to each row's largest magnitude), with a margin of about 2x or more:

    - F32/F64 weights: generated llama 7.4e-7 (logits) / 5.1e-7 (hidden), generated gemma3
      3.6e-5 / 2.2e-5 -> relative 2e-4 for both;
    - F16/BF16: generated llama 7.6e-4 / 4.9e-4, generated gemma3 4.9e-4 / 1.2e-4 -> 5e-3;
    - quantized: gemma3-270m Q4_K_M 0.205 / 0.095 on one x86-64 host (6 sequences, 3,654 rows)
      and 0.506 / 0.207 on an AMD EPYC host (12 sequences, 7,308 rows) — llama.cpp's own
      ``Llama.eval`` shows the same differences between batch sizes (the same 6.85 at the same
      row), so they are the backend's and its kernels', not the engine's; generated Q8_0 0 / 0.
      The logits maximum is one row of small magnitude (6.85 of 13.5): no relative bound a
      wrong output can still fail (the conformance suite accepts at most 0.5) covers it, while
      at a relative 0.4 an absolute 1.44 covers every row -> logits absolute 4.0 + relative
      0.4 (9.4 at that row). Hidden relative 0.25: gemma3's hidden rows are dominated by a few
      huge channels (~4,000 at layer 9), so the first 6 positions of another prompt differ by
      only 0.29-0.33 of a row at most; a bound must lie between that and the 0.207 measured.

    ``explicit`` (the ``tolerance`` option) declares one absolute bound for both kinds instead,
    as before per-kind tolerances existed."""
    split_exact = boundary_dtype == "f32"
    if explicit is not None:
        return Determinism(
            deterministic=True, split_exact=split_exact, tolerance=explicit, batch_invariant=False
        )
    types = {record.ggml_type.name for record in header.tensors.values()}
    if types <= _FLOAT_TYPES:
        logits = hidden = Tolerance(absolute=1e-5, relative=2e-4)
    elif types <= _FLOAT_TYPES | _HALF_TYPES:
        logits = hidden = Tolerance(absolute=1e-3, relative=5e-3)
    else:
        logits = Tolerance(absolute=4.0, relative=0.4)
        hidden = Tolerance(absolute=1e-2, relative=0.25)
    boundary = _BOUNDARY_TOLERANCE[boundary_dtype]
    rounding = _BOUNDARY_ROUNDING[boundary_dtype]
    return Determinism(
        deterministic=True,
        split_exact=split_exact,
        batch_invariant=False,
        logits_tolerance=Tolerance(
            absolute=max(logits.absolute, boundary.absolute),
            relative=max(logits.relative, boundary.relative),
        ),
        hidden_tolerance=Tolerance(
            absolute=hidden.absolute, relative=max(hidden.relative, rounding)
        ),
    )
