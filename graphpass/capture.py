"""Capture: an ``nn.Module`` plus example inputs → the one IR every pass works on.

The IR (STYLE.md) is a functional *forward* ``torch.fx.GraphModule``:

- user inputs are ``placeholder`` nodes, parameters and buffers are ``get_attr`` nodes whose
  target is the original module path (``h.0.attn.q.weight``), tied weights are one ``get_attr``
  whose ``gp.state_keys`` lists every ``state_dict`` key it stands for;
- every op is a ``call_function``; every tensor-valued node carries a FakeTensor in
  ``meta["val"]`` and its module path / repeated-layer index / source line in ``gp.*`` meta;
- the output node returns a tuple whose first element is the scalar loss; in-place buffer updates
  (BatchNorm statistics) are explicit ``aten.copy_`` nodes before the output.

Two routes reach it. ``torch.export.export(strict=False)`` is tried first: its training IR keeps
``aten.linear``, ``aten.layer_norm`` and ``aten.scaled_dot_product_attention`` whole, and it
handles Hugging Face models. ``torch.fx.symbolic_trace`` (tracing through every submodule, so
parameters become ``get_attr`` and methods become functions) is the fallback for models export
rejects. When both fail, :class:`CaptureError` names each route, the user source line and why.

Before/after (export route, one linear)::

    p_fc_weight = placeholder[PARAMETER fc.weight]     fc_weight = get_attr[target=fc.weight]
    x = placeholder                              →     x = placeholder
    linear = aten.linear(x, p_fc_weight)               linear = aten.linear(x, fc_weight)
    return (sum,)                                      return (sum,)   # meta: gp.role loss=0
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import re
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from graphpass import meta
from graphpass.fake_values import FakeAttrProp, carry_over, is_fake, propagate_fake
from graphpass.model_io import Batch, LossModule, NoLoss, adapt
from graphpass.nn.grouped_experts import substituted

log = logging.getLogger(__name__)

ROUTES = ("export", "symbolic_trace")


class CaptureError(RuntimeError):
    """Neither capture route could turn the model into a graph; the message says why per route."""


@dataclass
class CaptureResult:
    """What capture produced: the IR graph, the route that made it, and how long it took."""

    gm: fx.GraphModule
    route: str
    seconds: float
    failures: dict[str, str]
    #: the graph is a copy of an earlier capture of an equal model (:func:`reusing_captures`)
    reused: bool = False


def capture(
    model: nn.Module, example_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor], *, route: str = "auto",
    loss_fn: Callable | None = None,
) -> CaptureResult:
    """Capture ``model(*example_inputs)`` (or ``model(**example_inputs)``) into the graphpass IR.

    Args:
        model: any module whose ``forward`` returns the scalar loss, or a ``ModelOutput`` / dict
            / tuple holding it, or its output when ``loss_fn`` is given (:mod:`graphpass.model_io`).
            Parameters may live on the meta device (nothing is allocated: shapes flow as fake
            tensors).
        example_inputs: positional arguments of one forward call (the per-rank batch), or its
            keyword arguments as a dict (the graph's inputs are then named by the keys).
        route: ``"auto"`` (export, then symbolic_trace), ``"export"`` or ``"symbolic_trace"``.
        loss_fn: ``loss_fn(output, target) -> loss`` for a model that returns its output only.

    Raises:
        TypeError: bad ``example_inputs``.
        ValueError: the forward does not return a scalar loss, or mutates its inputs.
        CaptureError: no route could capture the model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    batch = Batch.of(example_inputs)
    inputs = batch.tensors
    model = adapt(model, batch, loss_fn)
    if route not in ("auto",) + ROUTES:
        raise ValueError(f"capture route must be 'auto', 'export' or 'symbolic_trace', got {route!r}")
    store = _REUSE[-1] if _REUSE else None
    key = _fingerprint(model, inputs, route) if store is not None else None
    if key in (store or {}):
        start = time.perf_counter()
        earlier = store[key]
        gm = _rebind(earlier.gm, model)
        return CaptureResult(gm, earlier.route, time.perf_counter() - start, earlier.failures, reused=True)
    routes = ROUTES if route == "auto" else (route,)
    failures: dict[str, str] = {}
    for name in routes:
        start = time.perf_counter()
        try:
            # expert loops over data-dependent counts run as grouped products (graphpass.nn.grouped_experts)
            with substituted(model):
                gm = _export(model, inputs) if name == "export" else _symbolic_trace(model, inputs)
            _name_inputs_as_their_nodes(gm)
        except (_BadModel, NoLoss):
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is reported per route below
            failures[name] = _describe_failure(exc)
            log.info("capture route %s failed: %s", name, failures[name])
            continue
        if not isinstance(model, LossModule) and _several_outputs(gm):  # nanoGPT's (logits, loss)
            return capture(LossModule(model, batch, None), inputs, route=route)
        _check_loss_output(gm, model)
        if name == "export":  # values of our own fake mode, which later passes re-derive from
            propagate_fake(gm, inputs)
        if store is not None:  # keep a copy no pass will touch; the caller gets the original
            store[key] = CaptureResult(_rebind(gm, None), name, 0.0, failures)
        seconds = time.perf_counter() - start
        log.info(
            "captured %s via %s in %.2f s: %d nodes",
            type(getattr(model, "wrapped", model)).__name__, name, seconds, len(gm.graph.nodes),
        )
        return CaptureResult(gm, name, seconds, failures)
    details = "\n".join(f"  - {name}: {why}" for name, why in failures.items())
    raise CaptureError(f"could not capture {type(getattr(model, 'wrapped', model)).__name__}:\n{details}")


# --------------------------------------------------------------------------- reusing captures

_REUSE: list[dict[tuple, CaptureResult]] = []


@contextlib.contextmanager
def reusing_captures(captures: dict | None = None) -> Iterator[dict]:
    """Inside this block, capturing a model equal to one captured earlier in the block reuses that
    graph, bound to the new model's own tensors, instead of tracing it again.

    For compiling one model under many strategies (a parity matrix, a strategy sweep): export is
    most of ``compile``'s time, and every strategy with the same local batch captures the same
    graph. Two models are equal when they have the same class, the same submodule tree (classes,
    names, plain Python attributes such as ``eps`` or ``num_heads``, hooks, tensors stored as plain
    attributes, by value), the same parameters and buffers (names, shapes, dtypes, devices,
    ``requires_grad``, tying) and the inputs have the same shapes and dtypes; the weights' values
    may differ. Entering the block asserts that such models compute the same function of their
    weights (a forward that branches on a global flag of its own changed between two compiles
    would not be seen; torch's grad mode, default dtype and autocast are compared). Blocks nest;
    the innermost one's captures are used.

    Args:
        captures: where the block keeps its captures (yielded by ``with``); pass the same dict to
            later blocks to reuse captures across them. Default: a new one, released with the block.

    Example::

        with graphpass.reusing_captures():
            for strategy in strategies:
                dmodel = graphpass.compile(build_model(), example_inputs=batch, strategy=strategy)
    """
    store = {} if captures is None else captures
    _REUSE.append(store)
    try:
        yield store
    finally:
        _REUSE.pop()


def _fingerprint(model: nn.Module, inputs: Sequence[torch.Tensor], route: str) -> tuple:
    """What decides the captured graph of ``model(*inputs)``, short of the code's own behaviour."""
    tensors = _named_tensors(model)
    state = tuple(
        (name, kind, tuple(t.shape), t.dtype, t.device.type, t.requires_grad) for name, (t, kind) in tensors.items()
    )
    modules = tuple(
        (name, f"{type(m).__module__}.{type(m).__qualname__}", _plain_attributes(m))
        for name, m in model.named_modules(remove_duplicate=False)
    )
    if isinstance(model, LossModule):  # a view: the model it views decides the rest
        wrapped = model.wrapped
        modules += (("<viewed>", f"{type(wrapped).__module__}.{type(wrapped).__qualname__}",
                     _plain_attributes(wrapped)),)
    shapes = tuple((tuple(t.shape), t.dtype, t.device.type) for t in inputs)
    modes = (torch.is_grad_enabled(), torch.get_default_dtype(), torch.is_autocast_enabled())
    return route, modes, state, tuple(_canonical_names(tensors).items()), modules, shapes


_MODULE_INTERNALS = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


def _plain_attributes(module: nn.Module) -> tuple:
    """A module's own attributes that can change what its forward computes, as comparable values:
    literals as they are, tensors by content, dicts (hooks, options) by their repr, other callables
    by identity, objects with ``to_dict`` (Hugging Face configs) by that dict, anything else by type."""
    out = []
    for name, value in sorted(vars(module).items()):
        if name in _MODULE_INTERNALS:
            continue
        ok, literal = _as_literal(value)
        if ok:
            out.append((name, _hashable(literal)))
        elif isinstance(value, torch.Tensor):
            out.append((name, _tensor_digest(value)))
        elif isinstance(value, dict):  # hooks (their reprs hold their addresses), option dicts by value
            out.append((name, repr(value)))
        elif callable(value):
            out.append((name, getattr(value, "__qualname__", type(value).__qualname__), id(value)))
        elif callable(getattr(value, "to_dict", None)):
            out.append((name, repr(value.to_dict())))
        else:
            out.append((name, f"{type(value).__module__}.{type(value).__qualname__}"))
    return tuple(out)


def _hashable(literal: Any) -> Any:
    """A literal as a key: lists as tagged tuples (a module may keep a list of names)."""
    if isinstance(literal, list):
        return ("list", tuple(_hashable(v) for v in literal))
    if isinstance(literal, tuple):
        return tuple(_hashable(v) for v in literal)
    return literal


def _tensor_digest(t: torch.Tensor) -> tuple:
    meta_only = (tuple(t.shape), t.dtype, t.device.type)
    if t.device.type == "meta" or is_fake(t):
        return meta_only
    try:
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError):  # a layout without plain bytes (sparse, nested): by identity
        return meta_only + (id(t),)
    return meta_only + (hashlib.sha1(data).hexdigest(),)


def _rebind(src: fx.GraphModule, model: nn.Module | None) -> fx.GraphModule:
    """A copy of ``src`` whose ``get_attr`` nodes hold ``model``'s tensors of the same names
    (constants that are not model state are cloned); with ``model=None``, meta stand-ins of the
    state (a copy to keep, holding no weights). Node meta is copied one level deep, so that a pass
    editing one graph's annotations never edits the other's."""
    tensors = _named_tensors(model) if model is not None else {}
    holder = nn.Module()
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in src.graph.nodes:
        new = graph.node_copy(node, lambda n: env[n])
        new.meta = {k: copy.copy(v) if isinstance(v, (dict, list)) else v for k, v in node.meta.items()}
        env[node] = new
        if node.op != "get_attr":
            continue
        kind = node.meta[meta.ATTR_KIND]
        if kind == "module":  # a higher-order op's subgraph: holds no tensors, shared as it is
            _set_attr(holder, node.target, _fetch(src, node.target), kind)
            continue
        if not node.meta[meta.STATE_KEYS] and node.target not in tensors:  # a lifted constant
            tensor = _fetch(src, node.target).clone()
        elif model is None:
            tensor = torch.empty_like(_fetch(src, node.target), device="meta")
        else:
            tensor = tensors[node.target][0]
        _set_attr(holder, node.target, tensor, kind)
    carry_over(env)  # the copy's next propagation runs only what its tensors change
    return fx.GraphModule(holder, graph, class_name=type(src).__name__)


class _BadModel(ValueError):
    """A user error found during capture (not a reason to try the other route)."""


def _describe_failure(exc: BaseException) -> str:
    """One readable line: exception type, first message line, and the user's source line."""
    first = (str(exc).strip().splitlines() or [""])[0]
    if len(first) > 300:
        first = first[:300] + "..."
    user_frame = None
    torch_dir = os.path.dirname(torch.__file__)
    for frame in traceback.extract_tb(exc.__traceback__):
        if not frame.filename.startswith(torch_dir) and "graphpass" not in frame.filename:
            user_frame = frame
    text = f"{type(exc).__name__}: {first}"
    match = re.search(r'File "([^"]+)", line (\d+)', str(exc))
    if user_frame is not None:
        text += f" (at {user_frame.filename}:{user_frame.lineno}: {user_frame.line})"
    elif match:
        text += f" (at {match.group(1)}:{match.group(2)})"
    return text


# --------------------------------------------------------------------------- export route


def _name_inputs_as_their_nodes(gm: fx.GraphModule) -> None:
    """Make every placeholder's argument name its node's name.

    fx renames a node whose name shadows a builtin (``input`` becomes node ``input_1``) but keeps
    the argument name, and its generated code then assigns ``input_1 = input`` before reading the
    argument ``input_1``: a ``forward(self, input, input_1)`` would read its first argument twice.
    Node names are unique and safe, so the arguments take them."""
    renamed = False
    for node in gm.graph.find_nodes(op="placeholder"):
        if node.target != node.name:
            node.target, renamed = node.name, True
    if renamed:
        gm.recompile()


def _export(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> fx.GraphModule:
    from torch.export.graph_signature import InputKind, OutputKind

    ep = torch.export.export(model, inputs, strict=False)
    src = ep.graph_module
    sig = ep.graph_signature
    tensors = _named_tensors(model)
    for name, value in ep.constants.items():
        if isinstance(value, torch.Tensor):
            tensors.setdefault(name, (value, "buffer"))

    graph = fx.Graph()
    attrs = _AttrTable(model, tensors, graph)
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in src.graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind == InputKind.USER_INPUT:
            new = graph.placeholder(node.name)
            new.meta.update(node.meta)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            new = attrs.node(spec.target)
            new.meta.setdefault(meta.VAL, node.meta.get(meta.VAL))
        else:
            raise NotImplementedError(
                f"graphpass cannot capture input {node.name!r} of kind {spec.kind.name}"
            )
        env[node] = new
    # Parameters first (sorted as captured), then the computation.
    output_node = None
    for node in src.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            output_node = node
            break
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            # export's check of a cast's input (dtype, device): it computes nothing, and its
            # device would fail the program on meta copies (planning a cluster from a laptop)
            # and on every other device
            continue
        if node.op == "get_attr" and isinstance(getattr(src, node.target, None), nn.Module):
            # a subgraph of a higher-order op (a `with torch.no_grad():` block's body)
            _set_attr(attrs.holder, node.target, getattr(src, node.target), "module")
            env[node] = graph.get_attr(node.target)
            env[node].meta[meta.ATTR_KIND] = "module"
            continue
        new = graph.node_copy(node, lambda n: env[n])
        env[node] = new
    assert output_node is not None
    outputs = list(output_node.args[0])
    user_outputs = []
    for value, spec in zip(outputs, sig.output_specs):
        if spec.kind == OutputKind.USER_OUTPUT:
            user_outputs.append(env[value] if isinstance(value, fx.Node) else value)
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            buf = attrs.node(spec.target)
            copy = graph.call_function(torch.ops.aten.copy_.default, (buf, env[value]))
            meta.copy_meta(env[value], copy)
            copy.meta[meta.VAL] = buf.meta.get(meta.VAL)
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            raise _BadModel(
                f"{type(model).__name__}.forward mutates its input {spec.target!r} in place; "
                "graphpass needs forward to leave its inputs unchanged"
            )
        else:
            raise NotImplementedError(f"graphpass cannot capture an output of kind {spec.kind.name}")
    _set_output(graph, user_outputs)
    gm = fx.GraphModule(attrs.holder, graph, class_name=type(model).__name__)
    _annotate(gm)
    return gm


class _AttrTable:
    """One ``get_attr`` node per distinct tensor (tied weights share it), registered on a holder
    module under the first name the model gives that tensor."""

    def __init__(self, model: nn.Module, tensors: dict[str, tuple[torch.Tensor, str]], graph: fx.Graph):
        self.holder = nn.Module()
        self.graph = graph
        self.tensors = tensors
        self.canonical = _canonical_names(tensors)
        self.state_keys = set(model.state_dict(keep_vars=True).keys())
        self.nodes: dict[str, fx.Node] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.canonical

    def node(self, name: str) -> fx.Node:
        target = self.canonical[name]
        if target not in self.nodes:
            tensor, kind = self.tensors[target]
            _set_attr(self.holder, target, tensor, kind)
            new = self.graph.get_attr(target)
            new.meta[meta.ATTR_KIND] = kind
            new.meta[meta.STATE_KEYS] = tuple(
                k for k, c in self.canonical.items() if c == target and k in self.state_keys
            )
            self.nodes[target] = new
        return self.nodes[target]

    def constant(self, name: str, value: torch.Tensor) -> fx.Node:
        """A tensor constant that is not model state (fx lifted it from forward)."""
        _set_attr(self.holder, name, value, "buffer")
        new = self.graph.get_attr(name)
        new.meta[meta.ATTR_KIND] = "buffer"
        new.meta[meta.STATE_KEYS] = ()
        return new


def _named_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, str]]:
    out: dict[str, tuple[torch.Tensor, str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = (p, "parameter")
    for name, b in model.named_buffers(remove_duplicate=False):
        out[name] = (b, "buffer")
    return out


def _canonical_names(tensors: dict[str, tuple[torch.Tensor, str]]) -> dict[str, str]:
    """Map every name to the first name of the same tensor object (tied weights share one)."""
    first: dict[int, str] = {}
    out = {}
    for name, (tensor, _) in tensors.items():
        out[name] = first.setdefault(id(tensor), name)
    return out


def _set_attr(root: nn.Module, target: str, tensor: torch.Tensor, kind: str) -> None:
    *path, leaf = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if kind == "parameter":
        module.register_parameter(leaf, tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor))
    elif kind == "module":
        module.add_module(leaf, tensor)
    else:
        module.register_buffer(leaf, tensor)


def _set_output(graph: fx.Graph, user_outputs: list[Any]) -> None:
    out = graph.output(tuple(user_outputs))
    out.meta[meta.ROLE] = {"loss": 0}


# --------------------------------------------------------------------------- symbolic_trace route


class _DeepTracer(fx.Tracer):
    """Traces through every submodule so that parameters appear as ``get_attr`` nodes."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return False


def _symbolic_trace(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> fx.GraphModule:
    tracer = _DeepTracer()
    tracer.record_stack_traces = True
    graph = tracer.trace(model)
    traced = fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)
    new_graph = fx.Graph()
    attrs = _AttrTable(model, _named_tensors(model), new_graph)
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise TypeError(
            f"{type(model).__name__}.forward takes {len(placeholders)} tensor arguments "
            f"({', '.join(p.target for p in placeholders)}) but example_inputs has {len(inputs)}"
        )
    outputs: list[Any] = []
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            env[node] = new_graph.placeholder(node.target)
            env[node].meta.update(node.meta)
        elif node.op == "get_attr":
            if node.target in attrs:
                env[node] = attrs.node(node.target)
            else:  # a tensor constant fx lifted (e.g. torch.tensor(...) in forward)
                env[node] = attrs.constant(node.target, _fetch(traced, node.target))
        elif node.op == "call_method":
            fn = getattr(torch.Tensor, node.target)
            env[node] = new_graph.call_function(fn, *_map(env, (node.args, node.kwargs)))
            env[node].meta.update(node.meta)
        elif node.op == "call_function":
            env[node] = new_graph.node_copy(node, lambda n: env[n])
        elif node.op == "call_module":
            raise NotImplementedError(f"symbolic_trace left call_module {node.target!r}")
        elif node.op == "output":
            result = _map(env, node.args[0])
            outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    _set_output(new_graph, outputs)
    gm = fx.GraphModule(attrs.holder, new_graph, class_name=type(model).__name__)
    _specialize_python_values(gm, inputs)
    propagate_fake(gm, inputs)
    _annotate(gm)
    return gm


_LITERALS = (int, float, bool, str, type(None), torch.device, torch.dtype)


def _as_literal(value: Any) -> tuple[bool, Any]:
    """(True, literal) when ``value`` is plain Python data a graph can hold as a constant."""
    if isinstance(value, torch.Size):
        return True, tuple(int(v) for v in value)
    if isinstance(value, _LITERALS):
        return True, value
    if isinstance(value, (tuple, list)):
        items = [_as_literal(v) for v in value]
        if all(ok for ok, _ in items):
            return True, type(value)(v for _, v in items)
    return False, None


def _specialize_python_values(gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> None:
    """Fold nodes that compute plain Python values (``x.shape``, ``x.device``, ``B // h``) into
    constants, as ``torch.export`` does: the IR is specialised to the captured shapes."""
    values: dict[fx.Node, Any] = {}

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    class Recorder(FakeAttrProp):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            values[n] = result
            return result

    with mode:
        Recorder(gm, mode).propagate_dont_convert_inputs(*[mode.from_tensor(t) for t in inputs])
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or isinstance(values.get(node), torch.Tensor):
            continue
        ok, literal = _as_literal(values.get(node))
        if ok:
            for user in list(node.users):
                user.args = fx.node.map_arg(user.args, lambda n: literal if n is node else n)
                user.kwargs = fx.node.map_arg(user.kwargs, lambda n: literal if n is node else n)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _fetch(module: nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _map(env: dict[fx.Node, fx.Node], value: Any) -> Any:
    return fx.node.map_arg(value, lambda n: env[n])


# --------------------------------------------------------------------------- shared helpers


def _annotate(gm: fx.GraphModule) -> None:
    """Write module path, repeated-layer index and source line on every node."""
    for node in gm.graph.nodes:
        path = _module_path(node)
        node.meta[meta.MODULE_PATH] = path
        node.meta[meta.LAYER] = layer_index(path)
        source = _user_source(node.meta.get("stack_trace"))
        if source:
            node.meta[meta.SOURCE] = source


_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)')


def _user_source(stack_trace: str | None) -> str | None:
    """``file:line: code`` of the innermost frame outside torch (the user's model code)."""
    if not stack_trace:
        return None
    torch_dir = os.path.dirname(torch.__file__)
    frames = [m for m in _FRAME_RE.finditer(stack_trace) if not m.group(1).startswith(torch_dir)]
    if not frames:
        return None
    file, line, code = frames[-1].groups()
    return f"{file}:{line}: {code.strip()}"


def _module_path(node: fx.Node) -> str:
    if node.op == "get_attr":
        return node.target.rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # symbolic_trace records the qualified name; export records it as the first tuple element.
    return path if isinstance(path, str) else ""


_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(module_path: str) -> int | None:
    """The index of the repeated layer a module path sits in: ``"h.3.attn"`` → 3, ``"wte"`` → None."""
    match = _LAYER_RE.search(module_path)
    return int(match.group(1)) if match else None


def _several_outputs(gm: fx.GraphModule) -> bool:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return len(out.args[0]) > 1


def _check_loss_output(gm: fx.GraphModule, model: nn.Module) -> None:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = list(out.args[0])
    what = None
    if len(values) != 1:
        what = f"{len(values)} outputs"
    else:
        value = values[0]
        val = value.meta.get(meta.VAL) if isinstance(value, fx.Node) else value
        if not isinstance(val, torch.Tensor):
            what = f"a {type(val).__name__}"
        elif val.dim() != 0:
            what = f"a tensor of shape {tuple(val.shape)}"
        elif not val.is_floating_point():
            what = f"a {val.dtype} scalar"
    if what is not None:
        raise ValueError(
            f"{type(getattr(model, 'wrapped', model)).__name__}.forward must return the scalar loss (a 0-dim "
            f"floating tensor) but returned {what}; return e.g. F.cross_entropy(logits, targets), or give "
            "compile(..., loss_fn=lambda output, target: ...) and example_inputs=(inputs..., target)"
        )
