"""SAKURA: importance-weighted progressive low-rank codec (and plain SVD, its q = 0 case).

Per matrix ``X [N, C]`` of a shard, with block importance ``p`` (mean 1, floored) and
weights ``w = p ** q``: ``diag(w) X = U S V^T``. A component ``c`` is the pair
``a_c = X v_c`` (``= (diag(w)^-1 U S)_c``, the exact projection, so a floored ``w`` never
blows up) and ``b_c = v_c``; reconstruction is ``sum_c a_c b_c^T``. Components of all
matrices of the shard are ordered together by their relative weighted contribution
``s_c^2 / ||diag(w) X||^2`` (so a prefix of the order minimises the mean weighted error
over the shard's matrices); a configuration's ``rank`` is the mean number of components
per matrix (total components = rank x matrices).

Each component (a and b rescaled to equal norms) is quantized progressively: level 0 with
``bits[0]`` bits, level l > 0 quantizes the residual of the levels before with
``bits[l] - bits[l-1]`` more bits (default 2, +2, +2, +2 = 2/4/6/8 bits) after a fixed
signed block-Hadamard rotation (spreads outlier tokens/channels), with one fp16 step per
group of ``group`` values chosen at level 0 and halved implicitly by every refinement.
A shard is stored as an embedded progressive stream (``codec.embedded``): a header,
then coding units (one rank segment at one precision level) in greedy rate-distortion
order, so that every configuration ``ranks = [r0, r1, r2, r3]`` (components with at least
2, 4, 6, 8 bits) is a prefix of the stream: ONE byte range of the pack. The ablation table
(``keep="all"``) adds fixed-precision streams whose prefixes are the uniform
configurations. Layout: ``FORMAT.md``.

The ladders and a shard's derived sizes are in ``codec.lowrank_geometry``; which
configurations a shard's table keeps (streams, Pareto front, the format-1 comparison) in
``codec.lowrank_table``. This module factorizes, quantizes, estimates the errors, encodes
and decodes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from sakura.codec import native as codec_native
from sakura.codec.base import Codec, EncodedConfig, EncodedShard, register
from sakura.codec.embedded import StreamHeader, unit_levels
from sakura.codec.errors import CodecError, PackError
from sakura.codec.lowrank_geometry import BASE_LADDER, UNIT_LADDER, ShardGeometry
from sakura.codec.lowrank_table import choose, prefix_cost, staircases, streams_of
from sakura.codec.metrics import DEFAULT_FLOOR, err_to_db, normalized_importance
from sakura.codec.quant import ProgressiveQuantizer, pack_codes, unpack_codes
from sakura.codec.shards import ShardData, ShardSpec

OUTPUT_Q_CHOICE: dict[str, Any] = {"q_candidates": (0.25, 0.5, 1.0), "q_front": "output",
                                   "q_dominate": False}
"""The ``sakura`` options a builder with a model adds (under any the caller gives): q chosen
per shard among 0, 0.25, 0.5 and 1 by the best mean output PSNR over ``q_ratios`` on the
profiling requests (issue 33; codec/README.md, "Importance weighting"). Without a model the
codec's defaults hold (q = 0.5 everywhere)."""


@dataclass(frozen=True)
class LowRankOptions:
    q: float = 0.5
    """Importance exponent: w = importance ** q (0 = plain SVD)."""
    bits: tuple[int, ...] = (2, 4, 6, 8)
    """Cumulative precision ladder; level l adds bits[l] - bits[l-1] bits per value."""
    r_max: int | None = None
    """Largest mean rank per matrix stored at level 0 (None: min(N, C) // 3, at most 128)."""
    level_fraction: tuple[float, ...] = (1.0, 1.0, 0.5, 0.25)
    """Fraction of r_max stored at each level (snapped down to the rank ladder)."""
    ranks: tuple[int, ...] | None = None
    """Rank ladder (mean ranks per matrix) of the coding units and uniform configurations;
    None: :data:`UNIT_LADDER` for the units, :data:`BASE_LADDER` for the uniform ones."""
    group: int = 64
    """Values per quantization step (along tokens for a, along channels for b)."""
    floor: float = DEFAULT_FLOOR
    """Importance floor relative to the mean importance."""
    uniform_bits: tuple[int, ...] = (2, 4, 8)
    """Precisions (cumulative bits) of the uniform configurations (every component at that
    precision: the fixed-bitwidth ones) considered for the ladder ranks."""
    mixed: bool = True
    """Also consider mixed-precision configs (top components at more bits)."""
    keep: str = "pareto"
    """Which candidate configurations go into the pack's table: ``"pareto"`` (the
    non-dominated set by bytes and weighted error, thinned to 15% byte steps) or
    ``"all"`` (every uniform one as well, e.g. for fixed-bitwidth ablations)."""
    key_q: float | None = None
    """Importance exponent of the keys (the even matrices of a shard; values keep ``q``).
    None: ``q`` for both. An attention output is linear in the values weighted by the
    attention mass (the importance), but a key's error moves its own logit, and so the
    mass of every token: a large key error on a low-importance token can make it matter."""
    q_candidates: tuple[float, ...] | None = None
    """Per-shard choice of q (issue 33): the shard is encoded at every candidate (q = 0 is
    always one) and keeps the one whose measured rate-quality front is best over
    ``q_ratios`` without being worse than q = 0's at any of them (:func:`choose_q`); the
    choice goes into the manifest (``shards[i].q``). None: ``q`` for every shard."""
    q_ratios: tuple[float, ...] = (5.0, 15.0, 50.0)
    """Ratios versus FP16 at which the candidates' fronts are compared."""
    q_dominate: bool = True
    """The choice keeps only candidates no worse than q = 0 at ANY of ``q_ratios`` on the
    measured front (:func:`choose_q_db`); False: the best mean over them (q = 0 still a
    candidate, so never worse than plain SVD on the front's mean)."""
    q_front: str = "kv"
    """Which front ``q_candidates`` are compared on: ``"kv"`` (each candidate's
    importance-weighted KV error, from the encoder, free) or ``"output"`` (per candidate and
    ratio, the configuration the allocator would take within ``fp16 bytes / ratio`` is
    decoded and measured by the builder's output-PSNR measure, :attr:`LowRankCodec.q_measure`:
    the profiling requests' edits with only that shard changed; without a measure, a model,
    the choice falls back to the kv front and says so in the shard's notes)."""
    rope: dict[str, Any] | None = None
    """Optional axial RoPE of the model (``{"heads", "axes", "theta", "positions"}``, see
    ``sakura.dit.rope.rope_option``): keys are factorized in the pre-rotation frame, where they are
    far lower-rank, and re-rotated on decode (rotations keep per-token norms, so errors are
    the same in both frames)."""

    def validate(self) -> None:
        if not 0.0 <= self.q <= 4.0:
            raise CodecError(f"q must be in [0, 4], got {self.q}")
        bits = list(self.bits)
        if not bits or any(b2 <= b1 for b1, b2 in zip(bits, bits[1:])) or bits[0] < 1:
            raise CodecError(f"bits must be strictly increasing and >= 1, got {self.bits}")
        if any(b2 - b1 > 8 for b1, b2 in zip([0] + bits, bits)):
            raise CodecError(f"a level adds at most 8 bits, got {self.bits}")
        if len(self.level_fraction) != len(bits):
            raise CodecError(f"level_fraction needs {len(bits)} entries, got {self.level_fraction}")
        fr = list(self.level_fraction)
        if fr[0] != 1.0 or any(f2 > f1 for f1, f2 in zip(fr, fr[1:])) or fr[-1] < 0:
            raise CodecError(f"level_fraction must start at 1 and not increase, got {fr}")
        if self.group < 4 or self.group > 4096 or self.group & (self.group - 1):
            raise CodecError(f"group must be a power of two in 4..4096, got {self.group}")
        if self.r_max is not None and self.r_max < 1:
            raise CodecError(f"r_max must be >= 1, got {self.r_max}")
        if self.ranks is not None and (not self.ranks or min(self.ranks) < 1):
            raise CodecError(f"ranks must be positive, got {self.ranks}")
        if not 0 < self.floor <= 1:
            raise CodecError(f"floor must be in (0, 1], got {self.floor}")
        if self.key_q is not None and not 0.0 <= self.key_q <= 4.0:
            raise CodecError(f"key_q must be in [0, 4], got {self.key_q}")
        if self.q_candidates is not None and (
                not self.q_candidates or any(not 0.0 <= c <= 4.0 for c in self.q_candidates)):
            raise CodecError(f"q_candidates must be in [0, 4], got {self.q_candidates}")
        if not self.q_ratios or any(r <= 0 for r in self.q_ratios):
            raise CodecError(f"q_ratios must be positive, got {self.q_ratios}")
        if not isinstance(self.q_dominate, bool):
            raise CodecError(f"q_dominate must be true or false, got {self.q_dominate!r}")
        if self.q_front not in ("kv", "output"):
            raise CodecError(f"q_front must be 'kv' or 'output', got {self.q_front!r}")
        if self.rope is not None:
            check_rope(self.rope)
        if self.keep not in ("pareto", "all"):
            raise CodecError(f"keep must be 'pareto' or 'all', got {self.keep!r}")


class LowRankCodec(Codec):
    """``sakura`` (q = 0.5 by default) and ``svd`` (q = 0)."""

    def __init__(self, name: str = "sakura", **options: Any) -> None:
        opts = dict(options)
        for key in ("bits", "level_fraction", "ranks", "uniform_bits", "q_candidates", "q_ratios"):
            if opts.get(key) is not None:
                opts[key] = tuple(opts[key])
        try:
            self.opts = LowRankOptions(**opts)
        except TypeError as exc:
            raise CodecError(f"bad options for codec {name!r}: {exc}") from None
        self.opts.validate()
        self.name = name  # type: ignore[misc]
        self.use_native = True
        """Decode with ``sakura_native`` when it imports (``codec.native``); False: Python."""
        self.native_threads = 1
        """Threads of the native decoder (the matrices of a shard are split among them)."""
        self.q_measure: Any = None
        """With ``q_front="output"``: ``measure(shard, params, decoded) -> dB`` (higher is
        better), the builder's output PSNR with only that shard decoded
        (``cloud.psnr_profile.OutputPSNR``); set by the caller that owns the model."""

    @property
    def options(self) -> dict[str, Any]:
        out = asdict(self.opts)
        for key in ("bits", "level_fraction", "ranks", "uniform_bits", "q_candidates", "q_ratios"):
            if out[key] is not None:
                out[key] = list(out[key])
        if out["q_candidates"] is None:  # (the per-shard choice off: the options, and so
            del out["q_candidates"], out["q_ratios"]  # the manifests, are as before)
        if out.get("q_candidates") is None or out["q_front"] == "kv":
            del out["q_front"]  # (the kv front: manifests as before this option)
        if out.get("q_candidates") is None or out["q_dominate"]:
            del out["q_dominate"]
        if out["key_q"] is None:
            del out["key_q"]
        return out

    # ------------------------------------------------------------------ geometry
    def geometry(self, matrices: int, tokens: int, channels: int) -> ShardGeometry:
        o = self.opts
        full = min(tokens, channels)
        r_max = o.r_max if o.r_max is not None else max(1, min(128, full // 3))
        r_max = min(r_max, full)
        base = o.ranks if o.ranks is not None else UNIT_LADDER
        ladder = sorted({r for r in base if r <= r_max} | {r_max})
        ref = o.ranks if o.ranks is not None else BASE_LADDER
        reference = sorted({r for r in ref if r <= r_max} | {r_max})
        level_max = []
        for f in o.level_fraction:
            cap = f * r_max
            level_max.append(max([0] + [r for r in ladder if r <= cap + 1e-9]))
        return ShardGeometry(
            matrices=matrices,
            tokens=tokens,
            channels=channels,
            group=o.group,
            bits=tuple(o.bits),
            ladder=tuple(ladder),
            level_max=tuple(level_max),
            reference=tuple(reference),
        )

    # ------------------------------------------------------------------ encode
    def factorize(
        self, x: torch.Tensor, importance: torch.Tensor, q: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Weighted SVD of one matrix: ``(a [K, N], b [K, C], rel [K])``, K = min(N, C).

        ``a_c = X v_c``, ``b_c = v_c`` and ``rel_c = s_c^2 / ||diag(w) X||^2``.
        """
        x64 = x.double()
        w = normalized_importance(importance, self.opts.floor) ** (self.opts.q if q is None else q)
        _, s, vh = torch.linalg.svd(w[:, None] * x64, full_matrices=False)
        energy = float((s**2).sum())
        rel = s**2 / energy if energy > 0 else torch.zeros_like(s)
        return (x64 @ vh.T).T.contiguous(), vh.contiguous(), rel

    def encode_shard(self, shard: ShardData) -> EncodedShard:
        cands = self.opts.q_candidates
        if cands is None:
            return self._encode_at(shard, self.opts.q)
        qs = [0.0] + sorted({float(c) for c in cands} - {0.0})
        encs = [self._encode_at(shard, q) for q in qs]
        spec = shard.spec
        fp16 = 2 * spec.num_matrices * spec.tokens * spec.channels
        budgets = [fp16 / r for r in self.opts.q_ratios]
        fronts = [[(e.config_bytes(j), c.weighted_err) for j, c in enumerate(e.configs)]
                  for e in encs]
        kv_db = [front_db(f, budgets) for f in fronts]
        out_db = None
        if self.opts.q_front == "output" and self.q_measure is not None:
            out_db = [self._output_front(shard, e, budgets) for e in encs]
        best = choose_q_db(out_db or kv_db, dominate=self.opts.q_dominate)
        enc = encs[best]
        enc.meta["q"] = qs[best]
        enc.meta["q_front"] = "output" if out_db else "kv"
        enc.meta["q_front_db"] = {f"{q:g}": d for q, d in zip(qs, kv_db)}
        if out_db:
            enc.meta["q_output_db"] = {f"{q:g}": d for q, d in zip(qs, out_db)}
        return enc

    def _output_front(self, shard: ShardData, enc: EncodedShard, budgets: list[float]
                      ) -> list[float | None]:
        """Per budget, :attr:`q_measure` (dB) of the configuration the allocator would take
        within it (the smallest weighted error that fits, as ``codec.profile`` ranks
        configurations without an output profile); None where none fits."""
        out: list[float | None] = []
        seen: dict[int, float] = {}
        for b in budgets:
            fits = [j for j in range(len(enc.configs)) if enc.config_bytes(j) <= b]
            if not fits:
                out.append(None)
                continue
            j = min(fits, key=lambda j: (enc.configs[j].weighted_err, -enc.config_bytes(j)))
            if j not in seen:
                cfg = enc.configs[j]
                decoded = self.decode(cfg.params, enc.config_data(j), shard.spec)
                seen[j] = round(float(self.q_measure(shard.spec.index, cfg.params, decoded)), 4)
            out.append(seen[j])
        return out

    def _encode_at(self, shard: ShardData, q: float) -> EncodedShard:
        spec = shard.spec
        m_count = len(shard.matrices)
        if m_count != spec.num_matrices or m_count > 255:
            raise CodecError(f"shard {spec.index}: expected {spec.num_matrices} matrices")
        g = self.geometry(m_count, spec.tokens, spec.channels)
        n, c = spec.tokens, spec.channels

        # 1. factorize every matrix, order all components of the shard together
        avecs, bvecs, rels, owner = [], [], [], []
        matrices = self._frame(shard.matrices, spec, inverse=True)
        shard = ShardData(spec=spec, matrices=matrices, importance=shard.importance)
        for m, (x, imp) in enumerate(zip(shard.matrices, shard.importance)):
            kq = self.opts.key_q
            a, b, rel = self.factorize(x, imp, q if kq is None or m % 2 else kq)
            avecs.append(a)
            bvecs.append(b)
            rels.append(rel)
            owner.append(torch.full((rel.numel(),), m, dtype=torch.long))
        rel_all = torch.cat(rels)
        owner_all = torch.cat(owner)
        local_all = torch.cat([torch.arange(r.numel()) for r in rels])
        order = torch.sort(-rel_all, stable=True).indices[: g.level_max[0] * m_count]
        slots = len(order)
        slot_m = owner_all[order]
        slot_c = local_all[order]
        a_sel = torch.stack([avecs[int(m)][int(k)] for m, k in zip(slot_m, slot_c)])
        b_sel = torch.stack([bvecs[int(m)][int(k)] for m, k in zip(slot_m, slot_c)])
        # balance: a and b get equal norms (b is a unit vector)
        f = a_sel.norm(dim=1).clamp_min(1e-30).sqrt()
        a_sel = a_sel / f[:, None]
        b_sel = b_sel * f[:, None]

        # 2. progressive quantization of [a | b] (rotated, embedded levels)
        level_slots = [g.level_max[lv] * m_count for lv in range(g.levels)]
        quant = g.quantizer()
        steps, codes, recon_levels = quant.encode(torch.cat([a_sel, b_sel], dim=1))
        chunks: list[np.ndarray] = []
        for lv, lbits in enumerate(g.level_bits):
            k = level_slots[lv]
            packed = pack_codes(codes[lv][:k].numpy(), lbits)
            if lv == 0:
                owner_col = slot_m[:k].to(torch.uint8).numpy().reshape(k, 1)
                step_bytes = steps[:k].numpy().view(np.uint8).reshape(k, -1)
                packed = np.concatenate([owner_col, step_bytes, packed], axis=1)
            assert packed.shape[1] == g.chunk_bytes(lv)
            chunks.append(packed)

        # 3. candidate configurations (every staircase of the rank ladder) and their
        # weighted errors (closed form)
        cands = staircases(g.ladder, g.level_max)
        errs = self._config_errors(shard, g, slot_m, recon_levels, cands)
        per_rank = np.array([m_count * g.chunk_bytes(lv) for lv in range(g.levels)])
        data_sizes = (np.array(cands, dtype=np.int64) @ per_rank).tolist()
        err_of = dict(zip(cands, errs))
        size_of = dict(zip(cands, data_sizes))

        # 4. streams (each configuration is a prefix of one stream) and the chosen offers
        streams, offers = streams_of(g, cands, errs, data_sizes, mixed=self.opts.mixed,
                                     keep_all=self.opts.keep == "all",
                                     uniform_bits=self.opts.uniform_bits)
        heads = [StreamHeader(g.levels, m_count, n, c, g.group, g.level_bits, g.ladder,
                              unit_levels(p)).size for p in streams]
        chosen = choose(streams, offers, err_of, size_of, heads, set(g.reference),
                        mixed=self.opts.mixed, keep_all=self.opts.keep == "all",
                        bits=self.opts.bits, uniform_bits=self.opts.uniform_bits)

        # 5. units: per stream its header then its units, up to the last one a
        # configuration uses (nothing else is stored)
        units: list[bytes] = []
        configs = []
        for s, path in enumerate(streams):
            used = [k for t, k in chosen if t == s]
            if not used:
                continue
            path = path[: max(used)]
            head = StreamHeader(g.levels, m_count, n, c, g.group, g.level_bits, g.ladder,
                                unit_levels(path))
            base = len(units)
            units.append(head.pack())
            for lv, first, end in head.walk():
                units.append(chunks[lv][first:end].tobytes())
            for k in sorted(used):
                ranks = path[k - 1]
                top = max(lv for lv, r in enumerate(ranks) if r > 0)
                params = {"rank": ranks[0], "bits": g.bits[top], "ranks": list(ranks)}
                configs.append(EncodedConfig(params=params, units=list(range(base, base + k + 1)),
                                             weighted_err=err_of[ranks]))
        configs.sort(key=lambda cf: (sum(len(units[u]) for u in cf.units), cf.weighted_err))
        meta = {"components": slots, "ladder": list(g.ladder), "level_max": list(g.level_max),
                "streams": sum(1 for s in range(len(streams)) if any(t == s for t, _ in chosen)),
                "bytes_vs_pareto": prefix_cost(g, streams, cands, errs, data_sizes)}
        return EncodedShard(units=units, configs=configs, meta=meta)

    def _config_errors(
        self,
        shard: ShardData,
        g: ShardGeometry,
        slot_m: torch.Tensor,
        recon_levels: list[torch.Tensor],
        cands: list[tuple[int, ...]],
    ) -> list[float]:
        """Weighted relative error of every candidate, via Gram matrices and prefix sums."""
        n = g.tokens
        m_count = g.matrices
        lv_count = g.levels
        cand_arr = np.array(cands, dtype=np.int64) * m_count  # global slot counts [K, L]
        # counts[m, s] = components of matrix m among the first s slots
        onehot = torch.nn.functional.one_hot(slot_m, m_count).T.numpy()
        counts = np.concatenate([np.zeros((m_count, 1), np.int64), onehot.cumsum(1)], axis=1)
        total_err = np.zeros(len(cands))
        for m in range(m_count):
            sel = (slot_m == m).nonzero().flatten()
            k = len(sel)
            x = shard.matrices[m].double()
            p = normalized_importance(shard.importance[m], self.opts.floor)
            energy = float((p[:, None] * x**2).sum())
            if k == 0:
                total_err += 1.0 if energy > 0 else 0.0
                continue
            a_all = torch.cat([r[sel, :n].T for r in recon_levels], dim=1)  # [N, L k]
            b_all = torch.cat([r[sel, n:] for r in recon_levels], dim=0)  # [L k, C]
            h = ((a_all.T @ (p[:, None] * a_all)) * (b_all @ b_all.T)).numpy()
            t = (p[:, None] * a_all * (x @ b_all.T)).sum(0).numpy().reshape(lv_count, k)
            h = h.reshape(lv_count, k, lv_count, k).transpose(0, 2, 1, 3)
            integ = np.zeros((lv_count, lv_count, k + 1, k + 1))
            integ[:, :, 1:, 1:] = h.cumsum(2).cumsum(3)
            tcum = np.zeros((lv_count, k + 1))
            tcum[:, 1:] = t.cumsum(1)
            # per config: level l covers local components [n_{l+1}, n_l)
            nl = counts[m][cand_arr]  # [K, L]
            bounds = np.concatenate([nl, np.zeros((len(cands), 1), np.int64)], axis=1)
            lin = np.zeros(len(cands))
            quad = np.zeros(len(cands))
            for la in range(lv_count):
                lo_a, hi_a = bounds[:, la + 1], bounds[:, la]
                lin += tcum[la, hi_a] - tcum[la, lo_a]
                for lb in range(lv_count):
                    lo_b, hi_b = bounds[:, lb + 1], bounds[:, lb]
                    ii = integ[la, lb]
                    quad += ii[hi_a, hi_b] - ii[lo_a, hi_b] - ii[hi_a, lo_b] + ii[lo_a, lo_b]
            err = (energy - 2 * lin + quad) / energy if energy > 0 else np.zeros(len(cands))
            total_err += np.maximum(err, 0.0)
        return [float(e) for e in total_err / m_count]

    # ------------------------------------------------------------------ decode
    def decode(self, params: dict[str, Any], data: bytes, spec: ShardSpec) -> list[torch.Tensor]:
        where = f"shard {spec.index}"
        head = StreamHeader.parse(data, where)
        m_count, n, c = head.matrices, head.tokens, head.channels
        if (m_count, n, c) != (spec.num_matrices, spec.tokens, spec.channels):
            raise PackError(
                f"{where}: header geometry {(m_count, n, c)} does not match "
                f"{(spec.num_matrices, spec.tokens, spec.channels)}"
            )
        levels = head.levels
        ranks = params.get("ranks")
        if (not isinstance(ranks, list) or len(ranks) != levels
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)):
            raise PackError(f"{where}: params {params} do not match {levels} levels")
        if ranks[0] < 1:
            raise PackError(f"{where}: a configuration needs at least one component")
        try:
            streams = head.split(data, ranks)  # checks the prefix and its length
        except PackError as exc:
            raise PackError(f"{where}: {exc}") from None
        native = codec_native.module() if self.use_native else None
        if native is not None:
            phasors = self._phasors(spec, torch.float32) if self.opts.rope is not None else None
            table = None if phasors is None else torch.view_as_real(phasors)
            return codec_native.decode_lowrank(data, ranks, table, self.native_threads, mod=native)
        bits = tuple(int(x) for x in np.cumsum(head.level_bits))
        g = ShardGeometry(m_count, n, c, head.group, bits, (), ())
        quant = self._quantizer(g)
        groups = g.plan.groups
        owners = torch.zeros(0, dtype=torch.long)
        steps = torch.zeros(0, groups, dtype=torch.float16)
        codes = []
        for lv, r in enumerate(ranks):
            k = r * m_count
            if k == 0:
                break
            size = g.chunk_bytes(lv)
            block = torch.frombuffer(bytearray(streams[lv]), dtype=torch.uint8).view(k, size)
            if lv == 0:
                owners = block[:, 0].long()
                steps = block[:, 1 : 1 + 2 * groups].contiguous().view(torch.float16)
                block = block[:, 1 + 2 * groups :]
            codes.append(unpack_codes(block, head.level_bits[lv], n + c))
        values = quant.decode(steps, codes)
        per_matrix = torch.bincount(owners, minlength=m_count).tolist()
        if len(per_matrix) != m_count:
            raise PackError(f"{where}: component owner out of range")
        parts = values[torch.argsort(owners, stable=True)].split(per_matrix)
        return self._frame([p[:, :n].T @ p[:, n:] for p in parts], spec, inverse=False)

    def _frame(self, mats: list[torch.Tensor], spec: ShardSpec, inverse: bool) -> list[torch.Tensor]:
        """Keys (even matrices) to (``inverse``) or from the pre-RoPE frame; values as is."""
        if self.opts.rope is None:
            return mats
        phasors = self._phasors(spec, mats[0].dtype)
        return [rope_apply(x, phasors, inverse) if i % 2 == 0 else x for i, x in enumerate(mats)]

    def _phasors(self, spec: ShardSpec, dtype: torch.dtype) -> torch.Tensor:
        """The keys' RoPE phasors ``[N, C/2]`` (complex), built once per geometry."""
        assert self.opts.rope is not None
        key = ("rope", spec.tokens, spec.channels, dtype)
        cache = self.__dict__.setdefault("_quantizers", {})
        if key not in cache:
            angles = rope_angles(self.opts.rope, spec.tokens, spec.channels)
            cache[key] = rope_phasors(angles, int(self.opts.rope["heads"]), dtype)
        return cache[key]

    def _quantizer(self, g: ShardGeometry) -> ProgressiveQuantizer:
        """Decoder quantizers (and their constant tables), built once per geometry."""
        key = (g.tokens, g.channels, g.group, g.level_bits)
        cache = self.__dict__.setdefault("_quantizers", {})
        if key not in cache:
            cache[key] = g.quantizer()
        return cache[key]

    def rank_key(self, params: dict[str, Any]) -> float:
        return float(sum(r * b for r, b in zip(params.get("ranks", []), self.opts.bits)))


# ---------------------------------------------------------------------------- q choice
def front_db(front: list[tuple[int, float]], budgets: list[float]) -> list[float | None]:
    """Per budget, the quality (``-10 log10 err``) of the best configuration of ``front``
    (``(bytes, err)`` pairs) within it; None where none fits."""
    out: list[float | None] = []
    for b in budgets:
        errs = [e for n, e in front if n <= b]
        out.append(None if not errs else round(err_to_db(min(errs)), 4))
    return out


def choose_q(fronts: list[list[tuple[int, float]]], budgets: list[float]) -> int:
    """Index of the candidate whose measured front (``(bytes, err)`` per configuration) is
    best on average over ``budgets``, among those no worse than candidate 0 (q = 0, plain
    SVD) at ANY budget: the result is never worse than plain SVD on the measured front.
    Ties keep the earlier candidate (q = 0 first)."""
    return choose_q_db([front_db(f, budgets) for f in fronts])


def choose_q_db(dbs: list[list[float | None]], dominate: bool = True) -> int:
    """:func:`choose_q` on qualities already measured per budget (dB, higher is better;
    None: nothing fits): the candidate with the best mean gain over candidate 0 among
    those no worse than it at any budget (``dominate=False``: among those that reach every
    budget candidate 0 reaches); ties keep the earlier candidate."""
    base = dbs[0]
    best, best_gain = 0, 0.0
    for i, db in enumerate(dbs[1:], start=1):
        gains = []
        ok = True
        for d, b0 in zip(db, base):
            if b0 is None:
                continue  # plain SVD has nothing there: any config is no worse
            if d is None or (dominate and d < b0):
                ok = False
                break
            gains.append(d - b0)
        gain = sum(gains) / len(gains) if gains else 0.0
        if ok and gain > best_gain:
            best, best_gain = i, gain
    return best


@register("sakura")
def make_sakura(**options: Any) -> LowRankCodec:
    return LowRankCodec("sakura", **options)


@register("sakura-all")
def make_sakura_all(**options: Any) -> LowRankCodec:
    """SAKURA keeping every uniform (rank, bits) configuration, not only the thinned Pareto
    front: the pack the fixed-config / fixed-bits ablations choose from."""
    return LowRankCodec("sakura-all", **{**options, "keep": "all"})


@register("svd")
def make_svd(**options: Any) -> LowRankCodec:
    if options.get("q", 0.0) != 0.0:
        raise CodecError("codec 'svd' is SAKURA with q = 0; use codec 'sakura' for q != 0")
    return LowRankCodec("svd", **{**options, "q": 0.0})


# ---------------------------------------------------------------------------- RoPE frame
def check_rope(rope: dict[str, Any]) -> None:
    try:
        heads, axes, theta = int(rope["heads"]), list(rope["axes"]), float(rope["theta"])
        pos = torch.as_tensor(rope["positions"], dtype=torch.float64)
    except (KeyError, TypeError, ValueError) as exc:
        raise CodecError(f"rope needs heads, axes, theta and positions: {exc!r}") from None
    if heads < 1 or not axes or any(int(a) % 2 or int(a) < 2 for a in axes) or theta <= 0:
        raise CodecError(f"bad rope heads/axes/theta: {heads}, {axes}, {theta}")
    if pos.dim() != 2 or pos.shape[1] != len(axes):
        raise CodecError(f"rope positions must be [N, {len(axes)}], got {tuple(pos.shape)}")


def rope_angles(rope: dict[str, Any], tokens: int, channels: int) -> torch.Tensor:
    """Per-token rotation angles ``[N, head_dim / 2]`` (float32, as the model computes them)."""
    pos = torch.as_tensor(rope["positions"], dtype=torch.float64)
    heads, axes = int(rope["heads"]), [int(a) for a in rope["axes"]]
    if pos.shape[0] != tokens:
        raise CodecError(f"rope has {pos.shape[0]} positions, the shard {tokens} tokens")
    if channels % heads or sum(axes) != channels // heads:
        raise CodecError(f"rope axes {axes} x {heads} heads do not match {channels} channels")
    out = []
    for i, dim in enumerate(axes):
        freqs = 1.0 / float(rope["theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        out.append(pos[:, i : i + 1] * freqs[None])
    return torch.cat(out, dim=-1).float()


def rope_rotate(x: torch.Tensor, angles: torch.Tensor, heads: int, inverse: bool) -> torch.Tensor:
    """Rotate channel pairs of every head of ``x [N, C]`` by ``angles`` (``-angles`` if inverse)."""
    return rope_apply(x, rope_phasors(angles, heads, x.dtype), inverse)


def rope_phasors(angles: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``exp(i * angle)`` per token and channel pair of all heads: ``[N, heads * D / 2]``."""
    a = angles.to(torch.float64 if dtype == torch.float64 else torch.float32)
    return torch.polar(torch.ones_like(a), a).repeat(1, heads)


def rope_apply(x: torch.Tensor, phasors: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Pairs ``(2j, 2j + 1)`` of ``x [N, C]`` as complex numbers, times the phasors."""
    n, c = x.shape
    xc = torch.view_as_complex(x.contiguous().view(n, c // 2, 2))
    return torch.view_as_real(xc * (phasors.conj() if inverse else phasors)).reshape(n, c)
