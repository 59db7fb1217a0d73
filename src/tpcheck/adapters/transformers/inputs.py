"""What a checked forward is fed and scored by: the inputs a forward requires (`_required_inputs`)
and those no generic rule makes (`_unmade_inputs`), the input sets it is tried with (`_input_sets`:
token ids, random embeddings, images), the batches of a case (`batch_maker`) and its losses
(`lm_loss` on logits, `hidden_loss` on a last hidden state).
"""

from __future__ import annotations

import inspect
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
    are `pixel_values` (an image of the config's size) and `*_embeds` / `*hidden_states` (random
    vectors of its hidden size). A forward requiring nothing it needs (no input at all) is
    unmade too."""
    required = _required_inputs(cls)
    unmade = [n for n in required if n != "pixel_values" and not _EMBEDDED.search(n)]
    return unmade if required else ["an input"]


IDS = (("input_ids", (BATCH, SEQ), "ids"),)


def _input_sets(cls, cfg) -> list[tuple]:
    """The input sets a forward is tried with, in turn, each a tuple of (name, shape, "ids" |
    "float"): token ids; random `inputs_embeds` of the hidden size (a model that embeds nothing
    itself); each of those with random `encoder_hidden_states` where the forward takes them (a
    decoder that cross-attends). A forward taking no token ids: its required inputs,
    `pixel_values` of the config's image size and `*_embeds` / `*hidden_states` of its hidden
    size (`model_class` chose it only when it needs nothing else)."""
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
    return [
        tuple(
            (name, _image_shape(cfg), "float") if name == "pixel_values" else vector(name)
            for name in _required_inputs(cls)
        )
    ]


def _image_shape(cfg) -> tuple[int, ...]:
    """(batch, channels, height, width) of the config's images (`num_channels` or `in_channels`,
    `image_size`; 4 patches a side without one)."""
    channels = getattr(cfg, "num_channels", None) or getattr(cfg, "in_channels", None) or 3
    size = getattr(cfg, "image_size", None) or 4 * (getattr(cfg, "patch_size", None) or 16)
    h, w = (size, size) if isinstance(size, int) else tuple(size)[:2]
    return (BATCH, channels, h, w)


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
        batch = {
            name: torch.randint(0, VOCAB, size, generator=g)
            if k == "ids"
            else torch.randn(size, generator=g).to(dtype)
            for name, size, k in inputs or IDS
        }
        if kind == LOGITS:
            return batch, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        return batch, torch.randn(shape, generator=g).to(dtype)

    return make_batch


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def hidden_loss(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The base model's loss: the mean squared error of its last hidden state against a random
    target. Its gradient (2(h - t)/n) is dense and random, so it reaches every parameter the
    hidden state depends on; a plain sum would not (through a LayerNorm whose gain is uniform the
    sum's gradient cancels)."""
    return F.mse_loss(hidden, target.to(hidden.dtype))
