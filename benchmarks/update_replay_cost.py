"""What the FSDP2 update replay and shard custody add to one rank's step, against the update.

One process, no collective: a rank's local shard of ``--elements`` float32 values in
``--params`` parameters, updated by AdamW (the optimizer's default implementation for the
device). Timed, each the median of ``--repeat`` runs:

* ``update``   — ``optimizer.step()`` on the whole shard (the reference);
* ``custody``  — one fingerprint pass over the shard (:mod:`detection.guard.update_replay`
  makes two a step: after the update and before the next);
* ``+state``   — the same over the shard and its two moments (``vote_optimizer_state=True``);
* ``snapshot`` — the owner's copy of one slice (``1/K`` of the shard: parameter, gradient,
  both moments, the step) into the one buffer it sends, in the pre-hook;
* ``replay``   — the buddy's side: the slice's update re-run in place on the received bytes
  (a copy of the buffer stands for the receive), and the fingerprints of what it wrote;
* ``sent``     — bytes the owner sends its buddy a step (the buffer; the header is apart).

The time of sending is not measured here (it is the link's: ``sent`` bytes a step, one
point-to-point exchange around the ring).

    python benchmarks/update_replay_cost.py --elements 4000000 --every 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from detection.guard.update_payload import encode, replay_payload, take_snapshots
from detection.guard.update_replay import balanced_slices
from detection.weights.fingerprint import fingerprint_on_device


def _median_s(fn: Callable[[], object], repeat: int, device: torch.device) -> float:
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=4_000_000)
    parser.add_argument("--params", type=int, default=16)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    each = args.elements // args.params
    params = [nn.Parameter(torch.randn(each, device=device)) for _ in range(args.params)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()  # the moments exist from here on
    options = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    slices = balanced_slices([p.numel() for p in params], args.every)
    mine = [(i, p) for i, (p, s) in enumerate(zip(params, slices, strict=True)) if s == 0]

    def update() -> None:
        opt.step()

    def custody() -> None:
        fingerprint_on_device([p.detach() for p in params])

    def custody_state() -> None:
        shard = [p.detach() for p in params]
        fingerprint_on_device(shard + [v for p in params for v in opt.state[p].values() if v.dim()])

    items = []
    for i, p in mine:
        assert p.grad is not None
        items.append((i, 0, options, p.detach(), p.grad, dict(opt.state[p])))

    def snapshot() -> object:
        return take_snapshots(items, 0, device)

    snaps, buffer = take_snapshots(items, 0, device)
    assert buffer is not None
    for snap, (_, p) in zip(snaps, mine, strict=True):
        snap.post_keys = sorted(opt.state[p])
        snap.post = torch.zeros(1 + len(snap.post_keys), 2, dtype=torch.int64, device=device)
    package = encode(snaps, [buffer])

    def replay() -> None:
        copy = [b.clone() for b in package.buffers]  # as received: the buddy's own bytes
        replay_payload(type(package)(package.header, copy), [opt], device, consume=True)

    rows = {
        name: _median_s(fn, args.repeat, device)
        for name, fn in (
            ("update", update),
            ("custody", custody),
            ("+state", custody_state),
            ("snapshot", snapshot),
            ("replay", replay),
        )
    }
    sent = buffer.numel()
    print(
        f"device {device}, {args.elements:,} elements in {args.params} parameters, "
        f"K = {args.every}, torch {torch.__version__}"
    )
    for name, seconds in rows.items():
        print(f"{name:9s} {seconds * 1e3:9.3f} ms  {seconds / rows['update']:6.3f} x update")
    print(f"{'sent':9s} {sent / 1e6:9.3f} MB a step ({sent / (4 * args.elements):.3f} x shard)")


if __name__ == "__main__":
    main()
