"""QuantizedTensor: a plain container for TE-layout FP8 storage (blockwise or MXFP8).

It is deliberately *not* a ``torch.Tensor`` subclass: it holds the four storage tensors described
in :mod:`parity.fp8.quantize` and knows how to dequantize, requantize in place, rebuild the 2D
columnwise copy after an all-gather, and hand out canonical GEMM operands.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .formats import canonical_fp8_dtype, e8m0_to_fp32, fp8_to_fp32
from .gemm import Operand

__all__ = ["QuantizedTensor", "is_quantized_tensor", "PART_NAMES"]

PART_NAMES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
_BLOCK_LEN = {"1x128": 128, "128x128": 128, "1x32": 32}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class QuantizedTensor:
    """FP8 storage of one logical high-precision tensor.

    Attributes: ``shape`` (logical torch.Size), ``dtype`` (logical high-precision dtype), ``recipe``
    ("blockwise"/"mxfp8"), ``block`` ("1x128"/"128x128"/"1x32"), ``fp8_dtype`` ("e4m3"/"e5m2"),
    ``pow2_scales``, ``eps``, the storage tensors ``rowwise_data``, ``rowwise_scale_inv``,
    ``columnwise_data``, ``columnwise_scale_inv`` (None when that usage is off), ``device`` and
    ``columnwise_stale`` (True after a 128x128 :meth:`requantize_` until
    :meth:`post_all_gather_processing`).
    """

    def __init__(self, *, shape, dtype: torch.dtype, recipe: str, block: str, fp8_dtype,
                 pow2_scales: bool, eps: float,
                 rowwise_data: Optional[torch.Tensor], rowwise_scale_inv: Optional[torch.Tensor],
                 columnwise_data: Optional[torch.Tensor], columnwise_scale_inv: Optional[torch.Tensor]):
        if (rowwise_data is None) != (rowwise_scale_inv is None):
            raise ValueError("rowwise_data and rowwise_scale_inv must both be given or both be None")
        if (columnwise_data is None) != (columnwise_scale_inv is None):
            raise ValueError("columnwise_data and columnwise_scale_inv must both be given or both be None")
        if rowwise_data is None and columnwise_data is None:
            raise ValueError("a QuantizedTensor needs at least one usage (rowwise or columnwise)")
        if block not in _BLOCK_LEN:
            raise ValueError(f"unknown block {block!r}")
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.recipe = recipe
        self.block = block
        self.fp8_dtype = canonical_fp8_dtype(fp8_dtype)
        self.pow2_scales = bool(pow2_scales)
        self.eps = float(eps)
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv
        self.columnwise_stale = False

    # -------------------------------------------------------------------------------- basics
    @property
    def device(self) -> torch.device:
        t = self.rowwise_data if self.rowwise_data is not None else self.columnwise_data
        return t.device

    @property
    def block_len(self) -> int:
        return _BLOCK_LEN[self.block]

    @property
    def m(self) -> int:
        """Rows of the 2-D view (product of the leading dims)."""
        return math.prod(self.shape[:-1])

    @property
    def k(self) -> int:
        """Columns of the 2-D view (the last dim)."""
        return self.shape[-1]

    def numel(self) -> int:
        return math.prod(self.shape)

    def size(self, dim: Optional[int] = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    def _parts(self) -> dict:
        return {name: getattr(self, name) for name in PART_NAMES if getattr(self, name) is not None}

    @property
    def nbytes(self) -> int:
        """Persistent bytes of all storage tensors (data and scale grids, padding included)."""
        return sum(t.numel() * t.element_size() for t in self._parts().values())

    def raw_parts(self) -> dict:
        """Cloned, contiguous copies of the present storage tensors (for snapshots / byte compares)."""
        return {name: t.detach().clone().contiguous() for name, t in self._parts().items()}

    def clone(self) -> "QuantizedTensor":
        parts = {name: (t.clone() if t is not None else None)
                 for name, t in ((n, getattr(self, n)) for n in PART_NAMES)}
        out = QuantizedTensor(shape=self.shape, dtype=self.dtype, recipe=self.recipe, block=self.block,
                              fp8_dtype=self.fp8_dtype, pow2_scales=self.pow2_scales, eps=self.eps,
                              **parts)
        out.columnwise_stale = self.columnwise_stale
        return out

    def __repr__(self) -> str:
        usages = [u for u in ("rowwise", "columnwise") if getattr(self, f"{u}_data") is not None]
        stale = ", columnwise_stale=True" if self.columnwise_stale else ""
        return (f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, recipe={self.recipe!r}, "
                f"block={self.block!r}, fp8_dtype={self.fp8_dtype!r}, pow2_scales={self.pow2_scales}, "
                f"eps={self.eps}, usages={usages}, device={self.device}{stale})")

    # -------------------------------------------------------------------------------- scales
    def _scales_of(self, usage: str) -> torch.Tensor:
        """Per-(row, block) fp32 scale_inv of the GEMM operand of ``usage``.

        rowwise: [M, ceil(K/blk)] (operand x, rows m); columnwise: [K, ceil(M/blk)] (operand x^T).
        """
        M, K = self.m, self.k
        if self.recipe == "mxfp8":
            if usage == "rowwise":
                return e8m0_to_fp32(self.rowwise_scale_inv[:M, : K // 32].contiguous())
            return e8m0_to_fp32(self.columnwise_scale_inv[: M // 32, :K].contiguous()).t().contiguous()
        Mb, Kb = _ceil_div(M, 128), _ceil_div(K, 128)
        if self.block == "1x128":
            if usage == "rowwise":
                return self.rowwise_scale_inv[:Kb, :M].t().contiguous()           # [M, Kb]
            return self.columnwise_scale_inv[:Mb, :K].t().contiguous()            # [K, Mb]
        if usage == "rowwise":
            grid = self.rowwise_scale_inv[:Mb, :Kb]                               # [Mb, Kb]
            return grid.repeat_interleave(128, dim=0)[:M].contiguous()            # [M, Kb]
        grid = self.columnwise_scale_inv[:Kb, :Mb]                                # [Kb, Mb]
        return grid.repeat_interleave(128, dim=0)[:K].contiguous()                # [K, Mb]

    def _check_usage(self, usage: str):
        if usage not in ("rowwise", "columnwise"):
            raise ValueError(f"usage must be 'rowwise' or 'columnwise', got {usage!r}")
        if getattr(self, f"{usage}_data") is None:
            raise RuntimeError(f"this QuantizedTensor has no {usage} usage")
        if usage == "columnwise" and self.columnwise_stale:
            raise RuntimeError("columnwise data is stale after requantize_(); call "
                               "post_all_gather_processing() to rebuild it from the rowwise data")

    # -------------------------------------------------------------------------------- dequantize
    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """High-precision values: fp32(q) * scale_inv in fp32, then rounded to ``dtype`` (docs/spec/te.md 1.5, 2.2).

        Uses the rowwise copy if present, else the columnwise copy.
        """
        dtype = dtype or self.dtype
        M, K = self.m, self.k
        usage = "rowwise" if self.rowwise_data is not None else "columnwise"
        self._check_usage(usage)
        blk = self.block_len
        if usage == "rowwise":
            q = fp8_to_fp32(self.rowwise_data.reshape(M, K), self.fp8_dtype)
            s = self._scales_of("rowwise").repeat_interleave(blk, dim=1)[:, :K]
            out = q * s
        elif self.recipe == "mxfp8":
            q = fp8_to_fp32(self.columnwise_data.reshape(M, K), self.fp8_dtype)
            s = e8m0_to_fp32(self.columnwise_scale_inv[: M // 32, :K].contiguous()).repeat_interleave(32, dim=0)
            out = q * s
        else:
            q = fp8_to_fp32(self.columnwise_data.reshape(K, M), self.fp8_dtype)
            s = self._scales_of("columnwise").repeat_interleave(blk, dim=1)[:, :M]
            out = (q * s).t()
        return out.to(dtype).reshape(self.shape).contiguous()

    # -------------------------------------------------------------------------------- GEMM operand
    def gemm_operand(self, usage: str) -> Operand:
        """Canonical GEMM operand contracting along its last dim.

        "rowwise": the operand is x as [M, K]; "columnwise": x^T as [K, M]. ``scale_inv`` is fp32
        [rows, ceil(cols/blk)] (a 128x128 tile's scale repeated on each of its rows; E8M0 decoded);
        ``tile_2d`` is the raw padded tile grid for 128x128 tensors (rows of tiles x pad4(col tiles)).
        """
        self._check_usage(usage)
        M, K = self.m, self.k
        if usage == "rowwise":
            data = self.rowwise_data.reshape(M, K)
        elif self.recipe == "mxfp8":
            data = self.columnwise_data.reshape(M, K).t()
        else:
            data = self.columnwise_data.reshape(K, M)
        tile = None
        if self.block == "128x128":
            tile = getattr(self, f"{usage}_scale_inv").contiguous()
        return Operand(data=data.contiguous(), fp8_dtype=self.fp8_dtype, scale_inv=self._scales_of(usage),
                       block_len=self.block_len, tile_2d=tile)

    # -------------------------------------------------------------------------------- in place
    def requantize_(self, src) -> "QuantizedTensor":
        """Re-quantize from a high-precision ``src`` into the existing storage tensors (copy_).

        128x128: only the rowwise copy is written and the columnwise copy (if any) is marked stale
        (``columnwise_stale``), its old bytes left in place; :meth:`post_all_gather_processing`
        rebuilds it. 1x128 and mxfp8: every present usage is written from ``src``. The scale rule
        uses ``src``'s dtype (the input of TE's cast kernel). A QuantizedTensor ``src`` is
        dequantized first (as TE's ``quantize_`` does).
        """
        import importlib
        _q = importlib.import_module("parity.fp8.quantize")  # late: the package name "quantize" is the function

        if is_quantized_tensor(src):
            src = src.dequantize()
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"requantize_ expects a torch.Tensor, got {type(src).__name__}")
        if src.numel() != self.numel():
            raise ValueError(f"requantize_ source has {src.numel()} elements, expected {self.numel()} "
                             f"(shape {tuple(self.shape)})")
        _q._check_input(src)
        if tuple(src.shape) != tuple(self.shape):
            src = src.reshape(self.shape)
        x2 = _q._as_2d(src.to(self.device))
        has_row = self.rowwise_data is not None
        has_col = self.columnwise_data is not None
        if self.block == "128x128" and has_row:
            parts = _q._quantize_parts(x2, self.recipe, self.block, self.fp8_dtype, self.pow2_scales,
                                       self.eps, rowwise=True, columnwise=False)
            if has_col:
                self.columnwise_stale = True
        else:
            parts = _q._quantize_parts(x2, self.recipe, self.block, self.fp8_dtype, self.pow2_scales,
                                       self.eps, rowwise=has_row, columnwise=has_col)
            self.columnwise_stale = False
        for name, new in parts.items():
            dst = getattr(self, name)
            dst.copy_(new.view(dst.shape))
        return self

    def post_all_gather_processing(self) -> "QuantizedTensor":
        """128x128: rebuild the columnwise copy as the exact transpose of the rowwise bytes and scale
        grid (created if absent, as TE's ``_create_columnwise`` does) and clear the stale flag.
        1x128 and mxfp8: nothing to do (their columnwise copy cannot come from the rowwise one).
        """
        if self.block != "128x128" or self.rowwise_data is None:
            return self
        from .quantize import _transpose_2d_parts

        col_data, col_scale = _transpose_2d_parts(self.rowwise_data, self.rowwise_scale_inv, self.m, self.k)
        col_shape = torch.Size((self.shape[-1],) + tuple(self.shape[:-1]))
        if self.columnwise_data is None:
            self.columnwise_data = col_data.view(col_shape)
            self.columnwise_scale_inv = col_scale
        else:
            self.columnwise_data.copy_(col_data.view(self.columnwise_data.shape))
            self.columnwise_scale_inv.copy_(col_scale)
        self.columnwise_stale = False
        return self


def is_quantized_tensor(x) -> bool:
    """True iff ``x`` is a :class:`QuantizedTensor` (a real type check)."""
    return isinstance(x, QuantizedTensor)
