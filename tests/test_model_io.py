"""Models as they ship (graphpass.model_io): Hugging Face models called with a keyword batch and
returning a ``ModelOutput``, nanoGPT's ``(logits, loss)``, a model returning its output with
``compile(loss_fn=...)``; on 2 gloo ranks against one process, and the errors of the ways in.

Tolerances: as tests/test_dp.py (rtol 1e-5 / atol 1e-6: data parallel reduces the batch in
another order than one process, fp32 rounding; SGD with momentum over 3 steps keeps it there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpass as gp
import zoo

RTOL, ATOL = 1e-5, 1e-6
HF = ("hf_llama", "hf_gpt2", "hf_t5")


class NanoGPTStyle(nn.Module):
    """nanoGPT's contract: ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(zoo.VOCAB, 32)
        self.block = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.lm_head = nn.Linear(32, zoo.VOCAB, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        logits = self.lm_head(x + self.block(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def _case(name: str):
    """(model, batches, loss_fn, one-process loss of a batch) of each way in."""
    torch.manual_seed(0)
    if name in HF:
        model = zoo.build(name).model  # the Hugging Face model itself, not a wrapper
        batches = [{"input_ids": x, "labels": y} for x, y in zoo.batches(name, 3)]
        return model, batches, None, lambda m, b: m(**b).loss
    if name == "nanogpt":
        return NanoGPTStyle(), zoo.batches("gpt", 3), None, lambda m, b: m(*b)[1]
    if name == "loss_fn":  # a regressor returning its output; the loss is the training loop's
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(3)]
        return model, batches, F.mse_loss, lambda m, b: F.mse_loss(m(b[0]), b[1])
    if name == "bert_3_labels":  # a classifier whose 3 labels tp=2 does not divide
        import transformers

        config = transformers.BertConfig(
            vocab_size=zoo.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=zoo.SEQ, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertForSequenceClassification(config)
        g = torch.Generator().manual_seed(1)
        batches = [{"input_ids": torch.randint(0, zoo.VOCAB, (8, zoo.SEQ), generator=g),
                    "attention_mask": torch.ones(8, zoo.SEQ, dtype=torch.long),
                    "labels": torch.randint(0, 3, (8,), generator=g)} for _ in range(3)]
        return model, batches, None, lambda m, b: m(**b).loss
    if name == "gpt2_odd_vocab":  # GPT-2's 50257 tokens in small: a vocabulary tp=2 does not divide
        import transformers

        config = transformers.GPT2Config(vocab_size=zoo.VOCAB + 1, n_positions=zoo.SEQ, n_embd=32, n_layer=2,
                                         n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
        batches = [{"input_ids": x, "labels": x} for x, _ in zoo.batches("gpt", 3)]
        return model, batches, None, lambda m, b: m(**b).loss
    raise KeyError(name)


def _call(fn, batch):
    return fn(**batch) if isinstance(batch, dict) else fn(*batch)


def _reference(name: str):
    model, batches, _, loss_of = _case(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for batch in batches:
        loss = loss_of(model, batch)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(name: str, strategy: gp.Strategy | None = None):
    model, batches, loss_fn, _ = _case(name)
    dmodel = gp.compile(model, gp.Cluster.local(), example_inputs=batches[0], loss_fn=loss_fn,
                        strategy=strategy or gp.Strategy(dp=torch.distributed.get_world_size()))
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for batch in batches:
        losses.append(_call(dmodel.train_step, batch).item())
        opt.step()
        opt.zero_grad()
    return losses, dmodel.full_state_dict()


@pytest.mark.timeout(600)
def test_models_as_they_ship_train_as_one_process_on_two_ranks(rank_pool):
    pool = rank_pool(2)
    for name in HF + ("nanogpt", "loss_fn"):
        ref_losses, ref_state = _reference(name)
        for rank, (losses, state) in enumerate(pool.run(_train, name, timeout_s=300)):
            zoo.assert_matches_reference(f"{name} rank {rank}/2", losses, state, ref_losses, ref_state,
                                         rtol=RTOL, atol=ATOL)


@pytest.mark.timeout(600)
def test_a_vocabulary_or_label_count_tp_does_not_divide_stays_whole_under_tp(rank_pool):
    # Megatron's layout shards the logits and the token embedding by vocabulary; 3 labels or an
    # odd vocabulary do not divide by tp=2, so they stay replicated (every rank computes whole
    # logits) instead of failing the Strategy. Tolerances: tp only reorders fp32 additions
    # (tests/test_tensor_parallel.py's RTOL/ATOL).
    pool = rank_pool(2)
    for name in ("bert_3_labels", "gpt2_odd_vocab"):
        ref_losses, ref_state = _reference(name)
        for rank, (losses, state) in enumerate(pool.run(_train, name, gp.Strategy(tp=2), timeout_s=300)):
            zoo.assert_matches_reference(f"{name} tp rank {rank}/2", losses, state, ref_losses, ref_state,
                                         rtol=RTOL, atol=ATOL)


def test_a_keyword_batch_names_the_graph_inputs_and_train_step_takes_the_same_keys():
    model, batches, _, loss_of = _case("hf_llama")
    expected = loss_of(model, batches[0]).item()
    dmodel = gp.compile(model, example_inputs=batches[0], strategy=gp.Strategy())
    assert [n.name for n in dmodel.graph_module.graph.nodes if n.op == "placeholder"] == ["input_ids", "labels"]
    assert dmodel.train_step(**batches[0]).item() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(TypeError, match=r"compiled with example_inputs as a dict \(input_ids, labels\)"):
        dmodel.train_step(*batches[0].values())
    with pytest.raises(TypeError, match=r"missing \['labels'\]; unexpected \['label'\]"):
        dmodel.train_step(input_ids=batches[0]["input_ids"], label=batches[0]["labels"])


def test_calling_backward_on_the_evaluation_loss_says_to_call_train_step():
    model, batches, _, _ = _case("nanogpt")
    dmodel = gp.compile(model, example_inputs=batches[0], strategy=gp.Strategy())
    loss = dmodel(*batches[0])
    assert loss.item() == pytest.approx(dmodel.train_step(*batches[0]).item(), rel=1e-6)
    with pytest.raises(RuntimeError, match=r"dmodel.train_step\(\*batch\)"):
        loss.backward()
    with torch.no_grad():
        assert not dmodel(*batches[0]).requires_grad


@pytest.mark.parametrize("kind, error, message", [
    ("no labels", ValueError, r"LlamaForCausalLM.forward returned CausalLMOutputWithPast without a loss "
                              r"\(its entries: logits\); pass the labels in the batch"),
    ("unknown key", TypeError, r"NanoGPTStyle.forward takes no argument named \['labels'\]; drop these keys"),
    ("logits only", ValueError, r"Sequential.forward must return the scalar loss .* loss_fn="),
    ("loss_fn, one input", TypeError, r"Sequential.forward needs \['input'\].*the last input goes to loss_fn"),
    ("not a tensor", TypeError, r"example_inputs\['labels'\] must be a torch.Tensor, got list"),
])
def test_a_forward_without_a_loss_says_how_to_give_one(kind, error, message):
    model, batches, _, _ = _case("hf_llama")
    x = batches[0]["input_ids"]
    if kind == "no labels":
        inputs, kwargs = {"input_ids": x}, {}
    elif kind == "unknown key":
        model, inputs, kwargs = NanoGPTStyle(), {"idx": x, "labels": x}, {}
    elif kind == "logits only":
        model, inputs, kwargs = nn.Sequential(nn.Linear(4, 2)), (torch.randn(8, 4),), {}
    elif kind == "loss_fn, one input":
        model, inputs, kwargs = nn.Sequential(nn.Linear(4, 2)), (torch.randn(8, 4),), {"loss_fn": F.mse_loss}
    else:
        inputs, kwargs = {"input_ids": x, "labels": x.tolist()}, {}
    with pytest.raises(error, match=message):
        gp.compile(model, example_inputs=inputs, strategy=gp.Strategy(), **kwargs)
