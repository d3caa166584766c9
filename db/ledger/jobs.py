"""Jobs and where their ranks run: the map that turns a suspect rank into a node to drain.

Invariant: one row per (job, rank); a re-registration overwrites placement in place, so the
map always names the node a rank runs on now, and ``first_seen`` survives replacements.
Registrations carry a generation (a number the job increases with each placement, e.g. its
restart count or start time): one older than the job's current generation is refused with
:class:`db.errors.StaleRegistration`, so a delayed or replayed registration never reverts a
newer map. Equal generations re-apply (a re-send is harmless).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from db.errors import InvalidValue, StaleRegistration
from db.ledger._base import LedgerBase, _log
from db.ledger._validate import _optional_text, _require_step, _require_text
from db.ledger._views import _rank_view
from db.models import JobRow, RankRow
from db.views import RankIn, RankView


class JobsMixin(LedgerBase):
    """:class:`db.ledger.Ledger`'s job and rank methods."""

    def ensure_job(self, job_id: str) -> None:
        """Make the job known; a no-op when it already is."""
        _require_text("job_id", job_id)
        self._write("ensure_job", lambda s: self._ensure_job(s, job_id))

    def register_ranks(self, job_id: str, ranks: Sequence[RankIn], *, generation: int = 0) -> None:
        """Record where each rank runs, creating the job if needed.

        Upsert by (job, rank): a re-registration (e.g. after a node was replaced) overwrites
        node, instance and GPU, keeps ``first_seen`` and moves ``last_seen``. ``generation``
        below the job's current one raises :class:`StaleRegistration` and changes nothing.
        """
        _require_text("job_id", job_id)
        _require_step("generation", generation)
        seen: set[int] = set()
        for rank in ranks:
            _require_step("rank", rank.rank)
            _require_step("local_rank", rank.local_rank)
            _require_text("node", rank.node)
            _optional_text("instance_id", rank.instance_id)
            _optional_text("gpu_uuid", rank.gpu_uuid)
            if rank.rank in seen:
                raise InvalidValue(f"rank {rank.rank} is listed twice for job {job_id!r}")
            seen.add(rank.rank)

        def work(s: Session) -> None:
            job = self._ensure_job(s, job_id, lock=True)
            current = job.ranks_generation or 0
            if generation < current:
                raise StaleRegistration(job_id, generation, current)
            job.ranks_generation = generation
            now = self._clock()
            existing = {
                row.rank: row for row in s.scalars(select(RankRow).where(RankRow.job_id == job_id))
            }
            for rank in ranks:
                row = existing.get(rank.rank)
                if row is None:
                    s.add(
                        RankRow(
                            job_id=job_id,
                            rank=rank.rank,
                            local_rank=rank.local_rank,
                            node=rank.node,
                            instance_id=rank.instance_id,
                            gpu_uuid=rank.gpu_uuid,
                            first_seen=now,
                            last_seen=now,
                        )
                    )
                else:
                    row.local_rank = rank.local_rank
                    row.node = rank.node
                    row.instance_id = rank.instance_id
                    row.gpu_uuid = rank.gpu_uuid
                    row.last_seen = now
            s.flush()

        self._write("register_ranks", work)
        _log.info("ranks registered", extra={"job": job_id, "ranks": len(ranks)})

    def job_ids(self) -> list[str]:
        """Every job the ledger knows, in id order (to resolve a reader's job patterns)."""
        return self._read(
            "job_ids", lambda s: list(s.scalars(select(JobRow.id).order_by(JobRow.id)))
        )

    def rank_map(self, job_id: str) -> dict[int, RankView]:
        """The job's ranks by rank number; empty for a job the ledger does not know."""

        def work(s: Session) -> dict[int, RankView]:
            rows = s.scalars(select(RankRow).where(RankRow.job_id == job_id).order_by(RankRow.rank))
            return {row.rank: _rank_view(row) for row in rows}

        return self._read("rank_map", work)
