"""T5Gemma2 under tensor parallelism: the backward raises in the embedding's end-of-image write.

    python docs/findings/repro_hf_t5gemma2_embedding.py

Plain torch + transformers on 2 CPU/gloo ranks. Builds a tiny T5Gemma2ForConditionalGeneration
(random weights saved with `save_pretrained`), loads it on every rank with `from_pretrained(...,
distributed_config=DistributedConfig(tp_plan="auto"))` and compares it with the same checkpoint
loaded dense. T5Gemma2's plans name no `embed_tokens` rule, so transformers' default
(distributed/mixin.py:93-94) makes both embeddings `embedding_rowwise`, which also shards the 1-D
`eoi_embedding` over the hidden features; `T5Gemma2TextScaledWordEmbedding.forward` writes it in
place into the vocab-parallel lookup (modeling_t5gemma2.py:629) and the backward of that
`index_put` raises (pytorch/pytorch#118461). Runs the plan as shipped, then two fixes:
  1. shipped styles: `replicate` for the encoder's and the decoder's `embed_tokens` and for
     `lm_head.out_proj` (it shares their weight), passed as `DistributedConfig(tp_plan={...})`,
     whose rules override the shipped plan's;
  2. model code (monkeypatched here): the end-of-image rows written out of place with
     `torch.where`, keeping the shipped vocab-parallel embedding and LM head.
The reference is always the dense model running the shipped code.
Exit 0: reproduced and both fixes verified; 1: not reproduced; 2: a fix failed.
"""

import os
import socket
import sys
import tempfile

import torch
import torch.multiprocessing as mp

VOCAB, EOI = 128, 5
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention"],
)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
REPLICATE_VOCAB = {  # the LM head shares the embeddings' weight, so it is unsharded with them
    "model.encoder.text_model.embed_tokens": "replicate",
    "model.decoder.embed_tokens": "replicate",
    "lm_head.out_proj": "replicate",
}
VARIANTS = {  # name -> (tp_plan, patch the model code)
    "as shipped": ("auto", False),
    "shipped styles (embed_tokens and lm_head.out_proj: replicate)": (REPLICATE_VOCAB, False),
    "model code (eoi rows written with torch.where)": ("auto", True),
}


def forward_out_of_place(self, input_ids: torch.Tensor):
    """T5Gemma2TextScaledWordEmbedding.forward with the end-of-image rows written out of place."""
    scale = self.embed_scale.to(self.weight.dtype)
    input_embeddings = torch.nn.Embedding.forward(self, input_ids) * scale
    is_eoi = (input_ids == self.eoi_token_index).unsqueeze(-1)
    return torch.where(is_eoi, self.eoi_embedding.to(input_embeddings.dtype), input_embeddings)


def measure(model, batch, dense=None) -> dict:
    """Logits with no grad, then loss.backward(); errors relative to the dense model's scale."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    res, stage = {}, "the no-grad forward"
    try:
        with torch.no_grad():
            res["logits"] = full(model(**batch).logits)
        stage = "loss.backward()"
        model(**batch).loss.backward()
    except (RuntimeError, AssertionError) as e:
        res["raised"] = f"{stage} raised {type(e).__name__}: {str(e).split(',')[0]}"
    if dense is not None and "logits" in res:
        scale = dense["logits"].abs().max().item()
        res["logits error"] = (res["logits"] - dense["logits"]).abs().max().item() / scale
    if "raised" in res:
        return res
    res["grads"] = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    if dense is None:
        return res
    res["grad error"], res["worst"] = max(
        ((res["grads"][n] - g).abs().max().item() / g.abs().max().item(), n)
        for n, g in dense["grads"].items()
        if g.abs().max() > 0
    )
    return res


def run(rank: int, world: int, port: int, ckpt: str, out) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    os.environ["LOCAL_RANK"] = str(rank)
    from transformers import AutoModelForSeq2SeqLM
    from transformers.distributed import DistributedConfig
    from transformers.models.t5gemma2 import modeling_t5gemma2

    embedding = modeling_t5gemma2.T5Gemma2TextScaledWordEmbedding
    shipped_forward = embedding.forward
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(7, VOCAB, (2, 8), generator=g)
    ids[:, 3] = EOI  # the end-of-image token in every row
    batch = dict(input_ids=ids, labels=torch.randint(7, VOCAB, (2, 6), generator=g))
    load = dict(dtype=torch.float32, attn_implementation="eager")
    dense = measure(AutoModelForSeq2SeqLM.from_pretrained(ckpt, **load), batch)
    for name, (plan, patch) in VARIANTS.items():
        embedding.forward = forward_out_of_place if patch else shipped_forward
        dc = DistributedConfig(tp_plan=plan)
        tp = AutoModelForSeq2SeqLM.from_pretrained(ckpt, distributed_config=dc, **load)
        res = measure(tp, batch, dense)
        out[name, rank] = {k: v for k, v in res.items() if k not in ("logits", "grads")}
    embedding.forward = shipped_forward


def save_checkpoint(path: str) -> None:
    from transformers import T5Gemma2Config, T5Gemma2ForConditionalGeneration

    enc = dict(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4)
    enc.update(boi_token_index=4, eoi_token_index=EOI, image_token_index=6)
    cfg = T5Gemma2Config(encoder=enc, decoder=TEXT, image_token_index=6)
    torch.manual_seed(0)
    model = T5Gemma2ForConditionalGeneration(cfg)
    with torch.no_grad():  # eoi_embedding and the (1 + w) norm weights off their zero init
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)


def main() -> int:
    import accelerate
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"accelerate {accelerate.__version__}, 2 gloo ranks (CPU), float32"
    )
    with tempfile.TemporaryDirectory() as ckpt:
        # written in a child process: the ranks are forked from this one, which stays free of
        # torch's thread pools (a pool in a process that forks can deadlock the forked ranks)
        writer = mp.get_context("fork").Process(target=save_checkpoint, args=(ckpt,))
        writer.start()
        writer.join()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = mp.Manager().dict()
        mp.start_processes(run, args=(2, port, ckpt, out), nprocs=2, start_method="fork")
    print("errors are max |TP - dense| / max |dense| (logits; worst parameter gradient)")
    verified = {}
    for name in VARIANTS:
        for rank in range(2):
            r, line = out[name, rank], f"{name}, rank {rank}:"
            if "logits error" in r:
                line += f" no-grad logits error {r['logits error']:.2e};"
            if "raised" in r:
                line += f" {r['raised']}"
            else:
                line += f" gradient error {r['grad error']:.2e} ({r['worst']})"
            print(line)
            ok = "raised" not in r and r["logits error"] < 1e-5 and r["grad error"] < 1e-4
            verified[name] = verified.get(name, True) and ok
    if verified["as shipped"]:
        print("NOT REPRODUCED: the TP model trains and matches the dense model")
        return 1
    print(
        "REPRODUCED: with the shipped plan, loss.backward() raises in the backward of the "
        "embedding's in-place eoi_embedding write (aten.index_put: mixed Tensor and DTensor)"
    )
    failed = False
    for name in list(VARIANTS)[1:]:
        label, what = name.rstrip(")").split(" (", 1)
        if verified[name]:
            print(
                f"FIX VERIFIED ({label}): {what}; logits and every gradient match the dense model"
            )
        else:
            failed = True
            print(f"FIX FAILED ({label}): {what}; see the errors above")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
