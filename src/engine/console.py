"""What a run shows on its console: one process speaks, known noise is filtered, and tracebacks only when asked for.

A leaf of the engine (no torch at import): the command line, the strategies and the run directory guard use it.
"""

import logging
import os
import warnings
from typing import Any

from engine.launch import environment

# Set by the user to see full tracebacks; copied at the first start so launched ranks keep it.
FULL_ERROR = "PROJECT_FULL_ERROR"
# A config of conf/profile/ applied to every command (PROJECT_PROFILE=tiny: the test suite's small sizes).
PROFILE = "PROJECT_PROFILE"


def full_error() -> bool:
    return os.environ.get(FULL_ERROR) == "1"


STOPPED_BY_A_SIGNAL = (130, 138, 143)  # 128 + SIGINT, SIGUSR1, SIGTERM: how a run that a signal stopped exits


def ignore_known_warnings() -> None:
    """In the process that parsed the command line, in a parallel sweep's workers (which start at `run`), in
    ddp_spawn's workers (engine.strategies.ddp) and wherever a Trainer is built (engine.build)."""
    # Lightning warns on every run on a machine that has srun (any login node) but did not start this run with it;
    # runs under SLURM start with srun (docs/several-nodes-and-slurm.md)
    warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")
    # Lightning 2.6 on torch >= 2.9 warns on every run about torch's pytree API; nothing a user can act on
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # said in our words, with the fix, by engine.contract (it stops the run)
    warnings.filterwarnings("ignore", message=r"Attribute '.*' is an instance of `nn.Module` and is already saved")
    # said in our words, with what it means, by engine.callbacks.resumable_data
    warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended")
    # a resumed run writes into its own new directory, by design: not a problem to report
    warnings.filterwarnings("ignore", message=r"The dirpath has changed from")


def _no_service_tips(record: logging.LogRecord) -> bool:
    """Lightning 2.6 logs, in every run, tips to install its cloud services' packages (litlogger, litmodels): noise
    in every run's console and log, and on a cluster's compute node without internet, advice that cannot apply."""
    message = str(record.msg)  # and, in every run, that the model summary conf/callbacks/ picks is not Lightning's
    return not message.startswith("💡 Tip:") and not message.startswith("Trainer already configured with model summary")


def one_console_output() -> None:
    """Under Hydra the root logger already prints, so Lightning's own console handlers would show every message twice
    (on stderr, where only `error:` lines belong). A rank that rank 0 started prints nothing: its own log has it."""
    import lightning.pytorch  # noqa: F401  adds its handlers on import: remove them after, not before

    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_no_service_tips)  # added once
    if environment.watched_rank():  # rank 0 alone on the console (as ddp_spawn's workers): this rank in its own log
        for handler in list(logging.getLogger().handlers):
            if type(handler) is logging.StreamHandler:
                logging.getLogger().removeHandler(handler)
    if logging.getLogger().handlers:
        for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning"):
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                if type(handler) is logging.StreamHandler:
                    logger.removeHandler(handler)
                    logger.propagate = True  # Lightning stopped it when it added its own: the root's handlers print


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted")


def lost_connection(error: BaseException) -> bool:
    """A collective that failed because another rank ended (died, or stopped on an error of its own)."""
    return any(text in str(error) for text in _PEER_GONE)


# The config's parts in the order a run builds them; the rest after, as composed.
TREE_ORDER = ("data", "model", "callbacks", "logger", "trainer", "paths")


_SHOWN: set[str] = set()  # the run directories said at start in this process (a sweep's jobs share it)


def show_start(cfg: Any, output_dir: Any) -> None:
    """The run's directory and its config, once the run is checked and built and about to start, so a refused start
    says nothing but its error line. Once per run, by rank 0 alone (not by the ranks it starts, nor by torchrun's or
    srun's other ranks)."""
    if environment.watched_rank() or environment.global_rank() > 0 or str(output_dir) in _SHOWN:
        return
    _SHOWN.add(str(output_dir))
    logging.getLogger("engine.entry").info("Run directory: %s", output_dir)
    if cfg.get("print_config", True):
        print_config_tree(cfg)


def print_config_tree(cfg: Any) -> None:
    """The composed config as a Rich tree, one branch per part (data, model, callbacks, ...), on stdout: what this
    run builds. `print_config=false` leaves it out."""
    from omegaconf import DictConfig, OmegaConf
    from rich import print as rich_print
    from rich.syntax import Syntax
    from rich.tree import Tree

    tree = Tree("config", guide_style="dim")
    keys = [k for k in TREE_ORDER if k in cfg] + [k for k in cfg if k not in TREE_ORDER]
    for key in keys:
        node = cfg._get_node(key)
        if isinstance(node, DictConfig):
            text = OmegaConf.to_yaml(node, resolve=False)
        else:
            text = f"{OmegaConf.to_yaml({key: node._value()}, resolve=False)}"
            key = str(key)
        tree.add(str(key)).add(Syntax(text.rstrip(), "yaml", theme="ansi_dark", background_color="default"))
    rich_print(tree)
