"""Data machinery any DataModule can use: resumable loading, in-memory tensors, what predict reads."""
