"""Accelerate and Lightning take loaders.DataLoader as they take torch's (CPU, one process)."""
import pytest
import torch
from torch.utils.data import TensorDataset

from loaders import DataLoader


def data(n=12):
    return TensorDataset(torch.arange(n, dtype=torch.float32)[:, None], torch.arange(n) % 2)


def test_accelerate_prepare_wraps_it_like_torchs():
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e .[test])")
    acc = accelerate.Accelerator(cpu=True)
    ours = acc.prepare(DataLoader(data(), batch_size=4))
    theirs = acc.prepare(torch.utils.data.DataLoader(data(), batch_size=4))
    assert type(ours) is type(theirs)  # wrapped (sharded and placed), not handed back untouched
    assert [b[0].tolist() for b in ours] == [b[0].tolist() for b in theirs]


def test_lightning_trainer_fits_on_it(tmp_path):
    pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install -e .[test])")

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 2)
            self.seen = 0

        def training_step(self, batch, _):
            x, y = batch
            self.seen += len(x)
            return torch.nn.functional.cross_entropy(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Model()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, DataLoader(data(), batch_size=4, shuffle=True, seed=0))
    assert model.seen == 12
