"""LightningDataModules. Small data sets live in memory as whole tensors (see tensors.py)."""
