#!/usr/bin/env python
"""Checks a checkpoint's integrity and its PyTorch parity (the MegaDLMs script's name).

    python scripts/verify_correctness_dlm.py --checkpoint-path runs/x [--hf-dir hf/x] [--dtype bf16]

Same flags as `python -m dlmjax.verify`; exits 0 when every check passes.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dlmjax import verify  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == '__main__':
  sys.exit(verify.main())
