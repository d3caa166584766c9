"""A user's own training script, written as a user would: DDP on gloo, the few sdcguard lines,
checkpoints uploaded to S3. Nothing of sdcguard's harness is used.

It reads the rendezvous from the training operator's env (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), the sdcguard contract from its own env (docs/training-job.md), and resumes from
``SDCGUARD_RESUME_FROM`` when the control plane set it. ``FAULT`` (a DESIGN fault spec) stands in
for bad hardware: a node-bound fault fires only on the node named in it.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import boto3
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.contract import TrainingContract
from detection.gate import CheckpointGate
from detection.guard import GuardConfig, SDCGuard
from detection.identity import RankIdentity
from detection.transport.sender import AlarmSender

STEPS = int(os.environ.get("TRAIN_STEPS", "200"))
STEP_PAUSE_S = float(os.environ.get("TRAIN_STEP_PAUSE_S", "0.05"))


def microbatch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def s3_split(uri: str) -> tuple[str, str]:
    parts = urlparse(uri)
    return parts.netloc, parts.path.lstrip("/")


def main() -> None:
    contract = TrainingContract.from_env()  # refuses to start without the contract
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    s3 = boto3.client("s3")
    start = 0
    if contract.resume_from:
        bucket, key = s3_split(contract.resume_from)
        with tempfile.TemporaryDirectory() as scratch:
            local = Path(scratch) / "resume.pt"
            s3.download_file(bucket, key, str(local))
            state = torch.load(local, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"]) + 1
        print(f"resumed from {contract.resume_from} at step {start}", flush=True)
    ddp = DistributedDataParallel(model)
    identity = RankIdentity.detect(rank, 0, world)
    assert contract.webhook_url
    assert contract.webhook_secret
    assert contract.job_id
    spool = Path(tempfile.mkdtemp(prefix=f"spool-{rank}-"))
    sender = AlarmSender(contract.webhook_url, contract.webhook_secret, contract.job_id, spool)
    gate = (
        CheckpointGate(
            Path(tempfile.mkdtemp(prefix="ckpt-")),
            audit_every=2,
            nodes=[identity.node],
            sink=sender,
            job_id=contract.job_id,
            uri_prefix=contract.checkpoint_prefix,
        )
        if rank == 0
        else None
    )
    fault = os.environ.get("FAULT")
    guard = SDCGuard(
        ddp,
        optimizer,
        microbatch=microbatch,
        loss_fn=loss_fn,
        config=GuardConfig(audit_every=2, halt_on_alarm=True, inject=(fault,) if fault else ()),
        identity=identity,
        sender=sender,
        gate=gate,
        job_id=contract.job_id,
    )
    for step in range(start, STEPS):
        if guard.halted:
            # The alarm is out; no further step would be trusted. sdcguard stops the job.
            print(f"halted by sdcguard before step {step}; waiting to be stopped", flush=True)
            sender.flush(30)
            while True:
                time.sleep(1)
        with guard.step(step):
            loss = loss_fn(ddp, microbatch(step, rank))
            guard.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if gate is not None and guard.replaying is None and step % 2 == 1 and not gate.closed:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            record = gate.write(step, lambda path, state=state: torch.save(state, path))
            bucket, key = s3_split(record.uri)
            local = gate.directory / Path(key).name  # type: ignore[operator]
            s3.upload_file(str(local), bucket, key, ExtraArgs={"ChecksumAlgorithm": "SHA256"})
        time.sleep(STEP_PAUSE_S)
    sender.close()
    print("training finished", flush=True)


if __name__ == "__main__":
    main()
