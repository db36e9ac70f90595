"""One DTensor finding reproduced with torch alone: the fixed program every repro runs.

Run as a script, never imported by shardverify: ``torchrun --nproc-per-node N repro_runner.py
CASE.json`` (``shardverify dtensor --confirm``: one real gloo process per rank), or ``python
repro.py``, a repro script written for a bug report, which is this file with its case embedded
as a literal (:data:`EMBEDDED`; ``shardverify.features.dtensor.repro``). The case is data only (shapes,
integer values, dtypes, placements, each rank's block, the call's torch name and literal
arguments) and is validated field by field before anything is built: a case that does not
validate is said in one ``VERDICT`` line with status ``error`` (exit status 2), never run.

The program builds the op's inputs (random floating values from a fixed seed, integer operands
written out), computes the single-device result, places each input on DTensor exactly as the
finding did (each rank's block, a partial sum as random pieces summing to the value), runs the
same call on DTensor (under ``LocalTensorMode`` on a fake process group in one process, or on
real gloo processes under torchrun), and prints every rank's ``full_tensor()`` of every output
the finding checked against the reference, then the gradients of the same loss the finding took
(``sum(output_k * g_k)`` over every differentiable one of them), then its verdict: in words and
as a line ``VERDICT {json}`` (``ranks``, ``status``, ``detail``), its status one of right, wrong
(silently), late-failure (the op returned; full_tensor() or the backward raised), raises (the op
itself) or error (the inputs could not be built). Before each step it prints ``STAGE {json}``: a
process killed inside DTensor's collectives (gloo aborts with SIGABRT when ranks hand one
collective buffers of different sizes) is then known to have died there. Exit status 1 while
DTensor is not right, 0 once it is.
"""

import contextlib
import datetime
import json
import math
import operator
import os
import sys

import torch
import torch.distributed as dist

EMBEDDED = None   # a repro script written for a report holds its case here

FORMAT = "dtensor-repro-case"
VERSION = 1
MAX_CASE_BYTES = 64 * 1024 * 1024
_DTYPES = ("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32", "int16",
           "int8", "uint8", "bool")
_MEMORY_FORMATS = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")
#: torch modules whose functions touch files, processes or the network: never a case's call
_NEVER = ("torch.serialization", "torch.hub", "torch.utils", "torch.storage", "torch.package",
          "torch.multiprocessing", "torch.distributed", "torch._dynamo", "torch.compiler")


class BadCase(ValueError):
    """A field of the case that does not validate (said in one line, nothing run)."""


def _need(ok, where, what):
    if not ok:
        raise BadCase(f"{where}: expected {what}")


def _int(value, where, low=0):
    _need(type(value) is int and value >= low, where, f"an integer >= {low}")
    return value


def _ints(value, where, low=0):
    _need(isinstance(value, list) and len(value) <= 64, where, "a list of at most 64 integers")
    return [_int(v, f"{where}[{i}]", low) for i, v in enumerate(value)]


def _name(value, where):
    _need(isinstance(value, str) and value.isidentifier() and not value.startswith("_") and len(value) <= 100,
          where, "a name of letters, digits and '_' (not starting with '_')")
    return value


def _numbers(value, where, depth=0):
    """A nested list of numbers (an operand's values written out: integers, booleans, or a
    running statistic's finite floats)."""
    _need(depth <= 8, where, "at most 8 nested lists")
    if isinstance(value, list):
        return [_numbers(v, where, depth + 1) for v in value]
    _need(type(value) in (int, bool) or (type(value) is float and math.isfinite(value)), where,
          "integers, booleans or finite numbers")
    return value


def _fits(values, shape):
    """Whether nested lists ``values`` have the dims ``shape``."""
    if not shape:
        return not isinstance(values, list)
    return isinstance(values, list) and len(values) == shape[0] and all(_fits(v, shape[1:]) for v in values)


def _value(value, where, roles, depth=0):
    """An argument of the call: a JSON scalar, a list, or one tagged object ({"tensor": role},
    {"dtype": name}, {"device": "cpu"}, {"memory_format": name}, {"float": "inf"},
    {"tuple": [...]}, {"dict": [[key, value], ...]})."""
    _need(depth <= 8, where, "at most 8 nested values")
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        _need(math.isfinite(value), where, "a finite number")
        return value
    if isinstance(value, list):
        return [_value(v, f"{where}[{i}]", roles, depth + 1) for i, v in enumerate(value)]
    _need(isinstance(value, dict) and len(value) == 1, where, "a value or an object with one tag")
    (tag, item), = value.items()
    if tag == "tensor":
        _need(item in roles, where, f"the name of an input ({sorted(roles)})")
        return roles[item]
    if tag == "dtype":
        _need(item in _DTYPES, where, f"a dtype of {_DTYPES}")
        return getattr(torch, item)
    if tag == "device":
        _need(item == "cpu", where, "the device 'cpu'")
        return torch.device("cpu")
    if tag == "memory_format":
        _need(item in _MEMORY_FORMATS, where, f"a memory format of {_MEMORY_FORMATS}")
        return getattr(torch, item)
    if tag == "float":
        _need(item in ("inf", "-inf", "nan"), where, "'inf', '-inf' or 'nan'")
        return float(item)
    if tag == "tuple":
        _need(isinstance(item, list), where, "a list")
        return tuple(_value(v, f"{where}[{i}]", roles, depth + 1) for i, v in enumerate(item))
    if tag == "dict":
        _need(isinstance(item, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                             for p in item), where, "a list of [name, value] pairs")
        return {k: _value(v, f"{where}[{k!r}]", roles, depth + 1) for k, v in item}
    raise BadCase(f"{where}: unknown tag {str(tag)[:40]!r}")


class _Input:
    """A name standing for an input tensor in the decoded call (resolved per world below)."""

    def __init__(self, role):
        self.role = role


def _callable(target, where):
    """The torch (or operator) function a dotted name reaches by attribute, importing nothing,
    never one of torch's file, process or network functions."""
    _need(isinstance(target, str) and len(target) <= 200, where, "a dotted name")
    parts = target.split(".")
    _need(parts[0] in ("torch", "operator") and all(p.isidentifier() and not p.startswith("__") for p in parts),
          where, "a dotted name under torch or operator")
    obj = torch if parts[0] == "torch" else operator
    for part in parts[1:]:
        _need(hasattr(obj, part), where, f"a name that resolves ({part!r} missing)")
        obj = getattr(obj, part)
    module = getattr(obj, "__module__", None) or ""
    overload = isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
    _need(callable(obj) and (overload or module in ("operator", "_operator") or (
        module.split(".")[0] == "torch" and not any(module == m or module.startswith(m + ".") for m in _NEVER))),
        where, "a tensor function of torch or operator")
    if overload:
        for schema in ([obj._schema] if isinstance(obj, torch._ops.OpOverload)
                       else [getattr(obj, o)._schema for o in obj.overloads()]):
            _need(not any(a.name in ("filename", "file", "path", "f") for a in schema.arguments), where,
                  "an op that takes no file name")
    return obj


def _module(spec, where):
    """A torch.nn module class and its literal arguments, built later (after the inputs are
    drawn: building it draws its own parameters from the same generator)."""
    _need(isinstance(spec, dict) and set(spec) == {"class", "args", "kwargs"}, where,
          "an object with 'class', 'args' and 'kwargs'")
    name = _name(spec["class"], f"{where}.class")
    cls = getattr(torch.nn, name, None)
    _need(isinstance(cls, type) and issubclass(cls, torch.nn.Module) and cls.__module__.startswith("torch.nn."),
          f"{where}.class", "a torch.nn module class")
    args = _value(spec["args"], f"{where}.args", {})
    kwargs = _value({"dict": spec["kwargs"]}, f"{where}.kwargs", {})
    _need(isinstance(args, list), f"{where}.args", "a list")
    return cls, args, kwargs


def checked(case):
    """The case with every field validated and decoded; BadCase naming the first field that is not."""
    _need(isinstance(case, dict), "the case", "a JSON object")
    _need(case.get("format") == FORMAT and case.get("version") == VERSION, "format/version",
          f"{FORMAT!r} version {VERSION}")
    known = {"format", "version", "mesh", "inputs", "call", "out", "operands"}
    _need(set(case) == known, "the case", f"exactly the fields {sorted(known)}")
    mesh = _ints(case["mesh"], "mesh", 1)
    _need(1 <= len(mesh) <= 4 and math.prod(mesh) <= 64, "mesh", "1 to 4 axes and at most 64 ranks")
    world = math.prod(mesh)
    _need(isinstance(case["inputs"], list) and case["inputs"], "inputs", "a non-empty list")
    inputs, roles = [], {}
    for i, item in enumerate(case["inputs"]):
        where = f"inputs[{i}]"
        _need(isinstance(item, dict) and set(item) == {"role", "shape", "dtype", "values", "grad"}, where,
              "an object with role, shape, dtype, values, grad")
        role = _name(item["role"], f"{where}.role")
        _need(role not in roles, f"{where}.role", "a name no other input has")
        shape = _ints(item["shape"], f"{where}.shape")
        _need(math.prod(shape) <= 1 << 24, f"{where}.shape", "at most 2**24 elements")
        _need(item["dtype"] in _DTYPES, f"{where}.dtype", f"one of {_DTYPES}")
        _need(type(item["grad"]) is bool, f"{where}.grad", "true or false")
        values = None if item["values"] is None else _numbers(item["values"], f"{where}.values")
        _need(values is None or _fits(values, shape), f"{where}.values", f"nested lists of shape {shape}")
        _need(values is not None or item["dtype"] == "float64", f"{where}.values",
              "values, unless the input is drawn (float64)")
        roles[role] = _Input(role)
        inputs.append({"role": role, "shape": shape, "dtype": item["dtype"], "values": values, "grad": item["grad"]})
    call = case["call"]
    _need(isinstance(call, dict) and set(call) == {"kind", "target", "args", "kwargs", "params"}, "call",
          "an object with kind, target, args, kwargs, params")
    _need(call["kind"] in ("function", "method", "module"), "call.kind", "function, method or module")
    if call["kind"] == "function":
        target = _callable(call["target"], "call.target")
    elif call["kind"] == "method":
        target = _name(call["target"], "call.target")
        _need(hasattr(torch.Tensor, target), "call.target", "a torch.Tensor method")
    else:
        target = _module(call["target"], "call.target")
    args = _value(call["args"], "call.args", roles)
    _need(isinstance(args, list), "call.args", "a list")
    kwargs = _value({"dict": call["kwargs"]}, "call.kwargs", roles)
    params = _value({"dict": call["params"]}, "call.params", roles)
    _need(call["kind"] == "module" or not params, "call.params", "none unless a module is called")
    out = _ints(case["out"], "out")
    _need(isinstance(case["operands"], list) and len(case["operands"]) == len(inputs), "operands",
          "one entry per input")
    operands = []
    for i, (item, spec) in enumerate(zip(case["operands"], inputs)):
        where = f"operands[{i}]"
        _need(isinstance(item, dict) and set(item) == {"blocks", "partial", "placements"}, where,
              "an object with blocks, partial, placements")
        blocks = item["blocks"]
        _need(isinstance(blocks, list) and len(blocks) == world, f"{where}.blocks", f"{world} ranks' blocks")
        slices = []
        for r, block in enumerate(blocks):
            _need(isinstance(block, list) and len(block) == len(spec["shape"]), f"{where}.blocks[{r}]",
                  f"{len(spec['shape'])} [start, stop] pairs")
            _need(all(isinstance(pair, list) and len(pair) == 2 and
                      all(b is None or (type(b) is int and b >= 0) for b in pair) for pair in block),
                  f"{where}.blocks[{r}]", "[start, stop] pairs of integers >= 0 or null")
            slices.append(tuple(slice(*pair) for pair in block))
        partial = item["partial"]
        if partial is not None:
            _need(isinstance(partial, dict) and set(partial) == {"count", "seed", "index"}, f"{where}.partial",
                  "null or an object with count, seed, index")
            count = _int(partial["count"], f"{where}.partial.count", 1)
            _int(partial["seed"], f"{where}.partial.seed")
            index = _ints(partial["index"], f"{where}.partial.index")
            _need(len(index) == world and all(k < count for k in index), f"{where}.partial.index",
                  f"one piece below {count} per rank")
        placements = item["placements"]
        _need(isinstance(placements, list) and len(placements) == len(mesh), f"{where}.placements",
              f"{len(mesh)} placements")
        built = [_placement(p, f"{where}.placements[{a}]") for a, p in enumerate(placements)]
        operands.append({"slices": slices, "partial": partial, "placements": built})
    return {"mesh": tuple(mesh), "world": world, "inputs": inputs, "kind": call["kind"], "target": target,
            "args": args, "kwargs": kwargs, "params": params, "out": tuple(out), "operands": operands}


def _placement(item, where):
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    _need(isinstance(item, list) and item and item[0] in ("R", "S", "SS", "P"), where,
          "['R'], ['S', dim], ['SS', dim, split_factor] or ['P', reduce]")
    if item[0] == "R":
        _need(len(item) == 1, where, "['R']")
        return Replicate()
    if item[0] == "S":
        _need(len(item) == 2, where, "['S', dim]")
        return Shard(_int(item[1], where))
    if item[0] == "SS":
        _need(len(item) == 3, where, "['SS', dim, split_factor]")
        return _StridedShard(_int(item[1], where), split_factor=_int(item[2], where, 1))
    _need(len(item) == 2 and item[1] in ("sum", "avg", "max", "min", "product"), where, "['P', reduce]")
    return Partial(item[1])


def load_case():
    """The embedded case, else the JSON file named by the first argument (a regular file, bounded)."""
    if EMBEDDED is not None:
        return EMBEDDED
    if len(sys.argv) != 2:
        raise BadCase("usage: repro_runner.py CASE.json")
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        import stat

        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise BadCase(f"{sys.argv[1]}: not a regular file")
        data = handle.read(MAX_CASE_BYTES + 1)
    if len(data) > MAX_CASE_BYTES:
        raise BadCase(f"{sys.argv[1]}: over {MAX_CASE_BYTES} bytes")
    return json.loads(data)


def say(line):
    """One write per line: the processes share torchrun's pipe, unbuffered (print writes its text
    and its newline apart, and another process's line could land between)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def said(exc):
    return f"{type(exc).__name__}: {str(exc).strip()[:300]}"


def pieces(value, count, seed):
    """count random pieces summing to value: each rank's contribution to a partial sum"""
    noise = torch.randn((count, *value.shape), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    scale = float(value.abs().mean()) / count if value.numel() else 1.0
    return (noise - noise.mean(dim=0, keepdim=True)) * (scale or 1.0) + value / count


def _bind(value, tensors):
    """The decoded argument with each input name replaced by this world's tensor of it."""
    if isinstance(value, _Input):
        return tensors[value.role]
    if isinstance(value, list):
        return [_bind(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_bind(v, tensors) for v in value)
    if isinstance(value, dict):
        return {k: _bind(v, tensors) for k, v in value.items()}
    return value


def call(case, tensors):
    """The finding's call on ``tensors`` (input name -> tensor)."""
    args, kwargs = _bind(case["args"], tensors), _bind(case["kwargs"], tensors)
    if case["kind"] == "function":
        return case["target"](*args, **kwargs)
    if case["kind"] == "method":
        return getattr(args[0], case["target"])(*args[1:], **kwargs)
    return torch.func.functional_call(case["target"], _bind(case["params"], tensors), tuple(args), kwargs)


def reference(case):
    """The case's inputs (random floating values from seed 0, the others written out), the module
    built for a module call, and the single-device result: (case, values by role, the roles that
    take a gradient, the outputs the finding checked, their loss weights g_k (None where an
    output takes no gradient), the inputs' gradients)."""
    torch.manual_seed(0)
    values = {}
    for item in case["inputs"]:
        if item["values"] is None:
            values[item["role"]] = torch.randn(tuple(item["shape"]), dtype=torch.float64)
        else:
            values[item["role"]] = torch.tensor(item["values"], dtype=getattr(torch, item["dtype"])).reshape(
                tuple(item["shape"]))
    if case["kind"] == "module":
        cls, args, kwargs = case["target"]
        case = {**case, "target": cls(*args, **kwargs)}
    floating = [item["role"] for item in case["inputs"] if item["grad"]]
    leaves = [values[r].requires_grad_() for r in floating]
    expected = picked(call(case, values), case["out"])
    # the loss is sum(output_k * g_k) over every differentiable output, as in the finding: which
    # outputs get a gradient picks autograd's backward formula (native_group_norm's mean and rstd
    # take it to a composite backward of its own, the output alone to native_group_norm_backward)
    gs = [torch.randn(e.shape, dtype=torch.float64) if e.is_floating_point() and e.requires_grad else None
          for e in expected]
    wanted = [(e, g) for e, g in zip(expected, gs) if g is not None]
    expected_grads = (torch.autograd.grad([e for e, _ in wanted], leaves, [g for _, g in wanted], allow_unused=True)
                      if leaves and wanted else ())
    return case, values, floating, expected, gs, expected_grads


def picked(result, out):
    """the outputs the finding checked: of a tuple, its elements OUT"""
    results = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    return [results[k] for k in out]


def local_blocks(case, values):
    """Each rank's local block of each input (of its own piece, for a partial sum), by role."""
    local = {}
    for item, operand in zip(case["inputs"], case["operands"]):
        role, own = item["role"], values[item["role"]].detach()
        partial = operand["partial"]
        parts = pieces(own, partial["count"], partial["seed"]) if partial is not None else None
        local[role] = {r: (parts[partial["index"][r]] if parts is not None else own)[operand["slices"][r]].clone()
                       for r in range(case["world"])}
    return local


class World:
    """The ranks this run has: every rank in this process (LocalTensorMode on a fake process group),
    or, started by torchrun, this process's own on real gloo processes."""

    def __init__(self, size):
        from torch.distributed._local_tensor import LocalTensorMode
        from torch.testing._internal.distributed.fake_pg import FakeStore

        self.size = size
        self.real = "RANK" in os.environ   # started by torchrun: one real gloo process per rank
        if self.real:   # a rank left waiting in a collective fails after a minute instead of hanging
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
            self.mode = contextlib.nullcontext()
        else:
            dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
            self.mode = LocalTensorMode(size)

    def ranks(self):
        return [dist.get_rank()] if self.real else list(range(self.size))

    def place(self, per_rank):
        """This world's local tensor: every rank's block at once, or this process's own."""
        from torch.distributed._local_tensor import LocalTensor

        return per_rank[dist.get_rank()] if self.real else LocalTensor(per_rank)

    def ranks_of(self, t):
        """Every rank's value this process sees."""
        return {dist.get_rank(): t} if self.real else dict(t._local_tensors)

    def check(self, what, t, want):
        """Prints every rank's value of t against want; the first wrong one said, or ""."""
        first = ""
        for rank, got in sorted(self.ranks_of(t).items()):
            ok = got.shape == want.shape and (torch.allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)
                                              if want.is_floating_point() else torch.equal(got, want))
            error = ("" if ok else f"max abs error {(got.double() - want.double()).abs().nan_to_num(float('inf')).max():.3g}"
                     if got.shape == want.shape else f"expected shape {tuple(want.shape)}")
            say(f"rank {rank}: {what} shape {tuple(got.shape)}, " + ("matches" if ok else f"WRONG ({error})"))
            first = first or ("" if ok else f"{what} on rank {rank}: {error}")
        return first

    def stage(self, what):
        """Said before each step: where a process that gloo kills (SIGABRT) died."""
        say("STAGE " + json.dumps({"ranks": self.ranks(), "stage": what}))


def main(case):
    OUT = case["out"]
    case, values, floating, expected, gs, expected_grads = reference(case)
    local = local_blocks(case, values)
    world = World(case["world"])
    # the verdict: right | wrong (silently) | late-failure (the op returned; full_tensor() or the
    # backward raised) | raises (the op itself) | error (the inputs could not be built)
    with world.mode:
        status, detail = on_dtensor(world, case, values, local, expected, gs, expected_grads, floating, OUT)
    ranks = world.ranks()
    say(f"verdict of rank(s) {ranks}: DTensor is {status}" + (f": {detail}" if detail else ""))
    say("VERDICT " + json.dumps({"ranks": ranks, "status": status, "detail": detail}))
    if world.real:
        try:
            dist.barrier()   # every rank has printed before one exits (torchrun stops the rest)
        except Exception as exc:   # a rank that raised elsewhere never reaches it
            say(f"rank {dist.get_rank()}: the closing barrier fails: {said(exc)}")
    dist.destroy_process_group()
    return 0 if status == "right" else 1


def on_dtensor(world, case, values, local, expected, gs, expected_grads, floating, OUT):
    """The same call on DTensor, each input placed as the finding placed it: (status, detail)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    try:
        mesh = init_device_mesh("cpu", case["mesh"])
        dtensors = {}
        for item, operand in zip(case["inputs"], case["operands"]):
            role = item["role"]
            dtensors[role] = DTensor.from_local(world.place(local[role]), mesh, operand["placements"], run_check=False,
                                                shape=values[role].shape, stride=values[role].stride())
            if item["grad"]:
                dtensors[role] = dtensors[role].detach().requires_grad_()
    except Exception as exc:
        return "error", f"the DTensor inputs cannot be built: {said(exc)}"
    try:
        world.stage("the op")
        out = call(case, dtensors)
    except Exception as exc:
        return "raises", f"the op raises {said(exc)}"
    outs = picked(out, OUT)
    status, detail = "right", "the script stopped before its verdict"
    for k, (out, want) in zip(OUT, zip(outs, expected)):
        name = "output" if len(OUT) == 1 else f"output {k}"
        if status != "right":
            break
        say(f"DTensor {name} placements: {out.placements} global shape: {tuple(out.shape)}")
        try:
            world.stage("full_tensor() of the output")   # one stage name for every output: confirm knows it
            detail = world.check(name, out.full_tensor(), want.detach())
            status = "wrong" if detail else "right"
        except Exception as exc:   # the output's metadata does not fit what the ranks hold
            status, detail = "late-failure", f"full_tensor() of the {name} raises {said(exc)}"
    if status == "right" and expected_grads:
        try:
            world.stage("the backward")
            sum((out.redistribute(mesh, [Replicate()] * mesh.ndim) * DTensor.from_local(
                world.place({r: g for r in range(world.size)}), mesh, [Replicate()] * mesh.ndim,
                run_check=False)).sum() for out, g in zip(outs, gs) if g is not None and out.requires_grad).backward()
            for name, want in zip(floating, expected_grads):
                leaf = dtensors[name]
                if want is not None and status == "right":
                    detail = (f"no gradient of {name}" if leaf.grad is None else
                              world.check(f"gradient of {name}", leaf.grad.full_tensor(), want))
                    status = "wrong" if detail else "right"
        except Exception as exc:
            status, detail = "late-failure", f"the backward or a gradient's full_tensor() raises {said(exc)}"
    return status, detail


def refuse(error):
    """A case that does not validate: one verdict line, status error, nothing run."""
    rank = os.environ.get("RANK", "0")
    detail = f"the case does not validate: {str(error)[:300]}"
    say(f"verdict of rank(s) [{rank if rank.isdigit() else 0}]: DTensor is error: {detail}")
    say("VERDICT " + json.dumps({"ranks": [int(rank) if rank.isdigit() else 0], "status": "error", "detail": detail}))
    return 2


if __name__ == "__main__":
    try:
        CASE = checked(load_case())
    except (BadCase, OSError, ValueError, RecursionError) as error:
        raise SystemExit(refuse(error))
    raise SystemExit(main(CASE))
