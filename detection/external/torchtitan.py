"""torchtitan's SDC replay, as an alarm: a few lines around the trainer's step.

torchtitan's SDC replay recomputes a step and raises ``SDCReplayMismatch`` on every rank when
the two results differ. Wrapped in :func:`report_sdc_mismatch`, the step posts a signed external
alarm naming this rank's node and rank and the step, and the exception goes on exactly as it
was raised — the trainer's own handling (and its exit) is unchanged::

    from detection.external import report_sdc_mismatch

    for step in range(start, steps):
        with report_sdc_mismatch(step=step):
            trainer.train_step(...)

torchtitan need not be importable where this module is: the exception is matched by class name
(``SDCReplayMismatch``, anywhere in its class hierarchy) unless the caller passes the class.
Every other exception passes through untouched and posts nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from detection.external.alarm import ExternalAlarm, Source
from detection.external.delivery import (
    WebhookTarget,
    deliver,
    job_from_env,
    node_from_env,
    rank_from_env,
)

__all__ = ["MISMATCH_NAME", "is_sdc_mismatch", "report_sdc_mismatch", "torchtitan_alarm"]

MISMATCH_NAME: Final = "SDCReplayMismatch"


def is_sdc_mismatch(error: BaseException, cls: type[BaseException] | None = None) -> bool:
    """Whether ``error`` is torchtitan's mismatch: an instance of ``cls`` when given, else of any
    class named ``SDCReplayMismatch`` in its hierarchy."""
    if cls is not None:
        return isinstance(error, cls)
    return any(klass.__name__ == MISMATCH_NAME for klass in type(error).__mro__)


def torchtitan_alarm(
    error: BaseException, *, job_id: str, node: str, rank: int | None, step: int | None
) -> ExternalAlarm:
    """The alarm for one mismatch seen by this rank at ``step``."""
    return ExternalAlarm(
        job_id=job_id,
        source=Source.TORCHTITAN.value,
        kind="sdc-replay-mismatch",
        node=node,
        rank=rank,
        step=step,
        evidence={"exception": type(error).__qualname__, "message": str(error)[:2000]},
    )


@contextmanager
def report_sdc_mismatch(
    *,
    step: int | None,
    job_id: str | None = None,
    node: str | None = None,
    rank: int | None = None,
    target: WebhookTarget | None = None,
    mismatch: type[BaseException] | None = None,
    timeout_s: float = 10.0,
) -> Iterator[None]:
    """Report an ``SDCReplayMismatch`` raised inside the block, then re-raise it unchanged.

    ``job_id``, ``node``, ``rank`` and ``target`` default to the training-job contract's
    environment (``SDCGUARD_JOB_ID``, ``NODE_NAME``, ``RANK``, ``SDCGUARD_WEBHOOK_*``). A report
    that cannot be delivered in ``timeout_s`` stays spooled and the mismatch is re-raised; with
    no webhook configured at all, :class:`~detection.external.DeliveryConfigError` is raised
    instead, the mismatch as its context — a misconfigured adapter must not pass for a silent one.
    """
    try:
        yield
    except BaseException as error:
        if is_sdc_mismatch(error, mismatch):
            alarm = torchtitan_alarm(
                error,
                job_id=job_id or job_from_env(),
                node=node or node_from_env(),
                rank=rank if rank is not None else rank_from_env(),
                step=step,
            )
            deliver(alarm, target or WebhookTarget.from_env(), timeout_s=timeout_s)
        raise
