"""The render engine's scheduler: priority monotasks, least-maximum-load placement with
affinity, step-boundary preemption and idempotent completion. Pure logic, no processes.

A *monotask* is one unit of one request's denoising step: a whole step (``patch = -1``:
warm-up or full execution), a gate probe (``patch = -2``) or one patch of a regional step.
Its output is keyed by ``(request, step, patch)``; the first completion of a key is
applied, any later one is a duplicate and is dropped, so re-running a task (after its
worker died) is harmless.

Order: first the request's **priority class** (``high``, ``normal``, ``low``: the
request's, from the API), then, within a class, policy ``warmup_first`` (FlashDiff's):
warm-up and probe tasks first (they unblock a request's partition or its next step), then
patch / full-step tasks; requests in arrival order, then step, then patch. Policy ``fifo``
drops the kinds: the earliest request of the class first. A request's step ``s + 1``
tasks only exist once all of its step ``s`` outputs are applied, and a dispatched task
always runs to the end, so a request overtakes another only at that one's step boundary.

**Preemption** (the paper's rule, ``preempt="benefit"``): when the next task of a
higher class ``H`` would take a worker ``w`` on which a lower-class request ``L`` is
running (``w`` holds ``L``'s state, so continuing it there costs nothing extra) while
``H`` would have to be moved there, ``H`` preempts ``L`` at ``L``'s step boundary only if
the benefit outweighs the switch cost::

    Benefit    = W_H * c_L            (H does not wait for L's step)
    SwitchCost = W_L * (c_H + s_H)    (L waits for H's step and for H's state to move)

with ``W`` the class weights (high 4, normal 2, low 1), ``c`` the step's estimated cost
and ``s_H`` = shipping ``H``'s state to ``w`` plus the per-call overhead, all in token
rows. This is the weighted-completion-time comparison of the two orders (Smith's rule
with a switching cost). ``preempt="strict"``: the higher class always goes first.

A task already in a worker's backlog is not reordered, so while a request of a higher
class is open, lower-class tasks may fill a worker's backlog only to ``reserve`` x the
capacity: the rest is kept for the higher class (whose next step would otherwise wait
for a full backlog of lower-class work at every step).

Placement: each worker has a load (estimated cost of its dispatched, unfinished tasks) and
a capacity (a short backlog, so that priorities are decided late). A task goes to the
worker that minimises the maximum load after placing it, where placing it on a worker
that lacks the request's state adds the cost of shipping that state (``transfer``):
that is the affinity. Ties go to the worker with affinity, then the less loaded one.
Tasks of one (request, step) placed on one worker in one round form one *group* (one
message, one packed forward).

A *gang* (``gang=True``: the active patches of a joint regional step, which see each other
fresh) is placed whole. The engine may cut a step's gang into ``part``s (patch
parallelism, ``cloud.render``): each part is then placed on its own by the same rule, so
the parts go to different workers only when the load after placing them, shipping the
request's K/V to the second worker included, is lower than on one worker; parts that land
on one worker in one round form one group again, and run as one joint unit.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

WARMUP, PATCH, FULL, PROBE = "warmup", "patch", "full", "probe"
PRIORITY = {WARMUP: 0, PROBE: 0, PATCH: 1, FULL: 1}
POLICIES = ("warmup_first", "fifo")
CLASSES = ("high", "normal", "low")
CLASS_WEIGHTS = (4.0, 2.0, 1.0)
PREEMPTION = ("benefit", "strict")


def class_index(name: str) -> int:
    """``"high"`` -> 0, ``"normal"`` -> 1, ``"low"`` -> 2 (ValueError otherwise)."""
    if name not in CLASSES:
        raise ValueError(f"priority must be one of {CLASSES}")
    return CLASSES.index(name)


@dataclass(frozen=True, order=True)
class TaskKey:
    """Identity of a monotask output: (request, step, patch); patch -1 = whole step."""

    rid: int
    step: int
    patch: int


@dataclass
class Task:
    key: TaskKey
    kind: str
    seq: int            # the request's arrival order
    cost: float         # estimated compute, in token rows
    tokens: int = 0     # region tokens the task computes (for transfer estimates)
    gang: bool = False  # all ready tasks of its (request, step, part) go to one worker together
    cls: int = 1        # the request's priority class (index into CLASSES)
    part: int = 0       # its gang within the step (patch parallelism: a step's gangs may
                        # go to different workers; on one worker they form one group)

    @property
    def priority(self) -> int:
        return PRIORITY[self.kind]

    @property
    def weight(self) -> float:
        return CLASS_WEIGHTS[self.cls]

    def order(self, policy: str = "warmup_first") -> tuple:
        kind = self.priority if policy == "warmup_first" else 0
        return (self.cls, kind, self.seq, self.key.step, self.key.patch)


@dataclass
class Group:
    """Tasks of one (request, step) sent to one worker together."""

    worker: int
    tasks: list[Task]

    @property
    def rid(self) -> int:
        return self.tasks[0].key.rid

    @property
    def step(self) -> int:
        return self.tasks[0].key.step


@dataclass
class SchedulerStats:
    dispatched: int = 0
    completed: int = 0
    duplicates: int = 0
    requeued: int = 0
    workers_lost: int = 0
    affinity_hits: int = 0
    preemptions: int = 0     # a higher class took a worker from a running lower-class request
    kept: int = 0            # a lower-class request kept its worker (switch cost > benefit)
    # recent placements (task, worker), bounded
    placements: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=100_000))


class Scheduler:
    """Ready queue + placement + in-flight bookkeeping.

    ``transfer(task, worker)`` returns the extra cost of running ``task`` on ``worker``
    (0 when the worker holds the request's state). ``group_overhead`` is the fixed cost
    of one message (one forward call).
    """

    def __init__(self, capacity: float, transfer: Callable[[Task, int], float] | None = None,
                 group_overhead: float = 0.0, policy: str = "warmup_first",
                 preempt: str = "benefit", reserve: float = 0.5):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        if preempt not in PREEMPTION:
            raise ValueError(f"preempt must be one of {PREEMPTION}")
        self.policy, self.preempt = policy, preempt
        self.reserve = reserve
        self.open: dict[int, int] = {}               # open request -> its class
        self.capacity = capacity
        self.transfer = transfer or (lambda task, worker: 0.0)
        self.group_overhead = group_overhead
        self.workers: dict[int, float] = {}          # worker -> load
        self.inflight: dict[TaskKey, tuple[int, Task, float]] = {}
        self.done: set[TaskKey] = set()
        self._ready: list[tuple[tuple, int, Task]] = []
        self._queued: set[TaskKey] = set()
        self._tie = itertools.count()
        self.stats = SchedulerStats()

    # -- workers ---------------------------------------------------------------------

    def add_worker(self, worker: int) -> None:
        self.workers.setdefault(worker, 0.0)

    def worker_lost(self, worker: int) -> list[Task]:
        """Forget a dead worker; its unfinished tasks go back to the ready queue."""
        self.workers.pop(worker, None)
        lost = [(k, t) for k, (w, t, _) in self.inflight.items() if w == worker]
        for k, t in lost:
            del self.inflight[k]
            self.add(t)
        self.stats.requeued += len(lost)
        self.stats.workers_lost += 1
        return [t for _, t in lost]

    def load(self, worker: int) -> float:
        return self.workers[worker]

    def open_request(self, rid: int, cls: int) -> None:
        """A request of class ``cls`` is admitted (it holds backlog room for its class)."""
        self.open[rid] = cls

    def _limit(self, task: Task) -> float:
        """The backlog a task may fill: all of it, or ``reserve`` of it while a request of
        a higher class is open."""
        higher = any(c < task.cls for c in self.open.values())
        return self.capacity * (self.reserve if higher else 1.0)

    # -- tasks -----------------------------------------------------------------------

    def add(self, task: Task) -> bool:
        """Queue a task unless its output exists or it is already queued / running."""
        k = task.key
        if k in self.done or k in self._queued or k in self.inflight:
            return False
        heapq.heappush(self._ready, (task.order(self.policy), next(self._tie), task))
        self._queued.add(k)
        return True

    def drop_request(self, rid: int) -> None:
        """Remove a request's queued tasks (e.g. it failed)."""
        keep = [e for e in self._ready if e[2].key.rid != rid]
        self._queued = {e[2].key for e in keep}
        self._ready = keep
        heapq.heapify(self._ready)

    @property
    def pending(self) -> int:
        return len(self._ready)

    def peek(self) -> Task | None:
        return self._ready[0][2] if self._ready else None

    def _unit(self, i: int) -> list[Task]:
        """Take the task at heap position ``i`` (and, for a gang, its siblings) out."""
        task = self._ready[i][2]
        same = [e for e in self._ready
                if e[2] is task or (task.gang and self._same_gang(e[2], task))]
        self._ready = [e for e in self._ready if not any(e is s for s in same)]
        heapq.heapify(self._ready)
        return [e[2] for e in sorted(same)]

    def _cost(self, i: int) -> float:
        task = self._ready[i][2]
        if not task.gang:
            return task.cost
        return sum(e[2].cost for e in self._ready if self._same_gang(e[2], task))

    def _choose(self, free: list[int], open_groups) -> tuple[int, int | None]:
        """Heap position of the next task to place (and the worker it is pinned to, if the
        preemption rule kept a lower-class request on its worker)."""
        top = self._ready[0][2]
        if self.preempt == "strict" or top.cls == len(CLASSES) - 1:
            return 0, None
        if any(self.transfer(top, w) == 0 for w in free):
            return 0, None  # it can run where its state is: nobody is displaced
        lower = sorted((e[0], i) for i, e in enumerate(self._ready) if e[2].cls > top.cls)
        c_top = self._cost(0)
        for _, i in lower:
            low = self._ready[i][2]
            for w in free:
                if (w, low.key.rid, low.key.step) in open_groups or self.transfer(low, w) != 0:
                    continue
                # `low` is running on `w`: preempt it at this step boundary?
                switch = self.transfer(top, w) + self.group_overhead
                benefit = top.weight * self._cost(i)
                cost = low.weight * (c_top + switch)
                if benefit > cost:
                    self.stats.preemptions += 1
                    return 0, None
                self.stats.kept += 1
                return i, w
        return 0, None

    def place(self) -> list[Group]:
        """Assign ready tasks, highest priority first (subject to the preemption rule),
        while some worker has room."""
        groups: list[Group] = []
        open_groups: dict[tuple[int, int, int], Group] = {}
        while self._ready:
            free = [w for w, load in self.workers.items() if load < self.capacity]
            if not free:
                break
            i, pinned = self._choose(free, open_groups)
            limit = self._limit(self._ready[i][2])
            eligible = [w for w in (free if pinned is None else [pinned])
                        if self.workers[w] < limit]
            if not eligible and pinned is not None:
                # the lower-class request kept on its worker has no room left there (its
                # class's reserve, none at reserve 0): the higher class goes instead, or
                # nothing would ever be placed again (reserve 0 stalled the engine)
                i, pinned = 0, None
                limit = self._limit(self._ready[0][2])
                eligible = [w for w in free if self.workers[w] < limit]
            if not eligible:
                break  # the room left is reserved for a higher class
            unit = self._unit(i)
            task = unit[0]
            cost = sum(t.cost for t in unit)
            best = None
            for w in eligible:
                key = (w, task.key.rid, task.key.step)
                extra = 0.0 if key in open_groups else self.transfer(task, w)
                overhead = 0.0 if key in open_groups else self.group_overhead
                after = self.workers[w] + cost + extra + overhead
                worst = max([after] + [ld for u, ld in self.workers.items() if u != w])
                cand = (worst, extra > 0, after, w)
                if best is None or cand < best[0]:
                    best = (cand, w, extra + overhead, extra == 0)
            _, w, fixed, affine = best
            for i, t in enumerate(unit):
                self._queued.discard(t.key)
                self._assign(t, w, t.cost + (fixed if i == 0 else 0.0), affine, open_groups,
                             groups)
        return groups

    @staticmethod
    def _same_gang(a: Task, b: Task) -> bool:
        return (a.key.rid, a.key.step, a.part) == (b.key.rid, b.key.step, b.part)

    def _assign(self, task: Task, w: int, charged: float, affine: bool,
                open_groups: dict, groups: list[Group]) -> None:
        self.workers[w] += charged
        self.inflight[task.key] = (w, task, charged)
        self.stats.dispatched += 1
        self.stats.affinity_hits += int(affine)
        self.stats.placements.append((task.key, w))
        gk = (w, task.key.rid, task.key.step)
        if gk in open_groups:
            open_groups[gk].tasks.append(task)
        else:
            g = Group(w, [task])
            open_groups[gk] = g
            groups.append(g)

    def complete(self, key: TaskKey, worker: int) -> bool:
        """Record an output. True the first time a key completes; False for a duplicate
        (or an output of a task this scheduler never dispatched)."""
        if key in self.done:
            self.stats.duplicates += 1
            self._release(key, worker)
            return False
        if key not in self.inflight:
            self.stats.duplicates += 1
            return False
        self._release(key, worker)
        self.done.add(key)
        self.stats.completed += 1
        return True

    def _release(self, key: TaskKey, worker: int) -> None:
        entry = self.inflight.get(key)
        if entry is None:
            return
        w, _, charged = entry
        del self.inflight[key]
        if w in self.workers:
            self.workers[w] = max(0.0, self.workers[w] - charged)

    def retry(self, key: TaskKey) -> bool:
        """Put a dispatched, unfinished task back in the queue (its worker could not run it)."""
        entry = self.inflight.get(key)
        if entry is None:
            return False
        self._release(key, entry[0])
        self.stats.requeued += 1
        return self.add(entry[1])

    def forget(self, rid: int) -> None:
        """Drop the done-set entries of a finished request (bounded memory)."""
        self.done = {k for k in self.done if k.rid != rid}
        self.open.pop(rid, None)


__all__ = ["CLASSES", "CLASS_WEIGHTS", "FULL", "PATCH", "POLICIES", "PREEMPTION", "PRIORITY",
           "PROBE", "WARMUP", "Group", "Scheduler", "SchedulerStats", "Task", "TaskKey",
           "class_index"]
