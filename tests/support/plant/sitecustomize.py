"""With this folder on PYTHONPATH and MEGATRON_EXT_FAULTS set (support/faults.py's ``env``), every Python process
plants the faults as megatron_ext's modules are imported: the ranks that torchrun or megatron_ext.launch start."""

import os
import sys

if os.environ.get("MEGATRON_EXT_FAULTS"):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/
    from support import faults

    faults.plant()
