"""Background replication of committed checkpoints from the first tier to the durable tiers.

``Replicator`` runs one worker thread per replica tier, so at most one copy is in flight per
tier and a slow tier never holds up a fast one. Each tier replicates in save order and never
skips a checkpoint: a failed copy is reported and retried (after ``retry_s``, doubling up to
five minutes) while training goes on. Only two things drop a checkpoint from a tier's queue, both
said in the log: it was pruned from every tier that could be its source, or the tier fell so far
behind that more than its ``keep_last_k`` newer checkpoints wait, so retention would remove it
at once.

The training thread never waits for a copy, with two exceptions: a save waits while a healthy
tier is ``max_lag`` checkpoints behind (the run slows rather than piling up work), and the last
save of a run waits until the checkpoint is committed in a durable tier (``settle``). Outcomes
come back to the training thread as records (``take_events``), never the other way round.

Retention: each replica prunes itself to its ``keep_last_k`` after a commit; the first tier
keeps a checkpoint beyond its ``keep_last_k`` until some replica has committed it (unless
``prune_unreplicated``). A checkpoint a tier is copying is pruned nowhere until the copy ends.

When a run starts, each worker first compares its tier with the first tier and queues what a
killed or failed earlier attempt left unreplicated, so the next run completes it. A run that
resumed from a checkpoint only a durable tier holds (the first tier is node-local and the job
came back elsewhere) first pulls it back into the first tier, where rank 0 alone writes (one
file, parts): a copy of S, what each of its saves writes anyway. Where every rank writes its own
parts (sharded), nothing is pulled back: each rank has just read its share from the replica,
and a copy by one process would be O(S) there (a copy by each rank another S/N' each); a resume
before the next save reads its share from the replica again, as this one did.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import koochak.loop.checkpoint.retention as retention
from koochak.loop.checkpoint.background import lower_this_threads_priority
from koochak.loop.checkpoint.budget import BandwidthBudget, bandwidth_budget
from koochak.loop.checkpoint.commit import unpublish_checkpoint
from koochak.loop.checkpoint.format import step_of_name
from koochak.loop.checkpoint.layouts import is_single_object, written_by_every_rank
from koochak.loop.checkpoint.part_receipt import put_receipt, read_receipt
from koochak.loop.checkpoint.parts_index import PART_INFIX
from koochak.loop.checkpoint.tiers import Replicated, describe_tier, replicate_checkpoint
from koochak.storage import artifact
from koochak.storage.store import Store
from koochak.storage.transfer import CopyItem, copy_objects

log = logging.getLogger("koochak.loop.checkpoint")

# Longest wait between two attempts of a failing tier, and how many more attempts each tier
# gets at the end of a run before the run gives up on it.
MAX_RETRY_S = 300.0
EXIT_ATTEMPTS = 3
# Never retry sooner than this, even with retry_s 0: a failing tier must not spin.
MIN_RETRY_S = 0.05


class CheckpointReplicationError(RuntimeError):
    """The run's last checkpoint could not be committed in any durable tier."""


@dataclass(frozen=True)
class ReplicaTier:
    """A durable tier as the replicator sees it: its index (1 = the first replica), its store,
    and how many checkpoints it keeps (None: every one)."""

    index: int
    store: Store
    keep_last_k: int | None


@dataclass(frozen=True)
class ReplicationEvent:
    """What happened to one checkpoint in one tier, delivered on the training thread.

    ``status``: ``committed``, ``failed`` (retried after ``retry_in_s``) or ``dropped`` (will
    not be replicated there; ``error`` says why); and, for the run history, ``published`` (the
    first tier, ``tier`` 0, committed it: the copies start from here) and ``pruned`` (a tier's
    retention removed it). ``lag`` is how many checkpoints the tier still
    has to copy; ``behind_s`` how long ago the first tier committed this one (None for a
    checkpoint an earlier attempt saved).
    """

    status: str
    name: str
    step: int | None  # None: not about one checkpoint (comparing the tier with the first)
    tier: int
    location: str
    publication: artifact.Publication | None = None
    path: str | None = None
    seconds: float = 0.0
    bytes_copied: int = 0
    lag: int = 0
    behind_s: float | None = None
    error: str | None = None
    retry_in_s: float | None = None
    at: float | None = None  # when it happened (Unix seconds), for the published/pruned events


@dataclass
class _Lane:
    """One replica tier's queue and health (guarded by the Replicator's condition)."""

    tier: ReplicaTier
    queue: deque[str] = field(default_factory=deque)  # names to copy, oldest first
    busy: str | None = None  # the name being copied
    source: Store | None = None  # the tier it is read from (the first, else a replica)
    committed: set[str] = field(default_factory=set)  # names known committed here
    held: set[str] = field(default_factory=set)  # ... or committed here once (pruned since)
    scanned: bool = False  # compared with the first tier yet
    failures: int = 0  # consecutive failed attempts
    retry_at: float = 0.0
    thread: threading.Thread | None = None
    budget: BandwidthBudget | None = None  # paces this tier's copies (None: unlimited)


class Replicator:
    """Copies each checkpoint committed in ``first`` to every tier of ``replicas``.

    ``spare(store, names)`` names checkpoints no tier's retention removes (``keep_best_k``).
    ``submit(name)`` after each first-tier commit (any thread); ``before_publish(name)`` before
    one (it waits while a tier copies that name, so a re-save never pulls the bytes from under
    a copy); ``wait_for_room()`` before a save (the lag bound); ``take_events()`` on the
    training thread; ``settle(name)`` at the end of a run; ``close()`` when done.
    """

    def __init__(
        self,
        first: Store,
        replicas: Sequence[ReplicaTier],
        *,
        first_keep_last_k: int | None,
        max_lag: int = 2,
        retry_s: float = 10.0,
        prune_unreplicated: bool = False,
        pull: str | None = None,
        spare: Callable[[Store, list[str]], set[str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        remote_writers: Collection[int] = (),
        bandwidth_mb_s: float | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("Replicator: needs at least one replica tier")
        if max_lag < 1:
            raise ValueError(f"train.checkpoint_replication_max_lag must be >= 1, got {max_lag}")
        self.first = first
        self.first_keep = first_keep_last_k
        self.max_lag = max_lag
        self.retry_s = float(retry_s)
        self.prune_unreplicated = prune_unreplicated
        self._spare = spare
        self._clock = clock
        # Ranks that copy their own parts to each replica (FollowerReplicator, under FSDP):
        # this waits for their receipts there instead of copying (or reading) their parts.
        self.remote_writers = frozenset(remote_writers)
        self._cond = threading.Condition()
        # train.checkpoint_replication_bandwidth_mb_s: each tier's copies paced to it.
        self.bandwidth_mb_s = bandwidth_mb_s
        self._lanes = [_Lane(tier, budget=bandwidth_budget(bandwidth_mb_s)) for tier in replicas]
        self._events: deque[ReplicationEvent] = deque()
        self._committed_at: dict[str, float] = {}  # first-tier commit time of this run's saves
        self._held_back: set[str] = set()  # first-tier names kept beyond keep_last_k (logged)
        self._closed = False
        self._exiting = False
        self._pull = pull
        self._pulled = threading.Event()
        self._starter = threading.Thread(
            target=self._start, name="koochak-replicate-start", daemon=True
        )
        self._starter.start()

    # ------------------------------------------------------------------ training-side calls

    def before_publish(self, name: str) -> None:
        """Wait until no tier copies ``name`` and take it off the queues (a new version of it is
        about to be committed in the first tier; ``submit`` queues that one)."""
        self._pulled.wait()  # a pull-back writes into the first tier: let it finish first
        with self._cond:
            while any(lane.busy == name for lane in self._lanes):
                self._cond.wait()
            for lane in self._lanes:
                if name in lane.queue:
                    lane.queue.remove(name)
                lane.committed.discard(name)
                lane.held.discard(name)  # a new version: not durable until copied again

    def submit(self, name: str) -> None:
        """Queue ``name``, just committed in the first tier, for every replica tier."""
        with self._cond:
            self._committed_at[name] = self._clock()
            self._events.append(ReplicationEvent("published", name, step_of_name(name), 0,
                                                 self.first.location, at=time.time()))  # fmt: skip
            for lane in self._lanes:
                if name not in lane.queue:
                    lane.queue.append(name)
                self._supersede(lane)
            self._cond.notify_all()
        self._prune_first()

    def wait_for_room(self) -> float:
        """Block while a healthy tier has ``max_lag`` or more checkpoints still to copy; return
        the seconds waited. A failing tier does not hold training up: it is retried meanwhile."""
        started = None
        with self._cond:
            while not self._closed:
                behind = [
                    lane
                    for lane in self._lanes
                    if lane.failures == 0 and len(lane.queue) >= self.max_lag
                ]
                if not behind:
                    break
                if started is None:
                    started = self._clock()
                    lane = behind[0]
                    log.info(
                        "checkpoint replication to %s is %d checkpoint(s) behind "
                        "(train.checkpoint_replication_max_lag=%d): the next save waits",
                        describe_tier(lane.tier.index, lane.tier.store),
                        len(lane.queue),
                        self.max_lag,
                    )
                self._cond.wait()
        if started is None:
            return 0.0
        waited = self._clock() - started
        log.info("checkpoint replication caught up after %.1f s; saving", waited)
        return waited

    def take_events(self) -> list[ReplicationEvent]:
        """Everything that happened since the last call, oldest first."""
        with self._cond:
            events = list(self._events)
            self._events.clear()
        return events

    def committed_in(self, name: str) -> list[ReplicaTier]:
        """The replica tiers known to hold ``name`` committed, in tier order."""
        with self._cond:
            return [lane.tier for lane in self._lanes if name in lane.committed]

    def settle(self, name: str, *, everywhere: bool) -> list[ReplicaTier]:
        """Wait until ``name`` is committed durably; return the tiers holding it, in tier order.

        Waits for the first replica tier (the one ``on_checkpoint`` names), or, should it give
        up, for any other; ``everywhere``: for every tier. Failing tiers are retried at once and
        then every ``retry_s`` (no longer doubling); a tier gives up after EXIT_ATTEMPTS more
        failures. Raises CheckpointReplicationError when no tier holds ``name`` in the end: the
        node's storage may not come back, so the run must not report success.
        """
        with self._cond:
            self._exiting = True
            start = {id(lane): lane.failures for lane in self._lanes}
            now = self._clock()
            for lane in self._lanes:
                lane.retry_at = min(lane.retry_at, now)
            self._cond.notify_all()
            announce = self._lanes[0]
            while not self._closed:
                done = [ln for ln in self._lanes if name in ln.committed and ln.busy != name]
                trying = [
                    lane
                    for lane in self._lanes
                    if lane not in done
                    and (name in lane.queue or lane.busy == name or not lane.scanned)
                    and lane.failures - start[id(lane)] < EXIT_ATTEMPTS
                ]
                if not trying:
                    break
                if not everywhere and (announce in done or (announce not in trying and done)):
                    break
                self._cond.wait()
            done = [ln for ln in self._lanes if name in ln.committed and ln.busy != name]
            failed = [lane for lane in self._lanes if lane not in done]
        for lane in failed:
            if lane.failures > start[id(lane)]:
                log.error("checkpoint %s could not be committed in %s", name,
                          describe_tier(lane.tier.index, lane.tier.store))  # fmt: skip
            else:
                log.info("checkpoint %s is still being copied to %s; the next run completes it",
                         name, describe_tier(lane.tier.index, lane.tier.store))  # fmt: skip
        if not done:
            where = ", ".join(describe_tier(ln.tier.index, ln.tier.store) for ln in self._lanes)
            raise CheckpointReplicationError(
                f"checkpoint {name} is committed only in the first tier ({self.first.location}); "
                f"no durable tier took it ({where}); see the log for each tier's error. It stays "
                "valid there, so a retry on this node resumes from it"
            )
        return [lane.tier for lane in done]

    def close(self) -> None:
        """Stop the workers after their current copy (nothing half-copied is ever committed)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ workers

    def _start(self) -> None:
        # Yield the CPU to training; the workers this thread starts, and their copy threads,
        # inherit the lower priority.
        lower_this_threads_priority()
        if self._pull is not None and (self.remote_writers or self._written_by_ranks(self._pull)):
            log.info("not pulling %s back into the first tier (%s): every rank resumed its own "
                     "share from the replica, and its next save lands there", self._pull,
                     self.first.location)  # fmt: skip
        elif self._pull is not None:
            try:
                self._pull_back(self._pull)
            except Exception as exc:  # the durable copy stays; only the fast path is lost
                log.warning("could not pull %s back into the first tier (%s): %s: %s",
                            self._pull, self.first.location, type(exc).__name__, exc)  # fmt: skip
        self._pulled.set()
        for lane in self._lanes:
            lane.thread = threading.Thread(
                target=self._work,
                args=(lane,),
                name=f"koochak-replicate-tier{lane.tier.index}",
                daemon=True,
            )
            lane.thread.start()

    def _written_by_ranks(self, name: str) -> bool:
        """Whether the replicas' ``name`` is a sharded checkpoint (a version-2 head, or an index
        of several writers): every rank of its run writes and reads its own parts, even on one
        process, so nothing is pulled back (the module docstring says why)."""
        for lane in self._lanes:
            store = lane.tier.store
            try:
                committed, _ = artifact.read_manifest(store, name)
                if not committed.size or is_single_object(store.get(name, 0, 1)):
                    return False
                raw = store.get(name, 0, committed.size + 1)
            except (artifact.InvalidArtifact, FileNotFoundError):
                continue
            where = f"{store.location}/{name}"
            try:
                return written_by_every_rank(raw, where, name)
            except ValueError:
                return False  # damaged: the pull-back's own checks say so
        return False

    def _pull_back(self, name: str) -> None:
        """Copy ``name`` from the first replica holding it into the first tier, if it lacks it."""
        try:
            artifact.read_manifest(self.first, name)
            return  # already there
        except artifact.InvalidArtifact:
            pass
        for lane in self._lanes:
            try:
                result = replicate_checkpoint(lane.tier.store, self.first, name)
            except artifact.InvalidArtifact:
                continue
            log.info("pulled %s back into the first tier (%s) from %s: %d bytes", name,
                     self.first.location, describe_tier(lane.tier.index, lane.tier.store),
                     result.bytes_copied)  # fmt: skip
            return

    def _work(self, lane: _Lane) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    now = self._clock()
                    if lane.scanned and not lane.queue:
                        self._cond.wait()
                    elif now < lane.retry_at:
                        self._cond.wait(lane.retry_at - now)
                    else:
                        break
                name = lane.queue[0] if lane.scanned else None
                lane.busy = name
                lane.source = self.first  # the first source tried (see _copy)
            if name is None:
                self._attempt(lane, None, self._scan)
            else:
                self._attempt(lane, name, self._copy)

    def _attempt(self, lane: _Lane, name: str | None, job: Callable[..., Any]) -> None:
        started = self._clock()
        try:
            result = job(lane, name) if name is not None else job(lane)
        except Exception as exc:
            self._failed(lane, name, exc)
            return
        if name is not None:
            self._done(lane, name, result, self._clock() - started)

    def _scan(self, lane: _Lane) -> None:
        """Queue what the first tier committed and this tier lacks (an earlier attempt's work)."""
        store = lane.tier.store
        here = {key for _, key in retention.committed(store)}
        first = retention.committed(self.first)
        newest_here = max((step_of_name(key) or 0 for key in here), default=-1)
        missing = []
        for number, key in first:
            if number < newest_here:
                break
            if key in here:
                # The newest step may have been re-saved in the first tier since it was copied.
                _, ours = artifact.read_manifest(self.first, key)
                if ours == artifact.read_manifest(store, key)[1]:
                    continue
                here.discard(key)
            missing.append(key)
        missing.reverse()  # oldest first: replication goes in order
        with self._cond:
            lane.committed |= here
            lane.held |= here
            pending = [key for key in missing if key not in lane.queue]
            lane.queue = deque(sorted([*pending, *lane.queue], key=lambda k: step_of_name(k) or 0))
            lane.scanned = True
            lane.failures = 0
            self._supersede(lane)
            self._cond.notify_all()
        if pending:
            log.info("%s lacks %d checkpoint(s) the first tier holds (%s...): replicating them",
                     describe_tier(lane.tier.index, store), len(pending), pending[0])  # fmt: skip
        self._prune_first()

    def _copy(self, lane: _Lane, name: str) -> Replicated | None:
        """Copy ``name`` into the lane's tier from the first tier, or else from a replica that
        holds it; None when no tier holds it any more."""
        with self._cond:
            sources = [self.first] + [
                other.tier.store
                for other in self._lanes
                if other is not lane and name in other.committed
            ]
        error: Exception | None = None
        for source in sources:
            with self._cond:
                lane.source = source  # retention leaves ``name`` alone there meanwhile
            remote = self.remote_writers if source is self.first else frozenset()
            with self._cond:
                earlier = name not in self._committed_at
            if remote and earlier:  # an earlier run's save: no follower copies it now
                remote = self._writers_not_in_first(name, remote)
            pace = lane.budget.take if lane.budget is not None else None
            try:
                return replicate_checkpoint(
                    source, lane.tier.store, name, remote_writers=remote, progress=pace
                )
            except artifact.InvalidArtifact:
                continue  # not (or no longer) committed there
            except ValueError as exc:  # changed or damaged there: another source may be good
                error = exc
        if error is not None:
            raise error
        return None

    def _writers_not_in_first(self, name: str, writers: frozenset[int]) -> frozenset[int]:
        """Those of ``writers`` none of whose parts of ``name`` the first tier holds (another
        node's, under a node-local first tier): their receipts are waited for; the coordinator
        copies the rest itself (one listing of the name's parts, for an earlier run's save)."""
        prefix = f"{name}{PART_INFIX}"
        present = set()
        for info in self.first.list(prefix):
            writer = info.key[len(prefix) : len(prefix) + 5]
            if writer.isdigit() and not info.key.endswith("-receipt"):
                present.add(int(writer))
        return frozenset(w for w in writers if w not in present)

    def _done(self, lane: _Lane, name: str, result: Replicated | None, seconds: float) -> None:
        store = lane.tier.store
        with self._cond:
            source, lane.source = lane.source, None  # the copy reads nothing any more
            if lane.queue and lane.queue[0] == name:
                lane.queue.popleft()
            lane.failures = 0
            if result is not None:
                lane.committed.add(name)  # lets the first tier prune it; still busy until pruned
                lane.held.add(name)
        if result is not None:
            # Retention before the commit is reported: whoever waits for this commit (the end of
            # the run) must not exit in the middle of a prune.
            self._prune_tier(lane)
            self._prune_first()
        # A replica this copy read from left ``name`` alone meanwhile: its retention, now.
        for other in self._lanes:
            if other is not lane and other.tier.store is source:
                self._prune_tier(other)
        with self._cond:
            lane.busy = None
            committed_at = self._committed_at.get(name)
            behind = self._clock() - committed_at if committed_at is not None else None
            if result is None:
                event = ReplicationEvent(
                    "dropped", name, step_of_name(name), lane.tier.index, store.location,
                    lag=len(lane.queue), error="pruned from every tier before it was copied",
                )  # fmt: skip
            else:
                publication = result.publication
                event = ReplicationEvent(
                    "committed", name, step_of_name(name), lane.tier.index, store.location,
                    publication=publication, path=_path(store, publication), seconds=seconds,
                    bytes_copied=result.bytes_copied, lag=len(lane.queue), behind_s=behind,
                )  # fmt: skip
            # Said before anyone waiting for this copy (settle, the end of the run) is woken, so
            # the line comes before whatever the run says next.
            self._log_done(lane, name, result, event, seconds, behind)
            self._events.append(event)
            self._cond.notify_all()

    def _log_done(self, lane: _Lane, name: str, result: Replicated | None,
                  event: ReplicationEvent, seconds: float, behind: float | None) -> None:  # fmt: skip
        store = lane.tier.store
        if result is None:
            log.warning("%s: %s will not be replicated: %s",
                        describe_tier(lane.tier.index, store), name, event.error)  # fmt: skip
            return
        rate = result.bytes_copied / seconds / 1e6 if seconds > 0 else 0.0
        budget = lane.budget
        capped = f", capped at {budget.rate / 1e6:g} MB/s" if budget is not None else ""
        log.info(
            "replicated %s to %s in %.1f s (%.1f MB, %.0f MB/s%s); %d checkpoint(s) still to copy "
            "there%s",
            name, describe_tier(lane.tier.index, store), seconds, result.bytes_copied / 1e6,
            rate, capped, len(lane.queue),
            f", {behind:.1f} s after the first tier committed it" if behind is not None else "",
        )  # fmt: skip

    def _failed(self, lane: _Lane, name: str | None, exc: Exception) -> None:
        store = lane.tier.store
        with self._cond:
            lane.busy = lane.source = None
            lane.failures += 1
            if self._exiting:
                delay = self.retry_s
            else:
                delay = min(self.retry_s * 2 ** (lane.failures - 1), MAX_RETRY_S)
            delay = max(delay, MIN_RETRY_S)
            lane.retry_at = self._clock() + delay
            what = name or "(comparing with the first tier)"
            error = f"{type(exc).__name__}: {exc}"
            event = ReplicationEvent(
                "failed", what, step_of_name(what), lane.tier.index, store.location,
                lag=len(lane.queue), error=error, retry_in_s=delay,
            )  # fmt: skip
            self._events.append(event)
            self._cond.notify_all()
        log.error("replicating %s to %s failed (attempt %d): %s; retrying in %.0f s, training "
                  "goes on", what, describe_tier(lane.tier.index, store), lane.failures, error,
                  delay)  # fmt: skip

    # ------------------------------------------------------------------ retention

    def _supersede(self, lane: _Lane) -> None:
        """Drop queued checkpoints the tier's retention would prune as soon as they landed.
        Called with the condition held."""
        keep = lane.tier.keep_last_k
        if keep is None:
            return
        head = 1 if lane.busy is not None else 0  # the one being copied stays
        waiting = list(lane.queue)[head:]
        if len(waiting) <= keep:
            return
        # The best by keep_best_k stay queued too: retention spares them on arrival (the best of
        # what waits; the tier's own pruning then judges among everything it holds).
        spared = self._spare(self.first, waiting) if self._spare is not None else set()
        for dropped in retention.to_drop(waiting[::-1], keep_last_k=keep, best=spared):
            lane.queue.remove(dropped)
            log.warning("%s is %d checkpoints behind: %s will not be replicated there "
                        "(keep_last_k=%d newer ones are waiting)",
                        describe_tier(lane.tier.index, lane.tier.store), len(lane.queue) + 1,
                        dropped, keep)  # fmt: skip
            event = ReplicationEvent(
                "dropped", dropped, step_of_name(dropped), lane.tier.index,
                lane.tier.store.location, lag=len(lane.queue),
                error=f"superseded: keep_last_k={keep} newer checkpoints wait",
            )  # fmt: skip
            self._events.append(event)

    def _prune_tier(self, lane: _Lane) -> None:
        keep = lane.tier.keep_last_k
        if keep is None:
            return
        store = lane.tier.store
        names = retention.committed_names(store)
        spared = self._spared(store, names)
        with self._cond:
            # Another tier copying from here: pruned once that copy ends.
            copying = {other.busy for other in self._lanes if other.source is store}
            for key in retention.to_drop(names, keep_last_k=keep, best=spared, in_flight=copying):
                unpublish_checkpoint(store, key)
                lane.committed.discard(key)
                self._events.append(ReplicationEvent("pruned", key, step_of_name(key),
                                                     lane.tier.index, store.location,
                                                     at=time.time()))  # fmt: skip

    def _prune_first(self) -> None:
        """Prune the first tier to its keep_last_k, never removing a checkpoint no replica holds
        (unless prune_unreplicated) nor one a tier is copying."""
        if self.first_keep is None:
            return
        names = retention.committed_names(self.first)
        spared = self._spared(self.first, names)
        with self._cond:
            durable, newest = self._was_durable(names)
            verdict = retention.judge(
                names,
                keep_last_k=self.first_keep,
                best=spared | newest,
                in_flight={lane.busy for lane in self._lanes if lane.source is self.first},
                durable=durable,
                prune_unreplicated=self.prune_unreplicated,
            )
            for key in verdict.drop:
                unpublish_checkpoint(self.first, key)
                self._committed_at.pop(key, None)
                self._events.append(ReplicationEvent("pruned", key, step_of_name(key), 0,
                                                     self.first.location,
                                                     at=time.time()))  # fmt: skip
            held = verdict.held
            # Until every tier has been compared with the first, "no replica holds it" may only
            # mean "not looked yet": say so only once it is known.
            known = all(lane.scanned for lane in self._lanes)
            fresh = [key for key in held if key not in self._held_back] if known else []
            if known:
                self._held_back = set(held)
        if fresh:
            log.warning("the first tier (%s) keeps %d checkpoint(s) beyond keep_last_k=%d "
                        "until a durable tier holds them: %s", self.first.location, len(held),
                        self.first_keep, ", ".join(fresh))  # fmt: skip

    def _was_durable(self, names: list[str]) -> tuple[set[str], set[str]]:
        """Of the first tier's ``names``: those that count as durable (every durable tier has
        held it, even if one pruned it since by its own keep_last_k; or a newer checkpoint is
        committed in every durable tier now), and the newest one committed in any durable tier
        (never pruned here while it is that). Holding the condition."""
        held = set.intersection(*(lane.held for lane in self._lanes))
        everywhere = set.intersection(*(lane.committed for lane in self._lanes))
        anywhere = set().union(*(lane.committed for lane in self._lanes))
        covered = max((step_of_name(n) or 0 for n in everywhere), default=-1)
        durable = {n for n in names if n in held or (step_of_name(n) or 0) < covered}
        newest = max(anywhere, key=lambda n: step_of_name(n) or 0, default=None)
        return durable, ({newest} if newest is not None else set())

    def _spared(self, store: Store, names: list[str]) -> set[str]:
        """What ``spare`` (keep_best_k) keeps in ``store`` whatever its keep_last_k says."""
        if self._spare is None:
            return set()
        return self._spare(store, names)


def self_replicating_writers(world: int) -> frozenset[int]:
    """The ranks that copy their own parts of a sharded checkpoint into each replica (every one
    but the coordinator, whatever the first tier): the coordinator copies only its own, and
    commits once the others' receipts are there (``tiers.replicate_checkpoint``)."""
    return frozenset(range(1, world))


class FollowerReplicator:
    """A follower's share of replication under FSDP: this rank's own parts of each checkpoint,
    copied from the first tier (its node's directory, or the shared one) into every replica
    tier, verified as they are written, then a receipt naming their digests
    (``part_receipt``); the coordinator waits for the receipts and commits the index and
    manifest, reading none of the data back.

    ``submit(name, parts)`` after each save (``parts``: this rank's ``(key, size, sha256)``);
    one background thread copies them in save order, retrying a failed copy (after ``retry_s``,
    doubling up to MAX_RETRY_S). With ``prune`` (a node-local first tier) the node's directory
    keeps this rank's parts by the one retention rule: the newest ``keep_last_k`` names, and
    any not yet in every replica; a shared first tier is pruned by the coordinator alone.
    ``settle()`` at the end of a run waits for what is queued (EXIT_ATTEMPTS more tries each).
    """

    def __init__(
        self,
        first: Store,
        replicas: Sequence[ReplicaTier],
        *,
        rank: int,
        keep_last_k: int | None,
        retry_s: float = 10.0,
        prune: bool = True,
    ) -> None:
        self.first = first
        self.prune = prune
        self.replicas = list(replicas)
        self.rank = rank
        self.keep = keep_last_k
        self.retry_s = float(retry_s)
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, tuple[tuple[str, int, str], ...]]] = deque()
        self._busy: str | None = None
        self._done: list[str] = []  # names whose parts every replica holds, oldest first
        # Names this rank holds parts of in the first tier (listed once, on the first prune).
        self._names: set[str] | None = None
        self._failures = 0
        self._exiting = False
        self._closed = False
        self._thread = threading.Thread(
            target=self._work, name=f"koochak-replicate-rank{rank}", daemon=True
        )
        self._thread.start()

    def submit(self, name: str, parts: Sequence[tuple[str, int, str]]) -> None:
        with self._cond:
            self._queue = deque(item for item in self._queue if item[0] != name)
            if name in self._done:
                self._done.remove(name)
            self._queue.append((name, tuple(parts)))
            self._cond.notify_all()

    def settle(self) -> None:
        """Wait until every queued copy is done, or has failed EXIT_ATTEMPTS more times."""
        with self._cond:
            self._exiting = True
            start = self._failures
            self._cond.notify_all()
            while (self._queue or self._busy) and not self._closed:
                if self._failures - start >= EXIT_ATTEMPTS:
                    log.error("rank %d could not replicate its parts of %s; giving up", self.rank,
                              self._queue[0][0] if self._queue else self._busy)  # fmt: skip
                    break
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _work(self) -> None:
        lower_this_threads_priority()
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                name, parts = self._queue[0]
                self._busy = name
            try:
                for tier in self.replicas:
                    if _receipt_of(tier.store, name, self.rank) == sorted(parts):
                        continue  # already there, verified (a retry, or a run started again)
                    for key, _, _ in parts:  # an older save of the same step: replaced
                        try:
                            tier.store.delete(key)
                        except FileNotFoundError:
                            pass
                    items = [CopyItem(key, size, sha) for key, size, sha in parts]
                    copy_objects(self.first, tier.store, items, show_progress=False)
                    put_receipt(tier.store, name, self.rank, parts)
            except Exception as exc:
                with self._cond:
                    self._failures += 1
                    self._busy = None
                    delay = self.retry_s if self._exiting else min(
                        self.retry_s * 2 ** (self._failures - 1), MAX_RETRY_S)  # fmt: skip
                    delay = max(delay, MIN_RETRY_S)
                    self._cond.notify_all()
                log.error("rank %d: replicating its parts of %s failed: %s: %s; retrying in "
                          "%.0f s", self.rank, name, type(exc).__name__, exc, delay)  # fmt: skip
                with self._cond:
                    self._cond.wait(delay)
                continue
            with self._cond:
                if self._queue and self._queue[0][0] == name:
                    self._queue.popleft()
                self._failures = 0
                self._done.append(name)
                self._busy = None
                self._cond.notify_all()
            if self.prune:
                self._prune()

    def _prune(self) -> None:
        """This rank's parts in the node's directory, by the one retention rule. The names it
        holds parts of are listed once (what earlier attempts left), then kept up to date here:
        a save lists only the objects of the checkpoint it prunes, never the tier."""
        prefix = f"{PART_INFIX}{self.rank:05d}-"
        if self._names is None:
            self._names = set()
            for info in self.first.list("step"):  # not superseded/: another run's, set aside
                head, infix, _ = info.key.partition(prefix)
                if infix and "/" not in head and step_of_name(head) is not None:
                    self._names.add(head)
        with self._cond:
            self._names.update(self._done)
            busy = {self._busy} | {name for name, _ in self._queue}
            durable = set(self._done)
        names = sorted(self._names, key=lambda n: step_of_name(n) or 0, reverse=True)
        for name in retention.to_drop(names, keep_last_k=self.keep, in_flight=busy,
                                      durable=durable):  # fmt: skip
            for info in self.first.list(name + prefix):  # this checkpoint's parts of this rank
                try:
                    self.first.delete(info.key)
                except FileNotFoundError:
                    pass
            self._names.discard(name)
            with self._cond:
                if name in self._done:
                    self._done.remove(name)


def _receipt_of(store: Store, name: str, rank: int) -> list[tuple[str, int, str]]:
    """The parts ``rank``'s receipt in ``store`` names (sorted); [] for none, or one that cannot
    be read as a receipt (it is replaced with the copy)."""
    try:
        return sorted(read_receipt(store, name, rank) or ())
    except ValueError:
        return []


def _path(store: Store, publication: artifact.Publication) -> str:
    return publication.path or f"{store.location.rstrip('/')}/{publication.key}"
