"""DGC in a Hugging Face Accelerate loop: dgc.integrations.accelerate.attach after accelerator.prepare.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_dgc.py             # 2 CPU processes (gloo)
    torchrun --standalone --nproc-per-node 2 examples/accelerate_dgc.py --resume    # continue from the saved state
    accelerate launch --multi_gpu --num_processes 8 examples/accelerate_dgc.py      # 8 GPUs

(`accelerate launch --cpu --num_processes 2` starts one process: Accelerate's CPU multi-process launch needs MPI.)
accelerator.save_state holds every rank's compression state; load_state gives each its own.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator

import dgc
from dgc.distributed import shutdown
from dgc.integrations.accelerate import attach


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default="runs/examples/accelerate")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/state")
    args = parser.parse_args()
    state_dir = Path(args.out) / "state"

    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # without cpu=True, CPU processes run alone
    torch.manual_seed(0)  # the same initial weights on every process
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g)
    y = (x[:, :10] * 3).argmax(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)

    sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.01, warmup_epochs=1))
    opt = dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9, weight_decay=1e-4)
    model, opt, loader = accelerator.prepare(model, opt, loader)  # the loader is sharded over the processes
    attach(accelerator, model, sync)  # the DGC hook on the DDP model, every rank's state in save_state

    start = 0
    if args.resume:
        accelerator.load_state(str(state_dir))
        start = int((state_dir / "epoch.txt").read_text())
    for epoch in range(start, args.epochs):
        for i, (xb, yb) in enumerate(loader):
            sync.set_epoch(epoch + i / len(loader))  # the density warm-up
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            accelerator.backward(loss)
            if accelerator.num_processes == 1:
                sync.step()  # one process: no DDP, no hook
            opt.step()
        accelerator.save_state(str(state_dir))
        if accelerator.is_main_process:
            (state_dir / "epoch.txt").write_text(str(epoch + 1))
            print(f"epoch {epoch}: loss {loss.item():.3f}, density {sync.last.density:g}, "
                  f"wire ratio {sync.last.wire_ratio:.0f}x")  # fmt: skip
    accelerator.wait_for_everyone()
    shutdown()  # leave the process group before exit (a gloo worker that does not may abort)


if __name__ == "__main__":
    main()
