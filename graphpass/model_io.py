"""What a model takes and returns, brought to the form graphpass compiles: tensors in, the
scalar loss out.

graphpass captures ``forward(*tensors) -> loss``. Models as they ship take keyword batches and
return richer things: a Hugging Face causal LM takes ``model(**batch)`` with
``batch = {"input_ids": ..., "labels": ...}``, returns a ``ModelOutput`` whose ``loss`` is the
loss, and builds a generation cache unless told not to; nanoGPT returns ``(logits, loss)``; a
classifier returns logits and leaves the loss to the training loop. :func:`adapt` turns each of
these into a :class:`LossModule`, a view of the model (it shares the model's parameters, buffers
and submodules, so every ``state_dict`` key and module path stays the model's own) whose
``forward`` takes the batch's tensors positionally, named after the batch's keys (or the model's
own argument names), and returns the loss:

- ``example_inputs`` a dict: ``model(**batch)``; ``train_step(**batch)`` then takes the same keys;
- an output that is a ``ModelOutput`` / dict with a ``loss`` entry: that entry; a tuple or list
  with exactly one 0-dim floating tensor (nanoGPT's ``(logits, loss)``, Hugging Face's tuples
  when ``labels`` are given): that tensor;
- ``loss_fn`` given: ``loss_fn(model(*inputs[:-1]), inputs[-1])`` for a tuple batch (the last
  input is the target), ``loss_fn(model(**model_entries), **other_entries)`` for a dict batch
  (entries ``model.forward`` accepts go to the model, the rest to ``loss_fn`` by keyword);
- a forward that accepts ``use_cache`` (Hugging Face models) gets ``use_cache=False``: training
  needs no generation cache, and export cannot return one.

A model whose forward already takes positional tensors and returns the scalar loss is compiled as
it is (:func:`adapt` returns it unchanged).
"""

from __future__ import annotations

import inspect
import keyword
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

#: the attributes a :class:`LossModule` shares with the model it views
_SHARED = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


class Batch:
    """One batch as the user gives it: the tensors in order, and their keys for a dict batch."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], keys: tuple[str, ...] | None):
        self.tensors = tensors
        self.keys = keys

    @classmethod
    def of(cls, example_inputs: Any, what: str = "example_inputs") -> "Batch":
        """Check ``example_inputs`` (a tuple/list of tensors or a dict of tensors by keyword).

        Raises:
            TypeError: naming the offending position or key and its type.
        """
        if isinstance(example_inputs, torch.Tensor):
            raise TypeError(
                f"{what} must be a tuple of tensors (the model's positional arguments) or a dict of "
                f"tensors (its keyword arguments), got a single Tensor; write {what}=(x,)"
            )
        if isinstance(example_inputs, Mapping):
            keys = tuple(example_inputs)
            for key in keys:
                if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
                    raise TypeError(f"{what} keys must be argument names, got {key!r}")
                if not isinstance(example_inputs[key], torch.Tensor):
                    raise TypeError(
                        f"{what}[{key!r}] must be a torch.Tensor, got {type(example_inputs[key]).__name__}; "
                        "graphpass captures tensor arguments only (bind other arguments in the module)"
                    )
            return cls(tuple(example_inputs[k] for k in keys), keys)
        if not isinstance(example_inputs, (tuple, list)):
            raise TypeError(
                f"{what} must be a tuple of tensors or a dict of tensors, got {type(example_inputs).__name__}"
            )
        for i, value in enumerate(example_inputs):
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{what}[{i}] must be a torch.Tensor, got {type(value).__name__}; "
                    "graphpass captures tensor arguments only (bind other arguments in the module)"
                )
        return cls(tuple(example_inputs), None)


def order_call(keys: tuple[str, ...] | None, args: Sequence[Any], kwargs: Mapping[str, Any],
               names: Sequence[str]) -> tuple[Any, ...]:
    """A ``train_step`` / ``forward`` call's inputs in the order the program takes them: positional
    as given for a program compiled from a tuple batch, by key for one compiled from a dict.

    Raises:
        TypeError: keywords given to a positional program, positionals or other keys given to a
            keyword program (naming the keys missing and unexpected).
    """
    if keys is None:
        if kwargs:
            raise TypeError(
                f"this program was compiled with positional example_inputs ({', '.join(names)}); call it "
                f"with positional tensors, got keywords {sorted(kwargs)}"
            )
        return tuple(args)
    if args:
        raise TypeError(
            f"this program was compiled with example_inputs as a dict ({', '.join(keys)}); call it with "
            f"the same keys, e.g. train_step(**batch), got {len(args)} positional inputs"
        )
    missing = [k for k in keys if k not in kwargs]
    unexpected = [k for k in kwargs if k not in keys]
    if missing or unexpected:
        raise TypeError(
            f"this program takes the keys it was compiled with ({', '.join(keys)}): "
            + "; ".join(part for part in (f"missing {missing}" if missing else "",
                                          f"unexpected {unexpected}" if unexpected else "") if part)
        )
    return tuple(kwargs[k] for k in keys)


def _parameters(forward: Callable) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(forward).parameters)
    except (TypeError, ValueError):  # a builtin or C forward: nothing to learn
        return None


def _accepts(params: dict[str, inspect.Parameter] | None, name: str) -> bool:
    if params is None:
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _positional_names(params: dict[str, inspect.Parameter] | None, count: int, target: bool) -> list[str]:
    """Names for ``count`` positional inputs: the forward's own where it has them, ``target``
    for the last one when it goes to ``loss_fn``, ``arg<i>`` for others. (Not ``input_<i>``:
    torch.fx renames an input called ``input``, a builtin, to ``input_1``.)"""
    own = [p.name for p in (params or {}).values()
           if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    names = own[:count - 1 if target else count]
    used = set(names)
    for i in range(len(names), count):
        name = "target" if target and i == count - 1 else f"arg{i}"
        while name in used:
            name += "_"
        names.append(name)
        used.add(name)
    return names


def _check_required(model: nn.Module, params: dict[str, inspect.Parameter] | None, batch: Batch,
                    loss_fn: Callable | None) -> None:
    """Raise when the batch leaves out an argument ``model.forward`` requires (instead of
    export's "missing 1 required positional argument" under a capture error)."""
    if params is None:
        return
    required = [p for p in params.values() if p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if batch.keys is not None:
        missing = [p.name for p in required if p.name not in batch.keys]
    else:
        given = len(batch.tensors) - (1 if loss_fn is not None else 0)
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()):
            return
        missing = [p.name for p in required[given:]]
    if missing:
        raise TypeError(
            f"{type(model).__name__}.forward needs {missing}, which the batch does not give; add them to "
            "example_inputs" + (" (the last input goes to loss_fn)" if loss_fn is not None and batch.keys is None
                                else "")
        )


def needs_adapting(model: nn.Module, batch: Batch, loss_fn: Callable | None) -> bool:
    """Whether ``model`` must be viewed through a :class:`LossModule` (a dict batch, a
    ``loss_fn``, or a forward that would build a generation cache)."""
    return batch.keys is not None or loss_fn is not None or _accepts_cache(model)


def _accepts_cache(model: nn.Module) -> bool:
    params = _parameters(model.forward)
    return params is not None and "use_cache" in params


def adapt(model: nn.Module, batch: Batch, loss_fn: Callable | None = None, *, force: bool = False) -> nn.Module:
    """``model`` as graphpass captures it: ``forward(*batch.tensors) -> scalar loss``.

    Returns ``model`` itself when nothing needs adapting (and ``force`` is false), else a
    :class:`LossModule` viewing it.

    Raises:
        TypeError: ``loss_fn`` is not callable; a dict batch gives the model keys its forward does
            not take while there is no ``loss_fn`` to take them.
        ValueError: ``loss_fn`` with a one-tensor tuple batch (no target left for it).
    """
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (output, *targets) -> loss, got {type(loss_fn).__name__}")
    if not force and not needs_adapting(model, batch, loss_fn):
        _check_required(model, _parameters(model.forward), batch, None)
        return model
    return LossModule(model, batch, loss_fn)


class LossModule(nn.Module):
    """A view of ``model`` whose forward takes the batch's tensors positionally and returns the
    scalar loss (see the module docstring for how the loss is found). It holds no state of its
    own: parameters, buffers and submodules are the model's (the same dicts), so names, module
    paths and ``state_dict`` keys are the model's."""

    def __init__(self, model: nn.Module, batch: Batch, loss_fn: Callable | None):
        super().__init__()
        for name in _SHARED:
            object.__setattr__(self, name, getattr(model, name))
        self.training = model.training
        params = _parameters(model.forward)
        _check_required(model, params, batch, loss_fn)
        if batch.keys is not None:
            names = list(batch.keys)
            if loss_fn is None:
                model_keys = names
                unknown = [k for k in names if not _accepts(params, k)]
                if unknown:
                    raise TypeError(
                        f"{type(model).__name__}.forward takes no argument named {unknown}; drop these keys "
                        "from the batch, or pass compile(..., loss_fn=...) to receive them"
                    )
            else:
                model_keys = [k for k in names if _accepts(params, k)]
        else:
            names = _positional_names(params, len(batch.tensors), loss_fn is not None)
            model_keys = None
            if loss_fn is not None and len(names) < 2:
                raise ValueError(
                    "loss_fn takes the model's output and the last example input (the target); give "
                    "example_inputs=(inputs..., target)"
                )
        # Plain data, so that graphpass.reusing_captures compares two views by what they do (a
        # tuple holding the model is described by its type only; the model itself is compared
        # through the shared submodules and _gp_root).
        self._gp_call = (model, loss_fn)
        self._gp_names = tuple(names)
        self._gp_model_keys = tuple(model_keys) if model_keys is not None else None
        self._gp_cache_off = params is not None and "use_cache" in params and "use_cache" not in names
        self._gp_loss_fn = None if loss_fn is None else (getattr(loss_fn, "__qualname__", repr(loss_fn)), id(loss_fn))
        self.__class__ = _with_forward(tuple(names))

    @property
    def wrapped(self) -> nn.Module:
        """The model this view adapts."""
        return self._gp_call[0]

    def _gp_loss(self, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        model, loss_fn = self._gp_call
        by_name = dict(zip(self._gp_names, tensors))
        extra = {"use_cache": False} if self._gp_cache_off else {}
        if self._gp_model_keys is not None:  # a dict batch
            output = model(**{k: by_name[k] for k in self._gp_model_keys}, **extra)
            if loss_fn is not None:
                return self._checked(loss_fn(output, **{k: v for k, v in by_name.items()
                                                       if k not in self._gp_model_keys}), "loss_fn")
        elif loss_fn is not None:
            output = model(*tensors[:-1], **extra)
            return self._checked(loss_fn(output, tensors[-1]), "loss_fn")
        else:
            output = model(*tensors, **extra)
        return self._checked(loss_of(output, type(model).__name__), f"{type(model).__name__}.forward")

    @staticmethod
    def _checked(loss: Any, source: str) -> torch.Tensor:
        if not isinstance(loss, torch.Tensor):
            raise NoLoss(f"{source} must return the scalar loss tensor, got {type(loss).__name__}")
        return loss


_VIEWS: dict[tuple[str, ...], type] = {}


def _with_forward(names: tuple[str, ...]) -> type:
    """The :class:`LossModule` subclass whose ``forward`` takes ``names`` (capture names the
    graph's inputs after the forward's arguments); one class per tuple of names, so that two
    views with the same names are of one class."""
    if names not in _VIEWS:
        scope: dict[str, Any] = {}
        args = ", ".join(names)
        exec(  # noqa: S102 - names are checked identifiers; the body only forwards them
            f"def forward(self, {args}):\n    return self._gp_loss(({args},))\n", scope)
        _VIEWS[names] = type("LossModule", (LossModule,), {"forward": scope["forward"],
                                                           "__module__": LossModule.__module__})
    return _VIEWS[names]


class NoLoss(ValueError):
    """The model's output holds no loss graphpass can train on (the message says how to fix it)."""


def loss_of(output: Any, model_name: str) -> Any:
    """The loss in a forward's ``output``: itself when it is a tensor, the ``loss`` entry of a
    ``ModelOutput`` / dict, the one 0-dim floating tensor of a tuple or list.

    Raises:
        NoLoss: no loss in it (a ``loss`` entry that is None: no labels given), or several
            candidates, saying how to fix it.
    """
    if isinstance(output, torch.Tensor):
        return output
    fix = ("pass the labels in the batch (e.g. example_inputs={'input_ids': x, 'labels': y}) or give "
           "compile(..., loss_fn=lambda output, target: ...)")
    if isinstance(output, Mapping) or hasattr(output, "keys") and hasattr(output, "__getitem__"):
        loss = output.get("loss") if hasattr(output, "get") else None
        if loss is None:
            raise NoLoss(
                f"{model_name}.forward returned {type(output).__name__} without a loss "
                f"(its entries: {', '.join(map(str, output.keys()))}); {fix}"
            )
        return loss
    if isinstance(output, (tuple, list)):
        scalars = [i for i, v in enumerate(output)
                   if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()]
        if len(scalars) == 1:
            return output[scalars[0]]
        what = "no 0-dim loss" if not scalars else f"several 0-dim tensors (positions {scalars})"
        raise NoLoss(
            f"{model_name}.forward returned a {type(output).__name__} of {len(output)} with {what}; return "
            f"the loss alone, or {fix}"
        )
    raise NoLoss(f"{model_name}.forward returned a {type(output).__name__}, not a loss; {fix}")


__all__ = ["Batch", "LossModule", "NoLoss", "adapt", "loss_of", "needs_adapting", "order_call"]
