import os, sys, time, torch, torch.distributed as dist
dev = sys.argv[1]
dist.init_process_group("nccl" if dev == "cuda" else "gloo")
if dev == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
n, w = (256 if dev == "cuda" else 16) * 2**20 // 4, dist.get_world_size()
x = torch.ones(n, device=dev)
for _ in range(3):
    dist.all_reduce(x)
if dev == "cuda":
    torch.cuda.synchronize()
t0, k = time.perf_counter(), 10
for _ in range(k):
    dist.all_reduce(x)
if dev == "cuda":
    torch.cuda.synchronize()
dt = (time.perf_counter() - t0) / k
if dist.get_rank() == 0:
    print(f"all-reduce {4 * n / 1e6:.0f} MB over {w}: {dt * 1e3:.2f} ms, bus bandwidth {2 * (w - 1) / w * 4 * n / dt / 1e9:.1f} GB/s")
dist.destroy_process_group()
