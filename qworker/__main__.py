"""``python -m qworker`` is the ``qworker`` console script."""

from qworker.cli import main

raise SystemExit(main())
