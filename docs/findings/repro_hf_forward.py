"""Minimal repro of a HuggingFace model whose TP forward fails: the dense model and transformers'
own TP plan (applied by `maybe_distribute_model`, as `from_pretrained(distributed_config=...)` does)
on 2 CPU ranks, the no-grad forward (transformers' local inference path) and the grad-enabled one
(DTensor), with tpcheck's shape-reduced config of the architecture:

    python docs/findings/repro_hf_forward.py doge
    python docs/findings/repro_hf_forward.py llama4_text
"""

import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank, world, m):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from tpcheck.adapters import transformers as hf

    cfg = hf.prepare(m, world).config
    torch.manual_seed(0)  # the same dense weights on every rank
    dense = hf.build_lm(m, cfg, torch.float32)
    tp = hf.build_lm(m, cfg, torch.float32, tie=False)
    tp.load_state_dict(dense.state_dict(), strict=False)
    dc, mesh = hf.mesh_manager(world)
    tp = type(tp).maybe_distribute_model(tp, dc, mesh)
    tp.tie_weights()
    ids = torch.randint(0, hf.VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    for grad in (False, True):
        try:
            with torch.set_grad_enabled(grad):
                a, b = dense(input_ids=ids).logits, tp(input_ids=ids).logits
            print(
                f"rank {rank}: {m}: {'grad-enabled' if grad else 'no-grad'} forward: max "
                f"|logits_TP - logits_dense| = {(a - b).abs().max().item():.3g}"
            )
        except Exception:  # noqa: BLE001
            if rank == 0:
                print(f"rank 0: {m}: {'grad-enabled' if grad else 'no-grad'} forward raised:")
                traceback.print_exc(limit=-int(os.environ.get("FRAMES", "4")))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2, sys.argv[1]), nprocs=2)
