"""``python -m gradclip_jax.demo``: the demo's command line."""

import sys

from gradclip_jax.demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
