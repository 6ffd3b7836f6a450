"""`strategy="pipe"`: one process, the net's stages on several devices, micro-batches pipelined (GPipe).

The classic model-parallel tutorial puts the first half of a net on cuda:0 and the second on cuda:1, then
splits each batch into micro-batches so that stage 2 works on micro-batch i while stage 1 works on i+1. Here
that is a strategy: the net (an nn.Sequential, project.strategies.parallelize) is cut into one stage per
device, and each stage runs in a worker thread of its own, so the devices really work at the same time.

Forward follows torchgpipe's fill-drain clock (at tick k, stage j runs micro-batch k - j), except that a
stage starts a micro-batch as soon as the stage before has handed it over, not when the whole tick is over.
Each stage's input is a detached copy, so the graph ends at every stage boundary; the LightningModule sees the
whole batch's output (the micro-batches concatenated) and computes its loss as on one device, `self.log` and
metrics unchanged. Backward runs the same clock in reverse in the workers: Lightning's `loss.backward()` only
reaches the last stage's outputs, then `backward` here sends each micro-batch's gradient back stage by stage.
Gradients accumulate over the micro-batches and the optimizer steps once per batch, so the steps equal a
single device's (BatchNorm aside: it normalises each micro-batch with that micro-batch's statistics).
"""

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

from project.errors import UserError
from project.strategies import parallelize
from project.strategies.one_process import OneProcessStrategy


@dataclass
class _Pass:
    """One forward of the pipelined net, kept until its backward: per stage and micro-batch, the stage's
    detached input and its output (whose graph ends at that input)."""

    inputs: list[list[Tensor]] = field(default_factory=list)
    outputs: list[list[Tensor]] = field(default_factory=list)
    last: list[Tensor] = field(default_factory=list)  # the last stage's outputs as leaves: the loss's inputs


def clock(micro_batches: int, stages: int) -> list[list[tuple[int, int]]]:
    """(stage, micro-batch) pairs that run together at each clock tick of the fill-drain schedule."""
    return [
        [(j, k - j) for j in range(max(0, k - micro_batches + 1), min(k + 1, stages))]
        for k in range(micro_batches + stages - 1)
    ]


class PipelinedForward:
    """Replaces the net's `forward` while the strategy runs: the same output, computed stage by stage."""

    def __init__(self, strategy: "PipeStrategy") -> None:
        self.strategy = strategy

    def __call__(self, x: Tensor) -> Tensor:
        s = self.strategy
        pieces = s.split(x)
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        context = s.step_context
        keep = grad and not inference
        run = _Pass(inputs=[[] for _ in s.stage_modules], outputs=[[] for _ in s.stage_modules])
        done: dict[tuple[int, int], Future] = {}

        def task(j: int, i: int) -> Callable[[], Tensor]:
            def compute() -> Tensor:
                # waits for the micro-batch from the stage before, which runs in its own thread: no deadlock,
                # since every worker takes its micro-batches in the order the stage before produces them
                source = pieces[i] if j == 0 else done[j - 1, i].result()
                with torch.inference_mode(inference), torch.set_grad_enabled(grad), context():
                    inp = source.detach().to(s.stage_devices[j], non_blocking=True)
                    if keep and j > 0 and inp.is_floating_point():
                        inp.requires_grad_(True)  # the gradient that goes back to stage j - 1 collects here
                    # a copy for the stage, which may start with an in-place op (ReLU(inplace=True)) that a
                    # leaf needing a gradient does not allow
                    out = s.stage_modules[j](inp.clone() if inp.requires_grad else inp)
                if keep:
                    run.inputs[j].append(inp)
                    run.outputs[j].append(out)
                return out

            return compute

        # Queued in the fill-drain clock's order; each task starts as soon as its input is ready, so a stage
        # never waits for a slower stage's unrelated micro-batch (no barrier per clock tick).
        for tick in clock(len(pieces), len(s.stage_modules)):
            for j, i in tick:
                done[j, i] = s.workers[j].submit(task(j, i))
        held = [[done[j, i].result() for i in range(len(pieces))] for j in range(len(s.stage_modules))]
        outputs = held[-1]
        if not keep:
            return torch.cat(outputs)
        run.last = [out.detach().requires_grad_(True) for out in outputs]
        s.pending.append(run)
        return torch.cat(run.last)


class PipeStrategy(OneProcessStrategy):
    """Model parallelism in one process: `trainer.devices` stages, `micro_batches` per batch (1: the plain
    split, one stage busy at a time), or `split_size` rows per micro-batch (the tutorials' knob).
    `balance`: blocks per stage (`[4, 8]`), or chosen by parameter count (`params`) or by timing (`time`).
    `threads_per_stage`: intra-op threads of each stage's worker on CPU (default: the cores shared out)."""

    strategy_name = "pipe"

    def __init__(
        self,
        micro_batches: int = 4,
        split_size: int | None = None,
        balance: str | Sequence[int] = "params",
        threads_per_stage: int | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if micro_batches < 1 or (split_size is not None and split_size < 1):
            raise UserError(
                f"trainer.strategy: micro_batches={micro_batches}, split_size={split_size}: both must be >= 1"
            )
        self.micro_batches, self.split_size, self.balance = micro_batches, split_size, balance
        self.threads_per_stage = threads_per_stage
        self.stage_modules: list[nn.Sequential] = []
        self.stage_devices: list[torch.device] = []
        self.workers: list[ThreadPoolExecutor] = []
        self.pending: list[_Pass] = []
        self.step_context: Callable[[], AbstractContextManager] = nullcontext

    @property
    def root_device(self) -> torch.device:
        return self.devices[-1]  # the last stage's: the net's output, the loss and the metrics live there

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
        net = getattr(module, "net", None)
        if not isinstance(net, nn.Module):
            raise UserError("strategy=pipe cuts the LightningModule's `net` into stages; this module has none")
        if not self.stage_modules:
            found = parallelize.blocks(net)
            sample = getattr(module, "example_input_array", None)
            if isinstance(sample, Tensor):
                sample = sample.expand(32, *sample.shape[1:]).contiguous()
            sizes = parallelize.balance(found, len(self.devices), self.balance, sample)
            self.stage_modules = [nn.Sequential(*(m for _, m in s)) for s in parallelize.stages(found, sizes)]
            self.stage_devices = list(self.devices)
        for name, child in module.named_children():
            if child is not net:
                child.to(self.root_device)
        for stage, device in zip(self.stage_modules, self.stage_devices):
            stage.to(device)
        self._start_workers(net)

    def _start_workers(self, net: nn.Module) -> None:
        if self.workers:
            return
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = self.threads_per_stage or max(1, cores // len(self.stage_modules))
        on_cpu = self.root_device.type == "cpu"

        def share_cores() -> None:
            if on_cpu:  # each stage's intra-op threads are its own share of the cores
                torch.set_num_threads(threads)

        self.workers = [
            ThreadPoolExecutor(1, thread_name_prefix=f"pipe-stage{j}", initializer=share_cores)
            for j in range(len(self.stage_modules))
        ]
        net.__dict__["forward"] = PipelinedForward(self)  # an instance attribute shadows the class's forward

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # Lightning's moves every optimizer state to root_device; each state belongs with its parameter's stage
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)

    def _step(self, name: str, context: Callable[[], AbstractContextManager], *args: Any, **kwargs: Any) -> Any:
        self.step_context = context  # autocast is thread-local: the workers enter it themselves
        return getattr(super(), name)(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", self.precision_plugin.train_step_context, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

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
            grads_out = [leaf.grad for leaf in run.last]
            if all(g is None for g in grads_out):
                continue  # this forward's output did not reach the loss
            last = len(self.stage_modules) - 1

            done: dict[tuple[int, int], Future] = {}

            def task(j: int, i: int) -> Callable[[], Tensor | None]:
                def compute() -> Tensor | None:
                    grad = grads_out[i] if j == last else done[j + 1, i].result()  # the stage after's, for mb i
                    out = run.outputs[j][i]
                    if grad is None or not out.requires_grad:  # nothing reached it, or a stage without weights
                        return None
                    torch.autograd.backward(out, grad.to(out.device))
                    return run.inputs[j][i].grad if j > 0 else None

                return compute

            for tick in clock(len(run.last), len(self.stage_modules)):
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
        net = getattr(self.lightning_module, "net", None)
        if isinstance(net, nn.Module):
            net.__dict__.pop("forward", None)
        super().teardown()
