"""A ResNet-50 training script for ``datapipe doctor`` on the GPU machine.

Trains ``STEPS`` steps fed by a torch DataLoader (webdataset + PIL decode, ``--workers`` workers,
pin_memory), then ``STEPS`` steps fed by ``loaders.ImageLoader`` (DALI on the GPU), so the doctor's
report shows both loaders' data wait side by side. Without CUDA (a check on CPU) the model is a
small CNN and the images are small.

    datapipe doctor --json doctor.json --probe-capacity -- bench/doctor_train.py SHARD_DIR [STEPS]
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model_for(device: torch.device) -> nn.Module:
    if device.type == "cuda":
        import torchvision

        return torchvision.models.resnet50(weights=None)
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 1000))


def torch_loader(urls: list[str], size: int, batch_size: int, workers: int, cuda: bool):
    from datapipe.tools.bench.baselines import torch_loader as baseline

    return baseline(urls, batch_size=batch_size, image_size=size, train=True, workers=workers,
                    device="cuda" if cuda else "cpu")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shards", help="directory of image shards (shard-*.tar with jpg + cls)")
    p.add_argument("steps", type=int, nargs="?", default=60)
    p.add_argument("--workers", type=int, default=8, help="torch DataLoader workers")
    p.add_argument("--batch-size", type=int, default=None, help="default 256 on CUDA, 16 on CPU")
    args = p.parse_args(argv)
    urls = sorted(glob.glob(os.path.join(args.shards, "*.tar")))
    if not urls:
        print(f"no shards in {args.shards}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    size, batch_size = (224, args.batch_size or 256) if cuda else (64, args.batch_size or 16)
    torch.backends.cudnn.benchmark = True
    model = model_for(device).to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    from loaders import ImageLoader

    feeds = {
        "torch DataLoader + webdataset + PIL": torch_loader(urls, size, batch_size, args.workers, cuda),
        "loaders.ImageLoader": ImageLoader(urls, batch_size=batch_size, image_size=size, train=True,
                                           device=device),
    }
    for name, loader in feeds.items():
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = nn.functional.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i + 1 == args.steps:
                break
        print(f"{name}: {args.steps} steps, loss {loss.item():.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
