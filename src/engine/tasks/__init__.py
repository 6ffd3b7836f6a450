"""What the entry points run: train (fit, then test) and evaluate (test a checkpoint)."""
