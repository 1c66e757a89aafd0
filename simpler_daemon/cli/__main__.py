"""``python -m simpler_daemon.cli``: the same as ``simplerctl``."""

from simpler_daemon.cli.simplerctl import main

raise SystemExit(main())
