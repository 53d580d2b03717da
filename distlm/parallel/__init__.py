from distlm.parallel.dims import ParallelDims, init_distributed
from distlm.parallel.parallelize import parallelize
from distlm.parallel.applied import ParallelPlan

__all__ = ["ParallelDims", "ParallelPlan", "init_distributed", "parallelize"]
