"""The operations that read a whole dimension, and the size of that dimension on each side.

TP code shards a dimension and runs the model's own code on each rank's part of it. Code between
modules (and a module's own code on its sharded parameters) is right on a shard only when it is
elementwise along that dimension. A reduction over it (mean, std, softmax, top-k, a norm) or a split
of it (`chunk(2)` of a packed [gate; up]) computes on the shard something other than its part of
the dense result, silently: the diagnosis names it (verdict/mechanisms.py `op_on_shard`).

During the first forward of step 1 (training or forward only), the dense and the TP forwards
each run under a `torch.overrides.TorchFunctionMode` (outside the decisions' mode, decisions.py,
which must see the model's own calls first) that notes, for every such operation with an explicit
dimension, where it ran (the module whose code called it, the source file and line) and the size
of that dimension in its input. Both sides run the same source where the TP code is the dense
model's own code sharded by a plan (transformers, DTensor plans, torchtitan), so an operation at
the same place and module whose dimension is smaller on the TP side runs on a shard. Operations on
DTensors see global shapes, the same as the dense side's: those are DTensor's to get right.

What differs is only a record: the rank sends it (`RankPayload.shard_ops`), and the diagnosis uses
it where the first divergence is a mismatch at a module that holds or calls such an operation.
Correct TP code runs such operations too (a packed_colwise shard split into its halves, a
vocab-parallel cross-entropy's local max before its all-reduce): the record alone is no failure.

The same mode notes the code's path (`OpSizes.sites`): every line of the code under test that
called a torch operation in that forward, with the operation and its module, in call order. Rank 0
sends both sides' (`RankPayload.code_paths`); a case's float64 run sends its own, and a line that
ran in the working dtype but not in float64 is code the float64 run never checked (a branch on
`x.dtype`, a kernel chosen by dtype: checker/verdict/code_path.py). And for each split, the sizes
of the parts it made and the module whose output it split (forward hooks, `OpSizes.watch`): where
that module's weight is sharded as one block along the parts (`packed`, with the plan), the
diagnosis names the weight (verdict/mechanisms.py `packed_shard`).
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tpcheck.checker.rank.capture import named_modules
from tpcheck.checker.sourcelines import caller, frame_kind

# operation name -> (position of its dimension argument, the input counted, default dimension):
# the default None means "no dimension given: the whole tensor", which is not recorded
_REDUCE = (
    "sum mean nansum nanmean std var std_mean var_mean amax amin logsumexp prod argmax argmin "
    "max min all any cumsum cumprod softmax log_softmax median count_nonzero"
).split()
DIM_ARG: dict[str, tuple[int, int | None]] = {
    **dict.fromkeys(_REDUCE, (1, None)),
    "sort": (1, -1),
    "argsort": (1, -1),
    "topk": (2, -1),
    "normalize": (2, 1),
    "norm": (2, None),
    "vector_norm": (2, None),
    "chunk": (2, 0),
    "split": (2, 0),
    "tensor_split": (2, 0),
}
SPLITS = frozenset({"chunk", "split", "tensor_split"})
MAX_RECORDS = 4096  # per side: a bound on what one forward may note
MAX_SENT = 32  # differing operations a rank sends
MAX_SITES = 8192  # per side: the lines of one forward's path noted


def _dims(name: str, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    """The dimensions operation `name` reads whole in `args[0]`, or None (none given, or a form
    that reads none: `max(a, b)` elementwise)."""
    position, default = DIM_ARG[name]
    if "dim" in kwargs:
        dim = kwargs["dim"]
    elif len(args) > position:
        dim = args[position]
        if name in ("std", "var", "std_mean", "var_mean") and isinstance(dim, bool):
            dim = default  # the old positional `unbiased`
    else:
        dim = default
    if isinstance(dim, bool) or dim is None:
        return None
    dims = (dim,) if isinstance(dim, int) else tuple(dim) if isinstance(dim, (tuple, list)) else ()
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return None
    ndim = args[0].dim()
    if ndim == 0 or not all(-ndim <= d < ndim for d in dims):
        return None
    return tuple(d % ndim for d in dims)


class OpSizes(TorchFunctionMode):
    """Notes (module, file, line, operation, dimension) -> the dimension's size, in call order, for
    the operations of `DIM_ARG` called while it is active on the modules `model` runs (under
    their `rename` names: a TP module named otherwise than its dense module); and `sites`: (file,
    line, operation) -> module of every operation the code under test called."""

    def __init__(self, model: nn.Module, rename: dict[str, str] | None = None) -> None:
        super().__init__()
        rename = rename or {}
        self.modules = {id(m): rename.get(name, name) for name, m in named_modules(model)}
        self.sizes: dict[tuple, int] = {}
        self.sites: dict[tuple[str, int, str], str] = {}
        # a split's key -> {"parts": its sizes, "producer": the module whose output it split}
        self.splits: dict[tuple, dict] = {}
        self.outputs: dict[int, tuple[str, weakref.ref]] = {}  # id(module output) -> (module, ref)

    def watch(self, model: nn.Module, rename: dict[str, str] | None = None) -> list:
        """Forward hooks that note which module produced each output (a split's producer); the
        handles, for the caller to remove."""
        rename = rename or {}

        def hook(name):
            def noted(module, args, out):
                if isinstance(out, torch.Tensor) and len(self.outputs) < MAX_RECORDS:
                    self.outputs[id(out)] = (name, weakref.ref(out))

            return noted

        return [
            m.register_forward_hook(hook(rename.get(name, name)))
            for name, m in named_modules(model)
            if name
        ]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = None
        with contextlib.suppress(Exception):  # a note is never worth failing the forward
            key = self._note(getattr(func, "__name__", ""), args, kwargs)
        out = func(*args, **kwargs)
        if key is not None:
            with contextlib.suppress(Exception):
                self._split(key, args[0], out)
        return out

    def _split(self, key: tuple, x: torch.Tensor, out) -> None:
        """A split's parts (their sizes along its dimension) and the module whose output it
        split."""
        dim = key[-1]
        noted = self.outputs.get(id(x))
        producer = noted[0] if noted is not None and noted[1]() is x else None
        parts = tuple(int(o.shape[dim]) for o in out)
        self.splits.setdefault(key, {"parts": parts, "producer": producer})

    def _note(self, name: str, args: tuple, kwargs: dict) -> tuple | None:
        """Notes the call (module docstring); returns a split's key, for its parts."""
        # past torch's and Python's frames and the function modes above this one (decisions.py's)
        frame = caller(sys._getframe(2))
        if frame is None or frame_kind(frame.f_code.co_filename) == "tpcheck":
            # tpcheck's own arithmetic (the capture hooks' comparisons), not the model's
            return None
        at = (frame.f_code.co_filename, frame.f_lineno)
        site = (*at, name)
        dims = (
            _dims(name, args, kwargs)
            if name in DIM_ARG and args and isinstance(args[0], torch.Tensor)
            else None
        )
        if (site in self.sites or len(self.sites) >= MAX_SITES) and dims is None:
            return None
        module = ""
        while frame is not None:
            owner = frame.f_locals.get("self")
            if owner is not None and id(owner) in self.modules:
                module = self.modules[id(owner)]
                break
            frame = frame.f_back
        if len(self.sites) < MAX_SITES:
            self.sites.setdefault(site, module)
        if dims is None or len(self.sizes) >= MAX_RECORDS:
            return None
        shape = args[0].shape
        for d in dims:
            self.sizes.setdefault((module, *at, name, d - args[0].dim()), int(shape[d]))
        return (module, *at, name, dims[0] - args[0].dim()) if name in SPLITS else None


class ShardOps:
    """The two sides' notes of one forward (step 1, its first micro-batch), and what differs."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.dense: dict[tuple, int] | None = None
        self.tp: dict[tuple, int] | None = None
        self.sites: dict[str, list] = {}  # side -> [[file, line, operation, module], ...]
        self.splits: dict[str, dict] = {}  # side -> OpSizes.splits

    @contextlib.contextmanager
    def side(self, which: str | None, model: nn.Module, rename: dict[str, str] | None = None):
        """Run a forward of `model` as the `which` side ("dense" or "tp"; None: a side not noted,
        the float64 truth), noting its operations if that side has not been noted yet."""
        if not self.enabled or which is None or getattr(self, which) is not None:
            yield
            return
        mode = OpSizes(model, rename)
        handles = mode.watch(model, rename)
        try:
            with mode:
                yield
        finally:
            for h in handles:
                h.remove()
        setattr(self, which, mode.sizes)
        self.sites[which] = [[*site, module] for site, module in mode.sites.items()]
        self.splits[which] = mode.splits

    def differing(self) -> list[dict]:
        """The operations that ran at the same place, in the same module, on both sides and found
        their dimension smaller on the TP side: each as {module, op, dim, at, tp_size,
        dense_size}, in the TP side's call order."""
        if not self.dense or not self.tp:
            return []
        out = []
        for key, size in self.tp.items():
            dense = self.dense.get(key)
            if dense is not None and size < dense:
                module, path, line, op, dim = key
                out.append(
                    {
                        "module": module,
                        "op": op,
                        "kind": "split" if op in SPLITS else "reduction",
                        "dim": dim,
                        "at": f"{path}:{line}",
                        "tp_size": size,
                        "dense_size": dense,
                        **self._split_of(key),
                    }
                )
        return out[:MAX_SENT]

    def _split_of(self, key: tuple) -> dict:
        """A split's dense parts and its input's producer (the TP side's, else the dense side's)."""
        dense = self.splits.get("dense", {}).get(key)
        tp = self.splits.get("tp", {}).get(key)
        if dense is None or tp is None:
            return {}
        return {"parts": list(dense["parts"]), "producer": tp["producer"] or dense["producer"]}


def packed(ops: list[dict], plan, dense_shapes: dict[str, tuple]) -> list[dict]:
    """`ops` with, on each split of a module's output into parts whose module holds a weight
    sharded as one block along the parts' dimension (a plain `Shard` of the dense size the parts
    add up to) and whose output is not placed `Fused`, that weight: {param, placement, fused} with
    the `Fused` placement that shards each part on its own (the diagnosis's `packed_shard`)."""
    from tpcheck.plan import Fused, Shard

    for op in ops:
        producer, parts = op.get("producer"), op.get("parts")
        if op["kind"] != "split" or not producer or not parts or len(parts) < 2:
            continue
        if isinstance(plan.activations.get(producer), Fused):
            continue  # split as it was sharded: each rank holds its block of every part
        weights = []
        for name, placement in plan.params.items():
            shape = dense_shapes.get(name)
            if name.rpartition(".")[0] != producer or type(placement) is not Shard or not shape:
                continue
            if shape[placement.dim] == sum(parts):
                weights.append(
                    {
                        "param": name,
                        "placement": f"Shard({placement.dim})",
                        "fused": f"Fused({placement.dim}, {tuple(parts)})",
                    }
                )
        if weights:
            op["packed"] = weights
    return ops
