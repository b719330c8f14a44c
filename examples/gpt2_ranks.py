"""A GPT-2 (random weights from a GPT2Config: no download) trained on 2 gloo ranks in torch DDP with
one GradScaler per rank, recorded by ``fpemu.record_torch`` on each rank:

    python examples/gpt2_ranks.py OUT_FOLDER [--poison-step 1]

Each rank writes ``OUT_FOLDER/gpt2.rank<r>.json``.  With ``--poison-step N`` rank 1 sets one gradient
element to inf after DDP's all-reduce at step N (as a hook or an in-place edit would): GradScaler
reduces no found-inf across ranks, so rank 1 alone skips that step, and the recorder's audit says
so (``found_inf_not_reduced``, ``ranks_disagree``); the traces' ``ranks`` metadata holds each rank's
skips and final scale.  The ranks are forked processes joined through a ``file://`` rendezvous.
"""

import argparse
import multiprocessing
import os
import tempfile

STEPS, BATCH, CONTEXT = 4, 2, 16


def _rank(rank: int, world: int, rendezvous: str, out: str, poison_step: int) -> None:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel
    import fpemu
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same weights on every rank
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=CONTEXT,
                                       bos_token_id=0, eos_token_id=0))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    data = torch.Generator().manual_seed(rank)  # each rank its own batches
    with fpemu.record_torch(scaler, optimizer, model, path=os.path.join(out, "gpt2.json"), name="gpt2_ddp") as rec:
        for step in range(STEPS):
            ids = torch.randint(0, 256, (BATCH, CONTEXT), generator=data)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ddp(ids, labels=ids).loss
            scaler.scale(loss).backward()
            if rank == 1 and step == poison_step:
                next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
    print(f"rank {rank}: {[(f.kind, f.step) for f in rec.audit.findings]}; {rec.trace.metadata['ranks']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for the per-rank traces")
    parser.add_argument("--poison-step", type=int, default=1, help="step at which rank 1's gradient gets an inf "
                                                                  "after the all-reduce (-1: never)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        context = multiprocessing.get_context("fork")
        ranks = [context.Process(target=_rank, args=(rank, 2, os.path.join(folder, "rendezvous"), args.out,
                                                     args.poison_step)) for rank in range(2)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
    print(sorted(os.listdir(args.out)))


if __name__ == "__main__":
    main()
