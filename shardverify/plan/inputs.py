"""A model's example inputs as the model wants them: the command line's ``--input`` grammar
(``ids=int64[4,8]:0..128``: a keyword input of dtype int64, shape [4, 8], values in [0, 128);
``64,128``: a positional float32 input, as before), keyword inputs passed to the model by name
(:class:`KeywordInputs`), and, when a model does not run on the inputs given, an error that names
the input, its shape and dtype, and what the layer it reached first wanted
(:func:`diagnose_inputs`), instead of torch's text about a graph node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shardverify.errors import InvalidArgument

__all__ = ["InputSpec", "parse_input", "draw_inputs", "KeywordInputs", "with_keywords", "InputError",
           "diagnose_inputs", "describe"]


class InputError(InvalidArgument):
    """An example input the model does not take (its shape or dtype), named with what was wanted."""


_GRAMMAR = re.compile(r"^(?:(?P<name>[A-Za-z_]\w*)=)?(?P<dtype>[a-z]+\d*)?\s*\[?(?P<shape>[\d,\s]+)\]?"
                      r"(?::(?P<low>-?[\d.]+)\.\.(?P<high>-?[\d.]+))?$")


@dataclass(frozen=True)
class InputSpec:
    """One example input: its forward argument name ("" for positional), shape, dtype and the
    range of its values (None: a float input from the standard normal)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    low: float | None = None
    high: float | None = None


def parse_input(text: str, flag: str = "--input", drawn: bool = True) -> InputSpec:
    """``[NAME=][DTYPE][SHAPE][:LOW..HIGH]``, e.g. ``64,128``, ``x=64,128``, ``ids=int64[4,8]:0..128``,
    ``mask=bool[4,8]``; anything else is an error naming the text, the ``flag`` and the grammar.
    ``drawn``: values will be drawn, so an integer input needs its range (``--cost-input``'s are
    only shapes and dtypes, captured on fake tensors)."""
    found = _GRAMMAR.match(text.strip())
    usage = (f"{flag} {text!r}: expected [NAME=][DTYPE][SHAPE][:LOW..HIGH] such as 64,128 or "
             "input_ids=int64[4,8]:0..128")
    if not found:
        raise InvalidArgument(usage)
    shape = tuple(int(s) for s in found["shape"].split(",") if s.strip())
    if not shape or any(size <= 0 for size in shape):
        raise InvalidArgument(usage + " (the shape's sizes are positive integers)")
    dtype = torch.float32
    if found["dtype"]:
        dtype = getattr(torch, found["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgument(f"{flag} {text!r}: {found['dtype']!r} is not a torch dtype (float32, int64, bool, ...)")
    low = None if found["low"] is None else float(found["low"])
    high = None if found["high"] is None else float(found["high"])
    if low is not None and not low < high:  # type: ignore[operator]
        raise InvalidArgument(f"{flag} {text!r}: the value range LOW..HIGH needs LOW < HIGH")
    if drawn and low is None and not (dtype.is_floating_point or dtype == torch.bool):
        raise InvalidArgument(f"{flag} {text!r}: an integer input needs its value range, e.g. "
                              f"{found['dtype']}[{','.join(map(str, shape))}]:0..128 (a vocabulary of 128)")
    return InputSpec(found["name"] or "", shape, dtype, low, high)


def draw_inputs(specs, gen: torch.Generator | None) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """(positional inputs, keyword inputs) drawn from ``gen`` as ``specs`` say; with ``gen`` None,
    zeros of their shapes and dtypes (a model built at its real size is only captured, on fake
    tensors: its inputs' values are never read)."""
    positional, keywords = [], {}
    for spec in specs:
        if gen is None:
            value = torch.zeros(spec.shape, dtype=spec.dtype)
        elif spec.dtype == torch.bool:
            value = torch.randint(0, 2, spec.shape, generator=gen).bool()
        elif spec.dtype.is_floating_point:
            value = torch.randn(spec.shape, generator=gen) if spec.low is None else \
                torch.rand(spec.shape, generator=gen) * (spec.high - spec.low) + spec.low
            value = value.to(spec.dtype)
        else:
            value = torch.randint(int(spec.low), int(spec.high), spec.shape, generator=gen, dtype=spec.dtype)
        if spec.name:
            if spec.name in keywords:
                raise InvalidArgument(f"--input names {spec.name!r} twice")
            keywords[spec.name] = value
        elif keywords:
            raise InvalidArgument("positional inputs (without NAME=) come before keyword inputs")
        else:
            positional.append(value)
    return tuple(positional), keywords


class KeywordInputs(torch.nn.Module):
    """The model called with its last inputs by keyword (an encoder-decoder's
    ``decoder_input_ids``): the plan check passes inputs by position, this passes them on by name."""

    def __init__(self, model: torch.nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.names = model, tuple(names)

    def forward(self, *inputs):
        count = len(inputs) - len(self.names)
        return self.model(*inputs[:count], **dict(zip(self.names, inputs[count:])))


def with_keywords(module: torch.nn.Module, example) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """``(module, inputs by position)`` for example inputs given as a tensor, a sequence, a mapping
    of keyword inputs, or a (sequence, mapping) pair."""
    if isinstance(example, torch.Tensor):
        return module, (example,)
    positional, keywords = (), {}
    if isinstance(example, Mapping):
        keywords = dict(example)
    elif isinstance(example, tuple) and len(example) == 2 and isinstance(example[1], Mapping):
        positional, keywords = tuple(example[0]), dict(example[1])
    else:
        positional = tuple(example)
    for name, value in [*((f"input {i}", v) for i, v in enumerate(positional)), *keywords.items()]:
        if not isinstance(value, torch.Tensor):
            raise InvalidArgument(f"example input {name!r} is a {type(value).__name__}, not a tensor")
    if not keywords:
        return module, positional
    return KeywordInputs(module, tuple(keywords)), (*positional, *keywords.values())


def describe(value: torch.Tensor) -> str:
    return f"shape {list(value.shape)}, {str(value.dtype).removeprefix('torch.')}"


def _wanted(module: torch.nn.Module) -> str:
    """What a layer takes, from its own attributes."""
    if isinstance(module, torch.nn.Linear):
        return f"shape [..., {module.in_features}]"
    if isinstance(module, torch.nn.Embedding):
        return f"integer ids (int64) in [0, {module.num_embeddings})"
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        dims = len(module.kernel_size)
        return f"shape [batch, {module.in_channels}{', ...' * dims}] ({dims} spatial dim(s))"
    if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
        return f"shape [..., {', '.join(map(str, module.normalized_shape))}]"
    return ""


def diagnose_inputs(module: torch.nn.Module, inputs: tuple) -> InputError | None:
    """Run the model once on ``inputs`` (a float64 copy, no gradient): if it raises, the error
    naming the innermost layer it was in, the input that reached it (if it is one of the model's
    inputs as given) and what the layer wanted; None if the model runs."""
    from shardverify.plan.recipe import as_float64, float64_copy

    model = float64_copy(module)
    values = [as_float64(x) for x in inputs]
    names = _input_names(module, len(values))
    entered: list[tuple[str, torch.nn.Module, tuple]] = []
    handles = []
    for qualname, sub in model.named_modules():
        def pre(m, args, qualname=qualname):
            entered.append((qualname, m, args))

        def post(m, args, out):
            entered.pop()
        handles += [sub.register_forward_pre_hook(pre), sub.register_forward_hook(post)]
    try:
        with torch.no_grad():
            model(*values)
    except Exception as error:  # noqa: BLE001 - what the model raised is the diagnosis
        text = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {text[0] if text else ''}"
        inner = [e for e in entered if e[0] and not isinstance(e[1], KeywordInputs)] or \
            [e for e in entered if _wanted(e[1])]
        given = ", ".join(f"{n!r} ({describe(v)})" for n, v in zip(names, inputs))
        if not inner:
            return InputError(f"{type(module).__name__} does not run on the inputs given ({given}): {reason}")
        qualname, layer, args = inner[-1]
        arg = next((a for a in args if isinstance(a, torch.Tensor)), None)
        which = next((n for n, v in zip(names, values) if arg is v), None)
        wanted = _wanted(layer)
        wants = f"{type(layer).__name__}, which wants {wanted}" if wanted else type(layer).__name__
        where = f"{qualname!r} ({wants})" if qualname else f"(the model itself: {wants})"
        if which is not None:
            original = inputs[names.index(which)]
            return InputError(f"input {which!r} ({describe(original)}) does not fit {type(module).__name__}: its "
                              f"first layer {where} raised {reason}")
        got = f" got {describe(arg)}" if arg is not None else ""
        return InputError(f"{type(module).__name__} does not run on the inputs given ({given}): layer {where}{got} "
                          f"and raised {reason}")
    finally:
        for handle in handles:
            handle.remove()
    return None


def _input_names(module: torch.nn.Module, count: int) -> list[str]:
    if isinstance(module, KeywordInputs):
        positional = count - len(module.names)
        return [*_input_names(module.model, positional), *module.names]
    try:
        from shardverify.capture.fx import forward_names

        return forward_names(module, count)
    except Exception:  # noqa: BLE001 - a forward without named parameters: numbered
        return [f"input {i}" for i in range(count)]
