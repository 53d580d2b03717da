import torch
from distlm.config import ParallelConfig
from distlm.parallel import init_distributed
dims = init_distributed(ParallelConfig(dp_shard=2, timeout_s=77), "cuda")
g = dims.mesh["dp_shard"].get_group()
print("rank", dims.rank, "dp_shard timeout", g._get_backend(torch.device("cuda")).options._timeout,
      "dp timeout", dims.dp_mesh.get_group()._get_backend(torch.device("cuda")).options._timeout)
torch.distributed.destroy_process_group()
