"""How float32 matrix products are computed on GPUs, from `float32_matmul_precision` in the config."""


def set_matmul_precision(precision: str) -> None:
    """`high` lets float32 matmuls use TF32 tensor cores (Ampere and newer): several times faster, about 3
    decimal digits. Only on CUDA: CPU results stay bit-exact, which the equivalence tests rely on."""
    import torch

    if torch.cuda.is_available():
        torch.set_float32_matmul_precision(precision)
