"""Ledger tests run on SQLite and PostgreSQL through ``tests/fixtures_db.py``."""
