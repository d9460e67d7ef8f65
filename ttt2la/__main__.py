"""``python -m ttt2la``: the same command line as the ``ttt2la`` script."""
from .cli import main

raise SystemExit(main())
