"""The built-in blocks: one file per block, each declaring a `Block`; `BLOCKS` is the explicit table
that the CLI, the resolver and the tests iterate over. Adding a block = one new
file + one line here.
"""

from __future__ import annotations

from tpcheck.blocks.attention import BLOCK as ATTENTION
from tpcheck.blocks.base import Block, config_for
from tpcheck.blocks.cross_entropy import BLOCK as CROSS_ENTROPY
from tpcheck.blocks.decode import BLOCK as DECODE
from tpcheck.blocks.embedding import BLOCK as EMBEDDING
from tpcheck.blocks.layer import BLOCK as LAYER
from tpcheck.blocks.lm import BLOCK as LM
from tpcheck.blocks.mlp import BLOCK as MLP

BLOCKS: dict[str, Block] = {
    b.name: b for b in (MLP, ATTENTION, LAYER, LM, EMBEDDING, CROSS_ENTROPY, DECODE)
}

__all__ = ["BLOCKS", "Block", "config_for"]
