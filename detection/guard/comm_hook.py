"""Non-finite gradient check before and after all-reduce, as a DDP communication hook.

The hook wraps the user's own hook (or the default all-reduce) and, per bucket, in one pass:

* before all-reduce: the sum of the rank's *local* bucket. Every NaN or ±Inf element makes
  the sum non-finite, so a non-finite sum is a rank-local verdict that survives the averaging —
  the one place where the rank that produced a NaN can still be named. (A finite bucket whose
  float32 sum overflows, |Σ| > 3.4e38, is flagged too: such gradients are corrupt in every
  practical sense.) With the per-step layer on, its bucket sum (float32 chunks added in
  float64) is that sum: the bucket is read once for both.
* after all-reduce: the same on the reduced bucket, which every replica must agree on.

Per-bucket sums stay on the device; :meth:`CheckedCommHook.flags` folds them into two flags the
guard all-gathers once per step with everything else, so the check adds no host synchronisation.

On audited gradient steps the hook also fingerprints the local bucket before all-reduce — the
only moment the rank's own gradient exists — and records the bucket partition the partner's
replay must group its gradients by.
"""

# No ``from __future__ import annotations`` here: DDP compares the hook's annotations with the
# real ``dist.GradBucket`` and ``Future[Tensor]`` objects when it is registered.

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from detection import native
from detection.faults.injector import FaultInjector
from detection.guard.carry import RowInBucket
from detection.row.held_works import hold
from detection.row.words import nonfinite_flag, nonfinite_sums
from detection.stepcheck.allreduce import native_chunk
from detection.transport.alarm import Phase
from detection.weights.fingerprint import fingerprint_on_device

__all__ = [
    "BucketObserver",
    "CheckedCommHook",
    "CommHook",
    "NonFiniteVerdict",
    "attribute_nonfinite",
]

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class BucketObserver(Protocol):
    """What else looks at each bucket before and after all-reduce (``detection.stepcheck.checks``).

    Each call may return the bucket's sum it took (a float32-or-wider scalar on the device,
    non-finite exactly when an element is NaN/Inf or a float32 partial sum overflows): the hook
    then uses it for its own check instead of reading the bucket once more."""

    def on_local(self, key: int, bucket: dist.GradBucket) -> torch.Tensor | None: ...

    def on_reduced(self, key: int, reduced: torch.Tensor) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class NonFiniteVerdict:
    phase: Phase
    suspects: tuple[int, ...]
    pre_ranks: tuple[int, ...]
    post_ranks: tuple[int, ...]


def attribute_nonfinite(pre: Sequence[bool], post: Sequence[bool]) -> NonFiniteVerdict | None:
    """Name the ranks behind non-finite gradients.

    A rank whose local gradient was non-finite before all-reduce produced it (every rank may
    be named, e.g. when the weights themselves went non-finite). With finite local gradients, a
    rank whose reduced gradient alone is non-finite is named; when every replica's reduced
    gradient is non-finite from finite inputs the reduction itself is at fault and no rank is.
    """
    pre_ranks = tuple(r for r, bad in enumerate(pre) if bad)
    post_ranks = tuple(r for r, bad in enumerate(post) if bad)
    if pre_ranks:
        return NonFiniteVerdict(Phase.PRE_ALLREDUCE, pre_ranks, pre_ranks, post_ranks)
    if post_ranks:
        suspects = post_ranks if len(post_ranks) < len(post) else ()
        return NonFiniteVerdict(Phase.POST_ALLREDUCE, suspects, pre_ranks, post_ranks)
    return None


def _bucket_sum(t: torch.Tensor) -> torch.Tensor:
    if native.stats_kind_ok(t) and native.available():
        return native.sum_f32(t.reshape(-1), native_chunk(t.numel()))
    return t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)


def _waits_here(bucket: dist.GradBucket, buffer: torch.Tensor) -> bool:
    """Whether the hook waits for this bucket's all-reduce itself: the last bucket of a CPU
    job. DDP waits for it as soon as the hook returns, so nothing overlaps it; a callback would
    run on the backend's thread and take the GIL there, which costs a small model's step more
    than the wait (see ``docs/detection-design.md``)."""
    return bucket.is_last() and buffer.device.type == "cpu"


def _completed(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(value)
    return done


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.to(torch.float64)


class CheckedCommHook:
    """The communication hook the guard registers on the DDP model.

    Threading: the pre-all-reduce part runs on the autograd thread, the post part in the
    future's callback, which a backend may run on its own threads; each writes only its own
    bucket's slot, and DDP's backward waits for every callback before returning.
    The reduced buckets are summed after that, on the training thread (:meth:`settle_reduced`).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        process_group: dist.ProcessGroup | None,
        inner: CommHook | None = None,
        inner_state: Any = None,
        injector: FaultInjector | None = None,
        observer: BucketObserver | None = None,
    ) -> None:
        self._index = {id(p): i for i, p in enumerate(params)}
        # Each gradient is fingerprinted at its parameter's global position, so the buckets'
        # fingerprints add up to the whole gradient's and never cancel across buckets.
        self._offset = [0] * len(params)
        for i in range(1, len(params)):
            self._offset[i] = self._offset[i - 1] + params[i - 1].numel()
        self._inner: CommHook = inner if inner is not None else allreduce_hook
        self._inner_state = inner_state if inner is not None else process_group
        self._group = process_group
        self._world = 0  # the group's size, read at the first all-reduce
        self._carry: RowInBucket | None = None
        self._injector = injector
        self._observer = observer
        self._device = params[0].device
        self._pre: dict[int, torch.Tensor] = {}
        self._post: dict[int, torch.Tensor] = {}
        self._reduced: dict[int, torch.Tensor] = {}  # reduced buckets not yet summed
        self._grad_fp: dict[int, torch.Tensor] = {}
        self._partition: dict[int, list[int]] = {}
        self._active = False
        self._fingerprint = False
        self._inject = False
        self.calls = 0

    def register(self, ddp: DistributedDataParallel) -> None:
        ddp.register_comm_hook(state=None, hook=self.hook)

    def begin_step(self, *, fingerprint_gradients: bool, inject: bool) -> None:
        self._pre.clear()
        self._post.clear()
        self._reduced.clear()
        self._grad_fp.clear()
        self._partition.clear()
        self._active = True
        self._fingerprint = fingerprint_gradients
        self._inject = inject

    def end_step(self) -> None:
        self._active = False

    @property
    def can_carry(self) -> bool:
        """Whether a row may ride in the gradient all-reduce: only DDP's own averaging one — a
        user hook may compress or reorder what it is handed (:mod:`detection.guard.carry`)."""
        return self._inner is allreduce_hook

    def carry(self, row: RowInBucket | None) -> None:
        """Send ``row`` with the next guarded step's gradient all-reduce (one bucket's);
        ``None`` withdraws a row no all-reduce took (it is being all-gathered instead)."""
        self._carry = row

    def hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The DDP comm hook (a bound method: DDP wants a named function)."""
        self.calls += 1
        if not self._active:
            # A backward outside guard.step() (e.g. an evaluation pass): pass straight through.
            return self._inner(self._inner_state, bucket)
        key = bucket.index()
        buffer = bucket.buffer()
        pairs: list[tuple[int, torch.Tensor]] = []
        if self._fingerprint or self._inject:
            pairs = [
                (self._index[id(p)], g)
                for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)
            ]
        if self._inject and self._injector is not None:
            self._injector.on_local_gradient(pairs)
        local = self._observer.on_local(key, bucket) if self._observer is not None else None
        self._pre[key] = local if local is not None else _bucket_sum(buffer)
        if self._fingerprint:
            self._grad_fp[key] = fingerprint_on_device(
                [g for _, g in pairs], offsets=[self._offset[i] for i, _ in pairs]
            )
            self._partition[key] = [i for i, _ in pairs]
        offsets = [(i, g.storage_offset() - buffer.storage_offset(), g.numel()) for i, g in pairs]

        def reduced_bucket(reduced: torch.Tensor) -> torch.Tensor:
            if self._inject and self._injector is not None:
                flat = reduced.reshape(-1)
                self._injector.on_reduced_gradient([(i, flat[o : o + n]) for i, o, n in offsets])
            self._reduced[key] = reduced  # summed by settle_reduced(), on the training thread
            return reduced

        carrying = self._reduce_carrying(bucket, buffer, reduced_bucket)
        if carrying is not None:
            return carrying
        if self._inner is allreduce_hook:
            # DDP's own averaging hook, as it does it (its state is the group), with one
            # callback where its and ours made two: each runs on the backend's thread and takes
            # the GIL from the autograd thread.
            group = self._inner_state
            self._world = self._world or dist.get_world_size(group)
            work = hold(dist.all_reduce(buffer.div_(self._world), group=group, async_op=True))
            if _waits_here(bucket, buffer):
                work.wait()
                return _completed(reduced_bucket(buffer))
            return work.get_future().then(lambda fut: reduced_bucket(fut.value()[0]))

        def after(fut: torch.futures.Future[Any]) -> torch.Tensor:
            value = fut.value()
            return reduced_bucket(value[0] if isinstance(value, list) else value)

        return self._inner(self._inner_state, bucket).then(after)

    def _reduce_carrying(
        self,
        bucket: dist.GradBucket,
        buffer: torch.Tensor,
        reduced_bucket: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.futures.Future[torch.Tensor] | None:
        """DDP's averaging all-reduce of ``bucket`` with the waiting row appended, or ``None``
        when no row waits or this bucket does not carry it."""
        row = self._carry
        if row is None or not self.can_carry:
            return None
        joined = row.join(buffer, is_last=bucket.is_last())
        if joined is None:
            return None
        self._carry = None
        n = buffer.numel()

        def split(fut: torch.futures.Future[Any]) -> torch.Tensor:
            fut.wait()
            row.received(joined[n:])
            return reduced_bucket(joined[:n])

        work = hold(dist.all_reduce(joined, group=self._group, async_op=True))
        if _waits_here(bucket, joined):
            work.wait()
            row.received(joined[n:])
            return _completed(reduced_bucket(joined[:n]))
        return work.get_future().then(split)

    def settle_reduced(self) -> None:
        """Take the reduced buckets' sums (and the observer's statistics of them), once the
        step's backward has returned.

        The future's callback only keeps a reference to each reduced bucket: a backend may
        run it on a thread of its own, where the bucket is cold in another core's cache, and a
        small model's step pays that per op. DDP's backward returns only after every callback
        ran, and the bucket keeps its reduced values until the next backward writes it, so the
        sums taken here on the training thread are of the same values. Idempotent: the guard
        calls it before the per-step layer decides, and :meth:`flags` before reading them."""
        for key, reduced in self._reduced.items():
            total = self._observer.on_reduced(key, reduced) if self._observer is not None else None
            self._post[key] = total if total is not None else _bucket_sum(reduced)
        self._reduced.clear()

    def flags(self) -> torch.Tensor:
        """``[pre_bad, post_bad]`` as int64 on the device, without a host synchronisation: the
        float64 total of every bucket's sum before and after all-reduce, one finiteness test.
        A total is non-finite exactly when one bucket's sum is (one of its elements is NaN/Inf,
        or its float32 sum overflowed): float64 cannot overflow from float32-sized terms."""
        self.settle_reduced()
        pre = [_wide(s) for s in self._pre.values()]
        post = [_wide(s) for s in self._post.values()]
        if not pre and not post:
            return torch.zeros(2, dtype=torch.int64, device=self._device)
        if len(pre) == len(post):
            both = torch.stack(pre + post)
            if len(pre) > 1:
                both = both.view(2, -1).sum(1)
        else:
            zero = torch.zeros((), dtype=torch.float64, device=self._device)
            both = torch.stack([torch.stack(side).sum() if side else zero for side in (pre, post)])
        return nonfinite_flag(both)

    def flags_on_host(self) -> tuple[int, int]:
        """:meth:`flags` as host ints, for a CPU job's row (:mod:`detection.row.words`)."""
        self.settle_reduced()
        return nonfinite_sums(self._pre.values()), nonfinite_sums(self._post.values())

    def gradient_fingerprint_on_host(self) -> list[int]:
        """:meth:`gradient_fingerprint` as host ints (no op when no bucket was fingerprinted)."""
        if not self._grad_fp:
            return [0, 0]
        words: list[int] = self.gradient_fingerprint().tolist()
        return words

    def gradient_fingerprint(self) -> torch.Tensor:
        """Σ over buckets of the local-gradient fingerprints (wrapping int64), on the device."""
        total = torch.zeros(2, dtype=torch.int64, device=self._device)
        for value in self._grad_fp.values():
            total = total + value
        return total

    def partition(self) -> list[list[int]]:
        """The parameter positions of each bucket seen this step, in bucket order."""
        return [self._partition[k] for k in sorted(self._partition)]
