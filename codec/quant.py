"""Bit packing and scalar quantizers shared by the codecs (vectorised numpy/torch).

Packing is row-wise and little-endian within a byte: the first code of a row sits in the
lowest bits of the row's first byte; every row starts on a byte boundary.

The mid-rise quantizer with ``L = 2**bits`` levels and step ``delta`` maps ``v`` to
``code = clamp(floor(v / delta + L / 2), 0, L - 1)`` and back to
``(code - (L - 1) / 2) * delta``; it has no zero level, so a residual of the next stage
is always within half a step of zero for values inside the range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from sakura.codec.errors import CodecError


def packed_row_bytes(length: int, bits: int) -> int:
    return (length * bits + 7) // 8


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack ``[R, L]`` integer codes (< 2**bits) into ``[R, packed_row_bytes(L, bits)]`` uint8."""
    if not 1 <= bits <= 8:
        raise CodecError(f"bits must be 1..8, got {bits}")
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    rows, length = codes.shape
    if bits == 8:
        return codes.copy()
    if 8 % bits == 0:
        per = 8 // bits
        pad = (-length) % per
        if pad:
            codes = np.concatenate([codes, np.zeros((rows, pad), np.uint8)], axis=1)
        grouped = codes.reshape(rows, -1, per).astype(np.uint16)
        shifts = (np.arange(per, dtype=np.uint16) * bits)[None, None, :]
        return (grouped << shifts).sum(axis=2).astype(np.uint8)
    bitplanes = (codes[:, :, None] >> np.arange(bits, dtype=np.uint8)[None, None, :]) & 1
    return np.packbits(bitplanes.reshape(rows, -1), axis=1, bitorder="little")


def unpack_codes(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes` on a ``[R, nbytes]`` uint8 tensor -> ``[R, length]`` uint8."""
    rows = packed.shape[0]
    if bits == 8:
        return packed[:, :length]
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
        out = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return out.reshape(rows, -1)[:, :length]
    arr = np.unpackbits(packed.numpy(), axis=1, bitorder="little", count=length * bits)
    arr = arr.reshape(rows, length, bits)
    weights = (1 << np.arange(bits, dtype=np.uint8))[None, None, :]
    return torch.from_numpy((arr * weights).sum(axis=2).astype(np.uint8))


def to_fp16_scale(delta: torch.Tensor) -> torch.Tensor:
    """Round steps to what is stored (fp16), keeping them finite and non-negative."""
    return delta.clamp(0, 65504.0).half().double()


def midrise_codes(v: torch.Tensor, delta: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``v``; a zero step (all-zero group) gives the code of the value +delta/2 = 0."""
    levels = 1 << bits
    codes = torch.floor(v / delta.clamp_min(1e-30) + levels / 2)
    return codes.clamp_(0, levels - 1)


def midrise_values(codes: torch.Tensor, delta: torch.Tensor, bits: int) -> torch.Tensor:
    return (codes - ((1 << bits) - 1) / 2) * delta


# ---------------------------------------------------------------------- rotations
def hadamard(size: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix of a power-of-two ``size`` (symmetric)."""
    if size < 1 or size & (size - 1):
        raise CodecError(f"Hadamard size must be a power of two, got {size}")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / float(size) ** 0.5


def sign_pattern(length: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Fixed pseudo-random signs: ``s_i = 1 - 2 * top_bit((i * 2654435761) mod 2^32)``."""
    i = torch.arange(length, dtype=torch.int64)
    top = ((i * 2654435761) % (1 << 32)) >> 31
    return (1 - 2 * top).to(dtype)


@dataclass(frozen=True)
class SegmentPlan:
    """How a vector made of parts (e.g. ``a`` then ``b``) is rotated and scaled.

    Each part of length ``L`` is cut into ``L // group`` blocks of ``group`` values and a
    tail, the tail into descending powers of two. Every piece is multiplied by the sign
    pattern (of its position in the whole vector) and rotated by the Hadamard matrix of its
    size. Every full block has its own quantization step; a part's tail pieces share one.
    """

    parts: tuple[int, ...]
    group: int

    @property
    def length(self) -> int:
        return sum(self.parts)

    def pieces(self) -> list[tuple[int, int, int]]:
        """``(start, size, count)`` runs of equally sized consecutive pieces."""
        runs = []
        start = 0
        for part in self.parts:
            full, tail = divmod(part, self.group)
            if full:
                runs.append((start, self.group, full))
            pos = start + full * self.group
            bit = 1 << max(tail.bit_length() - 1, 0)
            while tail:
                if tail & bit:
                    runs.append((pos, bit, 1))
                    pos += bit
                    tail -= bit
                bit >>= 1
            start += part
        return runs

    def group_index(self) -> torch.Tensor:
        """Step index of every value."""
        idx = []
        gid = 0
        for part in self.parts:
            full, tail = divmod(part, self.group)
            idx.append(gid + torch.arange(full * self.group) // self.group)
            gid += full
            if tail:
                idx.append(torch.full((tail,), gid))
                gid += 1
        return torch.cat(idx)

    @property
    def groups(self) -> int:
        return sum(-(-p // self.group) for p in self.parts)

    def rotate(self, v: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Apply (or undo) the signed block-Hadamard rotation along the last dim of ``[k, L]``."""
        signs = sign_pattern(self.length, v.dtype)
        out = v if inverse else v * signs
        out = out.clone()
        for start, size, count in self.pieces():
            if size == 1:
                continue
            h = hadamard(size, v.dtype)
            end = start + size * count
            seg = out[:, start:end].reshape(-1, count, size) @ h
            out[:, start:end] = seg.reshape(-1, size * count)
        return out * signs if inverse else out


@dataclass(frozen=True)
class ProgressiveQuantizer:
    """Embedded uniform quantizer with a precision ladder over a :class:`SegmentPlan`.

    Level 0 quantizes every (rotated) value with ``level_bits[0]`` bits and a per-group fp16
    step ``d0``; level ``l`` quantizes the residual with ``level_bits[l]`` more bits and the
    implicit step ``d_l = d_{l-1} / 2**level_bits[l]`` (nothing more is stored), i.e. it
    splits every bin of the level before. ``d0`` is chosen per group among candidates
    between 30% and 100% of the no-clipping step, minimising the sum over levels of
    ``log(squared error)`` (a step that clips hard is good for level 0 alone but leaves
    residuals that no refinement level can represent).
    """

    plan: SegmentPlan
    level_bits: tuple[int, ...]
    trials: int = 8

    def encode(self, vectors: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """``vectors [k, L]`` (float64) -> ``(steps [k, G] fp16, codes per level [k, L] uint8,
        reconstructions per level [k, L] in the original domain)``."""
        k = vectors.shape[0]
        if k == 0:
            empty = torch.zeros(0, self.plan.length, dtype=torch.float64)
            return torch.zeros(0, self.plan.groups, dtype=torch.float16), [], [empty]
        rot = self.plan.rotate(vectors)
        gidx = self.plan.group_index()
        ngroups = self.plan.groups
        absmax = torch.zeros(k, ngroups, dtype=rot.dtype).scatter_reduce(
            1, gidx.expand(k, -1), rot.abs(), reduce="amax"
        )
        b0 = self.level_bits[0]
        full = 2.0 * absmax / (1 << b0)
        fracs = torch.linspace(0.3, 1.0, self.trials, dtype=rot.dtype)
        cand = to_fp16_scale(full.unsqueeze(-1) * fracs)  # [k, G, T]
        best = torch.empty(k, ngroups, 1, dtype=torch.long)
        rows = max(1, (1 << 23) // (self.trials * self.plan.length))  # bound the memory
        for lo in range(0, k, rows):
            best[lo : lo + rows] = self._search(rot[lo : lo + rows], cand[lo : lo + rows], gidx)
        d0 = torch.gather(cand, -1, best).squeeze(-1)  # [k, G]
        step = d0[:, gidx]
        res = rot.clone()
        running = torch.zeros_like(rot)
        codes, recons = [], []
        for lv, bits in enumerate(self.level_bits):
            if lv:
                step = step / (1 << bits)
            q = midrise_codes(res, step, bits)
            deq = midrise_values(q, step, bits)
            res -= deq
            running += deq
            codes.append(q.to(torch.uint8))
            recons.append(self.plan.rotate(running, inverse=True))
        return d0.to(torch.float16), codes, recons

    def _search(self, rot: torch.Tensor, cand: torch.Tensor, gidx: torch.Tensor) -> torch.Tensor:
        """Index of the best candidate step per group (the search runs in float32)."""
        k, ngroups = rot.shape[0], self.plan.groups
        step = cand[:, gidx, :].permute(0, 2, 1).float()  # [k, T, L]
        res = rot.float().unsqueeze(1).expand(k, self.trials, -1).clone()
        score = torch.zeros(k, ngroups, self.trials)
        for lv, bits in enumerate(self.level_bits):
            if lv:
                step = step / (1 << bits)
            res -= midrise_values(midrise_codes(res, step, bits), step, bits)
            err = torch.zeros(k, self.trials, ngroups).index_add_(2, gidx, res * res)
            score += torch.log(err.permute(0, 2, 1) + 1e-30)
        return score.argmin(dim=-1, keepdim=True)

    def decode(self, steps: torch.Tensor, codes: list[torch.Tensor]) -> torch.Tensor:
        """``steps [k0, G]`` fp16 and per-level codes (``[k_l, L]``, k_l non-increasing) ->
        values ``[k0, L]`` float32 in the original domain.

        The order of operations makes the result independent of how a matmul sums: the
        level sums are dyadic with at most ``bits[-1] + 1`` significant bits, so the
        unnormalised (+-1) Hadamard sums are exact in float32 whenever
        ``bits[-1] + 1 + log2(piece) <= 24`` (the defaults: 15); then one rounding for the
        step (constant within a piece) and one for ``sign / sqrt(piece)``. The native
        decoder (``sakura_native``) does the same operations and is bit-equal here.
        """
        t = self._tables()
        acc = codes[0].float().sub_(((1 << self.level_bits[0]) - 1) / 2)
        scale = 1.0
        for lv in range(1, len(codes)):
            bits = self.level_bits[lv]
            scale /= 1 << bits
            q = codes[lv]
            acc[: q.shape[0]].add_(q.float().sub_(((1 << bits) - 1) / 2).mul_(scale))
        k = acc.shape[0]
        for start, size, count, h in t.runs:
            end = start + size * count
            acc[:, start:end] = (acc[:, start:end].view(k, count, size) @ h).view(k, -1)
        acc.mul_(steps.float()[:, t.gidx])
        return acc.mul_(t.signs)

    def _tables(self) -> _Tables:
        tables = self.__dict__.get("_cached_tables")
        if tables is None:
            runs = tuple(
                (start, size, count, torch.sign(hadamard(size)).float())  # +-1 entries
                for start, size, count in self.plan.pieces()
                if size > 1
            )
            # sign / sqrt(piece size) per position, the double rounded once to float32
            norm = torch.ones(self.plan.length, dtype=torch.float64)
            for start, size, count in self.plan.pieces():
                norm[start : start + size * count] = 1.0 / math.sqrt(size)
            signs = (sign_pattern(self.plan.length, torch.float64) * norm).float()
            tables = _Tables(self.plan.group_index(), signs, runs)
            object.__setattr__(self, "_cached_tables", tables)
        return tables


@dataclass(frozen=True)
class _Tables:
    """Constant tensors of a plan used by the decoder (built once per quantizer)."""

    gidx: torch.Tensor
    signs: torch.Tensor  # sign / sqrt(piece size) per position
    runs: tuple[tuple[int, int, int, torch.Tensor], ...]
