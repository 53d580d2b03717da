from distlm.parallel.dims import ParallelDims, init_distributed
from distlm.parallel.parallelize import parallelize

__all__ = ["ParallelDims", "init_distributed", "parallelize"]
