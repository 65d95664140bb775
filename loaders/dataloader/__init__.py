"""The drop-in ``torch.utils.data.DataLoader`` and its worker transport (recycled shared memory, resume, stats)."""
from loaders.dataloader.loader import DataLoader

__all__ = ["DataLoader"]
