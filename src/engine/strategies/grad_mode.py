"""Evaluation under torch.no_grad for the strategies that shard or cut the net across processes.

Lightning evaluates under torch.inference_mode, except with gloo (its CPU backend), where it takes no_grad. FSDP2
cannot gather parameters under inference_mode ("Inference tensors do not track version counter": eval.py of a
sharded checkpoint on an H200, NCCL), which CPU runs never showed. The pipeline's stages keep buffers and a cached
schedule between fit's validation (no_grad) and a later validate or test: under NCCL they would meet tensors made
under inference_mode, a path no run has taken. Both evaluate the way every CPU test has run them.
"""

from typing import Any


def evaluate_under_no_grad(trainer: Any) -> None:
    """The validate, test and predict loops run under no_grad (fit's own validation already does)."""
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        loop.inference_mode = False
