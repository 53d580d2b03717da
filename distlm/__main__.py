"""`python -m distlm VERB` (and `torchrun ... -m distlm train ...`)."""
import sys

from distlm.cli import main

sys.exit(main())
