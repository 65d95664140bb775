"""Launched by test_distributed.py under torchrun (2 CPU processes, gloo): Lightning's DDP strategy
fits on ``loaders.DataLoader``. Writes ``<out>/lightning-<rank>.json``: the sample ids this rank
trained on and what the loader Lightning re-created (with a DistributedSampler) is."""
import json
import os
import sys

import torch
from torch.utils.data import TensorDataset

import lightning.pytorch as pl
import loaders


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 2)
        self.seen = []
        self.loader = {}

    def on_train_start(self):
        dl = self.trainer.train_dataloader
        self.loader = {"type": f"{type(dl).__module__}.{type(dl).__qualname__}",
                       "ours": isinstance(dl, loaders.DataLoader),
                       "sampler": type(dl.sampler).__name__,
                       "seed": getattr(dl, "seed", "absent"),
                       "prefetch_depth": getattr(dl, "prefetch_depth", "absent"),
                       "has_stats": callable(getattr(dl, "stats", None))}

    def training_step(self, batch, _):
        x, y = batch
        self.seen += y.tolist()
        return torch.nn.functional.cross_entropy(self.layer(x), y % 2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out):
    n = 12
    data = TensorDataset(torch.arange(n, dtype=torch.float32)[:, None], torch.arange(n))
    model = Model()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=out)
    trainer.fit(model, loaders.DataLoader(data, batch_size=2, shuffle=True, seed=3, prefetch_depth=3))
    with open(os.path.join(out, f"lightning-{trainer.global_rank}.json"), "w") as f:
        json.dump({"world_size": trainer.world_size, "seen": model.seen, "loader": model.loader}, f)
    # leave together: a rank that exits while its peer still tears gloo down can abort the peer
    trainer.strategy.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
