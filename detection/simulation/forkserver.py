"""The ranks' fork server, started before the launcher's own imports.

A job's ranks fork from a ``forkserver`` that has torch imported (fast start, no fork of a
threaded parent). Started where the first rank is, it began importing only after the
launcher had finished importing torch itself, and the two imports, each seconds of CPU, ran one
after the other on every start of a job, a replay or a resumed run. :func:`start_early`, called
before the launcher imports torch, lets them run side by side; the launcher's later
``Process.start()`` finds the server running and uses it.

Invariant: the server holds :data:`PRELOAD` whoever starts it, so a rank finds the same modules
loaded either way; it inherits the launcher's environment of that moment (the harness hands the
webhook secret to its ranks explicitly).
"""

import multiprocessing
import multiprocessing.forkserver
from collections.abc import Sequence

__all__ = ["PRELOAD", "start_early"]

# Imported once in the fork server rather than once per rank: DDP's constructor pulls in
# torch._dynamo (about a second of CPU per process).
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.nn.parallel",
    "detection.guard.sdcguard",
    "detection.simulation.rank",
]


def start_early(argv: Sequence[str]) -> None:
    """Start the fork server now, unless ``argv`` only asks for help (no rank will run)."""
    if any(arg in ("-h", "--help") for arg in argv):
        return
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
