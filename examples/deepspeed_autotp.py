"""DeepSpeed AutoTP training of a HuggingFace Llama (pip install 'tpcheck[deepspeed]').

    tpcheck verify examples/deepspeed_autotp.py:autotp --world-size 2
    tpcheck verify examples/deepspeed_autotp.py:buggy --world-size 2   # exits 1: the planted bug

The TP side is what a DeepSpeed user runs: a transformers `LlamaForCausalLM` built from a config (2
layers, width 32, GQA, vocabulary 64; no hub), handed to `deepspeed.initialize` with the config's
`tensor_parallel: {autotp_size: world}` (ZeRO stage 0, DeepSpeed's AdamW). AutoTP replaces the
projections with its own layers: q/k/v, gate/up and the LM head `LinearLayer` (column parallel; the
LM head gathers its logits in training), o_proj and down_proj `LinearAllreduce` (row parallel,
all-reduce in the forward); norms and the embedding stay whole. Each step is DeepSpeed's own:
the engine's `step()` (its optimizer, DeepSpeed's gradient handling); tpcheck runs the forward and
backward. The plan below is that layout, as DeepSpeed documents it.

Clipping: DeepSpeed clips every step by default (`gradient_clipping` 1.0, in `engine.step()`), so
the dense side must clip too. The case says so (`RunSettings(clip_grad_norm=1.0)`), and the TP
clipping is the function the engine's step calls, `deepspeed.runtime.utils.clip_grad_norm_` with the
engine's model-parallel groups, run where the engine would run it (after the backward, before the
optimizer); the engine's own call is off so that it does not clip twice. tpcheck then checks
DeepSpeed's total norm (`clip:grad_norm`) and every clipped gradient (`clipped:<param>`). Left to
the engine alone (`engine_clips_alone`), the dense side does not clip: the TP optimizer's moments
are the dense ones scaled by the clip coefficient, and the case is "not equivalent" at `moment:` at
step 1 (before the optimizer stage was held to the dense side, AdamW's near scale invariance let it
pass).

On the CPU DeepSpeed needs `DS_ACCELERATOR=cpu` (set here when no GPU is visible) and compiles its
shared-memory all-reduce op once (a C++ compiler; cached under ~/.cache/torch_extensions).

Planted bug (`buggy`): layer 0's down_proj built without its TP group, as a hand-made
`LinearAllreduce(module, mp_group=None)` would be: its forward skips the all-reduce (DeepSpeed's
`RowParallel` returns the input when the group is not parallel), so each rank keeps its partial
sum. tpcheck flags `act:lm.model.layers.0.mlp.down_proj` in the forward of step 1, a partial sum.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

from tpcheck import Injection, RunSettings
from tpcheck.checker.case import Case
from tpcheck.plan import Plan, Replicate, Shard

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

try:
    import deepspeed
    import transformers
except ImportError as e:  # pragma: no cover - the tests skip first
    raise ImportError(
        f"{e.name} is not installed: pip install 'tpcheck[deepspeed]' (deepspeed==0.19.8, "
        "transformers==5.24.0)"
    ) from e

DIM, HEADS, KV_HEADS, FFN, LAYERS, VOCAB, SEQ, BATCH, LR = 32, 4, 2, 64, 2, 64, 8, 2, 1e-3
CLIP = 1.0  # DeepSpeed's default gradient_clipping
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def llama(dtype: torch.dtype) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=4 * SEQ,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config).to(dtype).train()


class CausalLM(nn.Module):
    """The HF model's logits for `input_ids` (both sides)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids).logits


def plan() -> Plan:
    """AutoTP's layout: column-parallel weights Shard(0), their outputs sharded on the last dim
    (the LM head's gathered: whole); row-parallel weights Shard(1), their outputs all-reduced
    (whole); everything else whole."""
    params = {n: Replicate() for n, _ in CausalLM(llama(torch.float32)).named_parameters()}
    activations = {}
    for name in params:
        module, kind = name.rsplit(".", 1)[0], name.rsplit(".", 2)[-2]
        if kind in COLUMN or kind == "lm_head":
            params[name] = Shard(0)
            activations[module] = Replicate() if kind == "lm_head" else Shard(-1)
        elif kind in ROW:
            params[name] = Shard(1)
            activations[module] = Replicate()
    return Plan(params=params, activations=activations)


class EngineStep:
    """DeepSpeed's step as the TP optimizer: `engine.step()` (gradient handling, its optimizer,
    zeroing). `optimizer` is the torch optimizer inside, where tpcheck reads the AdamW state."""

    def __init__(self, engine) -> None:
        self.engine, self.optimizer = engine, engine.optimizer

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.optimizer.zero_grad(set_to_none=set_to_none)


def setup(group) -> None:
    """What DeepSpeed's launcher would set: the rank's place (tpcheck's ranks are one per
    process on one machine), then DeepSpeed's communication on the existing process group."""
    for var, value in (
        ("RANK", group.rank),
        ("LOCAL_RANK", group.rank),
        ("WORLD_SIZE", group.world_size),
        ("LOCAL_SIZE", group.world_size),
    ):
        os.environ[var] = str(value)
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())


def build_tp(group, dtype: torch.dtype, engine_clips: bool = False) -> nn.Module:
    """The engine; its own clipping off unless `engine_clips` (tpcheck runs DeepSpeed's clipping at
    the step's clipping: `clip`)."""
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP if engine_clips else 0.0,
        "tensor_parallel": {"autotp_size": group.world_size},
        "zero_optimization": {"stage": 0},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True},
        },
    }
    lm = llama(dtype)
    engine, _, _, _ = deepspeed.initialize(
        model=lm, model_parameters=lm.parameters(), config=config
    )
    module = CausalLM(engine.module)
    object.__setattr__(module, "engine", engine)  # outside the module tree
    return module


def clip(module: nn.Module, max_norm: float, group) -> torch.Tensor:
    """DeepSpeed's clipping as `engine.step()` runs it (`clip_fp32_gradients`): the total norm over
    the model-parallel group (sharded gradients on every rank, replicated ones on rank 0 only)."""
    from deepspeed.runtime.utils import clip_grad_norm_

    engine = module.engine
    return clip_grad_norm_(engine.module.parameters(), max_norm, mpu=engine.mpu)


def make_batch(g, dtype):
    return (
        {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)},
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
    )


def lm_loss(logits, labels):
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _case(name: str, inject: Injection = Injection(), engine_clips: bool = False) -> Case:
    return Case(
        name=name,
        build_dense=lambda dtype: CausalLM(llama(dtype)),
        build_tp=lambda group, dtype: build_tp(group, dtype, engine_clips),
        plan=plan(),
        make_batch=make_batch,
        loss=lm_loss,
        dense_optimizer=lambda named: torch.optim.AdamW(
            [p for _, p in named], lr=LR, weight_decay=0.0
        ),
        tp_optimizer=lambda module, group: EngineStep(module.engine),
        tp_clip_grad_norm=None if engine_clips else clip,
        setup=setup,
        run=RunSettings(steps=2, micro_batches=1, clip_grad_norm=None if engine_clips else CLIP),
        inject=inject,
    )


def case_autotp(spec):
    return _case("deepspeed_autotp_llama")


def _drop_group(module: nn.Module, group) -> None:
    module.lm.model.layers[0].mlp.down_proj.mp_group = None


def case_buggy(spec):
    return _case("deepspeed_autotp_llama_ungrouped_down_proj", Injection(tamper=_drop_group))


def case_engine_clips_alone(spec):
    """The engine's default clipping left inside `engine.step()`, the dense side told nothing:
    not equivalent (the moments are the dense ones scaled by the clip coefficient)."""
    return _case("deepspeed_autotp_llama_engine_clips_alone", engine_clips=True)
