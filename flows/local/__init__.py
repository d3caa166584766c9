"""The local path: the whole incident on one machine, for the demo and for rehearsals.

- :mod:`~flows.local.demo` — ``sdcguard demo``: train, fault, alarm, flow, recovery, proof;
- :mod:`~flows.local.demo_flow` — the demo's flow run, followed through the ledger;
- :mod:`~flows.local.demo_report` — the demo's report JSON, tables and loss plot;
- :mod:`~flows.local.rehearsal` — ``sdcguard replay-incident``: rehearse a recorded incident on
  local backends;
- :mod:`~flows.local.prefect_server` — one Prefect API for a local command.
"""

__all__: list[str] = []
