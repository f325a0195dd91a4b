"""The engine's side of the workers' K/V replicas: which version of each request's K/V store
each worker holds, and what brings it to the start of a step.

A worker keeps a replica of a request's K/V store (the stale context of patch tasks) at a
version = the step whose start it reflects (``cloud.render_worker`` applies the syncs). The
engine sends nothing (the replica is current), a *delta* (the last K/V-writing step's
writes computed by other workers; the version may move several steps on, since a step where
every patch was skipped writes nothing), or the whole store as a *snapshot*. With patch
parallelism a worker may get another worker's writes of its current step *ahead* of the
step boundary (``("ahead", rid, step, writes)``, while it waits for the step's other
gangs); the next delta then leaves them out and says how many it relies on, and a worker
that does not hold them asks for a snapshot. A request here
is anything with ``rid``, ``kv_since`` (the store is unchanged since the start of this
step) and ``last`` (the last patch step that wrote K/V, and its writes by patch: token ids,
k, v, worker).
"""

from __future__ import annotations

from sakura.cloud.render_model import as_numpy


class ReplicaVersions:
    """Worker -> request -> the step its replica of the request's K/V store is at."""

    def __init__(self):
        self.versions: dict[int, dict[int, int]] = {}

    def reset(self, wid: int) -> None:
        """Worker ``wid`` holds no replica (new, or lost)."""
        self.versions[wid] = {}

    def forget(self, wid: int, rid: int) -> None:
        """Worker ``wid``'s replica of request ``rid`` is gone (closed or to be resent)."""
        self.versions.get(wid, {}).pop(rid, None)

    def move(self, wid: int, rid: int, step: int) -> None:
        """Worker ``wid``'s replica of ``rid`` is now at the start of ``step``."""
        self.versions[wid][rid] = step

    def sync_kind(self, r, step: int, wid: int) -> str:
        """How worker ``wid``'s replica is brought to the start of ``step``: ``none`` (it
        is there), ``delta`` (its version is the last K/V-writing step, whose writes from
        other workers it is sent, or later: then only its version moves on, since steps
        where every patch was skipped change nothing) or ``snapshot``."""
        version = self.versions.get(wid, {}).get(r.rid)
        if version is None or version > step:
            return "snapshot"
        if version == step:
            return "none"
        if version >= r.kv_since or (r.last is not None and r.last[0] == version):
            return "delta"
        return "snapshot"

    def delta_writes(self, r, wid: int) -> list:
        """The writes of the last K/V-writing step that worker ``wid`` did not compute
        and was not sent ahead (none when its replica is past that step)."""
        version = self.versions[wid][r.rid]
        if r.last is None or r.last[0] != version:
            return []
        sent = self.sent_ahead(r, wid, version)
        return [(o[0], o[1], o[2]) for p, o in r.last[1].items()
                if o[3] != wid and p not in sent]

    @staticmethod
    def sent_ahead(r, wid: int, step: int) -> set[int]:
        """Patches of ``step`` whose outputs went to worker ``wid``'s replica ahead of the
        step boundary (``r.ahead``; requests without it have none)."""
        got = getattr(r, "ahead", {}).get(wid)
        return got[1] if got is not None and got[0] == step else set()

    def sync(self, r, step: int, wid: int, store) -> tuple[str, tuple | None]:
        """What brings worker ``wid``'s replica of ``r`` to the start of ``step``: the
        kind, and the message (None for ``none``): ``("snapshot", step, k, v)`` of the
        request's K/V ``store`` or ``("delta", since, step, writes)``. The replica counts
        as at ``step`` from here on."""
        kind = self.sync_kind(r, step, wid)
        msg = None
        if kind == "snapshot":
            msg = ("snapshot", step, as_numpy(store.k), as_numpy(store.v))
        elif kind == "delta":
            since = self.versions[wid][r.rid]
            msg = ("delta", since, step, self.delta_writes(r, wid))
            ahead = len(self.sent_ahead(r, wid, since)) if r.last and r.last[0] == since else 0
            if ahead:  # the worker checks it holds that many writes sent ahead
                msg += (ahead,)
        self.move(wid, r.rid, step)
        return kind, msg
