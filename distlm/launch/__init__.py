"""Getting processes started: SLURM glue (slurm.py) and the `distlm env` report (env.py)."""
