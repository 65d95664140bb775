"""Preprocessing jobs: ``datapipe shard`` (WebDataset shards from folders, text and tars) and tokenisation."""
