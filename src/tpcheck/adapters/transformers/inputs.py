"""What a checked forward is fed and scored by: the inputs a forward requires (`_required_inputs`)
and those no generic rule makes (`_unmade_inputs`), the input sets it is tried with (`_input_sets`:
token ids, random embeddings, images), the batches of a case (`batch_maker`) and its losses
(`lm_loss` on logits, `hidden_loss` on a last hidden state).
"""

from __future__ import annotations

import inspect
import math
import re

import torch
import torch.nn.functional as F

from tpcheck.adapters.transformers.common import BATCH, LOGITS, SEQ, VOCAB

_EMBEDDED = re.compile(r"(_embeds|hidden_states)$")


def _required_inputs(cls) -> list[str]:
    """The forward's parameters without a default (not `self`, not `*args`/`**kwargs`)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return []
    return [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _unmade_inputs(cls) -> list[str]:
    """The required inputs of a forward that takes no token ids that no generic rule makes: made
    are `pixel_values` (an image of the config's size), `*_embeds` / `*hidden_states` (random
    vectors of its hidden size) and the metadata inputs `_METADATA` names. A forward requiring
    nothing it needs (no input at all) is unmade too."""
    required = _required_inputs(cls)
    unmade = [
        n
        for n in required
        if n != "pixel_values" and not _EMBEDDED.search(n) and n not in _METADATA
    ]
    return unmade if required else ["an input"]


IDS = (("input_ids", (BATCH, SEQ), "ids"),)


def _input_sets(cls, cfg) -> list[tuple]:
    """The input sets a forward is tried with, in turn, each a tuple of (name, shape, "ids" |
    "float"): token ids; random `inputs_embeds` of the hidden size (a model that embeds nothing
    itself); each of those with random `encoder_hidden_states` where the forward takes them (a
    decoder that cross-attends). A forward taking no token ids: its required inputs
    (`_encoder_inputs`; `model_class` chose it only when a rule makes each), then those with a
    mask of ones over all of them (`_with_mask`) where the forward takes a mask."""
    cfg = _own_config(cls, cfg)
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return [IDS]
    hidden = getattr(cfg, "hidden_size", None)
    vector = lambda name: (name, (BATCH, SEQ, hidden), "float")  # noqa: E731
    if "input_ids" in params:
        sets = [IDS]
        if not isinstance(hidden, int):
            return sets
        if "inputs_embeds" in params:
            sets.append((vector("inputs_embeds"),))
        if "encoder_hidden_states" in params:
            sets += [s + (vector("encoder_hidden_states"),) for s in sets]
        return sets
    encoder = _encoder_inputs(_required_inputs(cls), cfg)
    return [encoder] + ([_with_mask(encoder)] if "attention_mask" in params else [])


def _with_mask(inputs: tuple) -> tuple:
    """`inputs` with an attention mask of ones over every position its sequences give the keys
    (the lengths of its (batch, length, width) vectors summed): a forward that attends over
    states of two inputs side by side (a drafter's context states, then its own block) but
    builds its default mask from one of them does not run without it; ones mask nothing, so the
    model computes what it computes unmasked."""
    length = sum(shape[1] for _, shape, k in inputs if k == "float" and len(shape) == 3)
    return inputs + (("attention_mask", (BATCH, length), (1,) * (BATCH * length)),)


def _encoder_inputs(required: list[str], cfg) -> tuple:
    """The inputs of a forward that takes no token ids: each metadata input by its rule
    (`_METADATA`), which also lays out the pixels it describes (the one other required input,
    `pixel_values` or `hidden_states` alike: the name varies across families, the layout does
    not); else `pixel_values` of the config's image size and `*_embeds` / `*hidden_states` of the
    hidden size (`_vector_width`)."""
    made = {name: _METADATA[name](cfg) for name in required if name in _METADATA}
    pixels = next((p for _, p in made.values() if p is not None), None)
    out = []
    for name in required:
        if name in made:
            out.append(made[name][0])
        elif pixels is not None:
            out.append((name, pixels, "float"))
            pixels = None  # one pixel input beside its metadata
        elif name == "pixel_values":
            out.append((name, _image_shape(cfg), "float"))
        else:
            out.append((name, (BATCH, SEQ, _vector_width(name, cfg)), "float"))
    return tuple(out)


def _vector_width(name: str, cfg) -> int | None:
    """The width of a random `*_embeds` / `*hidden_states` input: the hidden size; for
    `context_hidden_states`, the states of the layers `target_layer_ids` lists side by side
    (len x hidden: a drafter fed the concatenated states of several layers of the model it
    drafts for), when the config lists them."""
    hidden = getattr(cfg, "hidden_size", None)
    layers = getattr(cfg, "target_layer_ids", None)
    if name == "context_hidden_states" and isinstance(layers, (list, tuple)) and layers:
        return len(layers) * hidden
    return hidden


def _image_shape(cfg) -> tuple[int, ...]:
    """(batch, channels, height, width) of the config's images (`num_channels` or `in_channels`,
    `image_size`; 4 patches a side without one)."""
    channels = getattr(cfg, "num_channels", None) or getattr(cfg, "in_channels", None) or 3
    size = getattr(cfg, "image_size", None) or 4 * (getattr(cfg, "patch_size", None) or 16)
    h, w = (size, size) if isinstance(size, int) else tuple(size)[:2]
    return (BATCH, channels, h, w)


def _ints(value) -> list[int]:
    """The positive ints of a size field: an int, or each of a list's (`[2, 2]`)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]


def _field(cfg, names: tuple[str, ...], default: int) -> int:
    """The first of the `names` the config sets to a positive int (a list's first), else
    `default`."""
    for name in names:
        if values := _ints(getattr(cfg, name, None)):
            return values[0]
    return default


_MERGE = re.compile(r"merge_(kernel_)?size$")


def _spatial_merge(cfg) -> int:
    """The least common multiple of the config's spatial merge sizes (`spatial_merge_size`,
    `merge_size`, `adapter_merge_size`, `merge_kernel_size`; a temporal one left out): a grid whose
    sides are multiples of it merges into whole tokens at every merger of the encoder."""
    merge = 1
    for name, value in vars(cfg).items():
        if _MERGE.search(name) and not name.startswith("temporal"):
            for v in _ints(value):
                merge = math.lcm(merge, v)
    return merge


def _patch_width(cfg, temporal: bool) -> int:
    """The values of one flattened patch: channels (`num_channels` / `in_channels`, else 3, the
    RGB the encoders without the field hard-code) x, where `temporal`, the frames a patch spans
    (`temporal_patch_size` / `patch_temporal`, else 1) x patch_size squared."""
    channels = _field(cfg, ("num_channels", "in_channels", "in_chans"), 3)
    frames = _field(cfg, ("temporal_patch_size", "patch_temporal"), 1) if temporal else 1
    return channels * frames * _field(cfg, ("patch_size",), 16) ** 2


def _grid_thw(cfg) -> tuple:
    """`grid_thw`, [t, h, w] in patches per image (the Qwen2-VL family's vision encoders and those
    built like them: the position ids, attention segments, windows and mergers all read it): one
    image of one frame, h = w = 2 x the spatial merge (`_spatial_merge`), so that every merger
    gives whole tokens (4 of them). Its pixels: the patches flattened in that order, (t x h x w,
    `_patch_width`), as these encoders take them (a linear or a conv over one patch)."""
    side = 2 * _spatial_merge(cfg)
    return ("grid_thw", (1, 3), (1, side, side)), (side * side, _patch_width(cfg, True))


def _pixel_position_ids(cfg) -> tuple:
    """`pixel_position_ids`, the (x, y) patch of each of the pixels' patches (Gemma 4's vision
    encoders: rotary positions and the pooling read it), in the order its image processor lays
    them out (rows of x): a square of 2 x `pooling_kernel_size` patches a side, so that the pooler
    averages whole kernels into 4 tokens; no padding (-1). Its pixels: (batch, patches, channels x
    patch_size squared), already patchified."""
    side = 2 * _field(cfg, ("pooling_kernel_size",), 1)
    xy = tuple(v for y in range(side) for x in range(side) for v in (x, y))
    n = side * side
    return ("pixel_position_ids", (BATCH, n, 2), xy * BATCH), (BATCH, n, _patch_width(cfg, False))


def _num_patches(cfg) -> tuple:
    """`num_patches`, how many of the embeddings that lead the sequence are image patches (the rest:
    learned queries; an encoder attending bidirectionally over the patches and causally over the
    queries): half the sequence. A 0-d tensor, which slices as the int it stands for. The
    embeddings keep their rule."""
    return ("num_patches", (), (SEQ // 2,)), None


# the metadata inputs made, by name: each rule gives (its entry, the shape of the pixels it
# describes or None); an entry (name, shape, values): the long tensor of `values` in that shape
_METADATA = {
    "grid_thw": _grid_thw,
    "pixel_position_ids": _pixel_position_ids,
    "num_patches": _num_patches,
}


def _own_config(cls, cfg):
    """The config `cls` is built from: `cfg`, or its sub-config of the class's `config_class` (a
    composite config whose causal-LM entry is the text model's class)."""
    config_cls = getattr(cls, "config_class", None)
    if not isinstance(config_cls, type) or isinstance(cfg, config_cls):
        return cfg
    subs = [v for v in vars(cfg).values() if isinstance(v, config_cls)]
    if subs:
        subs[0]._attn_implementation = "eager"
        subs[0]._experts_implementation = "eager"
        subs[0].use_cache = False
    return subs[0] if subs else cfg


def batch_maker(inputs: tuple, kind: str = LOGITS, shape: tuple[int, ...] = ()):
    """`make_batch` of the architecture's inputs (`_input_sets`: token ids, or random pixels or
    vectors in the run's dtype) and its target: token labels for a causal LM's logits, a random
    tensor of the output's `shape` for a base model's hidden states."""

    def make_batch(g: torch.Generator, dtype: torch.dtype):
        batch = {name: _drawn(size, k, g, dtype) for name, size, k in inputs or IDS}
        if kind == LOGITS:
            return batch, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        return batch, torch.randn(shape, generator=g).to(dtype)

    return make_batch


def _drawn(size: tuple, kind, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """One input of a batch: token ids, random values in `dtype`, or a metadata input's fixed
    values (`kind` a tuple of ints: the same in every batch, as the pixels it describes keep their
    layout)."""
    if kind == "ids":
        return torch.randint(0, VOCAB, size, generator=g)
    if kind == "float":
        return torch.randn(size, generator=g).to(dtype)
    return fixed(size, kind)


def fixed(size: tuple, values: tuple, device=None) -> torch.Tensor:
    """A metadata input: the long tensor of `values` in shape `size`."""
    return torch.tensor(values, dtype=torch.long, device=device).reshape(size)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def hidden_loss(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The base model's loss: the mean squared error of its last hidden state against a random
    target. Its gradient (2(h - t)/n) is dense and random, so it reaches every parameter the
    hidden state depends on; a plain sum would not (through a LayerNorm whose gain is uniform the
    sum's gradient cancels)."""
    return F.mse_loss(hidden, target.to(hidden.dtype))
