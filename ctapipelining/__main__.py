"""``python -m ctapipelining``: the ``ctapipelining`` command."""

import sys

from .cli import main

sys.exit(main())
