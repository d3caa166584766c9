"""Alembic migrations of the ledger schema; run them through :mod:`db.migrate`."""
