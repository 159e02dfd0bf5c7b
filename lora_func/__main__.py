"""``python -m lora_func`` is the ``lora-func`` command (e.g. ``python -m lora_func demo``)."""

import sys

from lora_func.cli import main

if __name__ == "__main__":
    sys.exit(main())
