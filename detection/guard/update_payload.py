"""An owner's update snapshot in one byte buffer, sent as it is, and its replay on plain
tensors.

:mod:`detection.guard.update_replay` sends, each step, the snapshot of one slice of a rank's
shards — for each parameter the pre-update value, its gradient, its optimizer state, its
group's options and the fingerprints of what the owner's update wrote — to another rank, which
re-runs the update and compares. The tensors are copied once, in the optimizer's pre-hook, into
one buffer (every piece 64-byte aligned, so that it is viewed in place at any dtype); a pickled
header says where each piece lies, its shape and dtype, the options, the non-tensor state and
the owner's fingerprints. :func:`ship` sends headers, then buffers as they are: uneven shards
need no agreement on shapes beforehand, and nothing is packed twice. The receiver replays on
views of the buffer it received — its own memory, written in place by the replay.

The replay is exact because it runs the owner's arithmetic: the same optimizer class, built
with the owner's group options (``foreach``, ``fused``, ``maximize``, … as the group holds
them), on the owner's inputs, elementwise the same kernels (a DTensor's update runs on its
local tensor). :data:`REPLAYABLE` lists the classes whose update reads only its own
parameter's gradient and state (elementwise), for which that holds; tests check each bitwise.
The header is pickled: it comes from a rank of the same job, as ``all_gather_object`` does.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from detection.weights.fingerprint import fingerprint_on_device
from detection.weights.fingerprint_each import fingerprints_each

__all__ = [
    "AMP",
    "REPLAYABLE",
    "Package",
    "Replayed",
    "Snapshot",
    "amp_of",
    "encode",
    "exchange",
    "fingerprint_one",
    "replay_payload",
    "replay_update",
    "ship",
    "take_snapshots",
]

#: Optimizer classes whose update a peer replays bitwise from a snapshot (elementwise: a
#: parameter's update reads only its own gradient, state and group options).
REPLAYABLE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
)


def fingerprint_one(t: torch.Tensor) -> torch.Tensor:
    """One tensor's fingerprint (2 int64), on its device; zeros for an empty tensor."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    return fingerprint_on_device([flat], offsets=[0]).to(t.device)


def replay_update(
    cls: Callable[..., torch.optim.Optimizer],
    options: Mapping[str, Any],
    param: torch.Tensor,
    grad: torch.Tensor,
    state: Mapping[str, Any],
    *,
    consume: bool = False,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Re-run one parameter's update on plain tensors: ``cls`` with the group's ``options``,
    from the pre-update ``param``, its ``grad`` and its ``state`` — copied first, never
    written, unless ``consume`` (the caller's own fresh copies, updated in place). Returns the
    updated parameter and state. ``options[AMP]``, when there, holds what a GradScaler set on
    the owner's optimizer for this step (:func:`amp_of`)."""

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.detach() if consume else t.detach().clone()

    p = nn.Parameter(own(param))
    p.grad = own(grad)
    group = {k: v for k, v in options.items() if k != AMP}
    opt = cls([{"params": [p], **group}])
    for name, value in options.get(AMP, {}).items():
        setattr(opt, name, value.detach().clone())  # as GradScaler hands a fused optimizer
    opt.state[p] = {
        key: own(value) if isinstance(value, torch.Tensor) else value
        for key, value in state.items()
    }
    opt.step()
    return p.detach(), dict(opt.state[p])


#: The options key that carries a GradScaler's ``grad_scale`` and ``found_inf``: a fused
#: optimizer stepped through ``scaler.step`` reads them from attributes GradScaler sets on it
#: for that step (it unscales and skips inside the kernel), so its replay needs them too.
AMP = "__amp__"


def amp_of(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The GradScaler attributes set on ``opt`` for the step now running (copied), if any."""
    found = {name: getattr(opt, name, None) for name in ("grad_scale", "found_inf")}
    return {k: v.detach().clone() for k, v in found.items() if isinstance(v, torch.Tensor)}


def _moved(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    return value


_ALIGN = 64  # bytes: every piece of a buffer starts aligned, so it is viewed in place


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class Snapshot:
    """One parameter's local shard before its update (views into its step's one buffer), and
    the fingerprints of what the update wrote."""

    index: int  # in the model's parameters() order
    opt: int  # the optimizer's place in the guard's list
    options: dict[str, Any]
    state: list[tuple[str, bool, Any]]  # key, in the buffer (a tensor), else its value
    buffer: int  # which of the step's buffers holds its pieces
    pieces: list[tuple[int, tuple[int, ...], torch.dtype]]  # offset, shape, dtype: param, grad,
    # then the state tensors in key order
    post_keys: list[str] = field(default_factory=list)
    post: torch.Tensor | None = None  # [1 + len(post_keys), 2] fingerprints


def take_snapshots(
    items: Sequence[tuple[int, int, dict[str, Any], torch.Tensor, torch.Tensor, Mapping[str, Any]]],
    buffer: int,
    device: torch.device,
) -> tuple[list[Snapshot], torch.Tensor | None]:
    """Copy ``(index, optimizer, options, param, grad, state)`` of each parameter into one new
    uint8 buffer — the one copy the replay makes on the owner, sent as it is — and describe
    where each piece lies (``buffer``: its place among the step's buffers)."""
    snaps: list[Snapshot] = []
    tensors: list[torch.Tensor] = []
    at = 0
    for index, opt, options, param, grad, state in items:
        pieces = [param, grad]
        state_meta: list[tuple[str, bool, Any]] = []
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                pieces.append(value)
                state_meta.append((key, True, None))
            else:
                state_meta.append((key, False, value))
        layout = []
        for t in pieces:
            layout.append((at, tuple(t.shape), t.dtype))
            tensors.append(t)
            at += _aligned(t.numel() * t.element_size())
        snaps.append(Snapshot(index, opt, options, state_meta, buffer, layout))
    if not snaps:
        return [], None
    out = torch.empty(at, dtype=torch.uint8, device=device)
    views = [p for s in snaps for p in s.pieces]
    places, sources = [], []
    for (offset, _, _), t in zip(views, tensors, strict=True):
        n = t.numel() * t.element_size()
        places.append(out[offset : offset + n])
        sources.append(t.detach().contiguous().reshape(-1).view(torch.uint8))
    torch._foreach_copy_(places, sources)  # one multi-tensor copy, not one a piece
    return snaps, out


@dataclass(frozen=True)
class Replayed:
    """One parameter's replay: its fingerprints (parameter, then state tensors by key) against
    the owner's, and whether they differ (compared for the whole package at once)."""

    index: int
    elements: int
    mine: torch.Tensor
    post: torch.Tensor
    param_differs: bool
    state_differs: bool  # a state tensor's fingerprint, or the state's keys


@dataclass
class Package:
    """What one rank sends another: a pickled header and buffers of bytes (sent as they are)."""

    header: Any
    buffers: list[torch.Tensor] = field(default_factory=list)


def encode(snaps: Sequence[Snapshot], buffers: Sequence[torch.Tensor]) -> Package:
    """The snapshots whose update ran (their fingerprints taken), and the step's buffers."""
    done = [s for s in snaps if s.post is not None]
    posts = torch.cat([s.post for s in done if s.post is not None]).tolist() if done else []
    entries, at = [], 0
    for snap in done:
        assert snap.post is not None
        rows = snap.post.shape[0]
        entries.append(
            {
                "index": snap.index,
                "opt": snap.opt,
                "options": _moved(snap.options, torch.device("cpu")),
                "state": snap.state,
                "buffer": snap.buffer,
                "pieces": snap.pieces,
                "post_keys": snap.post_keys,
                "post": posts[at : at + rows],
            }
        )
        at += rows
    return Package(entries, list(buffers))


def replay_payload(
    package: Package,
    optimizers: Sequence[torch.optim.Optimizer],
    device: torch.device,
    *,
    consume: bool = False,
) -> list[Replayed]:
    """Replay each parameter's update in a package of :func:`encode`, with the class of the
    same optimizer of this rank's list (every rank builds the same list). The pieces are read
    in place from the buffers: with ``consume`` (buffers received for this replay alone) they
    are updated in place, else copied first."""
    replayed: list[tuple[dict[str, Any], int, list[str]]] = []
    wrote: list[torch.Tensor] = []  # each replayed parameter, then its state tensors by key
    for entry in package.header:
        buffer = package.buffers[entry["buffer"]]
        pieces = [
            buffer[offset : offset + torch.Size(shape).numel() * dtype.itemsize]
            .view(dtype)
            .reshape(shape)
            for offset, shape, dtype in entry["pieces"]
        ]
        param, grad, *state_tensors = pieces
        values = iter(state_tensors)
        state = {k: next(values) if tensor else v for k, tensor, v in entry["state"]}
        options = _moved(entry["options"], device)
        cls = type(optimizers[entry["opt"]])
        new_param, new_state = replay_update(cls, options, param, grad, state, consume=consume)
        keys = sorted(k for k, v in new_state.items() if isinstance(v, torch.Tensor))
        replayed.append((entry, new_param.numel(), keys))
        wrote += [new_param, *(new_state[k] for k in keys)]
    if not replayed:
        return []
    # one multi-tensor pass over everything the replays wrote, and one copy of the owner's
    rows = fingerprints_each(wrote, device)
    posts = torch.tensor(
        [pair for entry, _, _ in replayed for pair in entry["post"]],
        dtype=torch.int64,
        device=device,
    ).reshape(-1, 2)
    # one comparison and one read back for the package, when every replay wrote the tensors
    # the owner's did (else each its own: its state's keys differ anyway)
    aligned = all(keys == entry["post_keys"] for entry, _, keys in replayed)
    differ = (rows != posts).any(dim=1).tolist() if aligned else []
    out: list[Replayed] = []
    at = theirs = 0
    for entry, elements, keys in replayed:
        n, m = 1 + len(keys), len(entry["post"])
        mine, post = rows[at : at + n], posts[theirs : theirs + m]
        if aligned:
            param_bad, state_bad = differ[at], any(differ[at + 1 : at + n])
        else:
            param_bad = not torch.equal(mine[0], post[0])
            state_bad = keys != entry["post_keys"] or not torch.equal(mine[1:], post[1:])
        out.append(Replayed(entry["index"], elements, mine, post, param_bad, state_bad))
        at += n
        theirs += m
    return out


def ship(
    outgoing: Mapping[int, Package],
    sources: Sequence[int],
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> dict[int, Package]:
    """Send each peer its package and receive one from each of ``sources`` (ranks), all
    posted at once in three rounds — header lengths, headers (which give the buffers' sizes),
    buffers — so that a ring, or any pattern where each pair exchanges at most one package
    each way, cannot deadlock. Buffers travel as they are, without a copy."""
    heads = {
        peer: torch.frombuffer(
            bytearray(pickle.dumps((p.header, [b.numel() for b in p.buffers]))), dtype=torch.uint8
        ).to(device)
        for peer, p in outgoing.items()
    }
    lengths = {s: torch.empty(1, dtype=torch.int64, device=device) for s in sources}
    exchange(
        [(torch.tensor([h.numel()], device=device), peer) for peer, h in heads.items()],
        [(t, s) for s, t in lengths.items()],
        group,
    )
    got = {s: torch.empty(int(t[0]), dtype=torch.uint8, device=device) for s, t in lengths.items()}
    exchange(list((h, peer) for peer, h in heads.items()), [(t, s) for s, t in got.items()], group)
    packages: dict[int, Package] = {}
    for s, raw in got.items():
        header, sizes = pickle.loads(raw.cpu().numpy().tobytes())
        packages[s] = Package(
            header, [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        )
    exchange(
        [(b, peer) for peer, p in outgoing.items() for b in p.buffers],
        [(b, s) for s, p in packages.items() for b in p.buffers],
        group,
    )
    return packages


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    receives: Sequence[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup | None,
) -> None:
    """Point-to-point sends and receives (tensor, peer rank), all posted at once and waited
    for: a ring's exchange needs no ordering between its sends and receives."""
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in receives]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
