"""DGC as the communication hook of a PyTorch DDP model, with a checkpoint holding every rank's compression state.

torchrun --standalone --nproc-per-node 2 examples/ddp_hook.py              # 2 CPU processes (gloo)
torchrun --standalone --nproc-per-node 2 examples/ddp_hook.py --resume     # on from OUT/checkpoint.pt
torchrun --standalone --nproc-per-node 8 examples/ddp_hook.py --device cuda
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import dgc
from dgc.distributed import init_distributed, shutdown
from dgc.integrations import EveryRank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="runs/examples/ddp_hook")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    path = Path(args.out) / "checkpoint.pt"

    info = init_distributed(args.device)  # the process group from torchrun's (or Slurm's) environment
    torch.manual_seed(0)  # the same initial weights on every worker
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(info.device)
    g = torch.Generator().manual_seed(info.rank)  # each worker its own data
    x = torch.randn(1024, 32, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, :10] * 3).argmax(1))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, generator=g)

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.01, warmup_epochs=1))
    ddp.register_comm_hook(sync, dgc.ddp_comm_hook)  # compress and exchange in DDP's backward
    opt = dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9, weight_decay=1e-4)
    state = EveryRank(sync)  # every rank's residuals and momenta in one checkpoint
    start = 0
    if args.resume:
        saved = torch.load(path, map_location=info.device, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["sync"])  # each rank its own (remapped on another number of ranks)
        start = saved["epoch"]

    for epoch in range(start, args.epochs):
        for i, (xb, yb) in enumerate(loader):
            sync.set_epoch(epoch + i / len(loader))  # the density warm-up: every step
            opt.zero_grad()
            loss = F.cross_entropy(ddp(xb.to(info.device)), yb.to(info.device))
            loss.backward()  # the hook exchanges the compressed gradients
            opt.step()  # skips the update on every rank when some rank's gradient was not finite
        # state.state_dict() gathers every rank's state: every rank calls it, rank 0 writes
        checkpoint = {"model": model.state_dict(), "optimizer": opt.state_dict(), "sync": state.state_dict()}
        checkpoint["epoch"] = epoch + 1
        if info.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(checkpoint, path)
            stats = sync.last
            print(f"epoch {epoch}: loss {loss.item():.3f}, density {stats.density:g}, "
                  f"{stats.sent_bytes} bytes sent per step ({stats.wire_ratio:.0f}x)")  # fmt: skip
    shutdown()  # wait for every worker, then leave the process group


if __name__ == "__main__":
    main()
