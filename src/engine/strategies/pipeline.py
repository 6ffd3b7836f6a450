"""`trainer=pipeline`: pipeline parallelism with one process per stage, on torch.distributed.pipelining.

Our DDPStrategy without the DDP wrapper, so launched like `ddp`. Equal micro-batches make gradients one device's
(the loss must be a batch mean); the user's step runs once more on the whole batch, its logs replayed on every rank."""

import zlib
from collections.abc import Callable
from datetime import timedelta
from functools import partialmethod
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout

from engine.errors import UserError
from engine.strategies import parallelize
from engine.strategies import pipeline_stages as st
from engine.strategies.pipeline_checkpoints import OneCheckpointFile
from engine.strategies.split import Split


class PipelineStrategy(OneCheckpointFile):
    """One pipeline stage per process (`stages_per_rank` with interleaved_1f1b). With `data_parallel=D` the
    processes form a (stages x D) mesh: D pipelines on different batches, their gradients averaged."""

    strategy_name = "pipeline"

    def __init__(
        self,
        schedule: str = "1f1b",
        micro_batches: int = 4,
        split_points: list[str] | None = None,
        balance: str | list[int] = "params",
        leaves: list[str] | None = None,
        stages_per_rank: int = 2,
        data_parallel: int = 1,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(start_method="popen", process_group_backend=process_group_backend, timeout=timeout)
        if schedule not in st.SCHEDULES:
            raise UserError(f"trainer.strategy.schedule={schedule!r}: use one of {', '.join(st.SCHEDULES)}")
        if micro_batches < 1 or data_parallel < 1:
            raise UserError("trainer.strategy.micro_batches and trainer.strategy.data_parallel must be >= 1")
        if schedule == "interleaved_1f1b" and stages_per_rank < 2:
            raise UserError(
                f"trainer.strategy.stages_per_rank={stages_per_rank}: interleaved_1f1b runs >= 2 stages per process; "
                "for one stage per process use trainer.strategy.schedule=1f1b"
            )
        self.schedule, self.micro_batches, self.data_parallel = schedule, micro_batches, data_parallel
        self.balance: str | list[int] = balance if isinstance(balance, str) else [int(n) for n in balance]
        self.split_points = [str(n) for n in split_points] if split_points else None
        self.leaves = [str(n) for n in leaves or ()]
        self.stages_per_rank = stages_per_rank if schedule == "interleaved_1f1b" else 1
        self.pp_group = None  # this rank's pipeline
        self.dp_group: Any = None  # the ranks that hold the same stages
        self.mine: dict[bool, list[nn.Module]] | None = None  # this rank's stages (train, eval), by parallelize()
        self._net: nn.Module | None = None  # the net they were cut from: the user's steps call it
        self._foreign, self._order, self._param_order = set(), [], []  # see OneCheckpointFile
        self._runs: dict[tuple, st.Run] = {}
        self._metrics: dict[str, Any] = {}
        self._stash: list[tuple[nn.Parameter, Tensor | None]] = []
        self._step: st.Run | None = None  # the training step in flight, for the loss function
        self._error: Exception | None = None  # the user's step failed on this rank during the schedule
        self._example: Any = None  # the module's example_input_array, put aside while the run lasts

    @property
    def net(self) -> nn.Module:
        assert self._net is not None, "cut in parallelize()"
        return self._net

    @property
    def pp_size(self) -> int:
        return self.world_size // self.data_parallel

    @property
    def pp_rank(self) -> int:
        return self.global_rank // self.data_parallel  # rank = pp_rank * D + dp_rank, as the mesh orders them

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.stages_per_rank

    @property
    def stage_indices(self) -> list[int]:
        """Stages r, r + P, r + 2P, ... on pipeline rank r (one of them unless interleaved)."""
        return [self.pp_rank + v * self.pp_size for v in range(self.stages_per_rank)]

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # the stages of a pipeline read the same batches; D pipelines read D shards
        return {"num_replicas": self.data_parallel, "rank": self.global_rank % self.data_parallel}

    def _configure_launcher(self) -> None:
        # Lightning calls this when the Trainer is built, before any process starts: refuse the config here.
        if getattr(self.precision_plugin, "precision", None) in ("16-mixed", "16"):
            raise UserError(
                "trainer=pipeline cannot use precision 16-mixed: its loss scaler never sees the backward that the "
                "schedule runs; use precision=bf16_mixed (or fp32)"
            )
        world = self.num_nodes * self.num_processes
        if world % self.data_parallel:
            raise UserError(
                f"trainer.strategy.data_parallel={self.data_parallel} does not divide the {world} processes "
                "(trainer.devices x trainer.num_nodes)"
            )
        super()._configure_launcher()

    def setup_environment(self) -> None:
        super().setup_environment()  # the process group, through our rendezvous
        if self.pp_group is None:
            from torch.distributed.device_mesh import init_device_mesh

            shape = (self.pp_size, self.data_parallel)
            mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=("pp", "dp"))
            self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")

    def stages(self, train: bool) -> list[nn.Module]:
        """This rank's stages (one, or stages_per_rank with interleaved 1F1B) for training or evaluation."""
        assert self.mine is not None, "cut in parallelize()"
        return self.mine[train]

    def parallelize(self, net: nn.Module) -> None:
        """Cut `net` (from configure_model, or setup) and keep this rank's stages: the other stages' tensors leave the
        net, so that state_dict holds this stage's keys under the full model's names. Idempotent."""
        module = self.lightning_module
        if self.mine is not None or module is None:
            return
        plan = self._plan(net)
        self._net = net
        st.check_cut(module, net, plan, self.pp_size, self.stages_per_rank)
        self._order, self._param_order = list(module.state_dict()), [n for n, _ in module.named_parameters()]
        st.keep_only(net, plan, self.stage_indices, first=self.is_first)
        # only this rank's stages are kept: the others (and with them the other ranks' layers) are freed
        self.mine = {mode: [plan.for_mode(mode)[i] for i in self.stage_indices] for mode in (True, False)}
        self._foreign = set(self._order) - set(module.state_dict())
        rank_zero_info(
            f"trainer=pipeline: {self.num_stages} stages on {self.pp_size} processes per pipeline, "
            f"{self.data_parallel} pipeline(s): {parallelize.describe(plan)}"
        )

    def _plan(self, net: nn.Module) -> Split:
        """The cut; with balance=time rank 0 times the blocks on a micro-batch on its device and decides for all
        (timings differ between processes), which runs the whole net once there."""
        if self.num_stages > 1 and self.split_points is None and self.balance == "time":
            names: list[str] = []
            if self.is_global_zero:
                net.to(self.root_device)  # timed where it will run
                sample = self._sample()
                micro_batch = sample[: max(1, len(sample) // self.micro_batches)].to(self.root_device)
                timed = parallelize.plan_stages(net, self.num_stages, None, "time", micro_batch, self.leaves)
                names = timed.names
            return parallelize.plan_stages(net, self.num_stages, list(self.broadcast(names)), leaves=self.leaves)
        try:
            return parallelize.plan_stages(net, self.num_stages, self.split_points, self.balance, leaves=self.leaves)
        except UserError as e:
            if "stages for a net of" not in str(e):
                raise
            fix = "lower trainer.strategy.stages_per_rank or " if self.stages_per_rank > 1 else ""
            raise UserError(
                f"trainer=pipeline: {self.num_stages} stages ({self.pp_size} processes x {self.stages_per_rank}) "
                f"for a net of fewer blocks; {fix}use fewer processes per pipeline (trainer.devices): {e}"
            ) from e

    def _sample(self) -> Tensor:
        module = self.lightning_module
        assert module is not None
        sample = module.example_input_array
        datamodule = getattr(module._trainer, "datamodule", None)
        if not isinstance(sample, Tensor) and datamodule is not None:
            sample = st.net_input(next(iter(datamodule.val_dataloader())))
        if not isinstance(sample, Tensor):
            raise UserError(
                "trainer.strategy.balance=time times the blocks on example_input_array or a validation batch, and "
                "this run has neither: set one, or use balance=params or a list of blocks per stage"
            )
        return sample

    def setup(self, trainer: Any) -> None:
        """DDP's setup without the DDP wrapper: this rank's stages on its device, optimizers over its parameters."""
        module = self.lightning_module
        assert module is not None and self.accelerator is not None
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            loop.inference_mode = False  # no_grad, as every gloo run takes: cached stages meet no inference tensors
        st.refuse(module)
        self.parallelize(parallelize.net_of(module))  # a module whose configure_model did not hand it over
        # No process holds the whole net, so nothing may run its forward on example_input_array (the model
        # summary would); restored at teardown.
        self._example, module.example_input_array = module.example_input_array, None
        self.accelerator.setup(trainer)
        self._layer_sync = None  # SyncBatchNorm syncs over all processes, but they hold different stages
        self.precision_plugin.convert_module(module)
        self.model_to_device()
        self._metrics = st.metrics(module)
        for metric in self._metrics.values():
            if self.data_parallel > 1:
                metric.process_group = self.dp_group
            else:  # the stages hold copies of one state: nothing to add up across them
                metric.sync_on_compute = metric._to_sync = False
        if self.data_parallel > 1:  # pipelines start equal even unseeded, as DDP makes its replicas
            src = dist.get_global_rank(self.dp_group, 0)
            for tensor in module.state_dict().values():
                if isinstance(tensor, Tensor):
                    dist.broadcast(tensor, src=src, group=self.dp_group)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        # an instance attribute shadows the plugin's method: clip by the norm over all stages, as one device does
        self.precision_plugin.__dict__["clip_grad_by_norm"] = self._clip_grad_by_norm

    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and self._example is not None:
            module.example_input_array, self._example = self._example, None
        super().teardown()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        run = self._run(st.net_input(args[0]), train=True)
        params = [p for p in module.parameters() if p.requires_grad]
        previous = [p.grad for p in params]  # earlier batches' gradients (accumulation), or soon zeroed
        for p in params:
            p.grad = None
        saved = st.snapshot(self._metrics) if self.is_last else {}
        run.args, run.kwargs, self._step, self._error = args, kwargs, run, None
        with self.precision_plugin.train_step_context():
            output = self._schedule(run, args[0], train=True)
        run.args, run.kwargs, self._step = (), {}, None
        st.restore(self._metrics, saved)
        # Lightning zeroes gradients *after* training_step, before backward(): keep this batch's aside till then.
        self._stash = [(p, p.grad) for p in params]
        for p, g in zip(params, previous):
            p.grad = g
        return self._finish("training_step", args, kwargs, output, self.precision_plugin.train_step_context)

    def _evaluate(self, method: str, context_name: str, *args: Any, **kwargs: Any) -> Any:
        context = getattr(self.precision_plugin, context_name)
        run = self._run(st.net_input(args[0]), train=False)
        self._error = None
        with context():
            output = self._schedule(run, args[0], train=False)
        return self._finish(method, args, kwargs, output, context)

    validation_step = partialmethod(_evaluate, "validation_step", "val_step_context")
    test_step = partialmethod(_evaluate, "test_step", "test_step_context")
    predict_step = partialmethod(_evaluate, "predict_step", "predict_step_context")

    def _run(self, x: Tensor, train: bool) -> st.Run:
        """The stages and schedule for this shape, built once. The ranks of the pipeline first check that they
        all got this shape: a mismatch is then one error on every rank, not a hang in a receive."""
        code = [x.dim(), *x.shape, zlib.crc32(str(x.dtype).encode())][:10]  # crc32: hash() differs per process
        code += [0] * (10 - len(code))
        both = torch.tensor(code + [-c for c in code], dtype=torch.int64, device=self.root_device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.pp_group)
        if not torch.equal(both[:10], -both[10:]):
            raise UserError(
                f"trainer=pipeline: the ranks of one pipeline got batches of different shapes ({tuple(x.shape)} "
                "here); every stage must read the same batches (the strategy's distributed_sampler_kwargs)"
            )
        key = (tuple(x.shape), x.dtype, train)
        if key not in self._runs:
            self._runs[key] = st.build_run(self, len(x), train, self._loss_fn if train else None)
        return self._runs[key]

    def _schedule(self, run: st.Run, batch: Any, train: bool) -> Any:
        kwargs: dict[str, Any] = {}
        if self.is_first:
            kwargs["arg_mbs"] = [(chunk,) for chunk in st.net_input(batch).tensor_split(run.micro_batches)]
        if self.is_last and train:
            kwargs["target_mbs"], kwargs["losses"] = run.targets, []
        return run.schedule.step(**kwargs)  # the whole batch's output (no graph) on the last stage, else None

    def _loss_fn(self, output: Tensor, target: Tensor) -> Tensor:
        """The schedule's loss for one micro-batch, on the last stage: the user's training_step on it."""
        run = self._step
        index = run.index(target) if run is not None else None
        if run is None or index is None or self._error is not None:
            # torch's shape inference (it passes a copy of the target), or a step that already failed
            return output.float().sum() * 0.0
        try:
            args, kwargs = run.micro_batch_args(index)
            return st.loss_of(st.call_user(self.lightning_module, self.net, "training_step", args, kwargs, output, []))
        except Exception as e:  # finish the schedule (the other ranks wait on it), then fail on every rank
            self._error = e
            return output.float().sum() * 0.0

    def _finish(self, method: str, args: tuple, kwargs: dict, output: Any, context: Callable) -> Any:
        """The last stage runs the user's step on the whole batch's output and tells its pipeline what it logged;
        every rank logs the same. A failure on the last stage becomes an error on every rank."""
        module = self.lightning_module
        assert module is not None
        result, payload = None, None
        if self.is_last and self._error is None:
            try:
                with context():
                    result, payload = st.last_stage_step(module, self.net, self._metrics, method, args, kwargs, output)
            except Exception as e:
                self._error = e
        if self.is_last and self._error is not None:
            payload = {"error": f"{type(self._error).__name__}: {self._error}"}
            payload["user_error"] = isinstance(self._error, UserError)
        box = [payload]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pp_group, self.pp_size - 1), group=self.pp_group)
        payload = box[0]
        assert payload is not None
        if payload["error"] is not None:
            if self._error is not None:
                raise self._error
            if payload["user_error"]:  # the same one line on every rank
                raise UserError(payload["error"].removeprefix("UserError: "))
            raise RuntimeError(f"trainer=pipeline: the last stage failed in {method}: {payload['error']}")
        st.replay(module, payload, self._metrics, self.root_device, self.is_last)
        if method == "training_step":
            return result if self.is_last else torch.tensor(payload["loss"], device=self.root_device)
        if method == "predict_step":
            return move_data_to_device(payload["result"], self.root_device)
        return result

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The schedule already ran the backward. Lightning calls this after zero_grad: add this batch's gradients,
        averaged over the pipelines and divided by the accumulation (as Lightning divides the loss)."""
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        grads = [(p, g) for p, g in self._stash if g is not None]
        self._stash = []
        if self.data_parallel > 1:
            _average([g for _, g in grads], self.dp_group, self.data_parallel)
        scale = 1.0 / module.trainer.accumulate_grad_batches
        for p, g in grads:
            g = g if scale == 1.0 else g * scale
            p.grad = g if p.grad is None else p.grad + g
        return self.precision_plugin.post_backward(closure_loss, module)

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        params = list(self.precision_plugin.main_params(optimizer))
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        squares = norm.float().to(self.root_device).pow(2)
        dist.all_reduce(squares, group=self.pp_group)  # the norm of all stages' gradients together
        torch.nn.utils.clip_grads_with_norm_(params, clip_val, squares.sqrt())

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        # sync_dist: the stages of a pipeline already hold the same logged values; only pipelines differ
        return super().reduce(tensor, group if group is not None else self.dp_group, reduce_op)

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        return super().all_gather(tensor, group if group is not None else self.dp_group, sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Over every process, as Lightning's callbacks ask (ModelCheckpoint: is this a new best?): Lightning's own
        sums through `reduce`, which adds up over the pipelines only (above), and compares with the world size."""
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes)
        return bool(votes == self.world_size) if all else bool(votes)


def _average(grads: list[Tensor], group: Any, size: int) -> None:
    """Average gradients over the pipelines: one flat all-reduce per dtype (gloo has no AVG)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for tensors in by_dtype.values():
        flat = torch._utils._flatten_dense_tensors(tensors)
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        for g, synced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
            g.copy_(synced)
