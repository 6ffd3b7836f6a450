"""A Lightning + Hydra template for training on one or many devices."""
