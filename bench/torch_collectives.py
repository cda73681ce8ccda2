#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_collectives.cpp.

Times all_gather_into_tensor, reduce_scatter_tensor (sum) and all_to_all_single
with torch.distributed's NCCL backend, one process per GPU, bf16, on the same
sizes as the C++ benchmark (nccl-tests' "size": the bytes of the larger buffer
of one rank, 1 MiB .. 1 GiB), and writes JSON that
bench/compare_collectives.py reads.

    torchrun --nproc-per-node 2 bench/torch_collectives.py --out torch_collectives.json

Method, per op and size: one correctness check (small integers, exact in bf16),
--warmup untimed collectives, then --reps timed batches of --batch collectives
between two CUDA events on the current stream (the collectives run on NCCL's
stream, which the current stream waits for). The time of one collective is the
median over batches of batch time / batch, then the slowest rank's.
Bandwidths follow nccl-tests (GB/s = 1e9 bytes/s):
    algbw = bytes / t,  busbw = algbw * (n - 1) / n   (all three ops)

Standard library and torch only. NCCL_NVLS_ENABLE=0 is set unless the
environment already sets it (NVLink multicast stays off on shared hosts).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script; does not import torch)

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402  (after the environment is set)
import torch.distributed as dist  # noqa: E402

OPS = ("all_gather", "reduce_scatter", "all_to_all")


def sizes(min_bytes, max_bytes, factor=4):
    s = min_bytes
    while s <= max_bytes:
        yield s
        s *= factor


def pattern(rank, n, device, first=0):
    """((i + 3 rank) mod 17) - 8 for i in [first, first + n): exact in bf16, as are sums over ranks."""
    i = torch.arange(first, first + n, device=device, dtype=torch.int32)
    return ((i + 3 * rank) % 17 - 8).to(torch.bfloat16)


def make_op(op, total, world, rank, device):
    """Buffers and a closure running one collective. total = elements of the larger buffer."""
    chunk = total // world
    if op == "all_gather":
        inp = torch.empty(chunk, dtype=torch.bfloat16, device=device)
        out = torch.empty(total, dtype=torch.bfloat16, device=device)
        return inp, out, lambda: dist.all_gather_into_tensor(out, inp)
    if op == "reduce_scatter":
        inp = torch.empty(total, dtype=torch.bfloat16, device=device)
        out = torch.empty(chunk, dtype=torch.bfloat16, device=device)
        return inp, out, lambda: dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM)
    if op == "all_to_all":
        inp = torch.empty(total, dtype=torch.bfloat16, device=device)
        out = torch.empty(total, dtype=torch.bfloat16, device=device)
        return inp, out, lambda: dist.all_to_all_single(out, inp)
    raise ValueError(op)


def check(op, inp, out, run, total, world, rank, device):
    """Runs the collective once on patterned inputs; returns '' or what went wrong."""
    chunk = total // world
    inp.copy_(pattern(rank, inp.numel(), device))
    out.fill_(float("nan"))
    run()
    torch.cuda.synchronize(device)
    if op == "all_gather":
        want = torch.cat([pattern(q, chunk, device) for q in range(world)])
    elif op == "reduce_scatter":
        acc = torch.zeros(chunk, dtype=torch.float32, device=device)
        for q in range(world):
            acc += pattern(q, chunk, device, first=rank * chunk).float()
        want = acc.to(torch.bfloat16)
    else:
        want = torch.cat([pattern(q, chunk, device, first=rank * chunk) for q in range(world)])
    bad = (out.view(torch.int16) != want.view(torch.int16)).nonzero()
    if bad.numel() == 0:
        return ""
    i = int(bad[0].item())
    return f"rank {rank}: element {i} of {out.numel()} is {out[i].item()}, expected {want[i].item()}"


def main():
    p = bench_util.parser(__doc__, out="torch_collectives.json", warmup=5, reps=20, batch=10,
                          out_help="JSON written by rank 0", warmup_help="untimed collectives per op and size",
                          batch_help="collectives per timed batch")
    p.add_argument("--min-bytes", type=int, default=1 << 20)
    p.add_argument("--max-bytes", type=int, default=1 << 30)
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    args = p.parse_args()

    if "LOCAL_RANK" not in os.environ:
        sys.exit("run under torchrun: torchrun --nproc-per-node 2 bench/torch_collectives.py")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    world, rank = dist.get_world_size(), dist.get_rank()

    results = []
    failed = False
    for op in [o for o in args.ops.split(",") if o]:
        if op not in OPS:
            sys.exit(f"unknown op {op!r}; expected some of {', '.join(OPS)}")
        for size in sizes(args.min_bytes, args.max_bytes):
            total = size // 2  # bf16 elements of the larger buffer
            inp, out, run = make_op(op, total, world, rank, device)
            error = check(op, inp, out, run, total, world, rank, device)
            t_ms = bench_util.time_us(run, args.warmup, args.reps, args.batch, device) * 1e-3
            # The slowest rank's median; any rank's check failure marks the row.
            agg = torch.tensor([t_ms, 1.0 if error else 0.0], dtype=torch.float64, device=device)
            dist.all_reduce(agg, op=dist.ReduceOp.MAX)
            t_ms, any_error = float(agg[0].item()), bool(agg[1].item())
            algbw = size / (t_ms * 1e-3) / 1e9
            busbw = algbw * (world - 1) / world
            row = {
                "op": op,
                "bytes": size,
                "time_us": t_ms * 1e3,
                "algbw_GBps": algbw,
                "busbw_GBps": busbw,
                "correct": not any_error,
            }
            if error:
                row["error"] = error
                print(f"[rank {rank}] {op} {size} B: CORRECTNESS CHECK FAILED: {error}", flush=True)
            failed |= any_error
            results.append(row)
            if rank == 0:
                print(f"{op:>15} {size:>11} B  {t_ms * 1e3:10.1f} us  algbw {algbw:8.2f}  busbw {busbw:8.2f} GB/s"
                      f"{'' if not any_error else '  WRONG RESULT'}", flush=True)
            del inp, out, run

    if rank == 0:
        ctx = bench_util.context(args, device, cuda=False, nccl=".".join(str(v) for v in torch.cuda.nccl.version()),
                                 world_size=world, NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE"))
        bench_util.write_doc(args.out, results, ctx)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
