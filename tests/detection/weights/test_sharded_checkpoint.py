"""Sharded checkpoints: certified at save, verified after loading under another mesh.

An FSDP2 job of four gloo ranks trains under the guard and writes a
``torch.distributed.checkpoint`` through ``CheckpointGate.write_sharded``: the ledger receives
its manifest's URI and sha256 and the sharding-invariant fingerprint; the control plane's
verifier accepts the manifest. Loaded at world 2 under FSDP2, and into a plain model under DDP,
``verify_loaded`` accepts it with the recorded fingerprint. A flipped bit in one shard file is
refused by the loader, naming the file, before anything is read; with the manifest rewritten to
match, the load goes through and ``verify_loaded`` refuses. The guard's learnt statistics
travel with the checkpoint: the resumed job holds them and catches a gradient outlier at its
first step.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from detection.gate import CheckpointGate, CheckpointStatus, GateError, StepOutcome
from detection.guard import GuardConfig, GuardConfigError, SDCGuard
from detection.guard.state import read_state, state_path
from detection.stepcheck import StatsConfig
from detection.weights.fingerprint import Fingerprint, weight_fingerprint
from detection.weights.load_check import LoadVerificationError
from detection.weights.sharded import sharded_fingerprint
from detection.weights.sharded_checkpoint import (
    MANIFEST_NAME,
    CheckpointIntegrityError,
    check_manifest,
    load_sharded,
    load_unsharded,
    sharded_directory,
)
from recovery.checkpoints.store import FileCheckpointStore
from recovery.checkpoints.uris import UriCheckpointStore
from tests.detection.conftest import run_ranks
from tests.detection.sharded_models import ResidualNet, mse_loss, shard_layers

SAVED = 2  # the checkpoint holds the state after this step (steps 0..2 run before it)
OUTLIER_RANK = 1
# rank 1's input scaled by this at the resumed job's first step: beyond the learnt temporal
# threshold, within the early one a guard without history speaks with
OUTLIER = 30.0
CONFIG = GuardConfig(seed=1, stats=StatsConfig(warmup=2))


def _plain(seed: int) -> ResidualNet:
    """Odd dims (uneven shards at world 4 and 2); no buffers: parameters are the state."""
    torch.manual_seed(seed)
    return ResidualNet(inputs=5, width=10, hidden=14)


def _sharded(world: int, seed: int) -> nn.Module:
    return shard_layers(_plain(seed), init_device_mesh("cpu", (world,)))


_loss = mse_loss


def _train(guard: Any, model: nn.Module, optim: Any, rank: int, steps: range) -> list[Any]:
    """The steps' alarms (``None`` for a silent step); at ``SAVED + 1`` rank ``OUTLIER_RANK``'s
    input is scaled by ``OUTLIER`` (finite): its gradient stands out against its history."""
    found = []
    for step in steps:
        with guard.step(step):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
            if step == SAVED + 1 and rank == OUTLIER_RANK:
                x[0] *= OUTLIER
            guard.backward(_loss(model, (x, y)))
            optim.step()
            optim.zero_grad()
        assert guard.last_outcome is not None
        alarm = guard.last_outcome.alarm
        found.append(None if alarm is None else alarm.to_report())
    return found


def _restore(model: nn.Module, optim: Any, where: str, sha256: str | None) -> None:
    """The resume recipe: the state dicts of the model and optimizer as they are now (before
    the guard: initialising an empty optimizer state steps it), loaded in place, taken over."""
    msd, osd = get_state_dict(model, optim)
    load_sharded(where, {"model": msd, "optim": osd}, sha256=sha256)
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)


class _Ledger:
    """A provenance sink that remembers what it was sent."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict[str, Any]]] = []

    def record_checkpoint(self, body: dict[str, Any]) -> None:
        self.posts.append(("checkpoint", body))

    def record_audit(self, body: dict[str, Any]) -> None:
        self.posts.append(("audit", body))


def _save_at_four(rank: int, world: int, directory: str) -> dict[str, Any]:
    model = _sharded(world, seed=0)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    ledger = _Ledger() if rank == 0 else None
    gate = CheckpointGate(directory, audit_every=0, sink=ledger, nodes=["n0"])
    guard = SDCGuard(model, optim, loss_fn=_loss, config=CONFIG, gate=gate)
    clean = _train(guard, model, optim, rank, range(SAVED + 1))
    msd, osd = get_state_dict(model, optim)
    record = gate.write_sharded(SAVED, {"model": msd, "optim": osd})
    learnt = guard.state_dict()
    assert guard.last_outcome is not None
    decided = guard.last_outcome.fingerprint.hex()

    # resumed at the same world size, in the same ranks: weights, optimizer and statistics
    fresh = _sharded(world, seed=5)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    _restore(fresh, fresh_optim, record.uri, record.sha256)
    resumed = SDCGuard(fresh, fresh_optim, loss_fn=_loss, config=CONFIG)
    resumed.verify_loaded(record.fingerprint)
    beside = read_state(sharded_directory(record.uri))
    assert beside is not None
    resumed.load_state_dict(beside)
    carried = resumed.state_dict()
    first = _train(resumed, fresh, fresh_optim, rank, range(SAVED + 1, SAVED + 2))
    resumed.close()
    # the same resume without the guard's state: its statistics have no history yet
    bare = _sharded(world, seed=5)
    bare_optim = torch.optim.Adam(bare.parameters(), lr=1e-2)
    _restore(bare, bare_optim, record.uri, record.sha256)
    unarmed = SDCGuard(bare, bare_optim, loss_fn=_loss, config=CONFIG)
    without = _train(unarmed, bare, bare_optim, rank, range(SAVED + 1, SAVED + 2))
    return {
        "clean": clean,
        "record": record.to_report(),
        "evidence": dict(record.evidence),
        "decided": decided,
        "posts": ledger.posts if ledger is not None else None,
        "learnt": learnt["per_step"],
        "carried": carried["per_step"],
        "beside_fingerprint": beside["fingerprint"],
        "first_resumed_step": first,
        "first_step_without_state": without,
    }


def _load_at_two(
    rank: int, world: int, good: str, sha256: str, fingerprint: str, flipped: str, forged: str
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = _sharded(world, seed=7)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = sharded_fingerprint(model.parameters()).hex()
    # one flipped bit in a shard file: refused, naming it, on every rank, before any read
    for name, where, ledger_sha in (("flipped", flipped, None), ("forged", forged, sha256)):
        try:
            _restore(model, optim, where, ledger_sha)
            out[name] = None
        except CheckpointIntegrityError as err:
            out[name] = Path(err.path).name
    out["untouched"] = sharded_fingerprint(model.parameters()).hex() == before
    # the manifest rewritten to match the flipped file, the ledger's hash not asked: the
    # bytes load, the recorded fingerprint refuses them
    _restore(model, optim, forged, None)
    guard = SDCGuard(model, optim, loss_fn=_loss, config=CONFIG)
    try:
        guard.verify_loaded(fingerprint)
        out["forged_refused_on"] = []
    except LoadVerificationError as err:
        out["forged_refused_on"] = err.ranks
    # the right checkpoint, resharded from 4 to 2: accepted, and training goes on
    _restore(model, optim, good, sha256)
    out["fsdp2_verified"] = guard.verify_loaded(fingerprint).hex()
    state = read_state(sharded_directory(good))
    try:
        guard.load_state_dict(state or {})
        out["state_at_two"] = "accepted"
    except GuardConfigError as err:
        out["state_at_two"] = str(err)
    out["continued"] = _train(guard, model, optim, rank, range(SAVED + 1, SAVED + 2))
    assert guard.last_outcome is not None
    out["moved_on"] = guard.last_outcome.fingerprint.hex() != fingerprint
    # a sink on a rank but 0 (two posts a checkpoint): every rank refuses, none left waiting
    gate = CheckpointGate(Path(flipped).parent / "sinks", audit_every=0, sink=_Ledger())
    gate.observe(guard.last_outcome)
    try:
        msd, osd = get_state_dict(model, optim)
        gate.write_sharded(SAVED + 1, {"model": msd, "optim": osd})
        out["two_sinks"] = "written"
    except GateError as err:
        out["two_sinks"] = str(err)
    out["nothing_written"] = not (Path(flipped).parent / "sinks").exists()
    guard.close()
    # a plain model under DDP: DCP loads the whole tensors into it
    plain = _plain(seed=9)
    plain_optim = torch.optim.Adam(plain.parameters(), lr=1e-2)
    _restore(plain, plain_optim, good, sha256)
    ddp = DistributedDataParallel(plain)
    ddp_guard = SDCGuard(ddp, plain_optim, loss_fn=_loss, config=GuardConfig(seed=1))
    out["ddp_verified"] = ddp_guard.verify_loaded(fingerprint).hex()
    # each kind of guard refuses the other's learnt state and keeps its own
    kept = (ddp_guard.state_dict()["per_step"], guard.state_dict()["per_step"])
    for name, into, other in (("into_ddp", ddp_guard, guard), ("into_fsdp2", guard, ddp_guard)):
        try:
            into.load_state_dict(other.state_dict())
            out[name] = "accepted"
        except GuardConfigError as err:
            out[name] = str(err)
    out["kept"] = kept == (ddp_guard.state_dict()["per_step"], guard.state_dict()["per_step"])
    return out


def _flip_a_weight(directory: Path) -> str:
    """Flip the lowest mantissa bit of the first element of ``inp.weight``'s first shard in
    its ``.distcp`` file (a finite, valid value: only the fingerprint can tell); the file name."""
    metadata = FileSystemReader(str(directory)).read_metadata()
    (index, info) = next(
        (i, s) for i, s in metadata.storage_data.items() if i.fqn == "model.inp.weight"
    )
    assert index.offset is not None
    path = directory / info.relative_path
    data = bytearray(path.read_bytes())
    record = data[info.offset : info.offset + info.length]
    shard = torch.load(io.BytesIO(bytes(record)), weights_only=True)
    at = info.offset + bytes(record).find(shard.numpy().tobytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))
    return path.name


def _rehash(directory: Path) -> None:
    """Rewrite the manifest to match the files as they are now (a forger, or a bug)."""
    files = sorted(p for p in directory.iterdir() if p.name != MANIFEST_NAME)
    body = {"files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}}
    (directory / MANIFEST_NAME).write_text(json.dumps(body))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("sharded")
    return directory, run_ranks(_save_at_four, 4, str(directory), timeout_s=120)


@pytest.mark.slow
def test_a_checkpoint_saved_at_world_four_is_sealed_and_posted_once(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, results = saved
    first = results[0]
    record = first["record"]
    for r in results:
        assert r["clean"] == [None] * (SAVED + 1)  # the clean steps are silent
        assert r["record"] == record  # every rank's gate holds the same record
        assert r["decided"] == record["fingerprint"]
    final = directory / "ckpt-000002"
    assert record["uri"] == str((final / MANIFEST_NAME).resolve())
    assert record["status"] == str(CheckpointStatus.PENDING)  # FSDP2: no vote, no audit
    assert first["posts"] == [
        (
            "checkpoint",
            {
                "step": SAVED,
                "uri": record["uri"],
                "sha256": record["sha256"],
                "fingerprint": record["fingerprint"],
                "nodes": ["n0"],
            },
        )
    ]
    assert all(r["posts"] is None for r in results[1:])
    files = check_manifest(final, record["sha256"])
    assert ".metadata" in files
    assert sum(n.endswith(".distcp") for n in files) == 4
    assert sorted(p.name for p in directory.iterdir()) == ["ckpt-000002", "ckpt-000002.sdcguard.pt"]
    assert state_path(final).is_file()
    store = UriCheckpointStore(FileCheckpointStore(directory))
    assert store.verify(record["uri"], record["sha256"])  # the control plane's verifier


@pytest.mark.slow
def test_the_learnt_state_travels_and_the_resumed_job_catches_at_its_first_step(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = saved
    for r in results:
        assert r["carried"] == r["learnt"] == results[0]["learnt"]
        assert r["beside_fingerprint"] == r["record"]["fingerprint"]
        (alarm,) = r["first_resumed_step"]  # step 3, the resumed job's first: caught
        assert alarm is not None
        assert (alarm["step"], alarm["layer"]) == (SAVED + 1, "gradstats")
        assert alarm["suspect_ranks"] == [OUTLIER_RANK]
        assert alarm["detail"]["test"] == "temporal"  # against the rank's carried history
        assert r["first_step_without_state"] == [None]  # a guard without it misses it


@pytest.mark.slow
def test_loaded_at_world_two_and_under_ddp_a_flipped_shard_bit_is_refused(
    saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    directory, results = saved
    record = results[0]["record"]
    good = directory / "ckpt-000002"
    flipped = tmp_path / "flipped"
    shutil.copytree(good, flipped)
    shard = _flip_a_weight(flipped)
    forged = tmp_path / "forged"
    shutil.copytree(flipped, forged)
    _rehash(forged)
    two = run_ranks(
        _load_at_two,
        2,
        str(good / MANIFEST_NAME),
        record["sha256"],
        record["fingerprint"],
        str(flipped),
        str(forged),
        timeout_s=120,
    )
    for r in two:
        assert r["flipped"] == shard  # the loader names the file
        assert r["forged"] == MANIFEST_NAME  # against the ledger's sha256, the manifest
        assert r["untouched"]  # refused before anything was read
        assert r["forged_refused_on"] == [0, 1]  # the bytes loaded, the fingerprint refuses
        assert r["fsdp2_verified"] == record["fingerprint"]
        assert r["ddp_verified"] == record["fingerprint"]
        assert "guard state refused" in r["into_ddp"]
        assert "not a sharded guard's statistics" in r["into_fsdp2"]
        assert r["kept"]
        assert "learnt by 4 ranks" in r["state_at_two"]
        assert r["continued"] == [None]
        assert "rank 1: its gate has a provenance sink" in r["two_sinks"]
        assert "rank 0:" not in r["two_sinks"]
        assert r["nothing_written"]
        assert r["moved_on"]


@pytest.mark.slow
def test_one_process_reads_the_whole_checkpoint_into_a_plain_model(
    saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    directory, results = saved
    record = results[0]["record"]
    good = directory / "ckpt-000002"
    full = load_unsharded(good / MANIFEST_NAME, sha256=record["sha256"])
    plain = _plain(seed=3)
    plain.load_state_dict(full["model"])
    assert weight_fingerprint(plain.parameters()).hex() == record["fingerprint"]
    flipped = tmp_path / "flipped"
    shutil.copytree(good, flipped)
    shard = _flip_a_weight(flipped)
    with pytest.raises(CheckpointIntegrityError, match=shard) as refused:
        load_unsharded(flipped)
    assert Path(refused.value.path).name == shard
    (flipped / "extra.bin").write_bytes(b"x")
    shutil.copy(good / shard, flipped / shard)
    with pytest.raises(CheckpointIntegrityError, match="not in the manifest"):
        check_manifest(flipped)
    (flipped / MANIFEST_NAME).write_text(json.dumps({"files": {"../elsewhere": "0" * 64}}))
    with pytest.raises(CheckpointIntegrityError, match="not a name inside the checkpoint"):
        check_manifest(flipped)


# -- one process, no process group: the gate's contract ----------------------------------------
# (DCP warns that it saves in a single process: what these tests mean it to do)
SINGLE = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _decided(gate: CheckpointGate, step: int) -> None:
    gate.observe(
        StepOutcome(step=step, ranks=(0,), fingerprint=Fingerprint(1, 2), vote_passed=False)
    )


@SINGLE
def test_a_sharded_checkpoint_follows_the_decision_of_its_step(tmp_path: Path) -> None:
    gate = CheckpointGate(tmp_path, audit_every=0)
    _decided(gate, 4)
    with pytest.raises(GateError, match="after the guard decided step 4"):
        gate.write_sharded(5, {"w": torch.ones(3)})
    assert list(tmp_path.iterdir()) == []
    assert gate.records == ()


@SINGLE
def test_a_failed_save_leaves_nothing_and_records_nothing(tmp_path: Path) -> None:
    gate = CheckpointGate(tmp_path, audit_every=0, uri_prefix="s3://bucket/job")
    _decided(gate, 1)
    with pytest.raises(CheckpointException, match="pickle"):
        gate.write_sharded(1, {"w": torch.ones(3), "bad": lambda: None})
    assert list(tmp_path.iterdir()) == []
    assert gate.records == ()
    record = gate.write_sharded(1, {"w": torch.ones(3)})
    assert record.uri == "s3://bucket/job/ckpt-000001/manifest.json"
    assert record.fingerprint == Fingerprint(1, 2).hex()
    again = gate.write_sharded(1, {"w": torch.zeros(3)})  # rewritten: the new one replaces it
    assert again.sha256 != record.sha256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000001"]
    assert check_manifest(tmp_path / "ckpt-000001", again.sha256)
