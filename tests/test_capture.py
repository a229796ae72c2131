"""Capture: every model reaches the one IR, runs like the eager model, and errors are readable."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import graphpass as gp
from graphpass import meta
from graphpass.capture import capture, layer_index

import zoo
from gpt import GPT, GPTConfig


def _assert_ir(gm: torch.fx.GraphModule, model: nn.Module) -> None:
    """The IR invariants of STYLE.md."""
    state_keys = set(model.state_dict().keys())
    covered = set()
    for node in gm.graph.nodes:
        assert node.op in ("placeholder", "get_attr", "call_function", "output"), node.format_node()
        if node.op == "get_attr":
            covered.update(meta.get(node, meta.STATE_KEYS))
            assert meta.get(node, meta.ATTR_KIND) in ("parameter", "buffer")
        if node.op in ("placeholder", "get_attr"):
            assert isinstance(node.meta[meta.VAL], torch.Tensor), node.name
        if node.op == "call_function" and node.target is not __import__("operator").getitem:
            assert meta.VAL in node.meta, node.name
        assert meta.MODULE_PATH in node.meta
    # Every parameter of the model is reachable by its original key.
    param_keys = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    assert param_keys <= covered | (state_keys - param_keys), param_keys - covered
    output = gm.graph.find_nodes(op="output")[0]
    assert meta.get(output, meta.ROLE) == {"loss": 0}


@pytest.mark.parametrize("name", zoo.MODELS)
def test_capture_matches_eager_loss(name):
    model = zoo.build(name)
    batch = zoo.batches(name, 1, 4)[0]
    result = capture(model, batch)
    assert result.route == "export"
    _assert_ir(result.gm, model)
    # Same parameters (shared storage), same math: the loss is identical.
    torch.testing.assert_close(result.gm(*batch)[0], model(*batch), rtol=0, atol=0)


def test_tied_weights_are_one_get_attr_with_both_keys():
    model = zoo.build("gpt")
    gm = capture(model, zoo.batches("gpt", 1, 2)[0]).gm
    wte = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "wte.weight"]
    assert len(wte) == 1
    assert meta.get(wte[0], meta.STATE_KEYS) == ("wte.weight", "lm_head.weight")
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "lm_head.weight"]


def test_module_path_and_layer_index_are_recorded():
    gm = capture(zoo.build("gpt"), zoo.batches("gpt", 1, 2)[0]).gm
    linears = [n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    paths = [meta.get(n, meta.MODULE_PATH) for n in linears]
    assert paths[:4] == ["h.0.attn.q", "h.0.attn.k", "h.0.attn.v", "h.0.attn.proj"]
    assert [meta.get(n, meta.LAYER) for n in linears] == [0] * 6 + [1] * 6 + [None]
    assert "gpt.py" in meta.get(linears[0], meta.SOURCE)
    assert layer_index("model.layers.12.mlp") == 12 and layer_index("lm_head") is None


def test_symbolic_trace_route_gives_the_same_loss():
    model = zoo.build("gpt")
    batch = zoo.batches("gpt", 1, 4)[0]
    result = capture(model, batch, route="symbolic_trace")
    assert result.route == "symbolic_trace"
    _assert_ir(result.gm, model)
    torch.testing.assert_close(result.gm(*batch)[0], model(*batch), rtol=0, atol=0)


def test_buffer_updates_reach_the_real_buffers():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net(x).pow(2).mean()

    wrapped = Loss()
    x = torch.randn(16, 8)
    gm = capture(wrapped, (x,)).gm
    # Training IR keeps BatchNorm's in-place statistics update on the get_attr buffers.
    buffers = {n.target for n in gm.graph.nodes if n.op == "get_attr" and meta.get(n, meta.ATTR_KIND) == "buffer"}
    assert buffers == {"net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"}
    before = model[1].running_mean.clone()
    gm(x)
    assert not torch.equal(before, model[1].running_mean)  # the graph updated the real buffer


def test_large_meta_model_captures_fast_without_allocating():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600))
    assert sum(p.numel() for p in model.parameters()) > 1.5e9
    idx = torch.zeros(2, 1024, dtype=torch.long, device="meta")
    result = capture(model, (idx, idx))
    # Nothing was allocated: the graph holds the model's meta parameters, values are fake.
    # (Speed is a benchmark, not a test: bench/capture_speed.py prints it; ~3.5 s here.)
    assert all(p.device.type == "meta" for p in result.gm.parameters())
    assert len([n for n in result.gm.graph.nodes if n.target == torch.ops.aten.linear.default]) == 48 * 6 + 1


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # data-dependent Python control flow: neither route can capture it
            return y.mean()
        return -y.mean()


def test_uncapturable_model_names_both_routes_and_the_line():
    with pytest.raises(gp.CaptureError) as info:
        capture(_DataDependent(), (torch.randn(2, 4),))
    text = str(info.value)
    assert "export:" in text and "symbolic_trace:" in text
    assert "if y.sum() > 0" in text
    assert "test_capture.py" in text


def test_forward_must_return_a_scalar_loss():
    with pytest.raises(ValueError, match=r"must return the scalar loss .* shape \(2, 3\)"):
        capture(nn.Linear(4, 3), (torch.randn(2, 4),))


@pytest.mark.parametrize(
    "inputs, message",
    [
        (torch.randn(2, 4), "got a single Tensor"),
        ({"x": torch.randn(2, 4)}, r"MLP.forward needs \['y'\], which the batch does not give"),
        ([torch.randn(2, 4)], r"MLP.forward needs \['y'\], which the batch does not give"),
        ({"x": torch.randn(2, 4), "y": [1.0]}, r"example_inputs\['y'\] must be a torch.Tensor, got list"),
        ({1: torch.randn(2, 4)}, "example_inputs keys must be argument names, got 1"),
        ((torch.randn(2, 4), 3), r"example_inputs\[1\] must be a torch.Tensor, got int"),
    ],
)
def test_example_inputs_of_the_wrong_type_are_rejected(inputs, message):
    with pytest.raises(TypeError, match=message):
        capture(zoo.build("mlp"), inputs)


# ------------------------------------------------------------------------ reusing captures


class _Scaled(nn.Module):
    """A model whose graph depends on a plain attribute and a plain tensor attribute."""

    def __init__(self, eps: float = 1e-5, offset: float = 0.0, tie: bool = False, power: int = 2,
                 order=("a", "b")):
        super().__init__()
        self.eps = eps
        self.order = list(order)  # a list attribute (unhashable) the forward reads
        self.options = {"power": power}
        self.offset = torch.full((4,), offset)
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        if tie:
            self.b.weight = self.a.weight

    def forward(self, x):
        first, second = (getattr(self, name) for name in self.order)
        return (second(first(x) + self.offset) / (x.abs().mean() + self.eps)).pow(self.options["power"]).mean()


def test_a_reused_capture_is_bound_to_the_new_model_and_untouched_by_edits_of_the_first():
    x = torch.randn(8, 4)
    with gp.reusing_captures() as captures:
        first = capture(_Scaled(), (x,))
        # A pass editing the first graph's annotations in place must not reach later copies.
        first.gm.graph.output_node().meta[meta.ROLE]["loss"] = 5
        model = _Scaled()
        again = capture(model, (x,))
        assert len(captures) == 1 and not first.reused and again.reused
        assert again.gm.code == first.gm.code
        assert meta.get(again.gm.graph.output_node(), meta.ROLE) == {"loss": 0}
        assert again.gm.get_parameter("a.weight") is model.a.weight  # bound to the new weights
        torch.testing.assert_close(again.gm(x)[0], model(x), rtol=0, atol=0)
        # What the block keeps holds no weights.
        (kept,) = captures.values()
        assert all(p.device.type == "meta" for p in kept.gm.parameters())


@pytest.mark.parametrize("other, inputs", [
    (lambda: _Scaled(eps=1e-3), None),               # a plain attribute the forward reads
    (lambda: _Scaled(offset=1.0), None),             # a plain tensor attribute, by value
    (lambda: _Scaled(power=4), None),                # a dict of options
    (lambda: _Scaled(order=("b", "a")), None),       # a list
    (lambda: _Scaled(tie=True), None),               # tying
    (lambda: _Scaled(), (torch.randn(4, 4),)),       # the batch shape
    (lambda: _Scaled().double(), (torch.randn(8, 4, dtype=torch.float64),)),  # dtypes
])
def test_a_model_or_batch_that_could_capture_differently_is_captured_again(other, inputs):
    x = torch.randn(8, 4)
    with gp.reusing_captures() as captures:
        capture(_Scaled(), (x,))
        model = other()
        result = capture(model, inputs or (x,))
        assert not result.reused and len(captures) == 2
        torch.testing.assert_close(result.gm(*(inputs or (x,)))[0], model(*(inputs or (x,))), rtol=0, atol=0)
    # Outside a block nothing is kept.
    assert not capture(_Scaled(), (x,)).reused


def test_compile_reuses_a_capture_across_strategies_and_trains_like_a_fresh_one():
    data = zoo.batches("gpt", 2, 8)
    fresh = zoo.train_compiled(gp.compile(zoo.build("gpt"), example_inputs=data[0], strategy=gp.Strategy(zero=3, split=2)), data)
    with gp.reusing_captures():
        gp.compile(zoo.build("gpt"), example_inputs=data[0], strategy=gp.Strategy(recompute=True))
        dmodel = gp.compile(zoo.build("gpt"), example_inputs=data[0], strategy=gp.Strategy(zero=3, split=2))
    assert dmodel.capture_route == "export"
    torch.testing.assert_close(zoo.train_compiled(dmodel, data), fresh, rtol=0, atol=0)


class _ArgumentsNamedLikeBuiltins(nn.Module):
    """``input`` shadows a builtin, so fx names its node ``input_1``: the name of the next argument."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, input, input_1, id):  # noqa: A002 - the names under test
        return ((self.fc(input) - input_1) ** 2).mean() + id.mean()


@pytest.mark.parametrize("route", ["export", "symbolic_trace"])
def test_arguments_named_like_builtins_keep_their_order(route):
    torch.manual_seed(0)
    model = _ArgumentsNamedLikeBuiltins()
    inputs = (torch.randn(8, 4), torch.randn(8, 4), torch.randn(8))
    gm = capture(model, inputs, route=route).gm
    torch.testing.assert_close(gm(*inputs)[0], model(*inputs), rtol=0, atol=0)
    assert [n.target for n in gm.graph.find_nodes(op="placeholder")] == \
        [n.name for n in gm.graph.find_nodes(op="placeholder")]
