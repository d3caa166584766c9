"""The ring audit under FSDP2 and HSDP (loss mode), in real gloo ranks.

A small transformer (embedding, causal attention through ``scaled_dot_product_attention``,
LayerNorm, an MLP with dropout) trains 200 steps with an audit every step under FSDP2 on two
and four ranks and under HSDP 2x2 and 3x2: no alarm, every audit passed, calibration armed, and the
replays leave training bitwise as it is without them. A flipped activation bit on one rank at
an audited step is caught at that step, the auditor/audited pair named; a rank corrupted in
every forward, its replays included, is named alone. A loss that reads an unseeded random
source is refused by calibration. Three launches (two, four and six ranks) carry
every scenario; each test reads its part.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from detection.audit.calibration import NotReplayableError
from detection.audit.ring import auditors_of, ring_partners
from detection.gate import CheckpointGate
from detection.guard import GuardConfig, GuardHaltedError, SDCGuard
from detection.guard.sharded_audit import replicas_apart
from detection.guard.sharded_decision import Row, ShardedDecision
from detection.weights.fingerprint import Fingerprint
from detection.weights.replicas import ReplicaGroups
from detection.weights.sharded import sharded_fingerprint
from tests.detection.conftest import run_ranks

DIM, HEADS, SEQ, BATCH, VOCAB = 16, 2, 8, 2, 32
CLEAN_STEPS = 200
COMPARED_STEPS = 30  # the clean run against the same loop without audits
RECIPE_STEPS = 6
FLIP_STEP, FLIP_TARGET = 3, 1
_UNSEEDED = torch.Generator().manual_seed(7)  # a random source the guard does not seed


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, DIM))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = _Attention()
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(
            nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * DIM, DIM)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _Tiny(nn.Module):
    """Embedding, two pre-norm blocks, a final norm and an untied head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h).reshape(-1, DIM))  # 2-D: the root returns no view


def _sharded(mesh_shape: tuple[int, ...], *, blocks: bool) -> _Tiny:
    """FSDP2's tutorial (``blocks``: each block its own FSDP module, then the root), or the
    root alone — a third of the collectives, for the long four-rank runs on a busy CPU."""
    torch.manual_seed(0)
    model = _Tiny()
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    if blocks:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _micro_batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _batch(step, 10 * rank + micro)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(model(tokens), targets.reshape(-1))


def _unreplayable_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss plus noise from a generator of the loop's own: another value every call."""
    return _loss(model, batch) + 1e-3 * torch.randn((), generator=_UNSEEDED)


class _ActivationFlip:
    """A forward hook on the embedding: when armed, the largest activation (|x| ≥ 2) of the
    next forward gets bit 30 — the exponent's top bit — flipped, a finite corruption of one
    rank's original forward (disarmed at once, so no replay sees it) or, ``persistent``, of
    every forward of that rank while armed, its replays of its partner included."""

    def __init__(self, persistent: bool = False) -> None:
        self.persistent = persistent
        self.armed = False
        self.flipped: float | None = None

    def __call__(self, _module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return output
        self.armed = self.persistent
        flat = output.detach().reshape(-1)
        i = int(flat.abs().argmax())
        assert abs(float(flat[i])) >= 2.0, "bit 30 must make the value smaller: finite"
        flipped = output.detach().clone()
        flipped.view(-1).view(torch.int32)[i] ^= 1 << 30
        self.flipped = float(flipped.view(-1)[i])
        mask = torch.zeros_like(flat, dtype=torch.bool)
        mask[i] = True
        return torch.where(mask.view_as(output), flipped, output)


def _shared_directory(rank: int) -> str:
    """A scratch directory every rank writes its shards into (rank 0 makes it)."""
    holder = [tempfile.mkdtemp(prefix="sharded-audit-") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    assert holder[0] is not None
    return holder[0]


def _run(
    rank: int,
    mesh_shape: tuple[int, ...],
    *,
    steps: int,
    audit_every: int = 1,
    calibrate: int = 2,
    shipped: bool = False,
    flip: bool = False,
    persistent: bool = False,
    loss_fn: Any = _loss,
    blocks: bool = True,
    micro: int = 1,
    autocast: bool = False,
    checkpoint_at: int | None = None,
) -> dict[str, Any]:
    model = _sharded(mesh_shape, blocks=blocks)
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = GuardConfig(seed=5, audit_every=audit_every, calibrate=calibrate, micro_batches=micro)
    batch_of: Any = _micro_batch if micro > 1 else _batch
    directory = _shared_directory(rank) if checkpoint_at is not None else None
    gate = CheckpointGate(directory, audit_every=audit_every) if directory else None
    guard = SDCGuard(
        model,
        optim,
        loss_fn=loss_fn,
        microbatch=None if shipped else batch_of,
        config=config,
        gate=gate,
    )
    hook = _ActivationFlip(persistent)
    if flip and rank == FLIP_TARGET:
        model.emb.register_forward_hook(hook)
    outcomes: list[tuple[int, bool, bool]] = []
    fingerprints: list[str] = []
    refused = ""
    for step in range(steps):
        hook.armed = flip and (step >= FLIP_STEP if persistent else step == FLIP_STEP)
        try:
            with guard.step(step):
                for m in range(micro):
                    model.set_requires_gradient_sync(m == micro - 1)  # type: ignore[operator]
                    batch = _micro_batch(step, rank, m) if micro > 1 else _batch(step, rank)
                    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                        loss = loss_fn(model, batch)
                    guard.backward(loss, batch=batch if shipped else None)
                optim.step()
                optim.zero_grad()
        except GuardHaltedError:
            break
        except NotReplayableError as err:
            refused = str(err)
            break
        outcome = guard.last_outcome
        assert outcome is not None
        outcomes.append((step, outcome.audit_passed, outcome.vote_passed))
        fingerprints.append(outcome.fingerprint.hex())
        if gate is not None and step == checkpoint_at:
            gate.write_sharded(step, {"model": model.state_dict()})  # collective
    whole = sharded_fingerprint(model.parameters())
    guard.close()
    checkpoints = (
        [(r.step, str(r.status), r.evidence.get("kind")) for r in gate.records] if gate else []
    )
    if directory is not None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory)
    return {
        "alarms": [a.to_report() for a in guard.alarms],
        "outcomes": outcomes,
        "fingerprints": fingerprints,
        "fingerprint_matches": not fingerprints or fingerprints[-1] == whole.hex(),
        "counters": guard.counters.to_dict(),
        "armed": guard.armed,
        "refused": refused,
        "coverage": guard.coverage(),  # type: ignore[attr-defined]
        "flipped": hook.flipped,
        "checkpoints": checkpoints,
    }


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    return {
        "clean": _run(rank, (world,), steps=CLEAN_STEPS),
        "unaudited": _run(rank, (world,), steps=COMPARED_STEPS, audit_every=0, calibrate=0),
        "unreplayable": _run(rank, (world,), steps=3, loss_fn=_unreplayable_loss),
        # with accumulation a loss audit replays micro-batch (step // audit_every) % 2
        "accumulation": _run(rank, (world,), steps=RECIPE_STEPS, micro=2, shipped=True),
        "autocast": _run(rank, (world,), steps=RECIPE_STEPS, autocast=True),
    }


def _four_ranks(rank: int, world: int) -> dict[str, Any]:
    return {
        "fsdp-clean": _run(rank, (world,), steps=CLEAN_STEPS, shipped=True, blocks=False),
        "hsdp-clean": _run(rank, (2, world // 2), steps=CLEAN_STEPS, blocks=False),
        "fsdp-flip": _run(
            rank, (world,), steps=FLIP_STEP + 3, calibrate=1, flip=True, checkpoint_at=1
        ),
        "hsdp-flip": _run(
            rank, (2, world // 2), steps=FLIP_STEP + 3, calibrate=1, flip=True, checkpoint_at=1
        ),
        "fsdp-persistent": _run(
            rank, (world,), steps=FLIP_STEP + 3, calibrate=1, flip=True, persistent=True
        ),
    }


def _six_ranks(rank: int, world: int) -> dict[str, Any]:
    return {"hsdp-clean": _run(rank, (3, world // 3), steps=CLEAN_STEPS, blocks=False)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_two_ranks, 2, timeout_s=180)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(_four_ranks, 4, timeout_s=240)


def _assert_clean(result: dict[str, Any], *, vote: bool) -> None:
    assert result["alarms"] == []
    assert [o[0] for o in result["outcomes"]] == list(range(CLEAN_STEPS))
    assert all(o[1] for o in result["outcomes"])  # every step audited and passed
    assert all(o[2] is vote for o in result["outcomes"])  # HSDP votes; FSDP2 has no copy
    counters = result["counters"]
    assert counters["audits"] == counters["audits_passed"] == CLEAN_STEPS
    assert counters["calibration_audits"] == 2
    assert result["armed"]
    assert result["fingerprint_matches"]
    assert "ring audit of the loss every 1 steps" in result["coverage"]


@pytest.mark.slow
def test_fsdp2_on_two_ranks_audits_200_steps_clean_and_leaves_training_as_it_was(
    two_ranks: list[dict[str, Any]],
) -> None:
    for r in two_ranks:
        _assert_clean(r["clean"], vote=False)
        # the replays changed nothing the training computes: same weights, step by step
        assert r["clean"]["fingerprints"][:COMPARED_STEPS] == r["unaudited"]["fingerprints"]
        assert r["unaudited"]["counters"]["audits"] == 0


@pytest.mark.slow
def test_fsdp2_on_four_ranks_with_shipped_batches_audits_200_steps_clean(
    four_ranks: list[dict[str, Any]],
) -> None:
    for r in four_ranks:
        _assert_clean(r["fsdp-clean"], vote=False)
        assert r["fsdp-clean"]["counters"]["batches_shipped"] == CLEAN_STEPS


@pytest.mark.slow
def test_hsdp_2x2_audits_200_steps_clean(four_ranks: list[dict[str, Any]]) -> None:
    for r in four_ranks:
        _assert_clean(r["hsdp-clean"], vote=True)


@pytest.mark.slow
def test_hsdp_3x2_audits_200_steps_clean() -> None:
    """Three replicas of two shards, six ranks: every step audited and voted, no alarm."""
    for r in run_ranks(_six_ranks, 6, timeout_s=300):
        _assert_clean(r["hsdp-clean"], vote=True)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["fsdp-flip", "hsdp-flip"])
def test_an_activation_flip_at_an_audited_step_names_the_pair(
    four_ranks: list[dict[str, Any]], scenario: str
) -> None:
    """Rank 1's embedding output loses its exponent's top bit in the original forward of
    step 3 (finite): its auditor's recomputation disagrees; that one pair is named. The
    steps before are silent and their audits pass; the checkpoint gate takes the audits'
    evidence as for DDP."""
    auditor = auditors_of(ring_partners([socket.gethostname()] * 4))[FLIP_TARGET]
    for rank, result in enumerate(four_ranks):
        r = result[scenario]
        assert [o[1] for o in r["outcomes"][:FLIP_STEP]] == [True] * FLIP_STEP
        (alarm,) = r["alarms"]
        assert (alarm["step"], alarm["layer"], alarm["phase"]) == (FLIP_STEP, "audit", "loss")
        assert alarm["detail"]["mismatched_pairs"] == [{"auditor": auditor, "audited": 1}]
        assert alarm["suspect_ranks"] == sorted([auditor, FLIP_TARGET])
        assert r["outcomes"][FLIP_STEP][1] is False  # the audit at the flip did not pass
        assert (r["flipped"] is not None) is (rank == FLIP_TARGET)
        # the gate (a sharded checkpoint through DCP after step 1): under HSDP the audited
        # step, audit and vote passed, verified it; under FSDP2 no copy was compared, so it
        # stayed pending until the alarm quarantined it
        want = (1, "verified", "loss") if scenario == "hsdp-flip" else (1, "quarantined", None)
        assert r["checkpoints"] == [want]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["accumulation", "autocast"])
def test_accumulation_and_autocast_replay_bitwise(
    two_ranks: list[dict[str, Any]], recipe: str
) -> None:
    """Two micro-batches a step (FSDP2's own sync switch, batches shipped: each audit replays
    the other one) and a bfloat16 autocast region around the loss: calibrated, then clean."""
    for r in two_ranks:
        result = r[recipe]
        assert result["alarms"] == []
        assert [o[1] for o in result["outcomes"]] == [True] * RECIPE_STEPS
        assert result["counters"]["calibration_audits"] == 2
        assert result["armed"]


@pytest.mark.slow
def test_a_loss_that_does_not_reproduce_itself_is_refused_by_calibration(
    two_ranks: list[dict[str, Any]],
) -> None:
    for r in two_ranks:
        u = r["unreplayable"]
        assert u["outcomes"] == []  # refused at the first (calibration) audit, on every rank
        assert "refuses to arm" in u["refused"]
        assert "twice from the same seed gave two different results" in u["refused"]
        assert u["alarms"] == []
        assert not u["armed"]


def _row(part: int) -> Row:
    return Row(
        1,
        False,
        False,
        True,
        False,
        False,
        0,
        1.0,
        1e-6,
        1.0,
        Fingerprint(3, 3),
        Fingerprint(part, part),
    )


def test_hsdp_replicas_alarmed_as_different_make_their_mismatch_a_consequence() -> None:
    """HSDP 2x2: ranks 0, 1 read replica 0, ranks 2, 3 replica 1. Once rank 2's copy of its
    shard was alarmed as different, ranks of the two replicas compute apart (an audit
    mismatch between them follows); ranks of one replica never do."""
    decision = ShardedDecision(ReplicaGroups.of_mesh([[0, 1], [2, 3]]), ["n"] * 4)
    apart = replicas_apart(decision)
    assert not any(apart(a, b) for a in range(4) for b in range(4))
    outcome = decision.decide(1, [_row(7), _row(8), _row(9), _row(8)])
    assert outcome.alarm is not None  # the split of shard (0, 2): known from now on
    pairs = [(a, b) for a in range(4) for b in range(4) if apart(a, b)]
    assert pairs == [(0, 2), (0, 3), (1, 2), (1, 3), (2, 0), (2, 1), (3, 0), (3, 1)]


@pytest.mark.slow
def test_a_rank_wrong_in_both_roles_is_named_alone(four_ranks: list[dict[str, Any]]) -> None:
    """From step 3 on every forward of rank 1 is corrupted, its replays of its partner too:
    both of its pairs disagree, and rank 1 is the one rank that explains both."""
    partners = ring_partners([socket.gethostname()] * 4)
    auditor = auditors_of(partners)[FLIP_TARGET]
    for result in four_ranks:
        r = result["fsdp-persistent"]
        assert [o[1] for o in r["outcomes"][:FLIP_STEP]] == [True] * FLIP_STEP
        (alarm,) = r["alarms"]
        assert (alarm["step"], alarm["layer"], alarm["phase"]) == (FLIP_STEP, "audit", "loss")
        pairs = {(p["auditor"], p["audited"]) for p in alarm["detail"]["mismatched_pairs"]}
        assert pairs == {(auditor, FLIP_TARGET), (FLIP_TARGET, partners[FLIP_TARGET])}
        assert alarm["suspect_ranks"] == [FLIP_TARGET]
