"""The private parts of Lightning, torchmetrics, torch and OmegaConf this project relies on are still there.

pyproject.toml bounds each package below its next major version; within a bound a private part can still
move. When one of these fails after an upgrade, the named module of ours is the one to adapt.
"""

import inspect

import pytest


def test_lightning_internals_used_by_strategies_launch_and_loggers():
    from lightning.fabric.utilities import distributed
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    # strategies/rendezvous.py: Lightning's own process-group setup, used under torchrun
    assert list(inspect.signature(distributed._init_dist_connection).parameters)[:2] == [
        "cluster_environment",
        "torch_distributed_backend",
    ]
    assert callable(distributed._destroy_dist_connection)
    # strategies/ddp.py and fsdp.py override the method that sets up the process group
    assert callable(DDPStrategy.setup_distributed) and callable(ModelParallelStrategy._setup_distributed)
    for strategy in (DDPStrategy(), ModelParallelStrategy()):
        assert hasattr(strategy, "_timeout") and hasattr(strategy, "_process_group_backend")
        assert callable(strategy._get_process_group_backend)
    assert hasattr(DDPStrategy(), "_layer_sync")  # ddp.py: sync BatchNorm skipped on CPU
    assert hasattr(ModelParallelStrategy(), "_data_parallel_size")  # fsdp.py: the mesh is all data parallel
    # launch/sweeps.py: which trainers re-run the script for their ranks
    assert "cluster_environment" in inspect.signature(_SubprocessScriptLauncher).parameters
    # strategies/ddp.py: what a spawned rank 0 sends back (get_extra_results / update_main_process_results), and the
    # counters and callback states it restores in the main process
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
    from lightning.pytorch.trainer.call import _call_callbacks_load_state_dict

    assert callable(_MultiProcessingLauncher.get_extra_results) and callable(_call_callbacks_load_state_dict)
    assert list(inspect.signature(_MultiProcessingLauncher.update_main_process_results).parameters)[1:] == [
        "trainer",
        "extra",
    ]
    loop = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False).fit_loop
    assert hasattr(loop.epoch_loop, "_batches_that_stepped")
    for progress in (
        loop.epoch_progress,
        loop.epoch_loop.automatic_optimization.optim_progress,
        loop.epoch_loop.manual_optimization.optim_step_progress,
    ):
        assert callable(progress.state_dict) and callable(progress.load_state_dict)
    # strategies/grad_mode.py: the evaluation loops' grad mode is read from their inference_mode when they run
    from lightning.pytorch.loops import utilities as loop_utilities

    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert all(hasattr(lp, "inference_mode") for lp in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop))
    assert "elif self.inference_mode:" in inspect.getsource(loop_utilities._no_grad_context)
    # launch/ranks.py: the launcher hands MASTER_PORT to the ranks it starts from the cluster environment's main_port
    assert 'os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)' in inspect.getsource(
        _SubprocessScriptLauncher._call_children_scripts
    )
    # loggers/tensorboard.py writes the HParams summary through the writer's file writer
    assert "default_hp_metric" in inspect.signature(TensorBoardLogger).parameters
    # ... and its log_metrics is Lightning's, with one event a call: Lightning's still prefixes the keys and writes a
    # scalar each, a dict as runs of their own
    from lightning.fabric.loggers.tensorboard import TensorBoardLogger as FabricsLogger

    source = inspect.getsource(FabricsLogger.log_metrics)
    assert "_add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR)" in source
    assert "self.experiment.add_scalars(k, v, step)" in source and "self.experiment.add_scalar(k, v, step)" in source
    assert TensorBoardLogger.log_metrics is FabricsLogger.log_metrics  # Lightning's pytorch logger adds nothing to it
    # loggers/logged_values.py: every self.log moves its result object with `.to(<a device>)`, the call it shortens
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    from engine.loggers.logged_values import _lightnings_to

    assert "self[key].to(value.device)" in inspect.getsource(_ResultCollection.log)
    assert "apply_to_collection" in inspect.getsource(_lightnings_to)  # Lightning's own, whatever is installed
    # callbacks/checkpoint.py: ModelCheckpoint's saves and the removal of a replaced best file go through these
    from lightning.pytorch.callbacks import ModelCheckpoint

    assert "trainer.strategy.remove_checkpoint(filepath)" in inspect.getsource(ModelCheckpoint._remove_checkpoint)
    source = inspect.getsource(ModelCheckpoint._update_best_and_save)  # the new best is saved, then the old removed
    assert -1 < source.index("self._save_checkpoint(") < source.index("self._remove_checkpoint(")
    # ... and its metric snapshot is Lightning's, with clones for the deep copy
    source = inspect.getsource(ModelCheckpoint._monitor_candidates)
    assert "deepcopy(trainer.callback_metrics)" in source
    assert 'monitor_candidates["epoch"] = epoch.int()' in source and 'monitor_candidates["step"] = step.int()' in source


def test_torchmetrics_internals_used_by_dp():
    from torchmetrics import MeanMetric

    metric = MeanMetric()  # strategies/dp.py: replica metric states, and combining them on the root
    for name in ("_wrap_update", "_wrap_compute", "_reduce_states", "_defaults"):
        assert hasattr(metric, name), name
    for name in ("_update_count", "_forward_cache", "_computed"):
        assert name in vars(metric), name


def test_torch_internals_used_without_a_gpu():
    import os

    import lightning  # noqa: F401  sets the variable
    import torch

    # launch/devices.py: Lightning's NVML-based check, and what torch reads it from
    assert os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") in ("0", "1")
    assert "_nvml_based_avail()" in inspect.getsource(torch.cuda.is_available)
    assert callable(torch.cuda._raw_device_count_nvml)  # tests/test_step_costs.py counts its calls


def test_torch_internals_used_by_dp_and_the_tensorboard_logger():
    import torch
    from torch.utils.tensorboard import SummaryWriter

    replica = torch.nn.Linear(1, 1)._replicate_for_data_parallel()  # strategies/dp.py: simulated replicas
    assert replica._parameters == {} and set(replica._buffers) == set() and replica._modules == {}
    assert callable(SummaryWriter._get_file_writer)  # loggers/tensorboard.py, callbacks/tensorboard.py
    assert "master_listen_fd" in torch.distributed.TCPStore.__init__.__doc__  # strategies/rendezvous.py
    # callbacks/tensorboard.py: the graph add_graph writes, traced without its check
    from torch.utils.tensorboard import _pytorch_graph as pytorch_graph
    from torch.utils.tensorboard.writer import FileWriter

    from engine.callbacks.tensorboard import _graph

    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Flatten()).eval()
    example = torch.zeros(2, 1, 5, 5)
    assert [p.SerializeToString() for p in _graph(net, example)] == [
        p.SerializeToString() for p in pytorch_graph.graph(net, example)
    ]  # what SummaryWriter.add_graph writes
    assert list(inspect.signature(FileWriter.add_graph).parameters)[:2] == ["self", "graph_profile"]


def test_omegaconf_internals_used_by_the_config_checks():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"a": 1, "b": "${a}"})  # build.py, config/schema.py
    assert cfg._get_node("b")._value() == "${a}"


@pytest.mark.parametrize("package", ["lightning", "torchmetrics", "torch", "hydra-core"])
def test_installed_versions_are_within_the_bounds_of_pyproject(package):
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    (bound,) = [Requirement(r) for r in requires("project") if Requirement(r).name == package]
    assert version(package) in bound.specifier, f"{package} {version(package)} outside {bound.specifier}"


def test_internals_used_by_the_pipeline_strategy():
    import torch
    from lightning.fabric.utilities import optimizer
    from lightning.pytorch.plugins.precision import Precision
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torchmetrics import MeanMetric

    # strategies/pipeline.py: optimizer state to the device; clipping replaced through the plugin's method
    assert callable(optimizer._optimizer_to_device) and callable(optimizer._optimizers_to_device)
    assert list(inspect.signature(Precision.clip_grad_by_norm).parameters) == ["self", "optimizer", "clip_val"]
    # pipeline.py builds stages over a process group and steps schedules with pre-split micro-batches
    assert {"group", "device"} <= set(inspect.signature(PipelineStage).parameters)
    assert {"arg_mbs", "target_mbs", "losses"} <= set(inspect.signature(ScheduleGPipe.step).parameters)
    assert callable(torch._utils._flatten_dense_tensors) and callable(torch._utils._unflatten_dense_tensors)
    # pipeline_stages.py: metric states copied between stages, their sync switched off or set to a group
    metric = MeanMetric()
    for name in ("_to_sync", "sync_on_compute", "process_group", "_update_count", "_forward_cache", "_computed"):
        assert name in vars(metric), name


def test_internals_used_by_the_step_loop_callbacks():
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.strategies import model_parallel

    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    # callbacks/checks.py: Lightning's per-step SIGTERM broadcast, switched off; the cluster environment
    epoch_loop = trainer.fit_loop.epoch_loop
    assert callable(epoch_loop._broadcast_sigterm_tensor)
    assert hasattr(trainer._accelerator_connector, "cluster_environment")
    assert callable(torch._foreach_norm)
    # callbacks/checks.py: Lightning's SIGTERM handlers are registered through this method, after the setup hook
    assert callable(trainer._signal_connector.register_signal_handlers)
    assert "dist.broadcast" in inspect.getsource(type(trainer._signal_connector)._sigterm_notifier_fn)
    # callbacks/checks.py: a stop inside a step's end hooks hands that step's logged values to the loggers itself
    assert callable(trainer._logger_connector.on_batch_end)
    assert callable(trainer._logger_connector.update_train_step_metrics)
    # callbacks/throughput.py: a net that Module.compile compiled
    net = torch.nn.Linear(1, 1)
    assert net._compiled_call_impl is None
    net.compile(backend="eager")
    assert net._compiled_call_impl is not None
    # callbacks/monitor.py and checkpoint.py: where an epoch is, and when each callback reads its metric
    assert isinstance(epoch_loop.batch_progress.current.completed, int)
    assert isinstance(epoch_loop.batch_progress.is_last_batch, bool)
    # callbacks/tensorboard.py: the step Lightning logs an epoch's validation scalars at
    assert isinstance(epoch_loop._batches_that_stepped, int)
    assert hasattr(EarlyStopping(monitor="x"), "_check_on_train_epoch_end")
    assert callable(ModelCheckpoint()._should_save_on_train_epoch_end)
    # strategies/fsdp.py: meta-device modules materialized after sharding
    assert callable(model_parallel._materialize_distributed_module)
    # callbacks/dispatch.py: a hook that is not callable is skipped, and hooks are entered through profile()
    from lightning.pytorch.trainer import call

    dispatch = inspect.getsource(call._call_callback_hooks)
    assert "if callable(fn):" in dispatch and "trainer.profiler.profile(" in dispatch
    # loggers/tensorboard.py: the event writer looks its checksum function up in its module at each record
    from tensorboard.summary.writer import record_writer

    assert "masked_crc32c(header)" in inspect.getsource(record_writer.RecordWriter.write)
    # callbacks/throughput.py: the monitor's compute dtype, its peak, and Lightning's table of peaks
    from lightning.fabric.utilities.throughput import _CUDA_FLOPS
    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

    assert callable(_plugin_to_compute_dtype) and "tfloat32" in _CUDA_FLOPS["h200 sxm1"]
    monitor = ThroughputMonitor(batch_size_fn=len)
    assert hasattr(monitor, "available_flops") and isinstance(monitor._throughputs, dict)
    assert "pl_module.flops_per_batch if self._module_has_flops" in inspect.getsource(ThroughputMonitor._update)


def test_interpreter_internals_used_at_exit():
    import atexit
    import threading

    # entry.py (and tests/warm.py) end a process as the interpreter would, without tearing its modules down
    assert callable(threading._shutdown) and callable(atexit._run_exitfuncs)


def test_lightning_skips_a_plateau_schedulers_step_in_a_resumed_epoch():
    """callbacks/run_state.py takes the step: the condition it mirrors is still Lightning's, and still skips it."""
    from lightning.pytorch.loops import fit_loop

    source = inspect.getsource(fit_loop._FitLoop.on_advance_end)
    assert "if not self.restarting and self.epoch_loop._num_ready_batches_reached():" in source
    assert 'update_lr_schedulers("epoch", update_plateau_schedulers=not self.restarting)' in source
