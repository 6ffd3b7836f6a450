"""`python -m engine.launch.devices`: what this machine offers, and what `trainer=default` would use."""

import logging
import os


def describe() -> list[str]:
    import torch

    lines = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = {None: "(not set: every GPU is visible)", "": "(empty: no GPU is visible)"}.get(visible, visible)
    lines.append(f"CUDA_VISIBLE_DEVICES: {shown}")
    if torch.cuda.is_available():
        lines.append(f"CUDA: {torch.cuda.device_count()} device(s), torch built for CUDA {torch.version.cuda}")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(
                f"  cuda:{i}  {p.name}  {p.total_memory / 2**30:.1f} GiB  compute capability {p.major}.{p.minor}"
            )
    else:
        lines.append("CUDA: none available" + ("" if torch.version.cuda else " (this torch has no CUDA build)"))
    mps = getattr(torch.backends, "mps", None)
    lines.append(f"MPS (Apple): {'available' if mps is not None and mps.is_available() else 'not available'}")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines.append(
        f"CPU: {os.cpu_count()} cores, {usable} usable by this process, torch uses {torch.get_num_threads()} threads"
    )
    lines.append(f"Default trainer (accelerator=auto, devices=1) picks: {default_choice()}")
    return lines


def default_choice() -> str:
    """Ask Lightning itself, so the answer is the one a real run gets."""
    import lightning.pytorch as L

    from engine.console import ignore_known_warnings

    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    ignore_known_warnings()  # on a login node that has srun, Lightning warns that this process was not started by it
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return f"{type(trainer.accelerator).__name__} on {trainer.strategy.root_device}"


NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def answer_cuda_checks_without_nvml() -> None:
    """Without a visible GPU, answer torch.cuda.is_available() from the CUDA runtime's cached count: Lightning's NVML
    check is never cached there, so it reloads NVML on every call, which torch's optimizers make every step."""
    import torch

    if os.environ.get(NVML_CHECK) == "1" and torch.cuda.device_count() == 0:
        os.environ[NVML_CHECK] = "0"


def main() -> None:
    print("\n".join(describe()))


if __name__ == "__main__":
    main()
