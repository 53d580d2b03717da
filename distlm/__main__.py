"""`python -m distlm VERB` (and `torchrun ... -m distlm train ...`)."""
import sys

from distlm.cli import run

sys.exit(run())
