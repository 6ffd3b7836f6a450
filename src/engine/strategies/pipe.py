"""`strategy="pipe"`: one process, the net's stages on several devices, micro-batches pipelined (GPipe).

Each stage runs in a worker thread of its own (so the devices really work at once) on torchgpipe's fill-drain clock;
the graph ends at every cut, and `backward` sends each micro-batch's gradient back stage by stage."""

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partialmethod
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from engine.errors import UserError
from engine.strategies import parallelize
from engine.strategies.one_process import OneProcessStrategy
from engine.strategies.split import Split

log = logging.getLogger(__name__)

Values = tuple[Any, ...]  # what crosses a cut: the tensors (and any other values) later stages still need


@dataclass
class _Pass:
    """One forward of the pipelined net, kept until its backward: per stage and micro-batch, the stage's
    detached inputs and its outputs (whose graph ends at those inputs)."""

    inputs: list[list[Values]] = field(default_factory=list)
    outputs: list[list[Any]] = field(default_factory=list)
    last: list[list[Tensor]] = field(default_factory=list)  # the net's outputs as leaves: the loss's inputs


def clock(micro_batches: int, stages: int) -> list[list[tuple[int, int]]]:
    """(stage, micro-batch) pairs that run together at each clock tick of the fill-drain schedule."""
    return [
        [(j, k - j) for j in range(max(0, k - micro_batches + 1), min(k + 1, stages))]
        for k in range(micro_batches + stages - 1)
    ]


def _received(value: Any, device: torch.device, needs_grad: bool) -> Any:
    """A value handed over a cut: a tensor is detached (the graph ends here) and moved to the stage's device;
    a floating one collects the gradient that goes back over the cut."""
    if not isinstance(value, Tensor):
        return value
    value = value.detach().to(device, non_blocking=True)
    return value.requires_grad_(True) if needs_grad and value.is_floating_point() else value


def _merged(outputs: list[Any]) -> Any:
    """The micro-batches' outputs as the whole batch's: every tensor concatenated along dim 0."""
    flat = [tree_flatten(out) for out in outputs]
    leaves = [
        torch.cat(parts) if isinstance(parts[0], Tensor) and parts[0].dim() else parts[0]
        for parts in zip(*(leaves for leaves, _ in flat))
    ]
    return tree_unflatten(leaves, flat[0][1])


class PipelinedForward:
    """Replaces the net's `forward` while the strategy runs: the same output, computed stage by stage."""

    def __init__(self, strategy: "PipeStrategy", net: nn.Module) -> None:
        self.strategy, self.net = strategy, net
        self.calls = 0

    def __call__(self, x: Tensor) -> Any:
        s = self.strategy
        self.calls += 1
        stages = s.stages(self.net.training)
        pieces = s.split(x)
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        context = s.step_context
        keep = grad and not inference
        run = _Pass(inputs=[[] for _ in stages], outputs=[[] for _ in stages])
        done: dict[tuple[int, int], Future] = {}

        def task(j: int, i: int) -> Callable[[], Any]:
            def compute() -> Any:
                # waits for the micro-batch from the stage before, which runs in its own thread: no deadlock,
                # since every worker takes its micro-batches in the order the stage before produces them
                source = (pieces[i],) if j == 0 else done[j - 1, i].result()
                with torch.inference_mode(inference), torch.set_grad_enabled(grad), context():
                    inputs = tuple(_received(v, s.stage_devices[j], keep and j > 0) for v in source)
                    # copies for the stage, which may start with an in-place op (ReLU(inplace=True)) that a leaf
                    # needing a gradient does not allow
                    out = stages[j](*(v.clone() if isinstance(v, Tensor) and v.requires_grad else v for v in inputs))
                if keep:
                    run.inputs[j].append(inputs)
                    run.outputs[j].append(out)
                return out

            return compute

        # Queued in the fill-drain clock's order; each task starts as soon as its input is ready, so a stage
        # never waits for a slower stage's unrelated micro-batch (no barrier per clock tick).
        for tick in clock(len(pieces), len(stages)):
            for j, i in tick:
                done[j, i] = s.workers[j].submit(task(j, i))
        outputs = [done[len(stages) - 1, i].result() for i in range(len(pieces))]
        for future in done.values():
            future.result()  # every task finished; a worker's exception is raised here
        if not keep:
            return _merged(outputs)
        leaves = []
        for out in outputs:
            flat, spec = tree_flatten(out)
            mine = [t.detach().requires_grad_(True) if isinstance(t, Tensor) and t.requires_grad else t for t in flat]
            leaves.append(tree_unflatten(mine, spec))
            run.last.append([t for t in mine if isinstance(t, Tensor) and t.requires_grad])
        s.pending.append(run)
        return _merged(leaves)


class PipeStrategy(OneProcessStrategy):
    """Model parallelism in one process: `trainer.devices` stages, `micro_batches` per batch (1: one stage busy at a
    time) or `split_size` rows per micro-batch; `threads_per_stage`: each CPU stage's threads (default: a share)."""

    strategy_name = "pipe"

    def __init__(
        self,
        micro_batches: int = 4,
        split_size: int | None = None,
        split_points: Sequence[str] | None = None,
        balance: str | Sequence[int] = "params",
        leaves: Sequence[str] = (),
        threads_per_stage: int | None = None,
        **kwargs: Any,  # accelerator, parallel_devices, checkpoint_io, precision_plugin
    ) -> None:
        super().__init__(**kwargs)
        if micro_batches < 1 or (split_size is not None and split_size < 1):
            raise UserError(
                f"trainer.strategy: micro_batches={micro_batches}, split_size={split_size}: both must be >= 1"
            )
        self.micro_batches, self.split_size, self.balance = micro_batches, split_size, balance
        self.split_points = [str(n) for n in split_points] if split_points else None
        self.leaves = [str(n) for n in leaves]
        self.threads_per_stage = threads_per_stage
        self.plan: Split | None = None
        self.stage_devices: list[torch.device] = []
        self.workers: list[ThreadPoolExecutor] = []
        self.pending: list[_Pass] = []
        self.step_context: Callable[[], AbstractContextManager] = nullcontext
        self._forward: PipelinedForward | None = None

    @property
    def root_device(self) -> torch.device:
        return self.devices[-1]  # the last stage's: the net's output, the loss and the metrics live there

    def stages(self, training: bool) -> list[nn.Module]:
        assert self.plan is not None, "cut in model_to_device"
        return list(self.plan.for_mode(training))

    def _configure_launcher(self) -> None:
        self._launcher = None

    def split(self, x: Tensor) -> list[Tensor]:
        if self.split_size is not None:
            return list(torch.split(x, self.split_size))
        return list(torch.tensor_split(x, min(self.micro_batches, len(x))))

    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        assert module is not None
        if any(getattr(m, "_compiled_call_impl", None) for m in module.modules()):
            raise MisconfigurationException(
                "model.compile does not work with strategy=pipe (the stages replace the net's forward); "
                "use model.compile=false"
            )
        super().setup(trainer)

    def model_to_device(self) -> None:
        """Each stage to its device, everything else of the module (loss, metrics) to the last one; never the
        whole model to one device, which a model that needs several could not survive."""
        module = self.lightning_module
        assert module is not None
        net = parallelize.net_of(module)
        if self.plan is None:
            sample = getattr(module, "example_input_array", None) if self.balance == "time" else None
            if isinstance(sample, Tensor):  # a batch of 32 of it: block timings of one sample say little
                sample = sample[:1].expand(32, *sample.shape[1:]).contiguous()
            self.plan = parallelize.plan_stages(
                net,
                len(self.devices),
                self.split_points,
                self.balance,
                sample if isinstance(sample, Tensor) else None,
                self.leaves,
            )
            self.stage_devices = list(self.devices)
            log.info("strategy=pipe: %s cut into %s", type(net).__name__, parallelize.describe(self.plan))
        staged: set[int] = set()
        for stages in (self.plan.train, self.plan.eval):
            for stage, device in zip(stages, self.stage_devices):
                stage.to(device)
                staged |= {id(t) for t in (*stage.parameters(), *stage.buffers())}
        _place_rest(module, staged, self.root_device)
        self._start_workers(net)

    def _start_workers(self, net: nn.Module) -> None:
        if self.workers:
            return
        assert self.plan is not None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = self.threads_per_stage or max(1, cores // len(self.plan.train))
        on_cpu = self.root_device.type == "cpu"

        def share_cores() -> None:
            if on_cpu:  # each stage's intra-op threads are its own share of the cores
                torch.set_num_threads(threads)

        self.workers = [
            ThreadPoolExecutor(1, thread_name_prefix=f"pipe-stage{j}", initializer=share_cores)
            for j in range(len(self.plan.train))
        ]
        self._forward = PipelinedForward(self, net)
        net.__dict__["forward"] = self._forward  # an instance attribute shadows the class's forward

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # Lightning's moves every optimizer state to root_device; each state belongs with its parameter's stage
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)

    def _step(self, name: str, context: str, *args: Any, **kwargs: Any) -> Any:
        self.step_context = getattr(self.precision_plugin, context)  # thread-local: the workers enter it
        calls = self._forward.calls if self._forward is not None else 0
        result = getattr(super(), name)(*args, **kwargs)
        if self._forward is not None and self._forward.calls == calls and name == "training_step":
            module = self.lightning_module
            raise UserError(
                f"strategy=pipe: {type(module).__name__}.training_step never called the net's forward, which is "
                "what runs in stages: compute the output with self(x) (or self.net(x))"
            )
        return result

    training_step = partialmethod(_step, "training_step", "train_step_context")
    validation_step = partialmethod(_step, "validation_step", "val_step_context")
    test_step = partialmethod(_step, "test_step", "test_step_context")
    predict_step = partialmethod(_step, "predict_step", "predict_step_context")

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's Strategy.backward, with the stages' backward between the loss's and the hooks after it."""
        self.pre_backward(closure_loss)
        assert self.lightning_module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.precision_plugin.backward(closure_loss, self.lightning_module, optimizer, *args, **kwargs)
        self._backward_stages()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def _backward_stages(self) -> None:
        """Each pending forward's gradients, sent back through the stages on the reversed clock."""
        passes, self.pending = self.pending, []
        for run in passes:
            if all(leaf.grad is None for leaves in run.last for leaf in leaves):
                continue  # this forward's output did not reach the loss
            last = len(run.outputs) - 1
            done: dict[tuple[int, int], Future] = {}

            def task(j: int, i: int) -> Callable[[], None]:
                def compute() -> None:
                    if j == last:
                        outs, grads = tree_flatten(run.outputs[j][i])[0], [leaf.grad for leaf in run.last[i]]
                        outs = [o for o in outs if isinstance(o, Tensor) and o.requires_grad]
                    else:
                        done[j + 1, i].result()  # the stage after has put its gradients on its inputs
                        outs = list(run.outputs[j][i])
                        grads = [v.grad if isinstance(v, Tensor) else None for v in run.inputs[j + 1][i]]
                    pairs = [
                        (o, g)
                        for o, g in zip(outs, grads)
                        if isinstance(o, Tensor) and o.requires_grad and g is not None
                    ]
                    if pairs:  # nothing reached it, or a stage without weights before it
                        torch.autograd.backward([o for o, _ in pairs], [g.to(o.device) for o, g in pairs])

                return compute

            for tick in clock(len(run.last), len(run.outputs)):
                # stage K-1-j at tick k takes micro-batch M-1-(k-j): the last stage starts with the last one
                for j, i in tick:
                    stage, piece = last - j, len(run.last) - 1 - i
                    done[stage, piece] = self.workers[stage].submit(task(stage, piece))
            for future in done.values():
                future.result()  # every task finished; a worker's exception is raised here

    def teardown(self) -> None:
        for worker in self.workers:
            worker.shutdown(wait=True)
        self.workers, self.pending = [], []
        module = self.lightning_module
        if module is not None:
            parallelize.net_of(module).__dict__.pop("forward", None)
        self._forward = None
        super().teardown()


def _place_rest(module: nn.Module, staged: set[int], device: torch.device) -> None:
    """Every tensor of `module` that no stage holds (loss, metrics, unused layers) onto `device`."""
    for child in module.children():
        if any(id(t) in staged for t in (*child.parameters(), *child.buffers())):
            _place_rest(child, staged, device)
        else:
            child.to(device)
    for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        if id(tensor) not in staged:
            tensor.data = tensor.data.to(device)
