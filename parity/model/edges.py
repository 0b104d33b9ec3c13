"""Numeric-edge edits of the init (:class:`~parity.model.config.InitEdges`).

FP8 bugs hide at the quantizer's edges: all-zero blocks (scale 1 by the zero rule), amaxes on a
power-of-two boundary (the pow2 scale flips on a one-ULP move), and tiny blocks (scale at the
2^127 cap or clamped to Vinf, subnormal scale_inv, the E8M0 floor). A random init reaches none of
them within a few steps. These edits put blocks there at step 0.

Every edit is a pure function of (init value, parameter name, options, recipe), so ON and OFF (and
every rank and EP layout) make the same edit. The result is an fp32 tensor of bf16-exact values:
the model's bf16 cast is exact, so ON's persisted FP8 bytes, ON's master (from the preserved
init) and OFF's bf16 weight all start from these bits (docs/spec/te.md s1.2, s2.2 for the
boundaries).
"""

from __future__ import annotations

import math
import zlib

import torch

from parity.fp8.formats import FP8_MAX
from parity.model.config import InitEdges

#: weight block edge per recipe: 128x128 tiles (blockwise), 1x32 / 32x1 blocks inside 32x32 tiles
TILE = {"blockwise": 128, "mxfp8": 32}
ZERO_TILE = 128  # zero regions are whole 128x128 tiles: zero in every recipe's blocks
E4M3_MAX = FP8_MAX["e4m3"]
#: where a pow2-edge tile's amax goes, relative to the boundary b = 448 * 2^k (cycled over tiles)
EDGE_POSITIONS = ("below", "at", "above")
#: tiny tiles: amax at the 2^127 scale cap (448 * 2^-127), under the Vinf clamp (2^-123), all
#: bf16 subnormal (2^-127)
TINY_AMAX = {"cap": E4M3_MAX * 2.0 ** -127, "vinf": 2.0 ** -123, "subnormal": 2.0 ** -127}
TINY_KINDS = tuple(TINY_AMAX)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 (RNE, subnormals kept) and widen back: exact from here on."""
    return x.to(torch.bfloat16).float()


def _bf16_step(v: float, ulps: int) -> float:
    """The bf16 value ``ulps`` representable steps from the positive bf16 value ``v``."""
    bits = torch.tensor([v], dtype=torch.bfloat16).view(torch.int16) + ulps
    return float(bits.view(torch.bfloat16)[0])


def pow2_boundary(amax: float) -> float:
    """The largest ``448 * 2^k <= amax``: a block with this amax gets the exact scale 2^-k; one
    bf16 ULP more and the pow2 scale (blockwise) drops to 2^(-k-1), the E8M0 exponent (mxfp8)
    rises by one."""
    _, e = math.frexp(amax)  # amax = m * 2^e, 0.5 <= m < 1
    b = math.ldexp(E4M3_MAX, e - 9)  # 448 = 0.875 * 2^9, so b = 0.875 * 2^e: exact, no log2 rounding
    return b if b <= amax else b / 2


def edge_value(amax: float, position: str) -> float:
    """The bf16 amax a pow2-edge tile gets: one ULP below, on, or one ULP above the boundary."""
    b = pow2_boundary(amax)
    return {"below": _bf16_step(b, -1), "at": b, "above": _bf16_step(b, 1)}[position]


def _generator(seed: int, name: str, what: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(f"{name}/{what}".encode())) % (2**63))


def _tiles(rows: int, cols: int, t: int):
    for r0 in range(0, rows, t):
        for c0 in range(0, cols, t):
            yield r0, c0, min(r0 + t, rows), min(c0 + t, cols)


def _edge_positions(h: int, w: int, recipe: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of the elements that carry a tile's amax. mxfp8: one per row and per column (a
    permutation), so every 1x32 and every 32x1 block of the tile has its amax on the edge;
    blockwise: one element (the 128x128 tile has one scale)."""
    if recipe == "mxfp8":
        n = min(h, w)
        return torch.arange(n), torch.randperm(w, generator=g)[:n]
    i = torch.randint(h * w, (1,), generator=g)
    return i // w, i % w


def place_pow2_edges(w: torch.Tensor, name: str, recipe: str, seed: int) -> None:
    """Rescale every tile of ``w`` (in place) so its block amaxes sit at the pow2 edge."""
    g = _generator(seed, name, "pow2_edge")
    for n, (r0, c0, r1, c1) in enumerate(_tiles(*w.shape, TILE[recipe])):
        tile = w[r0:r1, c0:c1]
        a = float(tile.abs().max())
        if a == 0.0:
            continue
        b = pow2_boundary(a)
        edge = edge_value(a, EDGE_POSITIONS[n % len(EDGE_POSITIONS)])
        cap = _bf16_step(b, -1)  # every other element stays strictly on the large-scale side
        rows, cols = _edge_positions(r1 - r0, c1 - c0, recipe, g)
        signs = torch.where(tile[rows, cols] >= 0, 1.0, -1.0)
        tile.copy_(_bf16(tile * (b / a)).clamp_(-cap, cap))
        tile[rows, cols] = signs * edge


def make_tiny(tile: torch.Tensor, kind: str) -> None:
    """Scale ``tile`` (in place) down so its amax is exactly ``TINY_AMAX[kind]``; bf16 rounding
    leaves many elements subnormal (or zero)."""
    a = float(tile.abs().max())
    if a == 0.0:
        return
    target = TINY_AMAX[kind]
    k = int(tile.abs().argmax())
    i, j = divmod(k, tile.shape[1])
    sign = 1.0 if float(tile[i, j]) >= 0 else -1.0
    tile.copy_(_bf16(tile * (target / a)))
    tile[i, j] = sign * target


def _zero_units(ffn: int) -> int:
    """Dead SwiGLU units: a whole 128-unit stripe when there are 256 or more units, else a
    32-aligned stripe of at most half of them."""
    return min(ZERO_TILE, (ffn // 2) // 32 * 32)


def edit_init(w: torch.Tensor, name: str, edges: InitEdges, recipe: str, seed: int, *,
              layer: int = 0, dead: bool = False) -> torch.Tensor:
    """The init ``w`` (fp32 [out, in]) of FP8 matrix ``name`` with the numeric-edge edits; an
    fp32 tensor of bf16-exact values. ``dead``: the matrix belongs to a dead expert."""
    w = _bf16(w)
    rows, cols = w.shape
    if edges.pow2_edge:
        place_pow2_edges(w, name, recipe, seed)
    if edges.tiny_values:
        t = TILE[recipe]
        if name.endswith("attn.qkv.weight"):
            make_tiny(w[(rows - 1) // t * t:, (cols - 1) // t * t:], TINY_KINDS[layer % len(TINY_KINDS)])
        elif dead and name.endswith("fc2.weight"):
            make_tiny(w[(rows - 1) // t * t:, (cols - 1) // t * t:], "subnormal")
    if edges.zero_blocks:
        if name.endswith("fc1.weight"):  # [gate; up]: the same units in both halves
            ffn, n = rows // 2, _zero_units(rows // 2)
            w[:n].zero_()
            w[ffn:ffn + n].zero_()
        elif name.endswith("fc2.weight"):
            w[:, :_zero_units(cols)].zero_()
        elif name.endswith("attn.proj.weight"):
            w[:ZERO_TILE, :ZERO_TILE].zero_()
    if dead and name.endswith("fc1.weight"):
        w.zero_()
    return w


# ------------------------------------------------------------------------------------------------
# observing the edges: per-block state of a quantized weight
# ------------------------------------------------------------------------------------------------

SCALE_INV_AT_CAP = 0x00400000  # fp32 bits of 2^-127: the scale_inv of a scale at the 2^127 cap


def _all_zero(data: torch.Tensor, dims) -> torch.Tensor:
    """Blocks whose FP8 bytes are all +-0 (0x00 / 0x80)."""
    return ((data & 0x7F) == 0).all(dim=dims).reshape(-1)


def block_states(qt) -> dict:
    """Per weight block of a QuantizedTensor ``qt`` (128x128 blockwise: one per tile; mxfp8: the
    1x32 rowwise blocks, then the 32x1 columnwise blocks), read from its own bytes and scales:

    - ``code``: the raw scale bits (fp32 scale_inv bits / E8M0 byte); with power-of-two scales two
      codes differ exactly when the scale exponent changed;
    - ``zero``: the block is all zero (its scale came from the zero rule: 1.0 / E8M0 0);
    - ``clamp``: a non-zero block whose scale sits at the bottom of the range (blockwise: scale
      2^127, scale_inv 2^-127 subnormal, reached by the cap or the Vinf clamp; mxfp8: E8M0 0).
    """
    M, K = qt.m, qt.k
    if qt.recipe == "blockwise" and qt.block == "128x128":
        Mb, Kb = -(-M // 128), -(-K // 128)
        data = torch.nn.functional.pad(qt.rowwise_data.reshape(M, K), (0, Kb * 128 - K, 0, Mb * 128 - M))
        zero = _all_zero(data.view(Mb, 128, Kb, 128), (1, 3))
        code = qt.rowwise_scale_inv[:Mb, :Kb].contiguous().view(torch.int32).reshape(-1).long()
        clamp = (code == SCALE_INV_AT_CAP) & ~zero
    elif qt.recipe == "mxfp8":
        row_code = qt.rowwise_scale_inv[:M, :K // 32].reshape(-1).long()
        col_code = qt.columnwise_scale_inv[:M // 32, :K].reshape(-1).long()
        row_zero = _all_zero(qt.rowwise_data.reshape(M, K // 32, 32), (2,))
        col_zero = _all_zero(qt.columnwise_data.reshape(M // 32, 32, K), (1,))
        code, zero = torch.cat([row_code, col_code]), torch.cat([row_zero, col_zero])
        clamp = (code == 0) & ~zero
    else:
        raise ValueError(f"block_states reads weight blocks (128x128 or 1x32), got {qt.recipe}/{qt.block}")
    return {"code": code, "zero": zero, "clamp": clamp}


class FlipCounter:
    """Counts, look after look, weight blocks whose scale changed since the previous look
    (``flips``: non-zero at both looks, so the pow2 exponent moved; ``unzeroed``: all zero before,
    not now), all-zero blocks and clamped blocks (see :func:`block_states`)."""

    def __init__(self):
        self.prev: dict = {}

    def observe(self, weights) -> dict:
        """``weights``: (name, QuantizedTensor) pairs. Totals over them, and per param its flips
        (the first look of a param counts no changes)."""
        out = {"flips": 0, "unzeroed": 0, "zero": 0, "clamp": 0, "blocks": 0, "flipped": {}}
        for name, qt in weights:
            st = block_states(qt)
            if name in self.prev:
                code, zero = self.prev[name]
                moved = st["code"] != code
                n = int((moved & ~zero & ~st["zero"]).sum())
                out["unzeroed"] += int((zero & ~st["zero"]).sum())
                if n:
                    out["flipped"][name] = n
                out["flips"] += n
            self.prev[name] = (st["code"].clone(), st["zero"].clone())
            out["zero"] += int(st["zero"].sum())
            out["clamp"] += int(st["clamp"].sum())
            out["blocks"] += int(st["code"].numel())
        return out
