"""The server never sends a byte its manifest does not vouch for: :class:`UnitVerifier`
checks the manifest's unit checksums (and the pack's embedded header) on the bytes in
storage before any of them is served, remembers what passed per version on storage, and
lists damaged packs for ``/healthz``. Callers (:func:`cloud.responses.serve_body`, the shard
endpoint's hash) pass exactly the pack spans they are about to send."""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
from typing import TYPE_CHECKING

from sakura.cloud.api_errors import ApiError
from sakura.cloud.errors import ErrorCode, StorageError
from sakura.cloud.storage import ObjectReader
from sakura.codec.manifest import MAGIC, PREAMBLE

if TYPE_CHECKING:  # resolve -> state -> verify at run time
    from sakura.cloud.resolve import Resolved

log = logging.getLogger("sakura.cloud.server")


class UnitVerifier:
    """Checks the manifest's unit checksums on the bytes in storage before any is served.

    What passed is remembered per (pack key, storage change token: inode, size and mtime
    for a folder, the ETag in a bucket), bounded LRU: a file repaired or replaced on disk
    has a new token and is checked again, so the repair is served without a restart, and a
    damaged file is never vouched for (``500`` with the reason). Damaged packs are listed
    for ``/healthz`` until a check of a newer version passes.
    """

    HEADER = -1  # the pseudo-unit of the pack's preamble and embedded header

    def __init__(self, max_versions: int = 4096) -> None:
        self.max_versions = max_versions
        self._ok: collections.OrderedDict[tuple[str, str], set[int]] = collections.OrderedDict()
        self._damaged: dict[str, tuple[str, str]] = {}  # pack key -> (token, reason)
        self._lock = threading.Lock()

    def damaged(self) -> list[dict[str, str]]:
        with self._lock:
            return [{"pack": k, "error": why, "code": ErrorCode.PACK_DAMAGED}
                    for k, (_t, why) in sorted(self._damaged.items())]

    def verify(self, reader: ObjectReader, resolved: Resolved,
               spans: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> None:
        """Raise :class:`ApiError` (500, ``pack_damaged``) unless every unit overlapping
        ``spans`` (pack offsets, lengths) of the version ``reader`` holds hashes to the
        manifest's value. Callers pass exactly the spans they are about to send."""
        index = resolved.index
        key = (resolved.pack_key, reader.info.etag)
        first_unit = index.units[0][0] if index.units else index.pack_bytes
        wanted = {i for off, n in spans if n > 0 for i in index.units_in(off, off + n)}
        with self._lock:
            ok = self._ok.get(key)
            if ok is None:
                ok = self._ok[key] = set()
                while len(self._ok) > self.max_versions:
                    self._ok.popitem(last=False)
            self._ok.move_to_end(key)
            # what is left to check, without copying the set of passed units (thousands in
            # a real pack) on every request
            todo = sorted(wanted - ok)
            header = self.HEADER not in ok and any(off < first_unit for off, n in spans
                                                   if n > 0)
        try:
            if header:
                self._check_header(reader, first_unit)
                with self._lock:
                    ok.add(self.HEADER)
            for run in _runs(todo):
                start = index.units[run[0]][0]
                stop = index.units[run[-1]][0] + index.units[run[-1]][1]
                data = reader.read_range(start, stop)
                for i in run:
                    off, length, sha = index.units[i]
                    if hashlib.sha256(data[off - start : off - start + length]).hexdigest() != sha:
                        raise _Damaged(f"unit {i} (bytes {off}-{off + length - 1}) fails its "
                                       "checksum")
                    with self._lock:
                        ok.add(i)
        except _Damaged as exc:
            why = (f"the pack of {resolved.template_id}/{resolved.codec} is damaged: {exc}; "
                   "it is not served until it is repaired")
            log.error("%s (%s)", why, resolved.pack_key)
            with self._lock:
                self._damaged[resolved.pack_key] = (reader.info.etag, why)
            raise ApiError(500, why, code=ErrorCode.PACK_DAMAGED) from None
        except StorageError as exc:
            log.error("reading %s failed: %s", resolved.pack_key, exc)
            raise ApiError(503, "storage unavailable", code=ErrorCode.STORAGE_UNAVAILABLE) from exc
        with self._lock:
            seen = self._damaged.get(resolved.pack_key)
            if seen is not None and seen[0] != reader.info.etag:
                del self._damaged[resolved.pack_key]  # a newer version passed: repaired

    def cached(self, reader: ObjectReader, resolved: Resolved,
               spans: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> bool:
        """Whether every unit overlapping ``spans`` of the version ``reader`` holds has
        passed already (so :meth:`verify` reads nothing: a set lookup). Only a hint for
        where to run :meth:`verify`, which is always called."""
        index = resolved.index
        first_unit = index.units[0][0] if index.units else index.pack_bytes
        with self._lock:
            ok = self._ok.get((resolved.pack_key, reader.info.etag))
            if ok is None:
                return False
            for off, n in spans:
                if n <= 0:
                    continue
                if off < first_unit and self.HEADER not in ok:
                    return False
                if any(i not in ok for i in index.units_in(off, off + n)):
                    return False
        return True

    @staticmethod
    def _check_header(reader: ObjectReader, first_unit: int) -> None:
        head = reader.read_range(0, min(first_unit, reader.size))
        if len(head) < PREAMBLE.size or head[:4] != MAGIC:
            raise _Damaged("the preamble is not a SAKURA pack's")
        _magic, _version, _flags, _size, header_len, header_sha = PREAMBLE.unpack_from(head)
        body = head[PREAMBLE.size : PREAMBLE.size + header_len]
        if len(body) != header_len or hashlib.sha256(body).digest() != header_sha:
            raise _Damaged("the embedded header fails its checksum")


class _Damaged(Exception):
    """Bytes in storage that do not match the manifest."""


def _runs(indices: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted unit indices (read with one storage request each)."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][-1] == i - 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out
