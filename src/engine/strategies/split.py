"""Cutting any traceable net into pipeline stages at module names: the one mechanism of `pipe` and `pipeline`.

A stage is a piece of the net's torch.fx graph that calls the net's own layers (no copies: parameters, buffers and
state_dict names stay the net's), and hands on every value a later stage needs (skip connections too)."""

import dis
import inspect
import linecache
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from engine.errors import UserError


@dataclass(frozen=True)
class Block:
    """A run of the graph that belongs to one module call, in call order; a cut may go before it."""

    name: str  # the module's qualified name, `pool@1` for its second call
    parameters: int  # of the parameters first used here


def _asserting(frame: Any) -> bool:
    """Whether the code of `frame` is at the test of an `assert` statement: the test's jump (taken when the test
    holds) comes just before the load of AssertionError that the statement raises."""
    instructions = list(dis.get_instructions(frame.f_code))
    at = next((i for i, ins in enumerate(instructions) if ins.offset >= frame.f_lasti), None)
    if at is None:
        return False
    for here, after in zip(instructions[at : at + 3], instructions[at + 1 : at + 4]):
        if "JUMP" in here.opname and "IF_TRUE" in here.opname:
            return after.opname == "LOAD_ASSERTION_ERROR" or (
                after.opname == "LOAD_GLOBAL" and after.argval == "AssertionError"
            )
    return False


class _Tracer(fx.Tracer):
    """torch.fx's tracer; `leaves` kept whole. An `assert` on a traced value becomes torch._assert (torch.fx's own
    detection misses Python 3.11's bytecode); other Python control flow on a traced value is still refused."""

    def __init__(self, leaves: Sequence[str]) -> None:
        super().__init__(autowrap_functions=(torch._check, torch._check_is_size))
        self.leaves = set(leaves)

    def to_bool(self, obj: fx.Proxy) -> bool:
        frame = inspect.currentframe()
        caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None  # past __bool__
        if caller is not None and _asserting(caller):
            self.create_proxy("call_function", torch._assert, (obj, "assertion in forward"), {})
            return True
        return super().to_bool(obj)

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return (
            super().is_leaf_module(m, qualified_name)
            or qualified_name in self.leaves
            or type(m).__name__ in self.leaves
        )


def _failure(net: nn.Module, tracer: _Tracer, error: Exception) -> UserError:
    """One line: which module's forward could not be traced, the construct (file, line, code), the way out."""
    inside = list(tracer.module_stack.values())
    module = f"{inside[-1][0]} ({inside[-1][1].__name__})" if inside else f"{type(net).__name__}.forward"
    where = ""
    frames = [
        f for f in traceback.extract_tb(error.__traceback__) if "/torch/" not in f.filename and f.filename != __file__
    ]
    if frames:
        frame = frames[-1]
        code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
        where = f" at {frame.filename}:{frame.lineno} `{code}`"
    reason = " ".join(str(error).split())[:160]
    way_out = (
        f"keep that module whole in one stage with trainer.strategy.leaves=[{inside[-1][1].__name__}]"
        if inside
        else "write that forward without Python control flow on tensor values"
    )
    return UserError(
        f"cannot cut {type(net).__name__} into stages: torch.fx cannot trace {module}{where} ({reason}); {way_out}"
    )


def _concrete_args(net: nn.Module) -> dict[str, Any]:
    """The net takes its first argument from the batch; further arguments keep their defaults."""
    parameters = list(inspect.signature(net.forward).parameters.values())
    if not parameters:
        raise UserError(f"cannot cut {type(net).__name__} into stages: its forward takes no input")
    rest = {}
    for p in parameters[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is p.empty:
            raise UserError(
                f"cannot cut {type(net).__name__} into stages: its forward takes more than one input ({p.name}); "
                "the stages pass one batch tensor to the net"
            )
        rest[p.name] = p.default
    return rest


def trace(net: nn.Module, training: bool, leaves: Sequence[str] = ()) -> fx.Graph:
    """The net's forward as a graph, traced in train or eval mode (the mode is restored after)."""
    was = net.training
    tracer = _Tracer(leaves)
    net.train(training)
    buffers = {name: (b, b._version, b.detach().clone()) for name, b in net.named_buffers()}
    try:
        graph = tracer.trace(net, concrete_args=_concrete_args(net) or None)
    except UserError:
        raise
    except Exception as e:
        raise _failure(net, tracer, e) from e
    finally:
        net.train(was)
        changed = _put_back_changed(net, buffers)
    if changed:
        raise UserError(
            f"cannot cut {type(net).__name__} into stages: its forward changes its own buffer {changed[0]!r} in "
            "Python code of its own (`self.count += 1`), which the stages, made from a trace of forward, would not "
            "repeat; do it inside a layer of the net (a module whose forward it is), or in the LightningModule"
        )
    return graph


def _put_back_changed(net: nn.Module, buffers: dict[str, tuple[torch.Tensor, int, torch.Tensor]]) -> list[str]:
    """Buffers the trace changed (run on the real tensors, not recorded in the graph), put back as they were."""
    changed = []
    for name, (tensor, version, value) in buffers.items():
        now = net.get_buffer(name)
        if now is not tensor or tensor._version != version:
            changed.append(name)
            with torch.no_grad():
                tensor.copy_(value)
            owner, _, leaf = name.rpartition(".")
            net.get_submodule(owner)._buffers[leaf] = tensor
    return changed


def _body(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op not in ("placeholder", "output")]


def _block_key(node: fx.Node, net: nn.Module) -> str | None:
    """The block a node belongs to: its outermost module call, descending through nn.Sequentials."""
    stack = list((node.meta.get("nn_module_stack") or {}).items())
    if not stack:
        return None
    depth = 0
    while depth + 1 < len(stack) and issubclass(stack[depth][1][1], nn.Sequential):
        depth += 1
    return stack[depth][0]


def _parameters_of(node: fx.Node, net: nn.Module) -> list[torch.Tensor]:
    if node.op == "call_module":
        module = net.get_submodule(str(node.target))
        return [*module.parameters(), *module.buffers()]
    if node.op == "get_attr":
        owner, _, name = str(node.target).rpartition(".")
        value = getattr(net.get_submodule(owner), name)
        return [value] if isinstance(value, torch.Tensor) else []
    return []


def blocks(graph: fx.Graph, net: nn.Module) -> tuple[list[Block], list[int]]:
    """The blocks of a traced net in call order, and the index in the graph's body where each starts."""
    keys: list[str | None] = [_block_key(n, net) for n in _body(graph)]
    first = next((k for k in keys if k is not None), None)
    if first is None:
        raise UserError(f"cannot cut {type(net).__name__} into stages: its forward calls no module")
    found: list[Block] = []
    starts: list[int] = []
    seen: set[int] = set()
    current, count = first, 0
    for index, (node, key) in enumerate(zip(_body(graph), keys)):
        key = key or current  # functional ops belong to the block before them (or the first)
        if key != current or not starts:
            if starts:
                found.append(Block(current, count))
            starts.append(index)
            current, count = key, 0
        for tensor in _parameters_of(node, net):
            if id(tensor) not in seen and isinstance(tensor, nn.Parameter):
                seen.add(id(tensor))
                count += tensor.numel()
    found.append(Block(current, count))
    return found, starts


def cut_positions(graph: fx.Graph, names: Sequence[str], net: nn.Module) -> list[int]:
    """Where in the graph's body each named module is first called: the stage boundaries."""
    body = _body(graph)
    positions = []
    for name in names:
        name = str(name)
        index = next(
            (
                i
                for i, node in enumerate(body)
                if any(name in (key, path) for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items())
            ),
            None,
        )
        if index is None:
            called, _ = blocks(graph, net)
            raise UserError(
                f"trainer.strategy.split_points: {type(net).__name__} calls no module named {name!r} in its forward; "
                f"its blocks in call order: {', '.join(b.name for b in called)}"
            )
        positions.append(index)
    if positions != sorted(set(positions)) or (positions and positions[0] == 0):
        raise UserError(
            f"trainer.strategy.split_points={list(names)}: give modules in the order the forward calls them, each "
            "after the start (the first stage needs something to compute)"
        )
    return positions


class Stage(fx.GraphModule):
    """One stage: takes the values the stage before handed on (the batch, for the first) and returns the values
    later stages need as a tuple; the last stage returns the net's output. Its layers are the net's own."""


def stages(graph: fx.Graph, net: nn.Module, positions: Sequence[int]) -> list[Stage]:
    """The graph cut at `positions` (indices into its body, increasing) into len(positions) + 1 stages."""
    body = _body(graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    bounds = [0, *positions, len(body)]
    stage_of = {node: s for s in range(len(bounds) - 1) for node in body[bounds[s] : bounds[s + 1]]}
    for node in placeholders:
        stage_of[node] = -1
    last = len(bounds) - 2

    def users_from(node: fx.Node) -> int:
        """The last stage that uses `node` (last + 1 for the net's output)."""
        return max((last + 1 if user.op == "output" else stage_of[user]) for user in node.users)

    # live[s]: the values stage s receives: made before it, used by it or after it, in graph order
    order = {node: i for i, node in enumerate(graph.nodes)}
    live = [
        sorted((n for n in stage_of if stage_of[n] < s and n.users and users_from(n) >= s), key=order.__getitem__)
        for s in range(last + 2)
    ]
    live[0] = [n for n in placeholders if n.users]
    built = []
    for s in range(last + 1):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in live[s]:
            env[node] = g.placeholder(node.name)
        for node in body[bounds[s] : bounds[s + 1]]:
            env[node] = g.node_copy(node, env.__getitem__)
        if s == last:
            g.output(fx.map_arg(output.args[0], env.__getitem__))
        else:
            g.output(tuple(env[n] for n in live[s + 1]))
        g.lint()
        built.append(Stage(net, g, class_name=f"Stage{s}"))
    _refuse_shared(built, net)
    return built


def _refuse_shared(built: list[Stage], net: nn.Module) -> None:
    """A parameter used by two stages (tied weights) would be two copies on two devices, trained apart."""
    owner: dict[int, int] = {}
    names = {id(p): n for n, p in net.named_parameters(remove_duplicate=False)}
    for s, stage in enumerate(built):
        for p in stage.parameters():
            if owner.setdefault(id(p), s) != s:
                raise UserError(
                    f"cannot cut {type(net).__name__} there: parameter {names.get(id(p), '?')} is used by stages "
                    f"{owner[id(p)]} and {s} (shared weights); choose split points that keep its users in one stage"
                )


@dataclass
class Split:
    """The net in stages, for train mode and for eval mode (the same list when the two traces agree)."""

    train: list[Stage]
    eval: list[Stage]
    blocks: list[Block]
    names: list[str]  # the split points: the module each stage after the first starts with

    def for_mode(self, training: bool) -> list[Stage]:
        return self.train if training else self.eval


def trace_both(net: nn.Module, leaves: Sequence[str] = ()) -> tuple[fx.Graph, fx.Graph]:
    graphs = trace(net, True, leaves), trace(net, False, leaves)
    if fx.GraphModule(net, graphs[0]).code == fx.GraphModule(net, graphs[1]).code:
        return graphs[0], graphs[0]
    return graphs


def split(net: nn.Module, names: Sequence[str], graphs: tuple[fx.Graph, fx.Graph] | None = None) -> Split:
    """The net cut before each of the modules `names` (in call order): len(names) + 1 stages."""
    train_graph, eval_graph = graphs or trace_both(net)
    found, _ = blocks(train_graph, net)
    names = [str(n) for n in names]
    train = stages(train_graph, net, cut_positions(train_graph, names, net))
    if eval_graph is train_graph:
        return Split(train, train, found, names)
    return Split(train, stages(eval_graph, net, cut_positions(eval_graph, names, net)), found, names)


def names_for(found: list[Block], sizes: Sequence[int]) -> list[str]:
    """The split points that give stages of `sizes` blocks each."""
    out, start = [], 0
    for size in sizes[:-1]:
        start += size
        out.append(found[start].name)
    return out


def run(stage_list: Sequence[nn.Module], x: Any) -> Any:
    """The stages one after the other: what the net computes (for checks and tests)."""
    values: Any = (x,)
    for stage in stage_list:
        values = stage(*values)
    return values
