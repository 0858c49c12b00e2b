"""Any torch optimizer (here AdamW) with DGC's sampled top-k, error feedback, warm-up and local clipping, but
without momentum correction (which needs dgc.SGD), on the library path: sync.step() after backward().

    torchrun --standalone --nproc-per-node 2 examples/adamw_topk.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import dgc
from dgc.distributed import init_distributed, shutdown


def main() -> None:
    info = init_distributed("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    g = torch.Generator().manual_seed(info.rank)
    x = torch.randn(1024, 32, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, :10] * 3).argmax(1))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, generator=g)

    compressor = dgc.build_compressor("dgc", density=0.01, warmup_epochs=1, momentum_correction=False)
    sync = dgc.GradientSync(model, compressor, clip_norm=1.0)  # local clipping of each worker's gradient
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for epoch in range(3):
        for i, (xb, yb) in enumerate(loader):
            sync.set_epoch(epoch + i / len(loader))
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            stats = sync.step()  # compress, exchange, average in place
            if not stats.skipped:  # a worker's gradient was not finite: every worker skips this step
                opt.step()
        if info.rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.3f}, density {stats.density:g} ({stats.wire_ratio:.0f}x)")
    shutdown()


if __name__ == "__main__":
    main()
